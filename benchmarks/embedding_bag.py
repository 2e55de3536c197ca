"""Embedding bags: jinsum against torch's `nn.EmbeddingBag` on CUDA and plain JAX, forward and forward+backward.

    python benchmarks/embedding_bag.py [--rows 1000000] [--features 128] [--bags 4096] [--longest 100] [--ids zipf]
        [--dtypes float32 bfloat16] [--modes sum mean max] [--calls 20] [--out benchmarks/results]

Workload: a table of `--rows` x `--features`, batches of `--bags` bags of 1 to `--longest` lookups (lengths uniform),
given as flat ids with offsets (torch's reading; for JAX padded with -1 to one static length over the batches). Ids
follow a power law (`--ids zipf`: P(k-th most popular) ~ k^-1.05, the popular ids spread over the table by a
permutation; the most popular one is some 7% of all lookups) or are uniform (`--ids uniform`). Passes: forward (the
`(B, F)` bags), and forward+backward (the output and the gradient with respect to the table that an optimiser
takes: the dense `(rows, F)` array, or the rows a batch touches). Systems:

- jinsum: `jinsum.graphs.bags(ids, offsets)` built on the device in every call, then `embedding_bag`; its dense
  gradient runs over the lookups in column order (gathers summed per row, no atomics). "sparse rows":
  `bags(..., unique=True)` and the gradient with respect to `bags.take(table)`: `(bags.rows, (U, F))`;
- plain JAX: gathers `table[ids]` and a sorted `jax.ops.segment_sum` (`segment_max` for max; the mean over the
  counts), the dense gradient by JAX's AD (a scatter-add of every lookup);
- torch (where it has CUDA): `nn.EmbeddingBag(mode, sparse=False)` (dense gradient) and `sparse=True` (a sparse COO
  gradient, one uncoalesced row per lookup), the forward without autograd, the backward by `torch.autograd.grad`.
Every system is timed the same way (`jinsum.timing.time_calls`: back-to-back calls over the batches in turn, one
synchronisation, median of rounds; torch with `torch.cuda.synchronize`), in two interleaved passes of which the
second is kept (DESIGN.md, "Measure device time, warm and interleaved"); "device ms" is the GPU's own time
(`jinsum.timing.device_time`). Before timing, each system's output and the per-row sums of its gradient are compared
with plain JAX's in float32 on the same batch ("rel. error": the largest difference over the largest value; a
maximum's ties, frequent in bfloat16, send jinsum's and torch's gradient to one lookup where `segment_max` splits
it), and after it each jitted function's compile count is checked (one, over all batches). Results go to `--out` as
`embedding_bag_<device>.md`; "vs torch" is torch's ms over the row's (above 1: faster than torch), against
`sparse=True` for the sparse rows and `sparse=False` otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jinsum.nn  # noqa: E402
from jinsum.timing import device_time, time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, baseline, command, device_file_name, device_name, failure, ratio,
    relative_error, sync_torch, torch_on_cuda, versions_text, write)

RESULTS = Results()
COLUMNS = (WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}", "failed"), Column("device ms", "device_ms", "{:.3f}"),
           Column("vs torch", "vs_torch", "{:.2f}"), Column("rel. error", "error", "{:.1e}"), NOTE)


# --- data -----------------------------------------------------------------------------------------------------------

def make_batches(rng, rows: int, bags: int, longest: int, ids: str, count: int):
    """`count` batches `(ids, offsets)` in NumPy (exact lengths), ids power-law or uniform."""
    if ids == "zipf":
        cdf = np.cumsum((np.arange(rows) + 1.0) ** -1.05)
        permutation = rng.permutation(rows)
    batches = []
    for _ in range(count):
        lengths = rng.integers(1, longest + 1, bags)
        total = int(lengths.sum())
        flat = (permutation[np.searchsorted(cdf, rng.random(total) * cdf[-1])] if ids == "zipf"
                else rng.integers(0, rows, total))
        batches.append((flat.astype(np.int32), (np.cumsum(lengths) - lengths).astype(np.int32)))
    return batches


def padded(batches):
    """The batches as device arrays of one static length (the longest), padded with -1 (ids that take no part)."""
    length = max(ids.shape[0] for ids, _ in batches)
    return [(jnp.asarray(np.pad(ids, (0, length - ids.shape[0]), constant_values=-1)), jnp.asarray(offsets))
            for ids, offsets in batches]


# --- the systems ----------------------------------------------------------------------------------------------------

def jinsum_forward(table, ids, offsets, mode):
    return jinsum.nn.embedding_bag(table, jinsum.graphs.bags(ids, offsets, num_embeddings=table.shape[0]), mode)


def segment_forward(table, ids, offsets, mode):
    """Plain JAX: gathers and a sorted segment reduction over each lookup's bag (padding, id -1, masked)."""
    bag = jnp.cumsum(jnp.zeros(ids.shape[0], jnp.int32).at[offsets].add(1)) - 1
    valid = (ids >= 0)[:, None]
    rows = table[jnp.maximum(ids, 0)]
    num_bags = offsets.shape[0]
    if mode == "max":
        out = jax.ops.segment_max(jnp.where(valid, rows, -jnp.inf), bag, num_bags, indices_are_sorted=True)
        return jnp.where(jnp.isneginf(out), 0, out)
    out = jax.ops.segment_sum(jnp.where(valid, rows, 0), bag, num_bags, indices_are_sorted=True)
    if mode == "sum":
        return out
    counts = jax.ops.segment_sum(valid.astype(jnp.float32), bag, num_bags, indices_are_sorted=True)
    return (out / jnp.maximum(counts, 1)).astype(table.dtype)


def forward_only(forward, mode):
    """`(table, ids, offsets) -> output`, jitted."""
    return jax.jit(lambda table, ids, offsets: forward(table, ids, offsets, mode))


def with_gradient(forward, mode):
    """`(table, cotangent, ids, offsets) -> (output, dense gradient)`, jitted."""
    def run(table, cotangent, ids, offsets):
        out, vjp = jax.vjp(lambda t: forward(t, ids, offsets, mode), table)
        return out, vjp(cotangent)[0]
    return jax.jit(run)


def jinsum_sparse_rows(mode):
    """`(table, cotangent, ids, offsets) -> (output, (rows, gradient of the rows))`, jitted."""
    def run(table, cotangent, ids, offsets):
        bags = jinsum.graphs.bags(ids, offsets, num_embeddings=table.shape[0], unique=True)
        out, vjp = jax.vjp(lambda rows: jinsum.nn.embedding_bag(rows, bags, mode), bags.take(table))
        return out, (bags.rows, vjp(cotangent)[0])
    return jax.jit(run)


def row_sums_of(gradient, rows: int):
    """The per-row sums of a gradient (dense, or `(rows, values)` of the touched rows) as float32 `(rows,)`."""
    if isinstance(gradient, tuple):
        touched, values = gradient
        return jnp.zeros(rows, jnp.float32).at[touched].add(values.astype(jnp.float32).sum(1), mode="drop")
    return gradient.astype(jnp.float32).sum(1)


def jax_result(result, rows: int):
    """(output, per-row sums of the gradient or None) of a JAX system's result, for the checks."""
    if isinstance(result, tuple):
        return result[0], row_sums_of(result[1], rows)
    return result, None


def cycle(fn, batches, *leading):
    """A call of `fn(*leading, *batch)` on the next batch each time (the first first): every call sees new bags."""
    position = [0]

    def one():
        position[0] += 1
        return fn(*leading, *batches[(position[0] - 1) % len(batches)])

    return one


def torch_systems(args, table: np.ndarray, dtype: str, mode: str, backward: bool, batches, cotangent):
    """`{name: (one, sync, to_check)}` for torch's `EmbeddingBag` on CUDA; empty without it."""
    torch = torch_on_cuda()
    if torch is None:
        return {}
    inputs = [(torch.from_numpy(ids).cuda(), torch.from_numpy(offsets).cuda()) for ids, offsets in batches]
    ct = torch.from_numpy(np.asarray(cotangent, np.float32)).cuda().to(getattr(torch, dtype))
    systems = {}
    for sparse in ([False, True] if backward else [False]):
        layer = torch.nn.EmbeddingBag(args.rows, args.features, mode=mode, sparse=sparse, device="cuda",
                                      dtype=getattr(torch, dtype))
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(table))

        def forward(ids, offsets, layer=layer):
            with torch.no_grad():
                return layer(ids, offsets)

        def forward_backward(ids, offsets, layer=layer):
            out = layer(ids, offsets)
            return out, torch.autograd.grad(out, layer.weight, ct)[0]

        def to_check(result, sparse=sparse):
            """(output, per-row sums of the gradient) as NumPy, for the checks."""
            if not backward:
                return result.float().cpu().numpy(), None
            out, grad = result
            sums = torch.sparse.sum(grad.float(), 1).to_dense() if sparse else grad.float().sum(1)
            return out.detach().float().cpu().numpy(), sums.cpu().numpy()

        name = f"torch EmbeddingBag, sparse={sparse}"
        systems[name] = (cycle(forward_backward if backward else forward, inputs), sync_torch, to_check)
    return systems


# --- running and recording --------------------------------------------------------------------------------------

def worst_error(got, want) -> float:
    """The largest relative error of (output, gradient's row sums) from the reference's."""
    return max(relative_error(a, b) for a, b in zip(got, want) if b is not None)


def run_workload(args, label: str, systems: dict, compiled: dict, reference) -> None:
    """Checks every system against `reference` (its error is a column), then times each twice, interleaved, keeping
    the second pass, and records the rows."""
    errors = {}
    for name, (one, sync, to_check) in list(systems.items()):
        try:
            errors[name] = worst_error(to_check(one()), reference)
        except Exception as error:  # noqa: BLE001 (a system that fails is a row, not the end of the run)
            traceback.print_exc()
            RESULTS.record(label, name, note=failure(error))
            del systems[name]
    timed = {}
    for _ in range(2):
        for name, (one, sync, _) in systems.items():
            timed[name] = 1e3 * time_calls(one, calls=args.calls, rounds=args.rounds, sync=sync)
    for name, (one, sync, _) in systems.items():
        device = device_time(one, calls=args.calls, sync=sync)
        if name in compiled:
            assert compiled[name]._cache_size() == 1, f"{name}: {compiled[name]._cache_size()} compiles"
        RESULTS.record(label, name, timed[name], "1 compile" if name in compiled else "",
                       device_ms=None if device is None else 1e3 * device, error=errors[name])


def workloads(args, rng):
    """Runs every (dtype, mode, pass) and records its rows."""
    host_batches = make_batches(rng, args.rows, args.bags, args.longest, args.ids, args.batches)
    jax_batches = padded(host_batches)
    for dtype in args.dtypes:
        table_np = (rng.standard_normal((args.rows, args.features)) / np.sqrt(args.features)).astype(np.float32)
        table = jnp.asarray(table_np, dtype)
        cotangent = jnp.asarray(rng.standard_normal((args.bags, args.features)), dtype)
        for mode in args.modes:
            for backward in (False, True):
                label = f"{dtype} {mode} {'forward+backward' if backward else 'forward'}"
                if backward:
                    functions = {"plain JAX gather + segment op": with_gradient(segment_forward, mode),
                                 "jinsum, dense gradient": with_gradient(jinsum_forward, mode),
                                 "jinsum, sparse rows": jinsum_sparse_rows(mode)}
                    leading = (table, cotangent)
                else:
                    functions = {"plain JAX gather + segment op": forward_only(segment_forward, mode),
                                 "jinsum": forward_only(jinsum_forward, mode)}
                    leading = (table,)
                systems = {name: (cycle(fn, jax_batches, *leading), jax.block_until_ready,
                                  lambda result: jax_result(result, args.rows))
                           for name, fn in functions.items()}
                systems.update(torch_systems(args, table_np, dtype, mode, backward, host_batches, cotangent))
                for fn in functions.values():  # every batch once: the compile count covers them all
                    for batch in jax_batches:
                        jax.block_until_ready(fn(*leading, *batch))
                # The reference: plain JAX in float32 on the first batch (the first each system is checked on).
                exact = (with_gradient if backward else forward_only)(segment_forward, mode)
                reference = jax_result(exact(*(x.astype(jnp.float32) for x in leading), *jax_batches[0]), args.rows)
                run_workload(args, label, systems, functions, [None if x is None else np.asarray(x, np.float64)
                                                               for x in reference])


def write_results(args, started: float) -> None:
    rows = RESULTS.rows
    for row in rows:  # (torch's time over the row's, against the torch layer of the same gradient)
        peer = f"torch EmbeddingBag, sparse={'sparse rows' in row['system']}"
        row["vs_torch"] = ratio(baseline(rows, row, lambda r: r["system"] == peer), row["ms"])
    preamble = (f"{versions_text(('triton', 'jax_triton', 'torch'))}; `{command(__file__)}` "
                f"({time.time() - started:.0f} s). Table {args.rows:,} x {args.features}, batches of {args.bags:,} "
                f"bags of 1-{args.longest} lookups ({args.ids} ids), flat ids + offsets. ms: median over rounds of "
                "back-to-back calls (`jinsum.timing.time_calls`), each call on the next of "
                f"{args.batches} batches; device ms: the GPU's own time. vs torch: torch's ms / the row's (above 1: "
                "faster), against `sparse=True` for the sparse rows, `sparse=False` otherwise."
                + ("" if torch_on_cuda() else " torch without CUDA: its rows are left out."))
    write(args.out / f"embedding_bag_{device_file_name()}", f"Embedding bags on {device_name()}", [preamble], COLUMNS,
          rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--bags", type=int, default=4096)
    p.add_argument("--longest", type=int, default=100, help="the most lookups in a bag (1 to longest, uniform)")
    p.add_argument("--ids", choices=["zipf", "uniform"], default="zipf")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--modes", nargs="+", choices=["sum", "mean", "max"], default=["sum", "mean", "max"])
    p.add_argument("--batches", type=int, default=4, help="distinct batches of the same shapes, called in turn")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    started = time.time()
    print(f"{device_name()}: table {args.rows:,} x {args.features}, {args.bags} bags of 1-"
          f"{args.longest} lookups, {args.ids} ids", flush=True)
    workloads(args, np.random.default_rng(0))
    write_results(args, started)


if __name__ == "__main__":
    main()

"""Sparse weights: `jinsum.nn.SparseLinear` against the dense layer and torch's sparse paths, forward and
forward + backward (the output, and the gradients with respect to the input and the stored values).

    python benchmarks/sparse_linear.py [--features 4096] [--batch 8192] [--calls 20] [--out benchmarks/results]

Workloads (the issue's; Scorch and SparseTIR's sparse autoencoders and pruned transformers):
- block sparse: `features x features` weights in 32 x 32 blocks at 10% of the blocks, bfloat16, batch 8192;
- element sparse: the same size at 1% of the elements, bfloat16 (and float32 for cuSPARSE).
Systems: jinsum `SparseLinear` (block: `BlockGroupCOO`, element: `GroupCOO`); the dense layer in JAX (`x @ W`, the
pattern's zeros stored) and in torch (`F.linear`); torch's block-sparse path (`F.linear` with a BSR weight, whose
CUDA kernel is Triton's `bsr_dense_mm`; its backward is not implemented in torch 2.11, so forward only) and its
element-sparse path (`torch.sparse.mm` on a CSR weight, cuSPARSE; forward + backward with the weight's values as a
leaf, where torch has the backward: float32); the torch systems where torch has CUDA. Every sparse system is
checked against the dense layer before it is timed.

Timing: `jinsum.timing.time_calls` (back-to-back calls, one sync per round, median of rounds) for every system.
TFLOP/s counts the stored entries' multiply-adds (2 x batch x nnz, three products for forward + backward).
Results go to `--out` as `sparse_linear_<device>.{md,csv}`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jinsum.nn as jnn  # noqa: E402
from jinsum.timing import time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, baseline, command, device_file_name, device_name, ratio, sync_torch,
    torch_on_cuda, versions_text, write)

torch = torch_on_cuda()  # (without CUDA, the torch rows are left out)

RESULTS = Results()
DENSE = "dense x @ W (JAX)"  # (the system every other is compared with)
CSV_FIELDS = ("workload", "system", "forward_ms", "forward_backward_ms", "forward_vs_dense",
              "forward_backward_vs_dense", "tflops", "note")
COLUMNS = (WORKLOAD, SYSTEM, Column("forward ms", "forward_ms", "{:.3f}"),
           Column("x dense", "forward_vs_dense", "{:.2f}"),
           Column("forward + backward ms", "forward_backward_ms", "{:.3f}"),
           Column("x dense", "forward_backward_vs_dense", "{:.2f}"), Column("TFLOP/s", "tflops", "{:.0f}"), NOTE)


def jax_times(apply, params, x, dy, calls: int, expected=None, dtype=jnp.bfloat16) -> dict:
    """The ms of `apply(params, x)` and of it with its vjp (gradients w.r.t. `params` and `x`), jitted."""
    forward = jax.jit(apply)
    both = jax.jit(lambda p, x, dy: jax.vjp(apply, p, x)[1](dy))
    if expected is not None:
        error = float(jnp.max(jnp.abs(forward(params, x).astype(jnp.float32) - expected)))
        scale = float(jnp.max(jnp.abs(expected)))
        if error > 2e-2 * scale:
            raise AssertionError(f"differs from the dense layer by {error:.3g} (max |y| {scale:.3g})")
    return {"forward_ms": 1e3 * time_calls(forward, params, x, calls=calls),
            "forward_backward_ms": 1e3 * time_calls(both, params, x, dy, calls=calls)}


def torch_times(forward, backward, calls: int, note: str = "") -> dict:
    """The ms of `forward()` and of `backward()` (None: torch has no backward), and `note`."""
    return {"forward_ms": 1e3 * time_calls(forward, calls=calls, sync=sync_torch),
            "forward_backward_ms": None if backward is None else 1e3 * time_calls(backward, calls=calls,
                                                                                 sync=sync_torch),
            "note": note}


def run(features: int, batch: int, workload: str, pattern, block_shape, dtype, calls: int) -> None:
    print(f"\n{workload}")
    layer = jnn.SparseLinear(features, features, pattern, block_shape=block_shape, use_bias=False, dtype=dtype,
                             param_dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    weight_t = layer.weight.todense()  # W^T (out, in), zeros off the pattern
    nnz = int(np.count_nonzero(np.asarray(weight_t, np.float32)))
    flops = 2.0 * batch * nnz
    dense_flops = 2.0 * batch * features * features
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, features)), dtype)
    dy = jnp.asarray(rng.standard_normal((batch, features)), dtype)
    expected = x.astype(jnp.float32) @ weight_t.T.astype(jnp.float32)

    RESULTS.attempt(workload, "jinsum SparseLinear", lambda: jax_times(
        lambda p, x: nnx.merge(graphdef, p, rest)(x), params, x, dy, calls, expected), flops=flops)
    RESULTS.attempt(workload, DENSE, lambda: jax_times(lambda w, x: x @ w, weight_t.T, x, dy, calls),
                    flops=dense_flops)
    if torch is None:
        return
    tx = torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(getattr(torch, jnp.dtype(dtype).name))
    tdy = torch.from_numpy(np.asarray(dy.astype(jnp.float32))).cuda().to(tx.dtype)
    tw = torch.from_numpy(np.asarray(weight_t.astype(jnp.float32))).cuda().to(tx.dtype)  # (out, in), as F.linear's
    texpected = torch.from_numpy(np.asarray(expected)).cuda()

    def check(y):
        error = float((y.float() - texpected).abs().max())
        if error > 2e-2 * float(texpected.abs().max()):
            raise AssertionError(f"differs from the dense layer by {error:.3g}")

    def dense_torch():
        w, xg = tw.clone().requires_grad_(), tx.clone().requires_grad_()
        forward = lambda: torch.nn.functional.linear(tx, tw)  # noqa: E731
        check(forward())

        def both():
            y = torch.nn.functional.linear(xg, w)
            return torch.autograd.grad(y, (w, xg), tdy)

        return torch_times(forward, both, calls)

    RESULTS.attempt(workload, "dense F.linear (torch)", dense_torch, flops=dense_flops)
    if block_shape is not None:
        def bsr_torch():
            w = tw.to_sparse_bsr(block_shape)
            forward = lambda: torch.nn.functional.linear(tx, w)  # noqa: E731
            check(forward())
            return torch_times(forward, None, calls, "forward only: torch has no BSR weight gradient")

        RESULTS.attempt(workload, "torch F.linear, BSR weight (Triton)", bsr_torch, flops=flops)
    else:
        def csr_torch():
            w = tw.to_sparse_csr()
            forward = lambda: torch.sparse.mm(w, tx.t()).t()  # noqa: E731
            check(forward())
            values = w.values().clone().requires_grad_()
            xg = tx.clone().requires_grad_()

            def both():
                wg = torch.sparse_csr_tensor(w.crow_indices(), w.col_indices(), values, w.shape)
                y = torch.sparse.mm(wg, xg.t()).t()
                return torch.autograd.grad(y, (values, xg), tdy)

            try:
                both()
            except (NotImplementedError, RuntimeError) as error:  # (no bfloat16 backward in torch 2.11)
                return torch_times(forward, None, calls, f"forward only: {str(error)[:80]}")
            return torch_times(forward, both, calls)

        RESULTS.attempt(workload, "torch.sparse.mm, CSR weight (cuSPARSE)", csr_torch, flops=flops)


def write_results(out: pathlib.Path, started: float) -> None:
    rows = RESULTS.rows
    for row in rows:
        for key in ("forward_ms", "forward_backward_ms"):
            dense = baseline(rows, row, lambda r: r["system"] == DENSE, key)
            row[key.replace("_ms", "_vs_dense")] = ratio(dense, row.get(key))
        both = row.get("forward_backward_ms")  # (three products: the output and the two gradients)
        row["tflops"] = None if both is None else 3 * row["flops"] / (both * 1e-3) / 1e12
    preamble = (f"{versions_text(('triton', 'jax_triton', 'torch'))}; `{command(__file__)}` "
                f"({time.time() - started:.0f} s). ms: median over rounds of back-to-back calls; x dense: the JAX "
                "dense layer's time over the system's (above 1: faster than dense); TFLOP/s: the stored entries' (or "
                "the dense layer's) forward + backward multiply-adds over its time.")
    write(out / f"sparse_linear_{device_file_name()}", f"Sparse linear layers on {device_name()}", [preamble], COLUMNS,
          rows, csv_fields=CSV_FIELDS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    started, f, b = time.time(), args.features, args.batch
    blocks = jnn.random_pattern(f, f, 0.1, block_shape=(32, 32))
    run(f, b, f"{f}x{f}, 32x32 blocks at 10%, bf16, batch {b}", blocks, (32, 32), jnp.bfloat16, args.calls)
    elements = jnn.random_pattern(f, f, 0.01)
    for dtype in (jnp.bfloat16, jnp.float32):
        run(f, b, f"{f}x{f}, elements at 1%, {jnp.dtype(dtype).name}, batch {b}", elements, None, dtype, args.calls)
    write_results(args.out, started)


if __name__ == "__main__":
    main()

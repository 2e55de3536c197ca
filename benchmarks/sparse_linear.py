"""Sparse weights: `jinsum.nn.SparseLinear` against the dense layer and torch's sparse paths, forward and
forward + backward (the output, and the gradients with respect to the input and the stored values).

    python benchmarks/sparse_linear.py [--features 4096] [--batch 8192] [--calls 20] [--out benchmarks/results]
    python benchmarks/sparse_linear.py --features 256 --batch 512 --calls 2 --out /tmp/sl   # CPU: a check, < 1 min
    python benchmarks/sparse_linear.py --tile-loads both      # jinsum's block kernels with and without TMA loads

Workloads (the issue's; Scorch and SparseTIR's sparse autoencoders and pruned transformers):
- block sparse: `features x features` weights in 32 x 32 blocks at 10% and at 5% of the blocks, bfloat16, batch
  8192 (issue targets, forward + backward over the dense layer's: >= 3x at 10%, >= 5x at 5%);
- element sparse: the same size at 1% of the elements, bfloat16 (and float32 for cuSPARSE).
Systems: jinsum `SparseLinear` (block: `BlockGroupCOO`, element: `GroupCOO`); the dense layer in JAX (`x @ W`, the
pattern's zeros stored) and in torch (`F.linear`); torch's block-sparse path (`F.linear` with a BSR weight, whose
CUDA kernel is Triton's `bsr_dense_mm`; its backward is not implemented in torch 2.11, so forward only) and its
element-sparse path (`torch.sparse.mm` on a CSR weight, cuSPARSE; forward + backward with the weight's values as a
leaf, where torch has the backward: float32); the torch systems where torch has CUDA. Every sparse system is
checked against the dense layer before it is timed.

What is timed, for every system: (a) the forward alone, `y = f(params, x)`; (b) forward and backward together, one
jitted function `y, pullback = jax.vjp(f, params, x); grads = pullback(dy)` returning `y` and the gradients, with
a random cotangent `dy` as an argument: nothing is dead code for XLA to drop, and no cotangent of ones lets it
simplify the backward (torch: `F.linear` then `torch.autograd.grad` with the same `dy`, eager). Timing:
`jinsum.timing.time_calls` (back-to-back calls, one sync per round, median of rounds).

FLOPs count what runs: forward 2 x batch x (stored entries; the dense layer: features^2), i.e. 2*M*N*K*density;
forward + backward 3x that (the output, dX and dW each one product of the same size). TFLOP/s over each time, and
"% peak" over the device's dense Tensor Core peak (`PEAKS`: bf16 989 TFLOP/s on H100 / H200 SXM; the float32 rows
against TF32's 495, the precision XLA's float32 dots use there by default). A figure above the peak is a bug in the
benchmark: such a row says so in its note. Results go to `--out` as `sparse_linear_<device>.{md,csv}`.

`--tile-loads`: how jinsum's block kernels (dot plans) read their tiles: `default` as the library does (by
pointers, unless `jinsum.autotune` stored TMA descriptors for a statement), `descriptors` or `pointers` forced,
`both` a row each (the descriptor row named "..., TMA descriptor loads"). Forcing runs every statement with the
default tiles (`jinsum.kernels.forced_config`), ignoring configurations `jinsum.autotune` stored.
"""

from __future__ import annotations

import argparse
import contextlib
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
from jinsum.kernels import KernelConfig, forced_config  # noqa: E402
from jinsum.timing import time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, baseline, command, device_file_name, device_name, ratio, sync_torch,
    torch_on_cuda, versions_text, write)

torch = torch_on_cuda()  # (without CUDA, the torch rows are left out)

RESULTS = Results()
JINSUM = "jinsum SparseLinear"
# --tile-loads: the jinsum rows to time, as (system, forced KernelConfig or None for the library's default).
TILE_LOADS = {"default": [(JINSUM, None)], "descriptors": [(JINSUM, KernelConfig(descriptors=True))],
              "pointers": [(JINSUM, KernelConfig(descriptors=False))],
              "both": [(JINSUM, KernelConfig(descriptors=False)),
                       (f"{JINSUM}, TMA descriptor loads", KernelConfig(descriptors=True))]}
DENSE = "dense x @ W (JAX)"  # (the system every other is compared with)
PASSES = ("forward", "forward_backward")  # (the column keys' prefixes: forward_ms, forward_backward_tflops, ...)
CSV_FIELDS = ("workload", "system", "flops", "peak_tflops", "target_vs_dense",
              *(f"{p}_{c}" for p in PASSES for c in ("ms", "tflops", "of_peak", "vs_dense")), "note")
COLUMNS = (WORKLOAD, SYSTEM,
           *(column for p, shown in zip(PASSES, ("fwd", "fwd+bwd")) for column in (
               Column(f"{shown} ms", f"{p}_ms", "{:.3f}"), Column(f"{shown} TFLOP/s", f"{p}_tflops", "{:.0f}"),
               Column(f"{shown} % peak", f"{p}_of_peak", "{:.0%}"),
               Column(f"{shown} x dense", f"{p}_vs_dense", "{:.2f}"))),
           Column("target (fwd+bwd x dense)", "target"), NOTE)

# Dense Tensor Core peaks in TFLOP/s (no structured sparsity) by device and dtype: bf16, and float32 as TF32 (XLA's
# default precision for float32 dots on these GPUs; torch's F.linear keeps IEEE float32, whose peak is 67).
PEAKS = {"H100 PCIe": {"bfloat16": 756.0, "float32": 378.0},
         "H100": {"bfloat16": 989.0, "float32": 494.7}, "H200": {"bfloat16": 989.0, "float32": 494.7}}


def peak_tflops(dtype) -> float | None:
    """The device's dense peak for `dtype`, None where `PEAKS` does not know the device (a CPU check)."""
    name = device_name()
    found = next((peaks for key, peaks in PEAKS.items() if all(word in name for word in key.split())), None)
    return None if found is None else found.get(jnp.dtype(dtype).name)


def jax_times(apply, params, x, dy, calls: int, expected=None) -> dict:
    """The ms of `apply(params, x)` alone, and of it with its backward in one jitted call that returns the output
    and the gradients w.r.t. `params` and `x` (so XLA keeps the forward), for the random cotangent `dy`."""
    forward = jax.jit(apply)

    def forward_backward(p, x, dy):
        y, pullback = jax.vjp(apply, p, x)
        return y, pullback(dy)

    both = jax.jit(forward_backward)
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


def run(features: int, batch: int, workload: str, pattern, block_shape, dtype, calls: int,
        target: float | None = None, tile_loads: str = "default") -> None:
    """`workload`'s rows; `target`: the issue's forward + backward speed-up over the dense layer for jinsum;
    `tile_loads`: how jinsum's block kernels read their tiles (`TILE_LOADS`)."""
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

    peak = peak_tflops(dtype)
    for system, config in TILE_LOADS[tile_loads if block_shape is not None else "default"]:
        def jinsum_times(config=config):
            with forced_config(config) if config is not None else contextlib.nullcontext():  # (compiled inside)
                return jax_times(lambda p, x: nnx.merge(graphdef, p, rest)(x), params, x, dy, calls, expected)

        RESULTS.attempt(workload, system, jinsum_times, flops=flops, peak_tflops=peak, target_vs_dense=target)
    RESULTS.attempt(workload, DENSE, lambda: jax_times(lambda w, x: x @ w, weight_t.T, x, dy, calls),
                    flops=dense_flops, peak_tflops=peak)
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

    RESULTS.attempt(workload, "dense F.linear (torch)", dense_torch, flops=dense_flops, peak_tflops=peak)
    if block_shape is not None:
        def bsr_torch():
            w = tw.to_sparse_bsr(block_shape)
            forward = lambda: torch.nn.functional.linear(tx, w)  # noqa: E731
            check(forward())
            return torch_times(forward, None, calls, "forward only: torch has no BSR weight gradient")

        RESULTS.attempt(workload, "torch F.linear, BSR weight (Triton)", bsr_torch, flops=flops, peak_tflops=peak)
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

        RESULTS.attempt(workload, "torch.sparse.mm, CSR weight (cuSPARSE)", csr_torch, flops=flops,
                        peak_tflops=peak)


def write_results(out: pathlib.Path, started: float) -> None:
    rows = RESULTS.rows
    for row in rows:
        for factor, pass_name in ((1, "forward"), (3, "forward_backward")):  # (fwd+bwd: output, dX and dW)
            ms = row.get(f"{pass_name}_ms")
            dense = baseline(rows, row, lambda r: r["system"] == DENSE, f"{pass_name}_ms")
            row[f"{pass_name}_vs_dense"] = ratio(dense, ms)
            tflops = None if ms is None else factor * row["flops"] / (ms * 1e-3) / 1e12
            row[f"{pass_name}_tflops"] = tflops
            row[f"{pass_name}_of_peak"] = ratio(tflops, row.get("peak_tflops"))
            if row[f"{pass_name}_of_peak"] and row[f"{pass_name}_of_peak"] > 1:
                row["note"] = (f"{row.get('note') or ''} {pass_name}: above the {row['peak_tflops']:.0f} TFLOP/s "
                               "peak, a bug in the benchmark").strip()
        target, reached = row.get("target_vs_dense"), row.get("forward_backward_vs_dense")
        if target is not None:
            row["target"] = f">= {target:g}x: {'met' if reached and reached >= target else 'missed'}"
    peaks = sorted({row["peak_tflops"] for row in rows if row.get("peak_tflops")})
    preamble = (f"{versions_text(('triton', 'jax_triton', 'torch'))}; `{command(__file__)}` "
                f"({time.time() - started:.0f} s). ms: median over rounds of back-to-back calls; fwd: the forward "
                "alone; fwd+bwd: the forward and the backward in one call (output, dX and dW, for a random "
                "cotangent); TFLOP/s: the multiply-adds that run (forward 2 x batch x stored entries, or features^2 "
                "for the dense layers; fwd+bwd 3x that) over the time; % peak: over the device's dense Tensor Core "
                f"peak ({' / '.join(f'{p:.0f}' for p in peaks) or 'unknown device'} TFLOP/s: bf16, float32 rows "
                "against TF32); x dense: the JAX dense layer's time over the system's (above 1: faster than dense); "
                "target: the issue's forward + backward speed-up over the dense layer.")
    write(out / f"sparse_linear_{device_file_name()}", f"Sparse linear layers on {device_name()}", [preamble], COLUMNS,
          rows, csv_fields=CSV_FIELDS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    p.add_argument("--tile-loads", choices=sorted(TILE_LOADS), default="default",
                   help="how jinsum's block kernels read tiles: the library's default, TMA descriptors, pointers, or "
                        "a row for each of the two (see above)")
    args = p.parse_args()
    started, f, b = time.time(), args.features, args.batch
    for density, target in ((0.10, 3.0), (0.05, 5.0)):  # (the targets over the dense layer, fwd+bwd)
        blocks = jnn.random_pattern(f, f, density, block_shape=(32, 32))
        run(f, b, f"{f}x{f}, 32x32 blocks at {density:.0%}, bf16, batch {b}", blocks, (32, 32), jnp.bfloat16,
            args.calls, target, args.tile_loads)
    elements = jnn.random_pattern(f, f, 0.01)
    for dtype in (jnp.bfloat16, jnp.float32):
        run(f, b, f"{f}x{f}, elements at 1%, {jnp.dtype(dtype).name}, batch {b}", elements, None, dtype, args.calls)
    write_results(args.out, started)


if __name__ == "__main__":
    main()

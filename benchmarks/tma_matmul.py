"""Whether TMA reaches the Tensor Cores' pace through jinsum's launcher (issue 42's first obstacle): a bf16 matmul
`C = A @ B` as a Triton kernel loading its tiles by TMA descriptors made on the device (their global scratch given
by the launch, `jinsum._lowering._launch`), against the same kernel loading tiles by pointers, and cuBLAS
(`jnp.dot`), in one process.

    python benchmarks/tma_matmul.py [--size 8192] [--calls 50]

Both kernels are the textbook ones (grouped program order for L2 reuse, `tl.range(num_stages=...)` pipelining);
each runs at four tile shapes. Results: `benchmarks/results/tma_matmul_<device>.md`.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from jinsum._lowering._launch import XLA_KERNEL
from jinsum.timing import time_calls

from _harness import (NOTE, SYSTEM, WORKLOAD, Column, Results, command, device_file_name, device_name,  # (benchmarks/)
                      versions_text, write)

HERE = pathlib.Path(__file__).parent
PEAK_TFLOPS = 989.0  # H100 / H200 SXM, bf16 dense
TILES = [(128, 128, 64, 4, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 4)]


@triton.jit
def _program_tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """Programs walk `GROUP` rows of tiles at a time, so those running together share A's and B's tiles in L2."""
    pid = tl.program_id(0)
    width = GROUP * tl.cdiv(N, BN)
    first = (pid // width) * GROUP
    rows = min(tl.cdiv(M, BM) - first, GROUP)
    return first + (pid % width) % rows, (pid % width) // rows


@triton.jit
def matmul_by_descriptors(a_ptr, b_ptr, M, N, K, c_ptr, scratch, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = _program_tile(M, N, BM, BN, GROUP)
    a = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    c = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        acc = tl.dot(a.load([pid_m * BM, k]), b.load([k, pid_n * BN]), acc)
    c.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


@triton.jit
def matmul_by_pointers(a_ptr, b_ptr, M, N, K, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       STAGES: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = _program_tile(M, N, BM, BN, GROUP)
    rows, cols, ks = pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        acc = tl.dot(tl.load(a_ptr + rows[:, None] * K + (k + ks)[None, :]),
                     tl.load(b_ptr + (k + ks)[:, None] * N + cols[None, :]), acc)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16))


def _kernel_matmul(kernel, size: int, tile, **launch):
    bm, bn, bk, warps, stages = tile
    grid = ((size // bm) * (size // bn),)

    def matmul(a, b):
        return XLA_KERNEL.call(kernel, a, b, size, size, size, out_shape=jax.ShapeDtypeStruct((size, size),
                                                                                             jnp.bfloat16),
                               grid=grid, num_warps=warps, num_stages=stages, name=kernel.__name__, BM=bm, BN=bn,
                               BK=bk, STAGES=stages, GROUP=8, **launch)
    return jax.jit(matmul)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=8192, help="M = N = K (a multiple of 256)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    size, flops = args.size, 2 * args.size ** 3
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16) for _ in range(2))
    workload = f"bf16 matmul {size}^3"
    results = Results()

    def measure(fn, expected=None):
        ms = time_calls(fn, a, b, calls=args.calls) * 1e3
        out = np.asarray(fn(a, b), np.float32)
        diff = None if expected is None else float(np.abs(out - expected).max())
        return dict(ms=ms, tflops=flops / ms / 1e9, peak=flops / ms / 1e9 / PEAK_TFLOPS, diff=diff), out

    cublas = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    measured, expected = measure(cublas)
    results.record(workload, "cuBLAS (jnp.dot)", **measured)
    for system, kernel, launch in [("Triton, TMA descriptors on the device", matmul_by_descriptors,
                                    dict(global_scratch=384)),  # (three descriptors of 128 bytes a program)
                                   ("Triton, pointer loads", matmul_by_pointers, {})]:
        for tile in TILES:
            results.attempt(workload, system, lambda: measure(_kernel_matmul(kernel, size, tile, **launch),
                                                              expected)[0],
                            note="{} x {} x {}, {} warps, {} stages".format(*tile))
    columns = [WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}"), Column("TFLOP/s", "tflops", "{:.0f}"),
               Column("of bf16 peak", "peak", "{:.0%}"), Column("max diff vs cuBLAS", "diff", "{:.1g}"), NOTE]
    preamble = [f"{versions_text()}; `{command(__file__)}`. ms: median over rounds of back-to-back calls "
                f"(`jinsum.timing.time_calls`); peak: {PEAK_TFLOPS:.0f} TFLOP/s."]
    write(args.out / f"tma_matmul_{device_file_name()}", f"TMA through jinsum's launcher, {device_name()}", preamble,
          columns, results.rows)


if __name__ == "__main__":
    main()

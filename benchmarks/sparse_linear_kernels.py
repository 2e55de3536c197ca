"""Where SparseLinear's time goes, kernel by kernel: the issue's layer (4096^2, 32 x 32 blocks at 10%, bf16, batch
8192), forward and backward in one jitted call, on a GPU.

    python benchmarks/sparse_linear_kernels.py --configs          # each kernel's device time under several tilings
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        python benchmarks/sparse_linear_kernels.py --profile       # one call's kernels against the hardware's limits
    python benchmarks/sparse_linear_kernels.py --configs --features 256 --batch 512 --calls 2   # CPU: a check

`--configs`: the call compiled under each `KernelConfig` of `CONFIGS` (forced for every statement of the call:
`jinsum.kernels.forced_config`, a new jitted function each time, since JAX's caches do not see the forced
configuration), its time (`jinsum.timing.time_calls`) and its kernels' device times (`jinsum.timing.kernel_times`):
the forward and the input gradient are `jinsum_dot_segmented` (one name for both), the weight gradient
`jinsum_dot_atomic`. `--profile`: three warm-up calls, then one call between `cudaProfilerStart` and
`cudaProfilerStop`, so that Nsight Compute profiles that call's kernels alone (not XLA's autotuning at compile time).
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jinsum.nn as jnn
from jinsum.kernels import KernelConfig, forced_config
from jinsum.timing import kernel_times, time_calls

# The default first; then taller batch tiles (fewer re-reads of each weight block), more warps, deeper pipelines,
# the weight gradient's batch cut into fewer or more chunks, wider k tiles for it.
CONFIGS = (None, KernelConfig(block_m=128), KernelConfig(block_m=128, num_warps=8), KernelConfig(block_m=32),
           KernelConfig(num_stages=3), KernelConfig(k_chunks=4), KernelConfig(k_chunks=16), KernelConfig(window=16))


def layer_call(features: int = 4096, batch: int = 8192, density: float = 0.10):
    """The forward and backward of the layer as one function of `(params, x, dy)`, a maker of fresh copies of it,
    and its arguments."""
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((batch, features)), dtype)
    dy = jnp.asarray(rng.standard_normal((batch, features)), dtype)
    pattern = jnn.random_pattern(features, features, density, block_shape=(32, 32))
    layer = jnn.SparseLinear(features, features, pattern, block_shape=(32, 32), use_bias=False, dtype=dtype,
                             param_dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def make():
        def forward_backward(p, x, dy):
            y, pullback = jax.vjp(lambda p, x: nnx.merge(graphdef, p, rest)(x), p, x)
            return y, pullback(dy)
        return jax.jit(forward_backward)

    return make, (params, x, dy)


def sweep(calls: int, features: int, batch: int) -> None:
    make, args = layer_call(features, batch)
    for config in CONFIGS:
        shown = "default" if config is None else ", ".join(
            f"{k}={v}" for k, v in vars(config).items() if v and k != "hopper")
        with forced_config(config) if config is not None else contextlib.nullcontext():
            compiled = make().lower(*args).compile()
        total = time_calls(compiled, *args, calls=calls)
        kernels = sorted(kernel_times(compiled, *args, calls=calls).items(), key=lambda kv: -kv[1])
        print(f"{shown:32s} {1e3 * total:.3f} ms:", ", ".join(f"{name} {1e6 * t:.0f} us" for name, t in kernels
                                                              if t > 0.01 * total), flush=True)


def profile(features: int, batch: int) -> None:
    import torch  # noqa: PLC0415 (its CUDA runtime binding starts and stops the profiler)

    make, args = layer_call(features, batch)
    call = make()
    for _ in range(3):
        jax.block_until_ready(call(*args))
    torch.cuda.profiler.start()
    jax.block_until_ready(call(*args))
    torch.cuda.profiler.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--configs", action="store_true", help="kernel times under each configuration of CONFIGS")
    which.add_argument("--profile", action="store_true", help="one call between cudaProfilerStart and Stop")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--features", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8192)
    args = p.parse_args()
    if args.configs:
        sweep(args.calls, args.features, args.batch)
    else:
        profile(args.features, args.batch)


if __name__ == "__main__":
    main()

"""Where a generated kernel stops paying: an SpMM over a fixed-fanout table (rows x k slots, F features), forward and
backward, inside a jitted function of several such statements, on the Triton lowering and on XLA's.

    python benchmarks/crossover.py [--rows 1024 4096 16384 65536 262144] [--fanout 10] [--features 32 128 256]

Each jitted call runs 4 chained SpMMs and their gradient for a random cotangent (a step's worth of statements), so
the per-statement launch cost inside one executable counts, as it does in a training step. Prints, per lowering,
ms per call of back-to-back calls (the two lowerings in interleaved rounds: calls this small are the host's, whose
speed drifts) and of the device's own time, and the number of terms (rows x k x F) per statement, which
the default of `jinsum.small_terms` is chosen from.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jinsum
from jinsum.timing import device_time, time_interleaved

from _harness import device_name  # (benchmarks/, this script's folder)


def chained(A, x, cotangent):
    """4 chained SpMMs and the gradient of their result for `cotangent` (not a sum's ones, which XLA may simplify)."""
    def forward(x):
        for _ in range(4):
            x = jnp.tanh(A @ x)
        return x

    out, pullback = jax.vjp(forward, x)
    return out, pullback(cotangent)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 262144])
    p.add_argument("--fanout", type=int, default=10)
    p.add_argument("--features", type=int, nargs="+", default=[32, 128, 256])
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"{device_name()}; SpMM over a (rows, {args.fanout}) table, 4 chained + gradient per call")
    print(f"{'rows':>8} {'F':>4} {'terms':>12} {'triton ms':>10} {'xla ms':>8} {'triton dev':>10} {'xla dev':>8} "
          f"{'xla/triton dev':>14}")
    for rows in args.rows:
        neighbors = jnp.asarray(rng.integers(0, rows, (rows, args.fanout)), jnp.int32)
        A = jax.jit(lambda n: jinsum.GroupCOO.from_neighbors(n, num_sources=n.shape[0]))(neighbors)
        for features in args.features:
            x = jnp.asarray(rng.normal(size=(rows, features)), jnp.float32)
            cotangent = jnp.asarray(rng.normal(size=(rows, features)), jnp.float32)
            steps = {}
            for name, kernels in (("triton", True), ("xla", False)):
                # (a kernel for every size in the Triton column; the settings are in JAX's cache keys)
                with jinsum.triton(kernels), jinsum.small_terms(0):
                    compiled = jax.jit(chained).lower(A, x, cotangent).compile()
                steps[name] = lambda compiled=compiled: compiled(A, x, cotangent)
            wall = time_interleaved(steps, calls=args.calls)
            device = {name: device_time(step, calls=args.calls) for name, step in steps.items()}
            on_device = (f"{1e3 * device['triton']:10.3f} {1e3 * device['xla']:8.3f} "
                         f"{device['xla'] / device['triton']:14.2f}" if device["triton"] else "(no GPU trace)")
            print(f"{rows:8d} {features:4d} {rows * args.fanout * features:12,d} {1e3 * wall['triton']:10.3f} "
                  f"{1e3 * wall['xla']:8.3f} {on_device}", flush=True)


if __name__ == "__main__":
    main()

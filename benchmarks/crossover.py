"""Where a generated kernel stops paying: an SpMM over a fixed-fanout table (rows x k slots, F features), forward and
backward, inside a jitted function of several such statements, on the Triton lowering and on XLA's.

    python benchmarks/crossover.py [--rows 1024 4096 16384 65536 262144] [--fanout 10] [--features 32 128 256]

Each jitted call runs 4 chained SpMMs and their gradient (a step's worth of statements), so the per-statement
launch cost inside one executable counts, as it does in a training step: XLA's fusions run as one CUDA graph, a
generated kernel (a custom call) is launched on its own. Prints ms per call for both lowerings and the number of
terms (rows x k x F) per statement, which `jinsum._lowering._route.SMALL_TERMS` is chosen from.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import jinsum
from jinsum.timing import time_calls

from _harness import device_name  # (benchmarks/, this script's folder)


def chained(A, x):
    for _ in range(4):
        x = jnp.tanh(A @ x)
    return x.sum()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 262144])
    p.add_argument("--fanout", type=int, default=10)
    p.add_argument("--features", type=int, nargs="+", default=[32, 128, 256])
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"{device_name()}; SpMM over a (rows, {args.fanout}) table, 4 chained + gradient per call")
    print(f"{'rows':>8} {'F':>4} {'terms':>12} {'triton ms':>10} {'xla ms':>8} {'xla/triton':>10}")
    for rows in args.rows:
        neighbors = jnp.asarray(rng.integers(0, rows, (rows, args.fanout)), jnp.int32)
        A = jax.jit(lambda n: jinsum.GroupCOO.from_neighbors(n, num_sources=n.shape[0]))(neighbors)
        for features in args.features:
            x = jnp.asarray(rng.normal(size=(rows, features)), jnp.float32)
            times = {}
            for lowering in ("1", "0"):
                os.environ["JINSUM_TRITON"] = lowering  # read when the statement is lowered
                os.environ["JINSUM_SMALL_TERMS"] = "0"  # a kernel for every size in the Triton column
                step = jax.jit(jax.value_and_grad(chained, argnums=1))
                times[lowering] = time_calls(step, A, x, calls=args.calls) * 1e3
            terms = rows * args.fanout * features
            print(f"{rows:8d} {features:4d} {terms:12,d} {times['1']:10.3f} {times['0']:8.3f} "
                  f"{times['0'] / times['1']:10.2f}", flush=True)
    os.environ.pop("JINSUM_TRITON")
    os.environ.pop("JINSUM_SMALL_TERMS")


if __name__ == "__main__":
    main()

"""One timing method for every system in a comparison (used by the examples and the benchmarks).

A host timer around one call of a jitted function measures dispatch, not the device. `time_calls` warms up
(compilation, caches), then times `calls` back-to-back calls closed by one synchronisation, divides by `calls`,
and reports the median over `rounds`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def time_calls(fn: Callable, *args, calls: int = 20, rounds: int = 5, warmup: int = 2,
               sync: Callable = jax.block_until_ready) -> float:
    """Median seconds per call of `fn(*args)`, over `rounds` rounds of `calls` back-to-back calls.

    `sync(output)` waits for the device: `jax.block_until_ready` for JAX; pass e.g.
    `lambda _: torch.cuda.synchronize()` to time another framework the same way.
    """
    for _ in range(warmup):
        sync(fn(*args))
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        sync(out)
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call)

"""One timing method for every system in a comparison (used by the examples and the benchmarks).

A host timer around one call of a jitted function measures dispatch, not the device. `time_calls` warms up
(compilation, caches), then times `calls` back-to-back calls closed by one synchronisation, divides by `calls`,
and reports the median over `rounds`. `time_interleaved` does the same for several systems at once, their rounds
taken in turn, so that a host whose speed drifts during a comparison moves every system alike (small steps are the
host's dispatch). `device_time` reads what the GPU itself spent per call from a profiler trace, for workloads so
small that back-to-back calls measure the host's dispatch.
"""

from __future__ import annotations

import pathlib
import statistics
import time
from collections.abc import Callable, Mapping

import jax


def time_calls(fn: Callable, *args, calls: int = 20, rounds: int = 5, warmup: int = 2,
               sync: Callable = jax.block_until_ready) -> float:
    """Median seconds per call of `fn(*args)`, over `rounds` rounds of `calls` back-to-back calls.

    `sync(output)` waits for the device: `jax.block_until_ready` for JAX; pass e.g.
    `lambda _: torch.cuda.synchronize()` to time another framework the same way.
    """
    return time_interleaved({"": lambda: fn(*args)}, calls=calls, rounds=rounds, warmup=warmup, sync=sync)[""]


def time_interleaved(fns: Mapping[str, Callable[[], object]], *, calls: int = 20, rounds: int = 5, warmup: int = 2,
                     sync: Callable = jax.block_until_ready) -> dict[str, float]:
    """Median seconds per call of each of `fns` (functions of no arguments, by name), over `rounds` rounds: each
    round times `calls` back-to-back calls of each function, closed by one `sync`, in an order that rotates from
    round to round. A small step's time is the host's, which drifts by tens of percent over a minute (DESIGN.md,
    "Measure device time, warm and interleaved"); measured one after another, two systems would each get their own
    minute."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            sync(fns[name]())
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(calls):
                out = fns[name]()
            sync(out)
            per_call[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(times) for name, times in per_call.items()}


def device_time(fn: Callable, *args, calls: int = 20, warmup: int = 2,
                sync: Callable = jax.block_until_ready) -> float | None:
    """Seconds per call that the GPU spends running the kernels and copies of `fn(*args)`, from a profiler trace.

    Back-to-back calls of a small workload are bound by the host's dispatch (DESIGN.md, "Measure device
    time, warm and interleaved"), whatever the kernels take; this is what the device does, summed over `calls`
    calls. Gaps between kernels do not count. Returns None where the trace has no GPU activity (a CPU backend).
    """
    kernels = kernel_times(fn, *args, calls=calls, warmup=warmup, sync=sync)
    return sum(kernels.values()) if kernels else None


def kernel_times(fn: Callable, *args, calls: int = 20, warmup: int = 2,
                 sync: Callable = jax.block_until_ready) -> dict[str, float]:
    """Seconds per call that each GPU kernel (and copy) of `fn(*args)` runs, by name, from a profiler trace:
    where a step's device time goes. Empty where the trace has no GPU activity."""
    import tempfile  # noqa: PLC0415

    from jax.profiler import ProfileData  # noqa: PLC0415

    for _ in range(warmup):
        sync(fn(*args))
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                out = fn(*args)
            sync(out)
        [path] = pathlib.Path(directory).rglob("*.xplane.pb")
        profile = ProfileData.from_file(str(path))
    totals: dict[str, float] = {}
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                for event in line.events:
                    totals[event.name] = totals.get(event.name, 0.0) + event.duration_ns / 1e9 / calls
    return totals

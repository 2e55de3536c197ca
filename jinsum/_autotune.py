"""Opt-in autotuning of generated kernels: time a small set of configurations on real operands, keep the fastest
(stored on disk by `jinsum.kernels`, and used by every later CUDA lowering of the same call)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence

import jax

from jinsum._frontend import _einsum
from jinsum._rules import _primitive
from jinsum._lang import Spec
from jinsum.kernels import KernelConfig, forced_config, has_tma, make_plan, statement_config, store_tuned_config
from jinsum.timing import time_calls


def candidate_configs(spec: Spec) -> list[KernelConfig]:
    """The configurations `autotune` tries for `spec` by default (the route's default first). On GPUs with TMA,
    dot plans also try their tiles read through descriptors; on sm_90, plans with a Hopper form
    (`jinsum.kernels.grouped_hopper_fallback`) try its column tiles and stages too."""
    plan = make_plan(spec)
    if getattr(plan, "template", None) == "dot":
        default = statement_config()
        hopper = []
        if default.hopper and make_plan(spec, default).config.hopper:
            hopper = [dataclasses.replace(default, block_n=bn, num_stages=s) for bn, s in
                      [(0, 0), (128, 0), (256, 2), (128, 3)]]
        tiles = [(0, 0, 0, ""), (128, 4, 2, "rows"), (256, 8, 3, "rows"), (128, 4, 2, "owned"), (256, 8, 1, "split"),
                 (128, 4, 1, "split")]
        return hopper + [KernelConfig(block_n=bn, num_warps=w, num_stages=s, schedule=schedule, descriptors=tma)
                         for tma in (False, True)[:1 + has_tma()] for bn, w, s, schedule in tiles]
    return [KernelConfig(block=b, window=win, num_warps=w, num_stages=s, schedule=schedule)
            for b, win, w, s, schedule in [(0, 0, 0, 0, ""), (0, 4, 0, 1, "split"), (0, 8, 0, 1, "split"),
                                           (0, 16, 0, 1, "split"), (0, 4, 0, 1, "owned"), (0, 1, 0, 2, "rows"),
                                           (64, 4, 1, 1, "split"), (0, 16, 0, 1, "tile"), (32, 16, 4, 1, "tile"),
                                           (0, 8, 0, 1, "tile")]]


def autotune(expression: str, /, *, configs: Sequence[KernelConfig] | None = None, calls: int = 10,
             sorted_indices: Collection[str] = (), allow_tf32: bool | None = None, **named) -> KernelConfig:
    """Times the generated kernel for this call under each configuration and stores the fastest.

    Takes `einsum`'s arguments, with the same defaults (the operands must live on a CUDA GPU). Returns the chosen
    configuration; from now on (also in later processes) the CUDA lowering of the same statement, shapes, dtypes
    and flags uses it: `allow_tf32` is part of that key, so tune with the precision the calls run at (None follows
    `jax.default_matmul_precision`, as `einsum` does).
    """
    statement, arrays, flags = _einsum.prepare(expression, named, sorted_indices=sorted_indices,
                                               allow_tf32=allow_tf32)
    spec = _primitive.make_spec(statement, arrays, **flags)
    _require_gpu()
    args = [arrays[n] for n in spec.arguments]  # (a format's column order too, where it carries one)
    timings = {}
    for config in configs or candidate_configs(spec):
        with forced_config(config):  # the lowering runs now, inside compile()
            compiled = jax.jit(functools.partial(_primitive.jinsum_p.bind, spec=spec)).lower(*args).compile()
        timings[config] = time_calls(compiled, *args, calls=calls)
    best = min(timings, key=timings.get)
    store_tuned_config(spec, best)
    return best


def _require_gpu() -> None:
    if jax.devices()[0].platform != "gpu":
        raise RuntimeError("jinsum.autotune times generated Triton kernels: it needs a CUDA GPU")

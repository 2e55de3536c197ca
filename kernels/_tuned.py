"""Tuned configurations on disk: `$JINSUM_CACHE_DIR/../autotune.json` (default `~/.cache/jinsum/autotune.json`),
keyed by (GPU, statement, shapes, dtypes, flags). `jinsum.autotune` writes them; the CUDA lowering reads them."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os
import pathlib

import jax

from jinsum._lang import Spec
from jinsum.kernels._cache import cache_dir
from jinsum.kernels._plan import KernelConfig

_OVERRIDE: contextvars.ContextVar[KernelConfig | None] = contextvars.ContextVar("jinsum_config", default=None)


@contextlib.contextmanager
def forced_config(config: KernelConfig):
    """Within this context, every lowering uses `config` (how `jinsum.autotune` times candidates)."""
    token = _OVERRIDE.set(config)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def tuned_config(spec: Spec) -> KernelConfig | None:
    """The configuration to lower `spec` with: the one being timed, else a stored one, else None."""
    forced = _OVERRIDE.get()
    if forced is not None:
        return forced
    stored = _stored().get(_key(spec))
    return KernelConfig(**stored) if stored else None


def _path() -> pathlib.Path:
    return cache_dir().parent / "autotune.json"


@functools.lru_cache(maxsize=1)
def _stored() -> dict:
    path = _path()
    return json.loads(path.read_text()) if path.exists() else {}


def _key(spec: Spec) -> str:
    operands = ";".join(f"{o.name}:{o.dtype}{list(o.shape)}" for o in spec.operands)
    return (f"{jax.devices()[0].device_kind}|{spec.statement}|{operands}|sorted={sorted(spec.sorted_indices)}"
            f"|tf32={spec.allow_tf32}")


def store_tuned_config(spec: Spec, config: KernelConfig) -> None:
    """Records `config` as the one to lower `spec` with on this GPU."""
    table = dict(_stored())
    table[_key(spec)] = dataclasses.asdict(config)
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(temporary, path)
    _stored.cache_clear()

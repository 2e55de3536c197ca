"""Tuned configurations on disk: `$JINSUM_CACHE_DIR/../autotune.json` (default `~/.cache/jinsum/autotune.json`),
keyed by (GPU, statement, shapes, dtypes, flags). `jinsum.autotune` writes them; the CUDA lowering reads them."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fcntl
import functools
import json
import os
import pathlib
import threading
import warnings

import jax

from jinsum._lang import Spec
from jinsum.kernels._cache import cache_dir
from jinsum.kernels._chain_plan import ChainConfig
from jinsum.kernels._plan import KernelConfig

_OVERRIDE: contextvars.ContextVar[KernelConfig | ChainConfig | None] = contextvars.ContextVar("jinsum_config",
                                                                                             default=None)


@contextlib.contextmanager
def forced_config(config: KernelConfig | ChainConfig):
    """Within this context, every lowering of a statement (a `KernelConfig`) or of an attention chain (a
    `ChainConfig`) uses `config`: how `jinsum.autotune` and the benchmarks time candidates. For a chain, the
    call (which computes its work lists) must happen inside the context too."""
    token = _OVERRIDE.set(config)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def chain_config() -> ChainConfig:
    """The configuration attention chains are lowered with: a forced one, else the defaults, which read tiles
    through TMA descriptors on GPUs that have TMA (Hopper and later) and take the Hopper form of the tile core on
    sm_90 (its wgmma is Hopper's alone)."""
    forced = _OVERRIDE.get()
    return forced if isinstance(forced, ChainConfig) else ChainConfig(descriptors=has_tma(), hopper=is_hopper())


def statement_config() -> KernelConfig:
    """The configuration statements are lowered with where none is forced or stored: the plans' defaults, in the
    Hopper form of the tile core on sm_90 where a plan has one (persistent programs, one per SM)."""
    return KernelConfig(hopper=True, programs=_multiprocessors()) if is_hopper() else KernelConfig()


@functools.lru_cache(maxsize=1)
def _multiprocessors() -> int:
    """The default GPU's streaming multiprocessors (132 on an H100 or H200 where the device does not say)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


@functools.lru_cache(maxsize=1)
def has_tma() -> bool:
    """Whether the default device is a GPU with TMA (Hopper and later)."""
    return _capability() >= 9


@functools.lru_cache(maxsize=1)
def is_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.0), which runs the Gluon forms."""
    return _capability() == 9


def _capability() -> float:
    """The default device's CUDA compute capability, 0 for other devices."""
    device = jax.devices()[0]
    return float(getattr(device, "compute_capability", 0)) if device.platform == "gpu" else 0.0


def tuned_config(spec: Spec) -> KernelConfig | None:
    """The configuration to lower `spec` with: the one being timed, else a stored one, else None. (The
    defaults read a statement's tiles by pointers: `jinsum.autotune` tries TMA descriptors where the GPU has
    them, and stores them where they win; DESIGN.md, "Measured and not kept".)"""
    forced = _OVERRIDE.get()
    if isinstance(forced, KernelConfig):
        return forced
    stored = _stored().get(_key(spec))
    return KernelConfig(**stored) if stored else None


def _path() -> pathlib.Path:
    return cache_dir().parent / "autotune.json"


@functools.lru_cache(maxsize=1)
def _stored() -> dict:
    return _read_table(_path())


def _read_table(path: pathlib.Path) -> dict:
    """The stored table; empty, with a warning, if it cannot be read (the lowering then uses the defaults)."""
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict):
            raise ValueError(f"a JSON {type(table).__name__}, not an object")
        return table
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
        warnings.warn(f"jinsum: the autotune table {path} cannot be read ({error}); it is ignored, and the next "
                      "jinsum.autotune rewrites it", RuntimeWarning, stacklevel=3)
        return {}


def _key(spec: Spec) -> str:
    operands = ";".join(f"{o.name}:{o.dtype}{list(o.shape)}" for o in spec.operands)
    return (f"{jax.devices()[0].device_kind}|{spec.statement}|{operands}|sorted={sorted(spec.sorted_indices)}"
            f"|tf32={spec.allow_tf32}")


def store_tuned_config(spec: Spec, config: KernelConfig) -> None:
    """Records `config` as the one to lower `spec` with on this GPU."""
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Read, add, write under an exclusive lock: processes tuning at once each add their entry (none is lost), and
    # a reader without the lock sees the old table or the new one (write, then rename), never half of one.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = _read_table(path)
        table[_key(spec)] = dataclasses.asdict(config)
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(temporary, path)
    _stored.cache_clear()

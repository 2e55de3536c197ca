"""A persistent cache of compiled kernels: what Triton makes of a kernel, on disk, shared by processes.

A generated kernel reaches the GPU in three steps. In the lowering, jax-triton's steps run Triton's front end (the
Python source to TTIR) and Triton's compiler (TTIR -> TTGIR -> LLVM IR -> PTX, the slow part); when XLA compiles the
executable, it assembles the PTX of the kernel node (`_launch`) into machine code (ptxas). jax-triton 0.3.1 keeps
its compiled kernels in a per-process dict and sets `TRITON_CACHE_DIR=""` on import, so every process paid every
step again.

The kernel node takes PTX and XLA runs ptxas itself, so the PTX is what can persist: `install` wraps jax-triton's
one compile function, `compile_ttir_inplace`, with a lookup keyed by everything that changes its output (the TTIR
text, which holds the source, the constexprs and the argument specialisation; Triton's compile options, num_warps
and num_stages among them; the GPU's compute capability; the Triton, jax-triton and jaxlib versions). For jinsum's
own kernels it also keeps the front end's output (the TTIR text, `<key>.ttir`), keyed by the generated module, the
helpers it imports, the signature, constexprs, specialisation, options and versions: a later process parses it
instead of running Triton's front end, which costs far more (DESIGN.md, "First calls"). The process that runs the
front end goes on with the module parsed from the stored text too, so every process hands Triton's compiler the same
text and the PTX lookup hits. These two wrappers, on jax-triton's module, are with the launcher's compile (jax-triton's
steps without its custom call) and global-scratch redirect (`_launch`) the places jinsum reaches into jax-triton,
which offers no hook.

Entries are files `<key>.json` (kernel name, shared memory, PTX) and `<key>.ttir` in `$JINSUM_CACHE_DIR/compiled`
(default `~/.cache/jinsum/kernels/compiled`), each sealed with the SHA-256 of its text as a last line, written to a
temporary file and renamed, so concurrent processes never read half an entry; an entry whose seal does not match
is ignored and rewritten.
The folder is kept under `$JINSUM_KERNEL_CACHE_MB` (default 1024) megabytes by deleting the least recently used
entries. `JINSUM_KERNEL_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import tempfile
import warnings
from collections.abc import Callable

from jinsum import kernels
from jinsum.kernels import cache_dir

_DEFAULT_MB = 1024


@dataclasses.dataclass
class CacheStats:
    """What this process's kernel compiles did: `compiled` ran Triton's compiler, `loaded` read a cached entry
    (`rejected`: a corrupt entry that was compiled again); `parsed` front ends read from the cache instead of
    running."""

    compiled: int = 0
    loaded: int = 0
    rejected: int = 0
    parsed: int = 0


STATS = CacheStats()


def directory() -> pathlib.Path:
    """Where compiled kernels are kept."""
    return cache_dir() / "compiled"


def enabled() -> bool:
    return os.environ.get("JINSUM_KERNEL_CACHE", "1") != "0"


def max_bytes() -> int:
    setting = os.environ.get("JINSUM_KERNEL_CACHE_MB", str(_DEFAULT_MB))
    try:
        megabytes = float(setting)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:
        raise ValueError(f"jinsum: JINSUM_KERNEL_CACHE_MB must be a size in megabytes (a number >= 0), got "
                         f"{setting!r}; unset it for the default {_DEFAULT_MB}, or set JINSUM_KERNEL_CACHE=0")
    return int(megabytes * 2**20)


def kernel_cache_info() -> dict:
    """This process's compiled-kernel counts (`compiled`, `loaded` from the cache, `rejected` corrupt entries),
    and the cache's `directory`, `entries`, `bytes` and whether it is `enabled`."""
    files = _entries(directory())
    return dict(dataclasses.asdict(STATS), directory=str(directory()), entries=len(files),
                bytes=sum(_size(f) for f in files), enabled=enabled())


def read(key: str) -> dict | None:
    """The entry stored under `key`, or None (absent, or corrupt: counted in `STATS.rejected`)."""
    text = _read_sealed(directory() / f"{key}.json")
    return None if text is None else json.loads(text)


def write(key: str, name: str, shared_mem_bytes: int, binary: str) -> None:
    """Stores an entry (write-then-rename), then deletes the least recently used entries over the size bound."""
    _write_sealed(directory() / f"{key}.json", json.dumps(dict(name=name, shared_mem_bytes=shared_mem_bytes,
                                                                 binary=binary)))


_SEAL = "\n// sha256 "  # the last line of every entry: the SHA-256 of the text before it (an MLIR comment too)


def _write_sealed(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(f"{text}{_SEAL}{hashlib.sha256(text.encode()).hexdigest()}\n")
    os.replace(f.name, path)
    _bound(path.parent, max_bytes())


def _read_sealed(path: pathlib.Path) -> str | None:
    """The text stored at `path` if its seal matches; None if absent, or corrupt (counted in `STATS.rejected`).
    Marks it recently used: the size bound deletes the oldest entries first."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # (ValueError: not even text)
        text = ""
    body, _, seal = text.rpartition(_SEAL)
    if seal.strip() != hashlib.sha256(body.encode()).hexdigest():
        STATS.rejected += 1
        warnings.warn(f"jinsum: the kernel cache entry {path} is corrupt (its SHA-256 seal does not match); it is "
                      "compiled again and rewritten", RuntimeWarning, stacklevel=2)
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return body


def _entries(folder: pathlib.Path) -> list[pathlib.Path]:
    """The cache's files: compiled kernels (`.json`) and front ends (`.ttir`)."""
    return [p for p in folder.glob("*") if p.suffix in (".json", ".ttir")] if folder.exists() else []


def _bound(folder: pathlib.Path, limit: int) -> None:
    entries = []
    for path in _entries(folder):
        try:
            stat = path.stat()
        except FileNotFoundError:  # deleted by another process meanwhile
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size


def _size(path: pathlib.Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def entry_key(ttir: str, options, compute_capability, platform: str, versions: tuple[str, ...]) -> str:
    """The cache key of one compile: a SHA-256 over everything that changes the PTX."""
    parts = (ttir, repr(options), str(compute_capability), platform, *versions)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


def caching(compile_ttir: Callable, result_type: Callable, versions: tuple[str, ...]) -> Callable:
    """`compile_ttir(ttir, backend, options, compute_capability, platform)` (jax-triton's signature, returning a
    `result_type(binary, name, shared_mem_bytes, ttgir, llir)`) with the on-disk cache in front of it (CUDA only:
    on ROCm the binary is a path to a file that jaxlib deletes after reading)."""

    @functools.wraps(compile_ttir)
    def compile_with_cache(ttir, backend, options, compute_capability, platform):
        if platform != "cuda" or not enabled():
            STATS.compiled += 1
            return compile_ttir(ttir, backend, options, compute_capability, platform)
        key = entry_key(str(ttir), options, compute_capability, platform, versions)
        entry = read(key)
        if entry is not None:
            STATS.loaded += 1
            return result_type(binary=entry["binary"], name=entry["name"],
                               shared_mem_bytes=entry["shared_mem_bytes"], ttgir=None, llir=None)
        result = compile_ttir(ttir, backend, options, compute_capability, platform)
        STATS.compiled += 1
        try:
            write(key, result.name, result.shared_mem_bytes, result.binary)
        except OSError:  # a read-only or full disk costs the cache, not the compile
            pass
        return result

    return compile_with_cache


class FrontEnd:
    """Triton's code generator as jax-triton sees it (its module global `code_gen`), with the TTIR of jinsum's
    generated kernels (`jinsum_generated_*` modules) kept on disk; everything else goes to Triton unchanged."""

    def __init__(self, code_gen, ir, versions: tuple[str, ...]):
        self._code_gen, self._ir, self._versions = code_gen, ir, versions

    def __getattr__(self, name):
        return getattr(self._code_gen, name)

    def ast_to_ttir(self, fn, src, *args, context, options, **kwargs):
        generated = getattr(getattr(fn, "fn", None), "__module__", "").startswith("jinsum_generated_")
        if not generated or not enabled() or args:
            return self._code_gen.ast_to_ttir(fn, src, *args, context=context, options=options, **kwargs)
        key = self._key(fn, src, options)
        path = directory() / f"{key}.ttir"
        module = self._parse(path, context)
        if module is not None:
            STATS.parsed += 1
            return module
        module = self._code_gen.ast_to_ttir(fn, src, context=context, options=options, **kwargs)
        try:
            _write_sealed(path, str(module))
        except OSError:
            return module
        # Go on with the module parsed from what was stored, as every later process will: the front end's own module
        # can print differently from its parsed text (it did for most chain kernels), and the compiled
        # kernel's key is that text, so a later process would miss every PTX entry the first one wrote.
        return self._parse(path, context) or module

    def _key(self, fn, src, options) -> str:
        module = pathlib.Path(fn.fn.__code__.co_filename).read_text()  # the generated module: source and imports
        helpers = pathlib.Path(kernels.__file__).with_name("helpers.py").read_text()  # (inlined by the front end)
        parts = (module, helpers, *(repr(sorted(items.items())) for items in (src.signature, src.constants, src.attrs)),
                 repr(options), *self._versions)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]

    def _parse(self, path: pathlib.Path, context):
        """The module stored at `path`, or None (absent, or corrupt: counted in `STATS.rejected`)."""
        if _read_sealed(path) is None:
            return None
        try:
            module = self._ir.parse_mlir_module(str(path), context)
        except Exception:  # noqa: BLE001 (an entry Triton cannot read is compiled again, like a corrupt one)
            STATS.rejected += 1
            return None
        module.context = context  # as Triton's own `parse` does: its passes read it, and it keeps the context alive
        return module


def install(triton_lib, versions: tuple[str, ...] | None = None) -> None:
    """Puts the cache in front of `jax_triton.triton_lib.compile_ttir_inplace` and of its `code_gen.ast_to_ttir`,
    once per process (a mark on the module, not on the functions: whoever wraps one after us must not get a second
    cache around it). `versions` default to those of Triton, jax-triton and jaxlib."""
    if getattr(triton_lib, "_jinsum_kernel_cache", False):
        return
    if versions is None:
        import jax_triton  # noqa: PLC0415
        import jaxlib  # noqa: PLC0415
        import triton  # noqa: PLC0415

        versions = (f"triton {triton.__version__}", f"jax-triton {jax_triton.__version__}",
                    f"jaxlib {jaxlib.__version__}")
    triton_lib.compile_ttir_inplace = caching(triton_lib.compile_ttir_inplace, triton_lib.CompilationResult,
                                              versions)
    triton_lib.code_gen = FrontEnd(triton_lib.code_gen, triton_lib._triton.ir, versions)
    triton_lib._jinsum_kernel_cache = True

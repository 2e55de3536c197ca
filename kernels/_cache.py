"""Generated sources -> importable modules. Triton reads a kernel's source from its file, so each generated module is
written once to a cache folder (`$JINSUM_CACHE_DIR`, default `~/.cache/jinsum/kernels`) and imported from there."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import re
import tempfile

_LOADED: dict[str, object] = {}  # digest -> module


def cache_dir() -> pathlib.Path:
    """Where generated kernel modules are written."""
    default = pathlib.Path.home() / ".cache" / "jinsum" / "kernels"
    return pathlib.Path(os.environ.get("JINSUM_CACHE_DIR", default))


def load_kernel(source: str, name: str | None = None):
    """The `@triton.jit` kernel `name` defined by `source`, by default the first function `jinsum_...` it defines
    (the module is imported once per distinct source and process)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    if digest not in _LOADED:
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"jinsum_{digest}.py"
        if not path.exists():  # write-then-rename: concurrent processes never import a half-written file
            with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
                f.write(source)
            os.replace(f.name, path)
        spec = importlib.util.spec_from_file_location(f"jinsum_generated_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[digest] = module
    return getattr(_LOADED[digest], name or re.findall(r"^def (jinsum_\w+)\(", source, re.MULTILINE)[0])

"""tokamax (openxla's library of JAX kernels) as a peer: its Mosaic GPU kernels for sm_90 (`implementation="mosaic"`),
attention (`tokamax.dot_product_attention`) and grouped matmuls (`tokamax.ragged_dot`).

tokamax 0.0.17 imports `xprof.cli.tools` at its own import, for profiling helpers these benchmarks do not use, and
xprof 2.22 ships no such module: where it cannot be imported, `import_tokamax` registers empty stand-ins first."""

from __future__ import annotations

import functools
import importlib
import sys
import types


@functools.cache
def import_tokamax() -> types.ModuleType | None:
    """tokamax, or None where it is not installed (the reason printed)."""
    try:
        importlib.import_module("xprof.cli.tools")
    except ImportError:
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            try:
                importlib.import_module(name)
            except ImportError:
                sys.modules[name] = types.ModuleType(name)
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = _no_profiler
    try:
        return importlib.import_module("tokamax")
    except ImportError as error:
        print(f"  (tokamax is not installed: {error}; its rows are left out)")
        return None


def _no_profiler(*args, **kwargs):
    raise NotImplementedError("xprof.cli.tools is a stand-in here (benchmarks/_tokamax.py)")

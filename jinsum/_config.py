"""jinsum's settings, registered as JAX configuration options. Each is set three ways, e.g. for `deterministic`:
`jax.config.update("jinsum_deterministic", True)`, the environment variable `JINSUM_DETERMINISTIC=1` (read when
jinsum is imported), or `with jinsum.deterministic(True): ...` (a context manager, thread-local).

They are JAX options, not module globals or environment variables read when a call is lowered, because then a
jitted function's cache key includes them: changing one makes the next call trace and lower again instead of
reusing an executable built under the other setting (both `include_in_jit_key` and `include_in_trace_context` are
needed for that on JAX 0.10). The registry is JAX's own, `jax._src.config`, which defines every `jax_*` flag the
same way.
"""

from __future__ import annotations

import numpy as np
from jax._src import config as _jax_config


def _setting(name: str, default, help: str):
    """The setting `jinsum.<name>`: the JAX option `jinsum_<name>` (environment variable `JINSUM_<NAME>`), in the jit
    cache key and the trace context, that takes a bool (or, for an int default, an int of 0 or more). JAX's own
    states take any value for its truth, so that `check_indices('false')` would turn the checks on."""
    def validate(value) -> None:
        if isinstance(default, bool) and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"jinsum.{name} takes a bool (True or False), got {value!r}")
        if not isinstance(default, bool) and (isinstance(value, bool) or value < 0):
            raise ValueError(f"jinsum.{name} takes an int of 0 or more, got {value!r}")

    state = _jax_config.bool_state if isinstance(default, bool) else _jax_config.int_state
    return state(name=f"jinsum_{name}", default=default, help=f"jinsum: {help}", include_in_jit_key=True,
                 include_in_trace_context=True, validator=validate)


deterministic = _setting("deterministic", False, (
    "bitwise-reproducible results on a given GPU. Generated kernels use no float atomics: sorted segment reductions "
    "run one program per row segment, and scatters through unsorted index arrays sort their entries by target first "
    "(a stable sort, so equal targets add in the entries' order)."))

check_indices = _setting("check_indices", False, (
    "under jit, check every index array against the dimension it addresses (and declared-sorted ones for order) "
    "with `jax.experimental.checkify` checks; run the function under `checkify.checkify` to get the error, naming "
    "the array, the position and the bound. Off: out-of-range reads give 0, writes are dropped."))

triton = _setting("triton", True, (
    "on CUDA, run statements, fused attention chains and kNN graphs through generated Triton kernels where their "
    "routes give them one. False: XLA's lowering everywhere, as on other platforms."))

fuse = _setting("fuse", True, (
    "on CUDA, run an attention chain (scores, softmax, weighted sum and their derivatives) as fused kernels. "
    "False: as its separate statements, each routed on its own."))

# The default of `small_terms`: the crossover below which XLA's lowering beat a launched kernel on CUDA
# (DESIGN.md, "Small statements belong to XLA").
SMALL_TERMS = 1 << 24

small_terms = _setting("small_terms", SMALL_TERMS, (
    "on CUDA, a statement of fewer terms than this (the product of its variables' extents: rows x slots x features "
    "for an SpMM) runs on XLA's lowering: its launch would cost more than the kernel saves. Derivatives in column "
    "order and deterministic statements keep their kernels. 0: a kernel for every statement."))


def tf32_allowed(allow_tf32: bool | None) -> bool:
    """Whether float32 products may use TensorFloat-32 on GPUs: `allow_tf32` where given, else JAX's reading of
    its default matmul precision (`jax.default_matmul_precision`), as `jnp.dot` does: TensorFloat-32 unless it is
    `"highest"` or `"float32"`. (Read when a call is traced: JAX keys its jit cache by that option.)"""
    if allow_tf32 is not None:
        return bool(allow_tf32)
    return str(_jax_config.default_matmul_precision.value).lower() not in ("highest", "float32")

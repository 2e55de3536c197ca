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


def _bool_only(switch: str):
    """A validator refusing what is not a bool: JAX's `bool_state` takes any value for its truth, so that
    `check_indices('false')` would turn the checks on and `deterministic(2)` pass for True."""
    def validate(value) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{switch} takes a bool (True or False), got {value!r}")
    return validate


deterministic = _jax_config.bool_state(
    name="jinsum_deterministic",
    default=False,
    help="jinsum: bitwise-reproducible results on a given GPU. Generated kernels use no float atomics: sorted "
         "segment reductions run one program per row segment, and scatters through unsorted index arrays sort "
         "their entries by target first (a stable sort, so equal targets add in the entries' order).",
    include_in_jit_key=True,
    include_in_trace_context=True,
    validator=_bool_only("jinsum.deterministic"),
)

check_indices = _jax_config.bool_state(
    name="jinsum_check_indices",
    default=False,
    help="jinsum: under jit, check every index array against the dimension it addresses (and declared-sorted ones "
         "for order) with `jax.experimental.checkify` checks; run the function under `checkify.checkify` to get the "
         "error, naming the array, the position and the bound. Off: out-of-range reads give 0, writes are dropped.",
    include_in_jit_key=True,
    include_in_trace_context=True,
    validator=_bool_only("jinsum.check_indices"),
)


def _non_negative_int(switch: str):
    def validate(value) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{switch} takes an int of 0 or more, got {value!r}")
    return validate


triton = _jax_config.bool_state(
    name="jinsum_triton",
    default=True,
    help="jinsum: on CUDA, run statements, fused attention chains and kNN graphs through generated Triton kernels "
         "where their routes give them one. False: XLA's lowering everywhere, as on other platforms.",
    include_in_jit_key=True,
    include_in_trace_context=True,
    validator=_bool_only("jinsum.triton"),
)

fuse = _jax_config.bool_state(
    name="jinsum_fuse",
    default=True,
    help="jinsum: on CUDA, run an attention chain (scores, softmax, weighted sum and their derivatives) as fused "
         "kernels. False: as its separate statements, each routed on its own.",
    include_in_jit_key=True,
    include_in_trace_context=True,
    validator=_bool_only("jinsum.fuse"),
)

# The default of `small_terms`: the crossover below which XLA's lowering beat a launched kernel on CUDA
# (`benchmarks/crossover.py`, DESIGN.md; again with kernels as nodes of the step's CUDA graph, where it held).
SMALL_TERMS = 1 << 24

small_terms = _jax_config.int_state(
    name="jinsum_small_terms",
    default=SMALL_TERMS,
    help="jinsum: on CUDA, a statement of fewer terms than this (the product of its variables' extents: rows x "
         "slots x features for an SpMM) runs on XLA's lowering: its launch would cost more than the kernel saves. "
         "Derivatives in column order and deterministic statements keep their kernels. 0: a kernel for every "
         "statement.",
    include_in_jit_key=True,
    include_in_trace_context=True,
    validator=_non_negative_int("jinsum.small_terms"),
)


def tf32_allowed(allow_tf32: bool | None) -> bool:
    """Whether float32 products may use TensorFloat-32 on GPUs: `allow_tf32` where given, else JAX's reading of
    its default matmul precision (`jax.default_matmul_precision`), as `jnp.dot` does: TensorFloat-32 unless it is
    `"highest"` or `"float32"`. (Read when a call is traced: JAX keys its jit cache by that option.)"""
    if allow_tf32 is not None:
        return bool(allow_tf32)
    return str(_jax_config.default_matmul_precision.value).lower() not in ("highest", "float32")

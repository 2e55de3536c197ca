"""jinsum: indirect Einsums for JAX — sparse tensor algebra as one primitive, closed under jit, vmap and grad.

    import jinsum
    C = jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=C, A=adjacency, B=B)
    C = adjacency @ B                                   # the same, written format-agnostically
"""

from jinsum._attention import attention as attention
from jinsum._autotune import autotune as autotune
from jinsum._config import check_indices as check_indices
from jinsum._config import deterministic as deterministic
from jinsum._einsum import einsum as einsum
from jinsum._inspect import triton_source as triton_source
from jinsum._kernel_cache import kernel_cache_info as kernel_cache_info
from jinsum._lang import ExpressionError as ExpressionError
from jinsum._lang import Spec as Spec
from jinsum._lower_triton import FallbackWarning as FallbackWarning
from jinsum._lowering import jinsum_p as jinsum_p
from jinsum.formats import BlockGroupCOO as BlockGroupCOO
from jinsum.formats import GroupCOO as GroupCOO
from jinsum.formats import default_group_size as default_group_size

__version__ = "0.1.0"
from jinsum import shard as shard

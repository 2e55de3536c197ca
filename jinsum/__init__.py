"""jinsum: indirect Einsums for JAX — sparse tensor algebra as one primitive, closed under jit, vmap and grad.

    import jinsum
    C = jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=C, A=adjacency, B=B)
    C = adjacency @ B                                   # the same, written format-agnostically

The pipeline, one folder a stage (the sparse formats, pytrees of index arrays, are in jinsum/formats/):
    notation    text -> syntax tree -> checked `Spec`                              jinsum/_lang/
    statement   `einsum(...)` / `A @ B` -> operands checked, `jinsum_p` bound     jinsum/_frontend/
    primitive   `jinsum_p` and its rules: JVP, transpose, vmap, determinism      jinsum/_rules/
    lowering    XLA everywhere; on CUDA a kernel plan, launched                  jinsum/_lowering/
    kernel      plan -> generated Triton source -> compiled kernel               kernels/ (as jinsum.kernels)
The attention chain (jinsum/_attention/) runs the same stages for softmax chains; graph data (jinsum/graphs/:
adjacencies, loaders, kNN graphs; no Flax) is built into formats; jinsum/shard and jinsum/nn build on the public
surface. Imports run one way, from a stage to the ones it builds on (tests/test_layout.py): kernels/ and _rules/ read
only _lang/; _lowering/ registers itself on the primitive, so _rules/ never imports it.
"""

from jinsum._attention import BlockMask as BlockMask
from jinsum._attention import attention as attention
from jinsum._attention import block_mask as block_mask
from jinsum._attention import block_pattern as block_pattern
from jinsum._attention import sequence_mask as sequence_mask
from jinsum._attention import paged_attention as paged_attention
from jinsum._autotune import autotune as autotune
from jinsum._config import check_indices as check_indices
from jinsum._config import deterministic as deterministic
from jinsum._config import fuse as fuse
from jinsum._config import small_terms as small_terms
from jinsum._config import triton as triton
from jinsum._frontend._einsum import einsum as einsum
from jinsum._inspect import triton_source as triton_source
from jinsum._lang import ExpressionError as ExpressionError
from jinsum._lang import Spec as Spec
from jinsum._lowering import jinsum_p as jinsum_p
from jinsum._lowering._kernel_cache import kernel_cache_info as kernel_cache_info
from jinsum._lowering._triton import FallbackWarning as FallbackWarning
from jinsum.formats import BlockGroupCOO as BlockGroupCOO
from jinsum.formats import GroupCOO as GroupCOO
from jinsum.formats import default_group_size as default_group_size

__version__ = "0.1.0"
# The subpackages without Flax load with jinsum (`jinsum.graphs.adjacency(...)` after `import jinsum`);
# `jinsum.nn` needs Flax and loads on `import jinsum.nn`.
from jinsum import graphs as graphs  # noqa: E402
from jinsum import sampling as sampling  # noqa: E402
from jinsum import shard as shard  # noqa: E402

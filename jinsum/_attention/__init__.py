"""The fused attention chain: scores, masked softmax and the weighted sum as one primitive pair.

Enters: `jinsum.attention(q, k, v, pattern, ...)`, built into a `Chain` (`jinsum._lang._chain`); a pattern
may be a `BlockMask` built on the device from a `mask_mod` (`_block_mask`), or from packed documents, or a host
block layout (`_patterns`). Leaves: the
forward and backward primitives (`_chain_primitive`), whose static parameter is the chain's route
(`_chain_route`: the plans of its kernels and their work lists, decided once at bind), lowered (`_lowering`)
unfused through `jinsum_p` statements (`_chain_reference`, every platform) or to the route's generated kernels
(`_chain_triton`, CUDA) from `jinsum.kernels`. Dropout's random bits (`_random_bits`) are drawn the same way on
both. `jinsum.paged_attention` (`_paged`) attends new query tokens over a paged key/value cache (serving).
"""

from jinsum._attention._api import attention as attention
from jinsum._attention._block_mask import BlockMask as BlockMask
from jinsum._attention._block_mask import block_mask as block_mask
from jinsum._attention._api import build_chain as build_chain
from jinsum._attention._paged import paged_attention as paged_attention
from jinsum._attention._patterns import block_pattern as block_pattern
from jinsum._attention._patterns import sequence_mask as sequence_mask
from jinsum._attention import _lowering  # noqa: F401 (registers the primitives' lowerings)

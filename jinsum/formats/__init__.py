"""Sparse formats of the Insum paper as JAX pytrees, with host-side converters from SciPy, dense and BCOO."""

from jinsum.formats._block_group_coo import BlockGroupCOO as BlockGroupCOO
from jinsum.formats._build import default_group_size as default_group_size
from jinsum.formats._group_coo import GroupCOO as GroupCOO
from jinsum.formats._group_coo import TransposedIndex as TransposedIndex

__all__ = ["BlockGroupCOO", "GroupCOO", "TransposedIndex", "default_group_size"]

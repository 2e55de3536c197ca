"""Sparse formats of the Insum paper as JAX pytrees: converters from SciPy, dense and BCOO on the host, and builders
inside `jit` for a static capacity (one builder, `_build`, serves both)."""

from jinsum.formats._block_group_coo import BlockGroupCOO as BlockGroupCOO
from jinsum.formats._build import capacity_group_size as capacity_group_size
from jinsum.formats._build import default_group_size as default_group_size
from jinsum.formats._group_coo import GroupCOO as GroupCOO
from jinsum.formats._group_coo import TransposedIndex as TransposedIndex

__all__ = ["BlockGroupCOO", "GroupCOO", "TransposedIndex", "capacity_group_size", "default_group_size"]

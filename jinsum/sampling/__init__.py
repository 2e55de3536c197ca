"""Sampling: sub-graphs drawn on the device inside `jit`, built straight into formats.

Enters: a graph kept on the device (`CSRGraph`, built once on the host), a batch of seed nodes and a random key.
Leaves: per layer a bipartite `GroupCOO` with static shapes (`jinsum.formats`), and the node ids whose features
the batch reads. Next stage: the layers of `jinsum.nn`, e.g. `SAGEConv((x_src, x_dst), A)`.
"""

from jinsum.sampling._neighbors import CSRGraph as CSRGraph
from jinsum.sampling._neighbors import NeighborSample as NeighborSample
from jinsum.sampling._neighbors import hop_sizes as hop_sizes
from jinsum.sampling._neighbors import sample_neighbors as sample_neighbors

"""Molecule-like graphs: small random trees with a few rings, the shape of the graphs that graph classification
benchmarks batch (10-50 nodes, about two directed edges per node)."""

from __future__ import annotations

import numpy as np

from jinsum.formats._convert import check_int


def molecules(count: int, *, min_nodes: int = 10, max_nodes: int = 50, max_rings: int = 3, atom_types: int = 8,
              features: int = 32, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`count` generated molecule-like graphs, labelled by their number of rings.

    Each graph has `n` nodes (uniform in `[min_nodes, max_nodes]`): a random tree (node `i` bonded to a random
    earlier node), plus `r` ring bonds (uniform in `[0, max_rings]`), each between two nodes 4-7 bonds apart on the
    tree, which closes a ring of 5-8 atoms. Every bond is an edge in both directions. A node's features are the
    one-hot code of its atom type (uniform among `atom_types`) in the first columns of `features`, the rest 0.
    The label `y` is `r`: a model can find it from the node and edge counts (`r = bonds - n + 1`), which sum
    pooling sees.

    Returns:
      A list of dicts, the graphs `jinsum.graphs.GraphLoader` reads: `"x"` float32 `(n, features)`,
      `"edge_index"` int32 `(2, 2 (n - 1 + r))` and `"y"` the int32 `r`.
    """
    count = check_int("molecules", "count", count)
    if not 2 <= min_nodes <= max_nodes or not 0 <= max_rings or not 1 <= atom_types <= features:
        raise ValueError(f"molecules: expected 2 <= min_nodes <= max_nodes and 1 <= atom_types <= features, got "
                         f"{min_nodes}, {max_nodes}, {atom_types}, {features}")
    rng = np.random.default_rng(seed)
    graphs = []
    for _ in range(count):
        n = int(rng.integers(min_nodes, max_nodes + 1))
        parent = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
        depth = np.zeros(n, int)
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        bonds = [(parent[i], i) for i in range(1, n)]
        rings = 0
        for _ in range(int(rng.integers(0, max_rings + 1))):
            for _ in range(20):  # a few tries for a pair 4-7 bonds apart, not bonded yet
                u, v = (int(a) for a in rng.integers(0, n, 2))
                if 4 <= _tree_distance(parent, depth, u, v) <= 7 and (u, v) not in bonds and (v, u) not in bonds:
                    bonds.append((u, v))
                    rings += 1
                    break
        bonds = np.array(bonds, np.int32).T
        x = np.zeros((n, features), np.float32)
        x[np.arange(n), rng.integers(0, atom_types, n)] = 1
        graphs.append(dict(x=x, edge_index=np.concatenate([bonds, bonds[::-1]], axis=1), y=np.int32(rings)))
    return graphs


def _tree_distance(parent: np.ndarray, depth: np.ndarray, u: int, v: int) -> int:
    """Bonds between `u` and `v` on the tree: climb from the deeper one to their common ancestor."""
    steps = 0
    while u != v:
        if depth[u] < depth[v]:
            u, v = v, u
        u, steps = parent[u], steps + 1
    return steps

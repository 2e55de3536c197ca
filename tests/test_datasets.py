"""The shipped Planetoid graphs and the R-MAT generator."""

import numpy as np
import pytest

from jinsum.datasets import Planetoid, load_planetoid, rmat
from jinsum.formats import GroupCOO

# name: (nodes, directed edges, features, classes, unlabelled nodes)
PLANETOID = {
    "cora": (2708, 10556, 1433, 7, 0),
    "citeseer": (3327, 9104, 3703, 6, 15),
    "pubmed": (19717, 88648, None, None, None),
}


def edge_keys(edge_index, n):
    return edge_index[0].astype(np.int64) * n + edge_index[1]


@pytest.mark.parametrize("name", PLANETOID)
def test_planetoid_graph(name):
    nodes, edges, *_ = PLANETOID[name]
    data = load_planetoid(name)
    assert isinstance(data, Planetoid) and data.name == name and data.num_nodes == nodes
    ei = data.edge_index
    assert ei.dtype == np.int32 and ei.shape == (2, edges)
    assert ei.min() >= 0 and ei.max() < nodes
    assert not np.any(ei[0] == ei[1]), "no self loops"
    keys = edge_keys(ei, nodes)
    assert np.all(np.diff(keys) > 0), "sorted by (source, destination), no duplicates"
    # Undirected: every edge is present in both directions.
    np.testing.assert_array_equal(np.sort(edge_keys(ei[::-1], nodes)), keys)


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_planetoid_features_labels_and_split(name):
    nodes, _, features, classes, unlabelled = PLANETOID[name]
    data = load_planetoid(name)
    assert data.x.format == "csr" and data.x.dtype == np.float32 and data.x.shape == (nodes, features)
    assert data.x.nnz > 0 and data.x.has_canonical_format
    assert data.y.dtype == np.int32 and data.y.shape == (nodes,)
    assert data.num_classes == classes and data.y.max() == classes - 1
    assert np.sum(data.y == -1) == unlabelled and data.y.min() >= -1
    assert (len(data.train_idx), len(data.val_idx), len(data.test_idx)) == (20 * classes, 500, 1000)
    # Kipf & Welling: 20 labelled training nodes per class, and the three sets are disjoint.
    np.testing.assert_array_equal(np.bincount(data.y[data.train_idx], minlength=classes), [20] * classes)
    split = np.concatenate([data.train_idx, data.val_idx, data.test_idx])
    assert len(np.unique(split)) == len(split) and split.min() >= 0 and split.max() < nodes
    # Only test nodes may lack a label.
    assert np.all(data.y[np.concatenate([data.train_idx, data.val_idx])] >= 0)


def test_pubmed_has_the_graph_only():
    data = load_planetoid("PubMed")
    assert data.name == "pubmed"
    assert (data.x, data.y, data.train_idx, data.val_idx, data.test_idx, data.num_classes) == (None,) * 6


def test_planetoid_unknown_name():
    with pytest.raises(ValueError, match=r"unknown dataset 'reddit'; expected one of cora, citeseer, pubmed"):
        load_planetoid("reddit")


def test_cora_as_group_coo():
    data = load_planetoid("cora")
    A = GroupCOO.from_edge_index(data.edge_index, num_nodes=data.num_nodes)
    assert A.shape == (2708, 2708) and A.nnz == 10556
    dense = np.asarray(A.todense())
    np.testing.assert_array_equal(dense, dense.T)
    # Row r of A[dst, src] counts the edges into r.
    np.testing.assert_array_equal(dense.sum(1), np.bincount(data.edge_index[1], minlength=2708))


# -- R-MAT ------------------------------------------------------------------------------------------------


def expected_distinct_edges(scale, edge_factor, a, b, c):
    """Exact expected number of distinct edges, per top-level quadrant: a cell of probability p is hit at
    least once in D draws with probability 1 - (1 - p)**D."""
    quadrant = np.array([[a, b], [c, 1 - a - b - c]])
    cells = np.ones((1, 1))
    for _ in range(scale):
        cells = np.kron(cells, quadrant)
    hit = 1 - (1 - cells) ** (edge_factor << scale)
    h = 1 << (scale - 1)
    return hit.sum(), np.array([[hit[:h, :h].sum(), hit[:h, h:].sum()], [hit[h:, :h].sum(), hit[h:, h:].sum()]])


def test_rmat_basic_properties():
    scale = 8
    edges = rmat(scale, 16, seed=1)
    n = 1 << scale
    assert edges.dtype == np.int32 and edges.shape[0] == 2
    assert edges.min() >= 0 and edges.max() < n
    keys = edge_keys(edges, n)
    assert np.all(np.diff(keys) > 0), "sorted by (source, destination), deduplicated"
    assert edges.shape[1] <= 16 * n
    np.testing.assert_array_equal(rmat(scale, 16, seed=1), edges)
    assert not np.array_equal(rmat(scale, 16, seed=2), edges)


def test_rmat_undirected_is_the_symmetric_closure_without_self_loops():
    scale = 7
    n = 1 << scale
    directed = rmat(scale, seed=3)
    edges = rmat(scale, seed=3, undirected=True)
    assert edges.dtype == np.int32 and np.all(edges[0] != edges[1])
    keys = edge_keys(edges, n)
    assert np.all(np.diff(keys) > 0), "sorted, each edge once"
    np.testing.assert_array_equal(np.sort(edge_keys(edges[::-1], n)), keys)  # symmetric
    dense = np.zeros((n, n), bool)
    dense[directed[0], directed[1]] = True
    dense = (dense | dense.T) & ~np.eye(n, dtype=bool)
    np.testing.assert_array_equal(np.stack(np.nonzero(dense)), edges)


@pytest.mark.parametrize("a, b, c", [(0.57, 0.19, 0.19), (0.45, 0.25, 0.15)])
def test_rmat_matches_the_expected_distinct_edge_counts(a, b, c):
    scale, edge_factor = 8, 16
    total, quadrants = expected_distinct_edges(scale, edge_factor, a, b, c)
    edges = rmat(scale, edge_factor, a=a, b=b, c=c, seed=0)
    # Hit indicators of distinct cells are negatively correlated, so the variance is below the mean.
    assert abs(edges.shape[1] - total) < 5 * np.sqrt(total)
    h = 1 << (scale - 1)
    observed = np.histogram2d(edges[0], edges[1], bins=[[0, h, 2 * h]] * 2)[0]
    # The b quadrant is (small source, large destination): rows are sources.
    assert np.all(np.abs(observed - quadrants) < 5 * np.sqrt(quadrants)), (observed, quadrants)


def test_rmat_degenerate_probabilities_pin_the_orientation():
    n = 1 << 5
    np.testing.assert_array_equal(rmat(5, a=1.0, b=0.0, c=0.0), [[0], [0]])
    np.testing.assert_array_equal(rmat(5, a=0.0, b=1.0, c=0.0), [[0], [n - 1]])
    np.testing.assert_array_equal(rmat(5, a=0.0, b=0.0, c=1.0), [[n - 1], [0]])
    np.testing.assert_array_equal(rmat(5, a=0.0, b=0.0, c=0.0), [[n - 1], [n - 1]])
    np.testing.assert_array_equal(rmat(0), [[0], [0]])


def test_rmat_scale_17_size():
    # The benchmark graph: about 1.94M distinct edges out of 2.1M draws.
    edges = rmat(17)
    assert 1.93e6 < edges.shape[1] < 1.955e6


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(scale=-1), ValueError, r"rmat: scale must be an int >= 0, got -1"),
        (dict(scale=63), ValueError, r"rmat: scale must be at most 62"),
        (dict(scale=2.5), TypeError, r"rmat: scale must be an int, got 2.5"),
        (dict(scale=4, edge_factor=0), ValueError, r"rmat: edge_factor must be an int >= 1, got 0"),
        (dict(scale=4, a=0.6, b=0.3, c=0.2), ValueError, r"a \+ b \+ c <= 1 .* got a=0.6, b=0.3, c=0.2"),
        (dict(scale=4, a=-0.1), ValueError, r"must be non-negative probabilities"),
    ],
)
def test_rmat_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        rmat(**kwargs)

"""Bad and edge inputs on the layers (`jinsum.nn`) and the graph data (`jinsum.graphs`), as a user passes them: each
gets the right answer (an empty result on zero nodes or edges, integer features as float ones, NaN weights as PyG
propagates them, checked against NumPy or PyG) or an error from the function or layer the user called, naming the
argument, what it got and what it needs, before JAX's internals see the input. The numbers in comments are the
items of the bad-input sweep's report."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch_geometric import nn as pyg

import jinsum.graphs as jg
import jinsum.nn as jnn

F = 3  # node features


def _rngs():
    return nnx.Rngs(0)


def _linear(n_in, n_out):
    return nnx.Linear(n_in, n_out, rngs=_rngs())


def _jitted(layer, *args):
    """`layer(*args)` in one compile (faster than the many small ones of an eager call); the shapes, which the
    fixes are about, are the same."""
    return nnx.jit(lambda layer, *args: layer(*args))(layer, *args)


# --- Zero edges, zero nodes: the result a graph without them has --------------------------------------------------

def test_gat_on_an_edge_list_without_edges_attends_the_self_loops():
    """#11: an EdgeList of 0 edges: each node attends only its self loop, linear(x) + bias, as with a GroupCOO of 0
    edges."""
    x, edges, attr = np.ones((5, 3), np.float32), jg.edge_list(np.zeros((2, 0), int), 5), np.zeros((0, 2), np.float32)
    gat = jnn.GATConv(3, 4, edge_dim=2, rngs=_rngs())
    gat.bias[...] = jnp.arange(4.0)
    expected = x @ np.asarray(gat.linear.kernel[...]) + np.arange(4.0)
    np.testing.assert_allclose(_jitted(gat, x, edges, attr), expected, rtol=1e-6)
    gat = jnn.GATConv(3, 4, rngs=_rngs())
    np.testing.assert_allclose(_jitted(gat, x, jg.adjacency(np.zeros((2, 0), int), 5)), expected - np.arange(4.0),
                               rtol=1e-6)


def test_gine_on_an_edge_list_without_edges_sends_no_messages():
    """#12: an EdgeList of 0 edges: mlp((1 + eps) x)."""
    x, edges, attr = np.ones((5, 3), np.float32), jg.edge_list(np.zeros((2, 0), int), 5), np.zeros((0, 2), np.float32)
    mlp = _linear(3, 4)
    gine = jnn.GINEConv(mlp, eps=0.5, edge_dim=2, in_features=3, rngs=_rngs())
    np.testing.assert_allclose(_jitted(gine, x, edges, attr),
                               1.5 * x @ np.asarray(mlp.kernel[...]) + np.asarray(mlp.bias[...]), rtol=1e-6)


def _edge_layers():
    """Layers that read the edges one by one, with the graph kind they take and the width of their output."""
    return {
        "GATConv edge_dim": (lambda: jnn.GATConv(F, 2, heads=2, edge_dim=2, rngs=_rngs()), 2, 4),
        "GATv2Conv edge_dim": (lambda: jnn.GATv2Conv(F, 2, heads=2, edge_dim=2, rngs=_rngs()), 2, 4),
        "GINEConv": (lambda: jnn.GINEConv(_linear(F, 2), edge_dim=2, in_features=F, rngs=_rngs()), 2, 2),
        "GATv2Conv": (lambda: jnn.GATv2Conv(F, 2, heads=2, rngs=_rngs()), None, 4),
    }


@pytest.mark.parametrize("name", list(_edge_layers()))
def test_edge_adjacency_without_edges(name):
    """An edge_adjacency of 0 edges gives what an EdgeList of 0 edges gives (no messages, self loops only)."""
    make, edge_dim, _ = _edge_layers()[name]
    x = np.random.default_rng(0).standard_normal((4, F)).astype(np.float32)
    layer, no_edges = make(), np.zeros((2, 0), int)
    attr = None if edge_dim is None else np.zeros((0, edge_dim), np.float32)
    expected = _jitted(layer, x, jg.edge_list(no_edges, 4), attr)
    np.testing.assert_allclose(_jitted(layer, x, jg.edge_adjacency(no_edges, 4, attr)), expected, rtol=1e-6)


@pytest.mark.parametrize("name", [*_edge_layers(), "GATConv", "GATConv on an edge_list", "RGCNConv num_blocks"])
def test_layers_on_zero_nodes(name):
    """#46, #49, #52 (and the same `reshape(n, -1)` of a size-0 array in every edge-by-edge layer and in RGCNConv's
    blocks): 0 nodes give an empty (0, out) output."""
    x, no_edges = np.ones((0, F), np.float32), np.zeros((2, 0), int)
    if name == "GATConv":
        out, width = jnn.GATConv(F, 4, rngs=_rngs())(x, jg.adjacency(no_edges, 0)), 4
    elif name == "GATConv on an edge_list":
        out, width = jnn.GATConv(F, 2, heads=2, rngs=_rngs())(x, jg.edge_list(no_edges, 0)), 4
    elif name == "RGCNConv num_blocks":
        graph = jg.relational_graph(no_edges[0], no_edges[1], no_edges[0], 0, 2)
        out, width = jnn.RGCNConv(F, 3, num_relations=2, num_blocks=3, rngs=_rngs())(x, graph), 3
    else:
        make, edge_dim, width = _edge_layers()[name]
        attr = None if edge_dim is None else np.zeros((0, edge_dim), np.float32)
        out = make()(x, jg.edge_list(no_edges, 0), attr)
        assert make()(x, jg.edge_adjacency(no_edges, 0, attr)).shape == (0, width)
    assert out.shape == (0, width)


def test_embedding_bags_without_lookups():
    """#29: (B, 0) indices are B empty bags: zeros, as torch."""
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    np.testing.assert_array_equal(jnn.embedding_bag(table, jg.bags(np.zeros((2, 0), int), num_embeddings=10), "sum"),
                                  np.zeros((2, 2)))


def test_embedding_bags_of_no_bags():
    """#84: no offsets are 0 bags, an empty batch, as torch's (and [0] with include_last_offset)."""
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    empty = jg.bags(np.array([4, 1]), np.zeros(0, int), num_embeddings=10)
    assert empty.num_bags == 0
    for mode in ("sum", "mean", "max"):
        assert jax.jit(jnn.embedding_bag, static_argnums=2)(table, empty, mode).shape == (0, 2)
    empty = jg.bags(np.array([4, 1]), np.array([0]), num_embeddings=10, include_last_offset=True, with_transpose=False)
    assert jnn.embedding_bag(table, empty, "sum").shape == (0, 2)
    with pytest.raises(ValueError, match=r"offsets must be an integer array \(B \+ 1,\) with include_last_offset"):
        jg.bags(np.array([4, 1]), np.zeros(0, int), num_embeddings=10, include_last_offset=True)


# --- Integer node features: cast, as GCNConv and nnx.Linear do ---------------------------------------------------

_EDGES = np.array([[0, 1, 2, 3, 1], [1, 2, 0, 0, 3]])
_BATCH = np.array([0, 0, 1, 1])
_INTEGER_INPUTS = {  # (the ones that refused integer features, or silently truncated them)
    "SGConv": lambda x: jnn.SGConv(F, 2, K=2, rngs=_rngs())(x, jg.adjacency(_EDGES, 4)),
    "APPNP": lambda x: jnn.APPNP(2, 0.1)(x, jg.adjacency(_EDGES, 4)),
    "SAGEConv mean": lambda x: jnn.SAGEConv(F, 2, rngs=_rngs())(x, jg.adjacency(_EDGES, 4)),
    "SAGEConv max": lambda x: jnn.SAGEConv(F, 2, aggr="max", rngs=_rngs())(x, jg.adjacency(_EDGES, 4)),
    "SAGEConv mean, std": lambda x: jnn.SAGEConv(F, 2, aggr=["mean", "std"], rngs=_rngs())(x, jg.adjacency(_EDGES, 4)),
    "GINConv": lambda x: jnn.GINConv(_linear(F, 2))(x, jg.adjacency(_EDGES, 4)),
    "GINEConv": lambda x: jnn.GINEConv(_linear(F, 2))(x, jg.edge_list(_EDGES, 4), np.ones((5, F), np.float32)),
    "GraphConv max": lambda x: jnn.GraphConv(F, 2, aggr="max", rngs=_rngs())(x, jg.adjacency(_EDGES, 4)),
    "EdgeConv nn": lambda x: jnn.EdgeConv(F, 2, nn=_linear(2 * F, 2), rngs=_rngs())(x, jg.adjacency(_EDGES, 4)),
    "DynamicEdgeConv": lambda x: _jitted(jnn.DynamicEdgeConv(_linear(2 * F, 2), 2), x),
    "global_add_pool": lambda x: jnn.global_add_pool(x, _BATCH, 2),
    "global_mean_pool": lambda x: jnn.global_mean_pool(x, _BATCH, 2),
    "global_max_pool": lambda x: jnn.global_max_pool(x, _BATCH, 2),
    "aggregate_by": lambda x: jnn.aggregate_by(jg.adjacency(_EDGES, 4), x, "std"),
    "embedding_bag": lambda x: jnn.embedding_bag(
        x, jg.bags(np.array([[0, 1], [2, -1]]), num_embeddings=4, with_transpose=False), "mean"),
}


@pytest.mark.parametrize("name", list(_INTEGER_INPUTS))
def test_integer_features_are_cast(name):
    """#30, #43, #51, #54, #55, #130: integer node features (an integer table) give the float result, never an
    error naming GroupCOO's Av."""
    x = np.arange(4 * F, dtype=np.int32).reshape(4, F) % 5
    ours, reference = _INTEGER_INPUTS[name](x), _INTEGER_INPUTS[name](x.astype(np.float32))
    assert ours.dtype == reference.dtype == jnp.float32
    np.testing.assert_allclose(ours, reference, rtol=1e-6)


# --- NaN and negative weights: as PyG computes them ---------------------------------------------------------------

@pytest.mark.parametrize("weights", [[np.nan, 1.0, 1.0, 1.0], [1.0, -3.0, 1.0, 1.0]], ids=["NaN", "negative"])
@pytest.mark.parametrize("layer", ["GCNConv", "APPNP"])
def test_gcn_normalisation_of_nan_and_negative_weights_as_pyg(layer, weights):
    """#50, #91: PyG's deg^-1/2 (inf -> 0, NaN and a negative degree NaN, as jinsum.graphs.gcn_norm computes it): a
    NaN weight makes node 1's degree NaN, so row 2, which reads node 1, is NaN too; a negative degree is NaN
    likewise (it was a scale of 0)."""
    edge_index, weights = np.array([[0, 1, 2, 3], [1, 2, 3, 1]]), np.array(weights)
    x = np.random.default_rng(0).standard_normal((4, 2))
    with jax.enable_x64(True):
        torch.manual_seed(0)
        if layer == "GCNConv":
            theirs = pyg.GCNConv(2, 2).double()
            ours = jnn.GCNConv(2, 2, param_dtype=jnp.float64, rngs=_rngs())
            ours.linear.kernel[...] = jnp.asarray(theirs.lin.weight.detach().numpy().T)
        else:
            theirs, ours = pyg.APPNP(K=2, alpha=0.1).double(), jnn.APPNP(2, 0.1)
        expected = theirs(torch.tensor(x), torch.tensor(edge_index), torch.tensor(weights)).detach().numpy()
        got = np.asarray(ours(x, jg.adjacency(edge_index, 4, values=weights)))
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(expected), rtol=1e-9)


def test_gcn_conv_reproduction_with_a_nan_weight():
    """#50, the sweep's input: rows 1 (its degree) and 2 (reads node 1) are NaN."""
    out = jnn.GCNConv(1, 1, use_bias=False, rngs=_rngs())(
        np.ones((3, 1), np.float32), jg.adjacency(np.array([[0, 1], [1, 2]]), 3, values=np.array([np.nan, 1.])))
    np.testing.assert_array_equal(np.isnan(out).ravel(), [False, True, True])


def test_dynamic_edge_conv_propagates_a_nan_point():
    """#99: a NaN point is its own neighbour (at distance 0, as PyG's kNN with the point itself), so its output is
    NaN; the other points do not see it (their distances to it are NaN, never among the nearest)."""
    x = np.array([[np.nan], [0.], [1.]], np.float32)
    h = _linear(2, 1)
    out = np.asarray(_jitted(jnn.DynamicEdgeConv(h, 2), x))
    W, b = np.asarray(h.kernel[...]), np.asarray(h.bias[...])

    def message(i, j):
        return np.concatenate([x[i], x[j] - x[i]]) @ W + b

    assert np.isnan(out[0]).all()
    np.testing.assert_allclose(out[1:], [np.maximum(message(1, 1), message(1, 2)),
                                         np.maximum(message(2, 2), message(2, 1))], rtol=1e-6)
    np.testing.assert_array_equal(jax.jit(lambda x: jg.knn(x, 2, loop=True))(x), [[0, -1], [1, 2], [2, 1]])


# --- Call arguments: node and edge features of the wrong shape ---------------------------------------------------

def _x(*shape):
    return np.ones(shape, np.float32)


_ONE_EDGE = np.array([[0], [1]])


@pytest.mark.parametrize("call, message", [
    (lambda: jnn.APPNP(1, 0.1)(_x(3), jg.adjacency(_ONE_EDGE, 3)),  # 42
     r"^APPNP: expected node features of shape \(N, F\), got \(3,\)"),
    (lambda: jnn.GINConv(_linear(1, 1))(_x(2), jg.adjacency(_ONE_EDGE, 2)),  # 112
     r"^GINConv: expected node features of shape \(N, F\), got \(2,\)"),
    (lambda: jnn.GATConv(3, 4, edge_dim=2, rngs=_rngs())(_x(2, 3), jg.edge_list(_ONE_EDGE, 2), _x(2, 2)),  # 44
     r"^GATConv: expected edge_attr of shape \(E, edge_dim\) = \(1, 2\), one row per edge of the edge index, got "
     r"\(2, 2\)"),
    (lambda: jnn.GATConv(3, 4, edge_dim=2, rngs=_rngs())(_x(2, 3), jg.edge_list(_ONE_EDGE, 2), _x(1, 3)),  # 45
     r"^GATConv: expected edge_attr of shape \(E, edge_dim\) = \(1, 2\), .* got \(1, 3\)"),
    (lambda: jnn.GATConv(3, 4, edge_dim=2, rngs=_rngs())(_x(2, 3), jg.edge_list(_ONE_EDGE, 2)),
     r"^GATConv: expected edge_attr of shape \(E, edge_dim\) = \(1, 2\), .* got None"),
    (lambda: jnn.GATConv(3, 4, rngs=_rngs())(_x(2, 3), jg.edge_list(_ONE_EDGE, 2), _x(1, 2)),
     r"^GATConv: got edge_attr, but the layer was built without edge_dim"),
    (lambda: jnn.GATConv(3, 4, rngs=_rngs())(_x(2, 2), jg.edge_list(_ONE_EDGE, 2)),
     r"^GATConv: expected node features x of shape \(N, 3\) \(the layer's in_features\), got \(2, 2\)"),
    (lambda: jnn.GATv2Conv(3, 4, edge_dim=2, rngs=_rngs())(_x(2, 3), jg.edge_list(_ONE_EDGE, 2), _x(1, 3)),  # 47
     r"^GATv2Conv: expected edge_attr of shape \(E, edge_dim\) = \(1, 2\), .* got \(1, 3\)"),
    (lambda: jnn.GATv2Conv(3, 4, rngs=_rngs())(_x(2, 2), jg.edge_list(_ONE_EDGE, 2)),  # 48
     r"^GATv2Conv: expected node features x of shape \(N, 3\) \(the layer's in_features\), got \(2, 2\)"),
    (lambda: jnn.GINEConv(_linear(3, 4), edge_dim=2, in_features=3, rngs=_rngs())(_x(2, 2), jg.edge_list(_ONE_EDGE, 2),
                                                                                   _x(1, 2)),
     r"^GINEConv: expected node features x of shape \(N, 3\) \(the layer's in_features\), got \(2, 2\)"),
    (lambda: jnn.GINEConv(_linear(3, 4))(_x(2, 3), jg.edge_list(_ONE_EDGE, 2), _x(1, 2)),
     r"^GINEConv: expected edge_attr of shape \(E, edge_dim\) = \(1, 3\), .* got \(1, 2\)"),
    (lambda: jnn.RGCNConv(3, 4, num_relations=2, rngs=_rngs())(  # 53
        _x(2, 2), jg.relational_graph(np.array([0]), np.array([1]), np.array([0]), 2, 2)),
     r"^RGCNConv: expected node features x of shape \(N, 3\) \(the layer's in_features\), got \(2, 2\)"),
], ids=["APPNP 1-D x", "GINConv 1-D x", "GATConv edge_attr rows", "GATConv edge_attr width", "GATConv no edge_attr",
        "GATConv edge_attr without edge_dim", "GATConv x width", "GATv2Conv edge_attr width", "GATv2Conv x width",
        "GINEConv x width", "GINEConv edge_attr width", "RGCNConv x width"])
def test_wrong_feature_shapes_name_the_layer(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- Constructor arguments: checked in the constructor, by the layer's name ---------------------------------------

@pytest.mark.parametrize("make, error, message", [
    (lambda: jnn.SGConv(2, 2, K=1.5, rngs=_rngs()), TypeError, r"^SGConv: K must be an int, got 1.5"),  # 98, 119
    (lambda: jnn.APPNP(2.5, 0.1), TypeError, r"^APPNP: K must be an int, got 2.5"),
    (lambda: jnn.APPNP(-1, 0.1), ValueError, r"^APPNP: K must be an int >= 0, got -1"),
    (lambda: jnn.EmbeddingBag(10, 0, rngs=_rngs()), ValueError,  # 102
     r"^EmbeddingBag: features must be an int >= 1, got 0"),
    (lambda: jnn.EmbeddingBag(0, 2, rngs=_rngs()), ValueError,  # 103
     r"^EmbeddingBag: num_embeddings must be an int >= 1, got 0"),
    (lambda: jnn.EmbeddingBag(2.5, 2, rngs=_rngs()), TypeError,  # 104
     r"^EmbeddingBag: num_embeddings must be an int, got 2.5"),
    (lambda: jnn.GATConv(3, 4, dropout=1.0, rngs=_rngs()), ValueError,  # 105
     r"^GATConv: dropout must be in \[0, 1\), got 1.0"),
    (lambda: jnn.GATConv(3, 4, heads=2.5, rngs=_rngs()), TypeError, r"^GATConv: heads must be an int, got 2.5"),  # 106
    (lambda: jnn.GATConv(3, None, rngs=_rngs()), TypeError,  # 107
     r"^GATConv: out_features must be an int, got None"),
    (lambda: jnn.GATConv((3, 2.5), 4, rngs=_rngs()), TypeError, r"^GATConv: in_features\[1\] must be an int, got 2.5"),
    (lambda: jnn.GATConv(3, 4, edge_dim=0, rngs=_rngs()), ValueError, r"^GATConv: edge_dim must be an int >= 1, got 0"),
    (lambda: jnn.GCNConv(-1, 4, rngs=_rngs()), ValueError, r"^GCNConv: in_features must be an int >= 1, got -1"),  # 108
    (lambda: jnn.GCNConv(2.5, 4, rngs=_rngs()), TypeError, r"^GCNConv: in_features must be an int, got 2.5"),  # 109
    (lambda: jnn.GCNConv(3, 0, rngs=_rngs()), ValueError, r"^GCNConv: out_features must be an int >= 1, got 0"),  # 110
    (lambda: jnn.GINConv(5), TypeError, r"^GINConv: mlp must be callable .*, got int"),  # 111
    (lambda: jnn.GINEConv(5), TypeError, r"^GINEConv: mlp must be callable .*, got int"),
    (lambda: jnn.EdgeConv(3, 4, nn=5, rngs=_rngs()), TypeError, r"^EdgeConv: nn must be callable .*, got int"),
    (lambda: jnn.RGCNConv(3, 4, num_relations=2, num_bases=0, rngs=_rngs()), ValueError,  # 114
     r"^RGCNConv: num_bases must be an int >= 1, got 0"),
    (lambda: jnn.RGCNConv(3, 4, num_relations=2, num_bases=2.5, rngs=_rngs()), TypeError,  # 115
     r"^RGCNConv: num_bases must be an int, got 2.5"),
    (lambda: jnn.RGCNConv(3, 4, num_relations=2, num_blocks=0, rngs=_rngs()), ValueError,  # 116
     r"^RGCNConv: num_blocks must be an int >= 1, got 0"),
    (lambda: jnn.RGCNConv(3, 4, num_relations=0, rngs=_rngs()), ValueError,  # 117
     r"^RGCNConv: num_relations must be an int >= 1, got 0"),
    (lambda: jnn.RGCNConv(3, 4, num_relations=2.5, rngs=_rngs()), TypeError,  # 118
     r"^RGCNConv: num_relations must be an int, got 2.5"),
    (lambda: jnn.SparseLinear(4, 4, np.ones((2, 2)), block_shape=(0, 2), rngs=_rngs()), ValueError,  # 120
     r"^SparseLinear: block_shape must be positive, got \(0, 2\)"),
    (lambda: jnn.SparseLinear(2.5, 4, np.ones((2, 4)), rngs=_rngs()), TypeError,  # 121
     r"^SparseLinear: in_features must be an int, got 2.5"),
    (lambda: jnn.random_pattern(0, 4, 0.5), ValueError,  # 122
     r"^jinsum.nn.random_pattern: in_features must be an int >= 1, got 0"),
    (lambda: jnn.random_pattern(2.5, 4, 0.5), TypeError,  # 123
     r"^jinsum.nn.random_pattern: in_features must be an int, got 2.5"),
    (lambda: jnn.random_pattern(3, 4, 0.5, seed=-1), ValueError,  # 124
     r"^jinsum.nn.random_pattern: seed must be an int >= 0, got -1"),
    (lambda: jnn.SAGEConv(3, 2.5, rngs=_rngs()), TypeError, r"^SAGEConv: out_features must be an int, got 2.5"),
    (lambda: jnn.GraphConv((3, 0), 2, rngs=_rngs()), ValueError,
     r"^GraphConv: in_features\[1\] must be an int >= 1, got 0"),
    (lambda: jnn.TransformerConv((3, 2, 1), 2, rngs=_rngs()), ValueError,
     r"^TransformerConv: in_features must be an int or a pair \(F_src, F_dst\), got \(3, 2, 1\)"),
    (lambda: jnn.GATv2Conv(3, 4, heads=0, rngs=_rngs()), ValueError, r"^GATv2Conv: heads must be an int >= 1, got 0"),
    (lambda: jnn.EdgeConv(3.0, 4, rngs=_rngs()), TypeError, r"^EdgeConv: in_features must be an int, got 3.0"),
])
def test_constructor_arguments_name_the_layer(make, error, message):
    with pytest.raises(error, match=message):
        make()


# --- Graph data: jinsum.graphs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, message", [
    (lambda: jg.adjacency(np.array([[0.7], [1.9]]), (3, 4)), ValueError,  # 25
     r"^jinsum.graphs.adjacency: edge_index must be an integer array of shape \(2, E\)"),
    (lambda: jg.adjacency(_ONE_EDGE, (3.0, 4.0)), TypeError,  # 26
     r"^jinsum.graphs.adjacency: num_nodes\[0\] must be an int, got 3.0"),
    (lambda: jg.adjacency(np.array([[0, 1], [1, 2]]), (3, 4), values=np.ones(1)), ValueError,  # 27
     r"^jinsum.graphs.adjacency: values must have shape \(E, \*dense_shape\) with E = 2 edges, got \(1,\)"),
    (lambda: jg.adjacency(np.array([[0, 1, 2, 2], [1, 2, 0, 1]]), 3, capacity=4, self_loops=True,  # 28
                          values=np.ones(3)), ValueError,
     r"^jinsum.graphs.adjacency: values must have shape \(E,\) with E = 4 edges .*, got \(3,\)"),
    (lambda: jg.adjacency(np.array([[0, 1], [1, 2]]), 3, capacity=4, self_loops=True, values=np.ones(1)), ValueError,
     r"^jinsum.graphs.adjacency: values must have shape \(E,\) with E = 2 edges .*, got \(1,\)"),
    (lambda: jg.adjacency(_ONE_EDGE, (3, 4, 5)), ValueError,  # 83
     r"^jinsum.graphs.adjacency: num_nodes must be an int N or a pair \(N_src, N_dst\), got \(3, 4, 5\)"),
    (lambda: jg.adjacency(_ONE_EDGE, (2.0, 2), capacity=4), TypeError,
     r"^jinsum.graphs.adjacency: num_nodes\[0\] must be an int, got 2.0"),
    (lambda: jg.edge_adjacency(_ONE_EDGE, 3.0), TypeError,  # 34, 35
     r"^jinsum.graphs.edge_adjacency: num_nodes must be an int, got 3.0"),
    (lambda: jg.edge_list(np.array([[0], [2]]), 2.5), TypeError,  # 36
     r"^jinsum.graphs.edge_list: num_nodes must be an int, got 2.5"),
    (lambda: jg.edge_list(np.array([[0], [2]]), 3.7), TypeError,  # 37
     r"^jinsum.graphs.edge_list: num_nodes must be an int, got 3.7"),
    (lambda: jg.edge_adjacency(_ONE_EDGE, 2, group_size=0), ValueError,  # 87
     r"^jinsum.graphs.edge_adjacency: group_size .* must be an int >= 1, got 0"),
    (lambda: jg.edge_adjacency(_ONE_EDGE, 2, group_size=2.5), TypeError,  # 88
     r"^jinsum.graphs.edge_adjacency: group_size .* must be an int, got 2.5"),
    (lambda: jg.edge_list(np.zeros((2, 0), int), -1), ValueError,  # 89
     r"^jinsum.graphs.edge_list: num_nodes must be an int >= 0, got -1"),
    (lambda: jg.edge_list(_ONE_EDGE, None), TypeError,  # 90
     r"^jinsum.graphs.edge_list: num_nodes must be an int, got None"),
    (lambda: jg.radius(np.array([[0.], [0.5]], np.float32), jnp.float32(-1.0)), ValueError,  # 38
     r"^jinsum.graphs.radius: r must be a radius >= 0, got -1.0"),
    (lambda: jg.radius(np.zeros((3, 2), np.float32), None), TypeError,  # 92
     r"^jinsum.graphs.radius: r must be a real number \(the radius\), got None"),
    (lambda: jg.radius(np.array([[0.], [0.5]], np.float32), "1.0"), TypeError,  # 93
     r"^jinsum.graphs.radius: r must be a real number \(the radius\), got '1.0'"),
    (lambda: jg.relational_graph(np.array([0]), np.array([1]), np.array([0]), 3.0, 2), TypeError,  # 39, 40
     r"^jinsum.graphs.relational_graph: num_nodes must be an int, got 3.0"),
    (lambda: jg.relational_graph(np.array([0]), np.array([1]), np.array([0]), 3, 2.5), TypeError,  # 41
     r"^jinsum.graphs.relational_graph: num_relations must be an int, got 2.5"),
    (lambda: jg.relational_graph(np.array([0]), np.array([1]), np.array([0]), None, 2), TypeError,  # 94
     r"^jinsum.graphs.relational_graph: num_nodes must be an int, got None"),
    (lambda: jg.GraphLoader([dict(x=np.ones((2, 1)), edge_index=_ONE_EDGE, y=np.ones(2)),  # 33
                             dict(x=np.ones((2, 1)), edge_index=_ONE_EDGE, y=np.ones(3))], 2), ValueError,
     r"^jinsum.graphs: graph 1's y has shape \(3,\), expected \(2,\) as graph 0's"),
    (lambda: jg.GraphBudget.for_dataset([dict(x=np.ones((2, 1)), edge_index=_ONE_EDGE)], 1,  # 85
                                        deviations=float("nan")), ValueError,
     r"^jinsum.graphs.GraphBudget.for_dataset: deviations must be a finite number >= 0 .*, got nan"),
    (lambda: jg.GraphBudget.for_dataset([dict(x=np.ones((2, 1)), edge_index=_ONE_EDGE)], 1, multiple=0),  # 86
     ValueError, r"^jinsum.graphs.GraphBudget.for_dataset: multiple must be an int >= 1, got 0"),
])
def test_graph_data_errors_name_the_function(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_sparse_adagrad_takes_numpy_arrays():
    """#31, #32: NumPy table, accumulator and gradient are taken as JAX arrays (the touched rows 1 and 4 updated by
    Adagrad's first step, lr g / sqrt(g^2)); a NaN learning rate makes those rows NaN; a gradient of the wrong shape
    is named."""
    bags = jg.bags(np.array([4, 1]), np.array([0]), num_embeddings=10, unique=True)
    table, accumulator = np.ones((10, 2), np.float32), np.zeros((10, 2), np.float32)
    new_table, new_accumulator = jnn.sparse_adagrad(table, accumulator, bags, np.ones((2, 2), np.float32), 0.1)
    expected = np.ones((10, 2))
    expected[[1, 4]] = 0.9
    np.testing.assert_allclose(new_table, expected, rtol=1e-6)
    np.testing.assert_array_equal(new_accumulator, expected == 0.9)
    nan_table = np.asarray(jax.jit(jnn.sparse_adagrad)(table, accumulator, bags, np.ones((2, 2), np.float32),
                                                       np.nan)[0])
    np.testing.assert_array_equal(np.isnan(nan_table).any(axis=1), np.isin(np.arange(10), [1, 4]))
    with pytest.raises(ValueError, match=r"^jinsum.nn.sparse_adagrad: expected grad of shape \(U, F\) = \(2, 2\), .* "
                                         r"got \(4, 2\)"):
        jnn.sparse_adagrad(table, accumulator, bags, np.ones((4, 2), np.float32), 0.1)


# --- Aggregations and pools ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, message", [
    (lambda: jnn.aggregate_by(np.eye(2, dtype=np.float32), _x(2, 1), "max"), TypeError,  # 125
     r"^jinsum.nn.aggregate_by: A must be a jinsum.GroupCOO .*, got ndarray \[2, 2\]"),
    (lambda: jnn.aggregate_by(np.eye(2, dtype=np.float32), _x(2, 1), "mean"), TypeError,  # 126
     r"^jinsum.nn.aggregate_by: A must be a jinsum.GroupCOO .*, got ndarray \[2, 2\]"),
    (lambda: jnn.aggregate_by(jg.adjacency(_ONE_EDGE, 2), _x(2, 1), "median"), ValueError,
     r"^jinsum.nn.aggregate_by: aggr must be one of \('sum', 'mean', 'max', 'min', 'var', 'std'\), got 'median'"),
    (lambda: jnn.multi_aggregate(jg.adjacency(_ONE_EDGE, 2), _x(2, 1), []), ValueError,  # 127
     r"^jinsum.nn.multi_aggregate: aggrs must name one or more of .*, got \[\]"),
    (lambda: jnn.global_add_pool(_x(3, 2), np.array([0., 0., 1.]), 2), ValueError,  # 129
     r"^jinsum.nn.global_add_pool: batch must be an integer array \(N,\), each node's graph id, got float32\[3\]"),
    (lambda: jnn.global_mean_pool(_x(3, 2), np.array([1, 0, 1]), 2), ValueError,
     r"^jinsum.nn.global_mean_pool: batch must be sorted"),
])
def test_aggregation_and_pool_errors_name_the_function(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_multi_aggregate_takes_one_name():
    """#128: one name is a list of one (as SAGEConv's aggr), not its letters: the mean over in-edges."""
    A = jg.adjacency(_ONE_EDGE, 2)
    np.testing.assert_array_equal(jnn.multi_aggregate(A, _x(2, 1), "mean"), [[0.0], [1.0]])

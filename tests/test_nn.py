"""jinsum.nn: every layer against a dense reference on graphs with empty rows and duplicate edges, its gradients
against finite differences, nnx.vmap against a loop, short training runs, block patterns, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import optax
import pytest
from flax import nnx

import jinsum
import jinsum.graphs as jg
import jinsum.nn as jnn
from jinsum.testing import assert_allclose

N, F_IN = 11, 5


@pytest.fixture(autouse=True)
def full_precision_matmuls():
    """On a GPU, JAX's float32 dense products (the layers' linear maps, the attention reference) default to
    TensorFloat-32, 1e-3 off a float64 reference: full precision here, so the comparisons test the sparse algebra."""
    with jax.default_matmul_precision("highest"):
        yield


def _graph(rng, num_nodes=N, num_edges=30, weighted=False):
    """An edge index over `num_nodes` nodes where nodes 0 and 1 receive no edge, one edge is repeated and node
    3 has a self loop; with `weighted`, positive weights."""
    src = rng.integers(0, num_nodes, num_edges)
    dst = rng.integers(2, num_nodes, num_edges)
    src[:3], dst[:3] = [4, 4, 3], [5, 5, 3]
    values = rng.uniform(0.5, 2.0, num_edges).astype(np.float32) if weighted else None
    return np.stack([src, dst]), values


def _dense(edge_index, values, num_nodes=N):
    """The reference adjacency: A[dst, src] summed over duplicate edges."""
    A = np.zeros((num_nodes, num_nodes))
    np.add.at(A, (edge_index[1], edge_index[0]), 1.0 if values is None else values)
    return A


def _randomize(model, rng, scale=0.5):
    """Every parameter (biases, attention vectors, eps too) drawn afresh, so that each takes part in the check."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: (scale * rng.standard_normal(p.shape)).astype(p.dtype), state))
    return model


@nnx.jit
def _apply(model, x, graph):
    """`model(x, graph)` jitted; one function for the module, so calls with the same model structure and shapes
    (a loop, a second call) reuse its compiled program."""
    return model(x, graph)


def _features(rng, *shape, dtype=np.float32):
    return jnp.asarray(rng.standard_normal(shape).astype(dtype))


def _close(actual, expected, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


# --- adjacency -------------------------------------------------------------------------------------------------

def test_adjacency_sums_duplicates_and_adds_missing_self_loops(rng):
    edge_index, values = _graph(rng, weighted=True)
    A = jg.adjacency(edge_index, N, values=values, group_size=2)
    _close(A.todense(), _dense(edge_index, values))
    assert A.group_size == 2
    looped = jg.adjacency(edge_index, N, values=values, self_loops=True)
    expected = _dense(edge_index, values)
    expected[np.diag_indices(N)] = np.where(np.diag(expected) == 0, 1, np.diag(expected))
    _close(looped.todense(), expected)


# --- GCN -------------------------------------------------------------------------------------------------------

def _gcn_reference(conv, x, A, add_self_loops, normalize):
    A = A + np.eye(len(A)) if add_self_loops else A
    if normalize:
        deg = A.sum(1)
        scale = np.where(deg > 0, 1 / np.sqrt(np.where(deg > 0, deg, 1)), 0)
        A = scale[:, None] * A * scale[None, :]
    return A @ (np.asarray(x) @ np.asarray(conv.linear.kernel[...])) + np.asarray(conv.bias[...])


@pytest.mark.parametrize("add_self_loops, normalize, weighted", [(True, True, False), (True, True, True),
                                                                 (False, True, True), (True, False, False)])
@pytest.mark.parametrize("out_features", [4, 8])  # (narrower: x W first; wider: A x first)
def test_gcn_matches_dense(rng, add_self_loops, normalize, weighted, out_features):
    edge_index, values = _graph(rng, weighted=weighted)
    conv = _randomize(jnn.GCNConv(F_IN, out_features, add_self_loops=add_self_loops, normalize=normalize,
                                  rngs=nnx.Rngs(0)), rng)
    x = _features(rng, N, F_IN)
    out = _apply(conv, x, jg.adjacency(edge_index, N, values=values, group_size=4))  # with padding slots
    _close(out, _gcn_reference(conv, x, _dense(edge_index, values), add_self_loops, normalize))


def test_gcn_sage_gin_take_a_block_adjacency(rng):
    edge_index, values = _graph(rng, weighted=True)
    A = _dense(edge_index, values)
    blocks = jinsum.BlockGroupCOO.from_dense(A.astype(np.float32), block_shape=(3, 2))
    x = _features(rng, N, F_IN)
    rngs = nnx.Rngs(0)
    for conv in (jnn.GCNConv(F_IN, 4, rngs=rngs), jnn.SAGEConv(F_IN, 4, rngs=rngs),
                 jnn.GINConv(nnx.Linear(F_IN, 4, rngs=rngs))):
        conv = _randomize(conv, rng)
        _close(_apply(conv, x, blocks), _apply(conv, x, jg.adjacency(edge_index, N, values=values)))


# --- SAGE, GIN -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_features", [3, 8])  # aggregates x W_l (narrower output) or x (narrower input)
def test_sage_matches_dense(rng, out_features):
    edge_index, values = _graph(rng, weighted=True)
    conv = _randomize(jnn.SAGEConv(F_IN, out_features, rngs=nnx.Rngs(0)), rng)
    x = _features(rng, N, F_IN)
    A = _dense(edge_index, values)
    deg = A.sum(1, keepdims=True)
    mean = A @ np.asarray(x) / np.where(deg != 0, deg, 1)
    expected = (mean @ np.asarray(conv.lin_neighbors.kernel[...])
                + np.asarray(x) @ np.asarray(conv.lin_root.kernel[...]) + np.asarray(conv.bias[...]))
    _close(_apply(conv, x, jg.adjacency(edge_index, N, values=values)), expected)


@pytest.mark.parametrize("n_src, f_in, f_out, transform_first", [(40, 6, 3, False), (6, 6, 3, True)])
def test_sage_bipartite_order(rng, n_src, f_in, f_out, transform_first):
    """On a bipartite layer the order follows the multiply-adds, not the widths: with many more sources than
    destinations (a sampled layer) the mean aggregates first even when `x W_l` is narrower; both orders agree."""
    from jinsum.nn._graph import transform_first as order  # noqa: PLC0415
    n_dst = 5
    neighbors = rng.integers(-1, n_src, (n_dst, 4))  # a fixed-fanout table, -1 padding
    A = jinsum.GroupCOO.from_neighbors(neighbors, num_sources=n_src)
    assert order(A, f_in, f_out) is transform_first
    conv = _randomize(jnn.SAGEConv((f_in, f_in), f_out, rngs=nnx.Rngs(0)), rng)
    x_src, x_dst = _features(rng, n_src, f_in), _features(rng, n_dst, f_in)
    dense = np.zeros((n_dst, n_src))
    for i, j in zip(*np.nonzero(neighbors >= 0)):
        dense[i, neighbors[i, j]] += 1
    mean = dense @ np.asarray(x_src) / np.maximum(dense.sum(1, keepdims=True), 1)
    expected = (mean @ np.asarray(conv.lin_neighbors.kernel[...])
                + np.asarray(x_dst) @ np.asarray(conv.lin_root.kernel[...]) + np.asarray(conv.bias[...]))
    _close(_apply(conv, (x_src, x_dst), A), expected)


def test_sage_without_root_or_bias(rng):
    edge_index, _ = _graph(rng)
    conv = _randomize(jnn.SAGEConv(F_IN, 4, root_weight=False, use_bias=False, rngs=nnx.Rngs(0)), rng)
    x = _features(rng, N, F_IN)
    out = _apply(conv, x, jg.adjacency(edge_index, N))
    assert conv.lin_root is None and conv.bias is None
    _close(out[:2], np.zeros((2, 4)))  # nodes 0 and 1 have no in-edges


@pytest.mark.parametrize("train_eps", [True, False])
def test_gin_matches_dense(rng, train_eps):
    edge_index, values = _graph(rng, weighted=True)
    mlp = nnx.Sequential(nnx.Linear(F_IN, 6, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(6, 3, rngs=nnx.Rngs(1)))
    conv = _randomize(jnn.GINConv(mlp, eps=0.3, train_eps=train_eps), rng)
    x = _features(rng, N, F_IN)
    eps = conv.eps[...] if train_eps else 0.3
    assert isinstance(conv.eps, nnx.Param) == train_eps
    expected = mlp((1 + eps) * x + jnp.asarray(_dense(edge_index, values), jnp.float32) @ x)
    _close(_apply(conv, x, jg.adjacency(edge_index, N, values=values)), expected)


# --- GAT -------------------------------------------------------------------------------------------------------

def _gat_reference(conv, x, A, *, heads, out_features, concat, add_self_loops, slope=0.2):
    h = (np.asarray(x, np.float64) @ np.asarray(conv.linear.kernel[...])).reshape(len(A), heads, out_features)
    s_src = np.einsum("nhf,hf->nh", h, conv.att_src[...])
    s_dst = np.einsum("nhf,hf->nh", h, conv.att_dst[...])
    e = s_dst[:, None, :] + s_src[None, :, :]
    e = np.where(e > 0, e, slope * e)
    edge = A != 0
    if add_self_loops:
        edge[np.diag_indices(len(A))] = True
    e = np.where(edge[..., None], e, -np.inf)
    weights = np.exp(e - np.max(e, axis=1, keepdims=True, initial=-1e30))
    alpha = weights / np.where(weights.sum(1, keepdims=True) > 0, weights.sum(1, keepdims=True), 1)
    out = np.einsum("ijh,jhf->ihf", alpha, h)
    out = out.reshape(len(A), -1) if concat else out.mean(1)
    return out + np.asarray(conv.bias[...])


@pytest.mark.parametrize("heads, concat, add_self_loops", [(3, True, True), (2, False, True), (1, True, False)])
def test_gat_matches_dense(rng, heads, concat, add_self_loops):
    edge_index, values = _graph(rng, weighted=True)  # weights and multiplicities must not change the attention
    conv = _randomize(jnn.GATConv(F_IN, 4, heads=heads, concat=concat, add_self_loops=add_self_loops,
                                  rngs=nnx.Rngs(0)), rng, scale=1.0)
    x = _features(rng, N, F_IN)
    out = _apply(conv, x, jg.adjacency(edge_index, N, values=values, group_size=2))
    assert out.shape == (N, heads * 4 if concat else 4)
    expected = _gat_reference(conv, x, _dense(edge_index, values), heads=heads, out_features=4, concat=concat,
                              add_self_loops=add_self_loops)
    _close(out, expected, rtol=1e-4, atol=1e-5)


def test_gat_dropout_drops_attention_in_training_only(rng):
    edge_index, _ = _graph(rng)
    A = jg.adjacency(edge_index, N)
    conv = jnn.GATConv(F_IN, 4, heads=2, dropout=0.5, rngs=nnx.Rngs(0, dropout=1))
    x = _features(rng, N, F_IN)
    first, second = _apply(conv, x, A), _apply(conv, x, A)
    assert not np.allclose(first, second)  # a fresh mask per call
    conv.eval()
    expected = _gat_reference(conv, x, _dense(edge_index, None), heads=2, out_features=4, concat=True,
                              add_self_loops=True)
    _close(_apply(conv, x, A), expected, rtol=1e-4)


# --- RGCN ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_bases", [None, 2])
def test_rgcn_matches_dense(rng, num_bases):
    R, E = 3, 40
    src, dst, rel = rng.integers(0, N, E), rng.integers(2, N, E), rng.integers(0, R, E)
    src[:2], dst[:2], rel[:2] = 4, 5, 1  # a duplicate edge
    conv = _randomize(jnn.RGCNConv(F_IN, 4, num_relations=R, num_bases=num_bases, rngs=nnx.Rngs(0)), rng)
    x = _features(rng, N, F_IN)
    out = _apply(conv, x, jg.relational_graph(src, dst, rel, N, R))
    weight = np.asarray(conv.weight[...], np.float64)
    if num_bases is not None:
        weight = np.einsum("rb,bcf->rcf", conv.comp[...], weight)
    expected = np.asarray(x) @ np.asarray(conv.root.kernel[...]) + np.asarray(conv.bias[...])
    for r in range(R):
        A = _dense(np.stack([src[rel == r], dst[rel == r]]), None)
        c = A.sum(1, keepdims=True)
        expected += (A / np.where(c > 0, c, 1)) @ np.asarray(x) @ weight[r]
    _close(out, expected)


def test_relational_graph_sorts_and_normalises():
    g = jg.relational_graph(np.array([0, 1, 2, 3]), np.array([2, 0, 2, 2]), np.array([1, 0, 1, 0]), 4, 2)
    np.testing.assert_array_equal(g.dst, [0, 2, 2, 2])
    np.testing.assert_array_equal(g.src, [1, 0, 2, 3])
    np.testing.assert_allclose(g.norm, [1, 0.5, 0.5, 1])
    leaves, tree = jax.tree.flatten(g)
    assert len(leaves) == 4 and jax.tree.unflatten(tree, leaves).num_nodes == 4


# --- block-sparse attention ------------------------------------------------------------------------------------

def test_block_pattern_band_global_random():
    p = jinsum.block_pattern(48, 4, local_blocks=1, global_blocks=2, random_blocks=2, seed=3)
    dense = np.asarray(p.todense())
    blocks = dense.reshape(12, 4, 12, 4).any(axis=(1, 3))
    assert p.group_size == 1 and p.block_shape == (4, 4) and p.nnz == blocks.sum()
    assert np.isin(dense, [0, 1]).all() and (dense.reshape(12, 4, 12, 4).all(axis=(1, 3)) == blocks).all()
    i, j = np.indices(blocks.shape)
    assert blocks[np.abs(i - j) <= 1].all() and blocks[:2].all() and blocks[:, :2].all()
    band_or_global = (np.abs(i - j) <= 1) | (i < 2) | (j < 2)
    assert ((blocks & ~band_or_global).sum(1)[2:] == 2).all()  # 2 random blocks in every non-global row
    again = jinsum.block_pattern(48, 4, local_blocks=1, global_blocks=2, random_blocks=2, seed=3)
    np.testing.assert_array_equal(again.todense(), dense)


def test_block_pattern_causal():
    p = jinsum.block_pattern(40, 5, local_blocks=2, global_blocks=1, random_blocks=1, causal=True)
    dense = np.asarray(p.todense())
    np.testing.assert_array_equal(np.triu(dense, 1), 0)
    assert (np.diag(dense) == 1).all()
    blocks = dense.reshape(8, 5, 8, 5).any(axis=(1, 3))
    i, j = np.indices(blocks.shape)
    assert blocks[(i - j >= 0) & (i - j <= 2)].all() and blocks[:, 0].all()


@jax.jit
def _attention_reference(q, k, v, mask):
    """JAX's dense attention under the element mask, jitted (eagerly, its ops would compile one by one)."""
    return jax.nn.dot_product_attention(q[None], k[None], v[None], mask=jnp.asarray(mask)[None, None])[0]


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_attention_matches_masked_dense(rng, causal):
    L, H, D = 64, 2, 8
    pattern = jinsum.block_pattern(L, 8, local_blocks=1, global_blocks=1, random_blocks=1, causal=causal)
    q, k, v = (_features(rng, L, H, D) for _ in range(3))
    out = jax.jit(jinsum.attention)(q, k, v, pattern)
    _close(out, _attention_reference(q, k, v, np.asarray(pattern.todense()) != 0), rtol=1e-4)


def test_block_sparse_attention_ragged_lengths_and_element_mask(rng):
    """Query and key lengths that are not multiples of the (non-square) blocks; zeros inside stored blocks mask."""
    L, S, H = 13, 10, 2
    mask = rng.random((L, S)) < 0.4
    mask[np.arange(L), np.arange(L) % S] = True  # every query attends somewhere
    pattern = jinsum.BlockGroupCOO.from_dense(mask.astype(np.float32), block_shape=(4, 3), group_size=2)
    q, k, v = _features(rng, L, H, 6), _features(rng, S, H, 6), _features(rng, S, H, 5)
    out = jax.jit(jinsum.attention)(q, k, v, pattern)
    scores = np.einsum("lhd,shd->hls", q, k) / np.sqrt(6)
    scores = np.where(mask[None], scores, -np.inf)
    alpha = np.exp(scores - scores.max(-1, keepdims=True))
    alpha /= alpha.sum(-1, keepdims=True)
    _close(out, np.einsum("hls,shd->lhd", alpha, v), rtol=1e-4)


def test_block_sparse_attention_module(rng):
    L, E = 32, 12
    pattern = jinsum.block_pattern(L, 8, local_blocks=1, causal=True)
    attn = _randomize(jnn.BlockSparseAttention(E, 3, head_dim=4, out_features=7, rngs=nnx.Rngs(0)), rng)
    x = _features(rng, L, E)

    @jax.jit
    def reference(x, qkv_kernel, qkv_bias, out_kernel, out_bias, mask):
        """The projections by hand around JAX's dense attention (one compiled program, not an eager op each)."""
        qkv = (x @ qkv_kernel + qkv_bias).reshape(L, 9, 4)
        heads = _attention_reference(qkv[:, :3], qkv[:, 3:6], qkv[:, 6:], mask)
        return heads.reshape(L, 12) @ out_kernel + out_bias

    expected = reference(x, attn.qkv.kernel[...], attn.qkv.bias[...], attn.out.kernel[...], attn.out.bias[...],
                         np.asarray(pattern.todense()) != 0)
    _close(_apply(attn, x, pattern), expected, rtol=1e-4)


# --- gradients -------------------------------------------------------------------------------------------------

def _check_model_grads(model, x, graph):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # rest: e.g. dropout RNG keys, not differentiable

    @jax.jit
    def f(params, x):
        return nnx.merge(graphdef, params, rest)(x, graph)

    jax.test_util.check_grads(f, (params, x), order=1, modes=["rev"])


def test_gradients(rng):
    """Reverse-mode gradients of GCN, GAT, RGCN and attention w.r.t. parameters and inputs, in float64."""
    edge_index, values = _graph(rng, num_nodes=7, num_edges=14, weighted=True)
    src, dst, rel = rng.integers(0, 7, 14), rng.integers(1, 7, 14), rng.integers(0, 2, 14)
    with jax.enable_x64(True):
        A = jg.adjacency(edge_index, 7, values=values)  # float32 values: the layers compute in float64
        x = _features(rng, 7, 3, dtype=np.float64)
        rngs = nnx.Rngs(0)
        f64 = dict(param_dtype=jnp.float64, rngs=rngs)
        _check_model_grads(jnn.GCNConv(3, 2, **f64), x, A)
        _check_model_grads(jnn.GATConv(3, 2, heads=2, **f64), x, A)
        _check_model_grads(jnn.RGCNConv(3, 2, num_relations=2, num_bases=2, **f64), x,
                           jg.relational_graph(src, dst, rel, 7, 2))
        pattern = jinsum.block_pattern(12, 4, local_blocks=1, causal=True)
        q, k, v = (_features(rng, 12, 2, 3, dtype=np.float64) for _ in range(3))
        jax.test_util.check_grads(jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern)), (q, k, v),
                                  order=1, modes=["rev"])


# --- vmap ------------------------------------------------------------------------------------------------------

def test_vmap_over_feature_batches_equals_a_loop(rng):
    edge_index, values = _graph(rng, weighted=True)
    A = jg.adjacency(edge_index, N, values=values)
    g = jg.relational_graph(edge_index[0], edge_index[1], rng.integers(0, 2, edge_index.shape[1]), N, 2)
    rngs = nnx.Rngs(0)
    cases = [(jnn.GCNConv(F_IN, 3, rngs=rngs), A), (jnn.SAGEConv(F_IN, 3, rngs=rngs), A),
             (jnn.GINConv(nnx.Linear(F_IN, 3, rngs=rngs)), A), (jnn.GATConv(F_IN, 3, heads=2, rngs=rngs), A),
             (jnn.RGCNConv(F_IN, 3, num_relations=2, rngs=rngs), g),
             (jnn.BlockSparseAttention(F_IN, 1, head_dim=2, rngs=rngs), jinsum.block_pattern(N + 1, 4))]
    for model, graph in cases:
        length = N + 1 if isinstance(graph, jinsum.BlockGroupCOO) else N
        xs = _features(rng, 3, length, F_IN)
        batched = nnx.jit(nnx.vmap(lambda model, x, graph: model(x, graph), in_axes=(None, 0, None)))
        _close(batched(model, xs, graph), np.stack([_apply(model, x, graph) for x in xs]), rtol=1e-5)


# --- training --------------------------------------------------------------------------------------------------

class _TwoLayer(nnx.Module):
    def __init__(self, make, *, rngs: nnx.Rngs):
        self.first, self.second = make(F_IN, 8, rngs), make(8, 2, rngs)

    def __call__(self, x, A):
        return self.second(jax.nn.relu(self.first(x, A)), A)


@pytest.mark.parametrize("make", [
    lambda i, o, rngs: jnn.GCNConv(i, o, rngs=rngs),
    lambda i, o, rngs: jnn.GATConv(i, o, heads=2, concat=False, dropout=0.1, rngs=rngs),
], ids=["gcn", "gat"])
def test_training_reduces_the_loss(rng, make):
    """Two communities, labels carried by the graph and weakly by the features."""
    n = 40
    labels = np.repeat([0, 1], n // 2)
    src, dst = rng.integers(0, n, 200), rng.integers(0, n, 200)
    keep = (labels[src] == labels[dst]) | (rng.random(200) < 0.1)
    A = jg.adjacency(np.stack([src[keep], dst[keep]]), n)
    x = jnp.asarray(rng.standard_normal((n, F_IN)) + 0.5 * labels[:, None], jnp.float32)
    model = _TwoLayer(make, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.02), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, A):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x, A), labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, x, A)) for _ in range(30)]
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


# --- errors ----------------------------------------------------------------------------------------------------

def test_a_raw_edge_index_is_refused_with_a_pointer_to_adjacency(rng):
    edge_index, _ = _graph(rng)
    x = _features(rng, N, F_IN)
    rngs = nnx.Rngs(0)
    for conv in (jnn.GCNConv(F_IN, 3, rngs=rngs), jnn.SAGEConv(F_IN, 3, rngs=rngs),
                 jnn.GINConv(nnx.Linear(F_IN, 3, rngs=rngs)), jnn.GATConv(F_IN, 3, rngs=rngs)):
        with pytest.raises(TypeError, match=r"got an array int\d+\[2, 30\].*jinsum\.graphs\.adjacency\(edge_index"):
            conv(x, jnp.asarray(edge_index))
        with pytest.raises(TypeError, match=r"jinsum\.graphs\.adjacency"):  # also inside jit, on a tracer
            _apply(conv, x, jnp.asarray(edge_index))


def test_layer_argument_errors(rng):
    edge_index, _ = _graph(rng)
    A = jg.adjacency(edge_index, N)
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match=r"N = 6 rows"):
        jnn.GCNConv(F_IN, 3, rngs=rngs)(_features(rng, 6, F_IN), A)
    with pytest.raises(TypeError, match=r"GATConv: expected the adjacency as a jinsum\.GroupCOO, got BlockGroupCOO"):
        jnn.GATConv(F_IN, 3, rngs=rngs)(_features(rng, N, F_IN), jinsum.BlockGroupCOO.from_dense(
            np.asarray(A.todense()), block_shape=(2, 2)))
    with pytest.raises(TypeError, match=r"relational_graph"):
        jnn.RGCNConv(F_IN, 3, num_relations=2, rngs=rngs)(_features(rng, N, F_IN), A)
    with pytest.raises(TypeError, match=r"BlockSparseAttention: expected the pattern as a jinsum\.BlockMask or "
                       r"jinsum\.BlockGroupCOO, got GroupCOO"):
        jnn.BlockSparseAttention(F_IN, num_heads=2, block=4, rngs=rngs)(_features(rng, N, F_IN), A)
    with pytest.raises(ValueError, match=r"rel\[1\] = 5 is out of range"):
        jg.relational_graph([0, 1], [1, 0], [0, 5], 3, 2)
    with pytest.raises(ValueError, match=r"block_pattern: seq_len must be a multiple of block"):
        jinsum.block_pattern(30, 8)
    for conv in (jnn.GCNConv(F_IN, 3, rngs=rngs), jnn.SAGEConv(F_IN, 3, rngs=rngs), jnn.GATConv(F_IN, 3, rngs=rngs)):
        name = type(conv).__name__
        with pytest.raises(ValueError, match=rf"{name}: expected node features of shape \(N, {F_IN}\) \(the "
                                             rf"layer's in_features\), got \({N}, {F_IN + 1}\)"):
            conv(_features(rng, N, F_IN + 1), A)
    with pytest.raises(ValueError, match=r"GATConv: heads must be an int >= 1, got 0"):
        jnn.GATConv(F_IN, 3, heads=0, rngs=rngs)


def test_edge_adjacency_errors(rng):
    edge_index, _ = _graph(rng)
    attr = rng.standard_normal((edge_index.shape[1], 2)).astype(np.float32)
    E = jg.edge_adjacency(edge_index, N, attr)
    assert E.shape == (N, N, 3) and E.nnz == edge_index.shape[1]  # duplicate edges stay separate entries
    x, rngs = _features(rng, N, F_IN), nnx.Rngs(0)
    with pytest.raises(ValueError, match=r"expected floating edge features \(E, D\) = \(30, D\), got float32\[29, 2\]"):
        jg.edge_adjacency(edge_index, N, attr[:-1])
    with pytest.raises(ValueError, match=r"GINEConv: expected an edge_adjacency whose edges carry 3 features"):
        jnn.GINEConv(nnx.Linear(F_IN, 3, rngs=rngs), edge_dim=3, in_features=F_IN, rngs=rngs)(x, E)
    with pytest.raises(ValueError, match=r"GATv2Conv: expected an edge_adjacency .* over the 11 rows of x, got x \(6"):
        jnn.GATv2Conv(F_IN, 3, edge_dim=2, rngs=rngs)(x[:6], E)
    with pytest.raises(TypeError, match=r"GATv2Conv: expected the edges as a jinsum.graphs.EdgeList .* or a "
                                        r"jinsum.graphs.edge_adjacency"):
        jnn.GATv2Conv(F_IN, 3, rngs=rngs)(x, jg.adjacency(edge_index, N))
    with pytest.raises(ValueError, match=r"carries its edge features in its values; pass no edge_attr"):
        jnn.GATv2Conv(F_IN, 3, edge_dim=2, rngs=rngs)(x, E, attr)
    with pytest.raises(NotImplementedError, match=r"attention weights come in the edge index's order"):
        jnn.GATConv(F_IN, 3, edge_dim=2, rngs=rngs)(x, E, return_attention_weights=True)


# --- mixed precision -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", ["GCNConv", "SAGEConv", "SAGEConv-max", "GATConv"])
def test_mixed_precision_layers_match_float32(layer, rng):
    """`dtype=bfloat16` with float32 parameters: bfloat16 outputs (and sparse products) within bfloat16's tolerance
    of the float32 layer, float32 parameter gradients close to the float32 layer's."""
    edge_index, _ = _graph(rng)
    A = jg.adjacency(edge_index, N)
    x = _features(rng, N, 6)
    make = {"GCNConv": lambda **kw: jnn.GCNConv(6, 5, **kw), "SAGEConv": lambda **kw: jnn.SAGEConv(6, 5, **kw),
            "SAGEConv-max": lambda **kw: jnn.SAGEConv(6, 5, aggr="max", **kw),
            "GATConv": lambda **kw: jnn.GATConv(6, 5, heads=2, **kw)}[layer]
    full = _randomize(make(rngs=nnx.Rngs(0)), np.random.default_rng(1))
    half = _randomize(make(dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), np.random.default_rng(1))

    def loss(model):
        return jnp.sum(jnp.tanh(model(x, A).astype(jnp.float32)))

    @nnx.jit
    def output_and_grads(model):
        """The layer's output (a plain call) and the parameter gradients of a loss on it, in one compiled program."""
        return model(x, A), nnx.grad(loss)(model)

    out, grads_half = output_and_grads(half)
    out_full, grads_full = output_and_grads(full)
    assert out.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(half, nnx.Param)))
    assert_allclose(out, out_full, jnp.bfloat16)
    for g_half, g_full in zip(jax.tree.leaves(grads_half), jax.tree.leaves(grads_full)):
        assert g_half.dtype == jnp.float32
        assert_allclose(g_half, g_full, jnp.bfloat16)

"""Aggregations against PyTorch Geometric in float64, PyG's weights copied in: `SAGEConv` (every `aggr`, `normalize`,
`project`), `EdgeConv` (linear and MLP messages) and the global pools over a batch of graphs; outputs and input
gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jinsum.graphs as jg

import jinsum.nn as jnn

from conftest import ON_GPU

torch = pytest.importorskip("torch")
pyg = pytest.importorskip("torch_geometric.nn", reason="the parity tests need torch_geometric (the test extra)")

N, F_IN, F_OUT = 23, 5, 4


def _edges(rng, num_edges=70):
    """Random edges without duplicates, nodes 0 and 1 without in-edges, a self loop on node 3."""
    src, dst = rng.integers(0, N, num_edges), rng.integers(2, N, num_edges)
    src[0], dst[0] = 3, 3
    return np.unique(np.stack([src, dst]), axis=1)


def _copy_linear(ours: nnx.Linear, theirs) -> None:
    ours.kernel[...] = jnp.asarray(theirs.weight.detach().numpy().T)
    if ours.bias is not None:
        ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())


def _output_and_grads(f, probe, *inputs):
    """`f(*inputs)`, which returns `(output, extras)`, and the gradients of `sum(output * probe)` with respect to
    every input (the pullback of `probe`), in one jitted program: `(output, extras, grads)`. The output is the
    plain call's (a forward without differentiation may take another path than the one `jax.vjp` runs)."""
    @jax.jit
    def run(probe, *inputs):
        out, extras = f(*inputs)
        _, pullback, _ = jax.vjp(f, *inputs, has_aux=True)
        return out, extras, pullback(probe)

    return run(jnp.asarray(probe), *map(jnp.asarray, inputs))


def _compare(ours, theirs, x, rng, graph, *their_graph):
    """`ours(x, graph)` against `theirs(x, *their_graph)` (numpy arrays, passed as torch tensors): outputs and the
    gradient of a random linear functional of the output with respect to `x` (one jitted program)."""
    x_torch = torch.tensor(x, requires_grad=True)
    expected = theirs(x_torch, *map(torch.from_numpy, their_graph))
    probe = rng.standard_normal(expected.shape)
    (expected * torch.from_numpy(probe)).sum().backward()
    out, _, (grad,) = _output_and_grads(lambda x: (ours(x, graph), None), probe, x)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad, x_torch.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("aggr", ["mean", "sum", "max", ("mean", "max", "min", "std")], ids=str)
@pytest.mark.parametrize("normalize, project", [(False, False), (True, True)])
def test_sage(aggr, normalize, project, rng):
    with jax.enable_x64(True):
        torch.manual_seed(0)
        theirs = pyg.SAGEConv(F_IN, F_OUT, aggr=aggr if isinstance(aggr, str) else list(aggr), normalize=normalize,
                              project=project).double()
        ours = jnn.SAGEConv(F_IN, F_OUT, aggr=aggr, normalize=normalize, project=project, param_dtype=jnp.float64,
                            rngs=nnx.Rngs(0))
        _copy_linear(ours.lin_neighbors, theirs.lin_l)
        ours.bias[...] = jnp.asarray(theirs.lin_l.bias.detach().numpy())
        _copy_linear(ours.lin_root, theirs.lin_r)
        if project:
            _copy_linear(ours.project, theirs.lin)
        edge_index = _edges(rng)
        _compare(ours, theirs, rng.standard_normal((N, F_IN)), rng, jg.adjacency(edge_index, N), edge_index)


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "mlp"])
def test_edge_conv(mlp, rng):
    with jax.enable_x64(True):
        torch.manual_seed(0)
        if mlp:
            theirs = pyg.EdgeConv(torch.nn.Sequential(torch.nn.Linear(2 * F_IN, 7), torch.nn.Tanh(),
                                                      torch.nn.Linear(7, F_OUT))).double()
            rngs = nnx.Rngs(0)
            nn = nnx.Sequential(nnx.Linear(2 * F_IN, 7, param_dtype=jnp.float64, rngs=rngs), jnp.tanh,
                                nnx.Linear(7, F_OUT, param_dtype=jnp.float64, rngs=rngs))
            _copy_linear(nn.layers[0], theirs.nn[0])  # (after PyG's constructor, which draws its weights again)
            _copy_linear(nn.layers[2], theirs.nn[2])
            ours = jnn.EdgeConv(F_IN, F_OUT, nn=nn, rngs=rngs)
        else:
            theirs = pyg.EdgeConv(torch.nn.Linear(2 * F_IN, F_OUT)).double()
            ours = jnn.EdgeConv(F_IN, F_OUT, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
            _copy_linear(ours.nn, theirs.nn)
        edge_index = _edges(rng)
        _compare(ours, theirs, rng.standard_normal((N, F_IN)), rng, jg.adjacency(edge_index, N), edge_index)


def _graphs(rng, count=5):
    """Small graphs of 1 to 9 nodes (one without edges), as PyG's `Batch` would hold them."""
    sizes = rng.integers(1, 10, count)
    edges = [np.unique(rng.integers(0, n, (2, 3 * n)), axis=1) if k else np.zeros((2, 0), np.int64)
             for k, n in enumerate(sizes)]
    return edges, [int(n) for n in sizes]


@pytest.mark.parametrize("pool", ["global_add_pool", "global_mean_pool", "global_max_pool"])
def test_global_pools(pool, rng):
    import torch_geometric.nn.pool as pyg_pool  # noqa: PLC0415

    edges, sizes = _graphs(rng)
    A, batch = jg.batch_graphs(edges, sizes)
    with jax.enable_x64(True):
        x = rng.standard_normal((sum(sizes), 3))
        probe = rng.standard_normal((len(sizes), 3))
        x_torch = torch.tensor(x, requires_grad=True)
        expected = getattr(pyg_pool, pool)(x_torch, torch.from_numpy(np.asarray(batch, np.int64)), len(sizes))
        (expected * torch.from_numpy(probe)).sum().backward()
        ours = getattr(jnn, pool)
        out, _, (grad,) = _output_and_grads(lambda x: (ours(x, batch, len(sizes)), None), probe, x)
        np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grad, x_torch.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_batch_graphs_is_block_diagonal(rng):
    edges, sizes = _graphs(rng)
    A, batch = jg.batch_graphs(edges, sizes)
    offsets = np.cumsum([0, *sizes])
    dense = np.zeros((offsets[-1],) * 2)
    for e, o in zip(edges, offsets):
        np.add.at(dense, (e[1] + o, e[0] + o), 1)
    np.testing.assert_array_equal(A.todense(), dense)
    np.testing.assert_array_equal(batch, np.repeat(np.arange(len(sizes)), sizes))


def test_pool_and_batch_errors(rng):
    with pytest.raises(ValueError, match="graph 1 has 3 nodes"):
        jg.batch_graphs([np.zeros((2, 0), int), np.array([[0], [3]])], [2, 3])
    with pytest.raises(ValueError, match="batch must be sorted"):
        jnn.global_add_pool(jnp.ones((3, 2)), jnp.array([1, 0, 1]), 2)
    with pytest.raises(TypeError, match="num_graphs must be a Python int"):
        jnn.global_max_pool(jnp.ones((3, 2)), jnp.array([0, 0, 1]), 2.0)


def _without_self_loops(edge_index):
    """PyG's GCN normalisation replaces a stored self loop (`add_remaining_self_loops`); jinsum's adds to it."""
    return edge_index[:, edge_index[0] != edge_index[1]]


@pytest.mark.parametrize("layer", ["GCNConv improved", "SGConv K=3", "APPNP", "GraphConv add", "GraphConv mean",
                                   "GraphConv max", "GraphConv mean wide"])  # (wide: aggregates before W_2)
def test_propagation_layers(layer, rng):
    edge_index = _without_self_loops(_edges(rng))
    weights = rng.uniform(0.5, 2.0, edge_index.shape[1])
    with jax.enable_x64(True):
        torch.manual_seed(0)
        f64 = dict(param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        if layer == "GCNConv improved":
            theirs = pyg.GCNConv(F_IN, F_OUT, improved=True).double()
            ours = jnn.GCNConv(F_IN, F_OUT, improved=True, **f64)
            _copy_linear(ours.linear, theirs.lin)
            ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())
        elif layer == "SGConv K=3":
            theirs = pyg.SGConv(F_IN, F_OUT, K=3).double()
            ours = jnn.SGConv(F_IN, F_OUT, K=3, **f64)
            _copy_linear(ours.linear, theirs.lin)
        elif layer == "APPNP":
            theirs, ours = pyg.APPNP(K=4, alpha=0.2).double(), jnn.APPNP(K=4, alpha=0.2)
        else:
            aggr, out = layer.split()[1], 2 * F_IN if layer.endswith("wide") else F_OUT
            theirs = pyg.GraphConv(F_IN, out, aggr=aggr).double()
            ours = jnn.GraphConv(F_IN, out, aggr=aggr, **f64)
            _copy_linear(ours.lin_rel, theirs.lin_rel)
            _copy_linear(ours.lin_root, theirs.lin_root)
        _compare(ours, theirs, rng.standard_normal((N, F_IN)), rng, jg.adjacency(edge_index, N, values=weights),
                 edge_index, weights)


@pytest.mark.parametrize("improved", [False, True])
def test_gcn_on_its_normalisation_computed_once_equals_pyg(improved, rng):
    """`gcn_norm` once, then `GCNConv(normalize=False, add_self_loops=False)`: PyG's `GCNConv`, whose
    normalisation keeps a stored self loop's weight (`_edges` has one on node 3) and gives nodes 0 and 1 (no
    in-edges) their self loop alone."""
    edge_index = _edges(rng)
    weights = rng.uniform(0.5, 2.0, edge_index.shape[1])
    with jax.enable_x64(True):
        torch.manual_seed(0)
        theirs = pyg.GCNConv(F_IN, F_OUT, improved=improved).double()
        ours = jnn.GCNConv(F_IN, F_OUT, normalize=False, add_self_loops=False, param_dtype=jnp.float64,
                           rngs=nnx.Rngs(0))
        _copy_linear(ours.linear, theirs.lin)
        ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())
        A_hat = jg.gcn_norm(edge_index, N, values=weights, improved=improved)
        _compare(ours, theirs, rng.standard_normal((N, F_IN)), rng, A_hat, edge_index, weights)


@pytest.mark.parametrize("aggr", ["mean", "add"])
@pytest.mark.parametrize("num_bases, num_blocks, relations", [(None, None, 2), (2, None, 3), (None, 2, 3),
                                                              (None, None, 40)])
def test_rgcn(aggr, num_bases, num_blocks, relations, rng):
    """(2 relations: fewer than edges per node, every node transformed by every relation; 40: more, so the
    messages run edge by edge, grouped by relation, some relations without edges.)"""
    edge_index = _edges(rng)
    rel = rng.integers(0, relations, edge_index.shape[1])
    with jax.enable_x64(True):
        graph = jg.relational_graph(edge_index[0], edge_index[1], rel, N, relations)  # (its 1 / c in float64)
        if num_bases is None and num_blocks is None:
            assert (edge_index.shape[1] < N * relations) == (relations == 40)
        torch.manual_seed(0)
        f_in = 6 if num_blocks else F_IN  # (blocks divide the widths)
        theirs = pyg.RGCNConv(f_in, F_OUT, relations, num_bases=num_bases, num_blocks=num_blocks, aggr=aggr).double()
        ours = jnn.RGCNConv(f_in, F_OUT, num_relations=relations, num_bases=num_bases, num_blocks=num_blocks,
                            aggr=aggr, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        ours.weight[...] = jnp.asarray(theirs.weight.detach().numpy())
        if num_bases:
            ours.comp[...] = jnp.asarray(theirs.comp.detach().numpy())
        ours.root.kernel[...] = jnp.asarray(theirs.root.detach().numpy())
        ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())
        _compare(ours, theirs, rng.standard_normal((N, f_in)), rng, graph, edge_index, rel)


def _copy_all(ours, theirs, names):
    for name in names:
        _copy_linear(getattr(ours, name), getattr(theirs, name))


@pytest.mark.parametrize("heads, concat, beta", [(1, True, False), (3, True, True), (2, False, True)])
def test_transformer(heads, concat, beta, rng):
    with jax.enable_x64(True):
        torch.manual_seed(0)
        theirs = pyg.TransformerConv(F_IN, F_OUT, heads=heads, concat=concat, beta=beta).double()
        ours = jnn.TransformerConv(F_IN, F_OUT, heads=heads, concat=concat, beta=beta, param_dtype=jnp.float64,
                                   rngs=nnx.Rngs(0))
        _copy_all(ours, theirs, ["lin_query", "lin_key", "lin_value", "lin_skip"] + ["lin_beta"] * beta)
        edge_index = _edges(rng)
        _compare(ours, theirs, rng.standard_normal((N, F_IN)), rng, jg.adjacency(edge_index, N), edge_index)


@pytest.mark.parametrize("layer", ["SAGEConv mean", "SAGEConv max", "GraphConv add", "TransformerConv", "GATConv",
                                   "GATConv mean"])
def test_bipartite(layer, rng):
    """Sources and destinations of different counts and widths: `x = (x_src, x_dst)`, `A` `(N_dst, N_src)`."""
    n_src, n_dst, f_src, f_dst = 17, 9, 5, 3
    edge_index = np.unique(np.stack([rng.integers(0, n_src, 40), rng.integers(1, n_dst, 40)]), axis=1)  # dst 0: none
    with jax.enable_x64(True):
        torch.manual_seed(0)
        f64 = dict(param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        name, *aggr = layer.split()
        if name == "SAGEConv":
            theirs = pyg.SAGEConv((f_src, f_dst), F_OUT, aggr=aggr[0]).double()
            ours = jnn.SAGEConv((f_src, f_dst), F_OUT, aggr=aggr[0], **f64)
            _copy_linear(ours.lin_neighbors, theirs.lin_l)
            ours.bias[...] = jnp.asarray(theirs.lin_l.bias.detach().numpy())
            _copy_linear(ours.lin_root, theirs.lin_r)
        elif name == "GraphConv":
            theirs = pyg.GraphConv((f_src, f_dst), F_OUT, aggr=aggr[0]).double()
            ours = jnn.GraphConv((f_src, f_dst), F_OUT, aggr=aggr[0], **f64)
            _copy_all(ours, theirs, ["lin_rel", "lin_root"])
        elif name == "TransformerConv":
            theirs = pyg.TransformerConv((f_src, f_dst), F_OUT, heads=2).double()
            ours = jnn.TransformerConv((f_src, f_dst), F_OUT, heads=2, **f64)
            _copy_all(ours, theirs, ["lin_query", "lin_key", "lin_value", "lin_skip"])
        else:  # GATConv: 3 heads, concatenated or averaged; a bipartite graph has no self loops
            options = dict(heads=3, concat=not aggr, add_self_loops=False)
            theirs = pyg.GATConv((f_src, f_dst), F_OUT, **options).double()
            ours = jnn.GATConv((f_src, f_dst), F_OUT, **options, **f64)
            _copy_linear(ours.linear, theirs.lin_src)
            _copy_linear(ours.lin_dst, theirs.lin_dst)
            for att in ("att_src", "att_dst"):
                getattr(ours, att)[...] = jnp.asarray(getattr(theirs, att).detach().numpy()[0])
            ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())
        A = jg.adjacency(edge_index, (n_src, n_dst))
        x_src, x_dst = rng.standard_normal((n_src, f_src)), rng.standard_normal((n_dst, f_dst))
        ts, td = torch.tensor(x_src, requires_grad=True), torch.tensor(x_dst, requires_grad=True)
        expected = theirs((ts, td), torch.from_numpy(edge_index))
        probe = rng.standard_normal(expected.shape)
        (expected * torch.from_numpy(probe)).sum().backward()
        out, _, grads = _output_and_grads(lambda s, d: (ours((s, d), A), None), probe, x_src, x_dst)
        # (On a GPU the fused attention chain's float64 kernels agree to ~3e-7, as test_nn's GAT test shows.)
        fused = name == "GATConv" and ON_GPU
        tolerance = dict(rtol=1e-6, atol=1e-8) if fused else dict(rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out, expected.detach().numpy(), **tolerance)
        np.testing.assert_allclose(grads[0], ts.grad.numpy(), **tolerance)
        np.testing.assert_allclose(grads[1], td.grad.numpy(), **tolerance)


@pytest.mark.parametrize("edge_dim", [None, 3])
def test_gine(edge_dim, rng):
    """Per-edge messages, duplicate edges kept apart (as in PyG), edge features in the edge index's order."""
    edge_index = _edges(rng)
    edge_index = np.concatenate([edge_index, edge_index[:, :4]], axis=1)[:, rng.permutation(edge_index.shape[1] + 4)]
    with jax.enable_x64(True):
        torch.manual_seed(0)
        theirs = pyg.GINEConv(torch.nn.Sequential(torch.nn.Linear(F_IN, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)),
                              eps=0.3, train_eps=True, edge_dim=edge_dim).double()
        rngs = nnx.Rngs(0)
        mlp = nnx.Sequential(nnx.Linear(F_IN, 6, param_dtype=jnp.float64, rngs=rngs), nnx.relu,
                             nnx.Linear(6, 2, param_dtype=jnp.float64, rngs=rngs))
        _copy_linear(mlp.layers[0], theirs.nn[0])
        _copy_linear(mlp.layers[2], theirs.nn[2])
        ours = jnn.GINEConv(mlp, eps=0.3, train_eps=True, edge_dim=edge_dim, in_features=F_IN,
                            param_dtype=jnp.float64, rngs=rngs)
        ours.eps[...] = jnp.asarray(theirs.eps.item())  # (PyG's 0.3 went through float32)
        if edge_dim:
            _copy_linear(ours.lin, theirs.lin)
        edges = jg.edge_list(edge_index, N)
        x = rng.standard_normal((N, F_IN))
        attr = rng.standard_normal((edge_index.shape[1], edge_dim or F_IN))
        tx, ta = torch.tensor(x, requires_grad=True), torch.tensor(attr, requires_grad=True)
        expected = theirs(tx, torch.from_numpy(edge_index), ta)
        probe = rng.standard_normal(expected.shape)
        (expected * torch.from_numpy(probe)).sum().backward()
        out, _, grads = _output_and_grads(lambda x, a: (ours(x, edges, a), None), probe, x, attr)
        np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads[0], tx.grad.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads[1], ta.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads, concat, self_loops, edge_dim, share", [
    (1, True, True, None, False), (3, True, True, 2, False), (2, False, False, None, True), (2, True, False, 2, False)])
def test_gatv2(heads, concat, self_loops, edge_dim, share, rng):
    edge_index = _edges(rng)  # (with a stored self loop, which add_self_loops replaces)
    with jax.enable_x64(True):
        torch.manual_seed(0)
        options = dict(heads=heads, concat=concat, add_self_loops=self_loops, edge_dim=edge_dim, share_weights=share)
        theirs = pyg.GATv2Conv(F_IN, F_OUT, **options).double()
        ours = jnn.GATv2Conv(F_IN, F_OUT, **options, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        _copy_all(ours, theirs, ["lin_l", "lin_r"] + ["lin_edge"] * bool(edge_dim))
        ours.att[...] = jnp.asarray(theirs.att.detach().numpy()[0])
        ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())
        edges = jg.edge_list(edge_index, N)
        x = rng.standard_normal((N, F_IN))
        attr = rng.standard_normal((edge_index.shape[1], edge_dim)) if edge_dim else None
        tx = torch.tensor(x, requires_grad=True)
        expected = theirs(tx, torch.from_numpy(edge_index), None if attr is None else torch.from_numpy(attr))
        probe = rng.standard_normal(expected.shape)
        (expected * torch.from_numpy(probe)).sum().backward()
        out, _, (grad,) = _output_and_grads(lambda x: (ours(x, edges, attr), None), probe, x)
        np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads, concat, self_loops, edge_dim", [
    (1, True, True, None), (3, True, True, 2), (2, False, False, 2)])
def test_gat_edge_by_edge(heads, concat, self_loops, edge_dim, rng):
    """GATConv on an EdgeList: edge features in the scores, and the attention weights against PyG's."""
    edge_index = _edges(rng)  # (with a stored self loop, which add_self_loops replaces)
    with jax.enable_x64(True):
        torch.manual_seed(0)
        options = dict(heads=heads, concat=concat, add_self_loops=self_loops, edge_dim=edge_dim)
        theirs = pyg.GATConv(F_IN, F_OUT, **options).double()
        ours = jnn.GATConv(F_IN, F_OUT, **options, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        _copy_linear(ours.linear, theirs.lin)
        for name in ("att_src", "att_dst") + ("att_edge",) * bool(edge_dim):
            getattr(ours, name)[...] = jnp.asarray(getattr(theirs, name).detach().numpy()[0])
        if edge_dim:
            _copy_linear(ours.lin_edge, theirs.lin_edge)
        ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())
        edges = jg.edge_list(edge_index, N)
        x = rng.standard_normal((N, F_IN))
        attr = rng.standard_normal((edge_index.shape[1], edge_dim)) if edge_dim else None
        tx = torch.tensor(x, requires_grad=True)
        expected, (pairs, alpha) = theirs(tx, torch.from_numpy(edge_index),
                                          None if attr is None else torch.from_numpy(attr),
                                          return_attention_weights=True)
        probe = rng.standard_normal(expected.shape)
        (expected * torch.from_numpy(probe)).sum().backward()
        # (The gradient is the plain call's; the weights, and the output beside them, come from a second call.)
        out, (weighted_out, (weights, own)), (grad,) = _output_and_grads(
            lambda x: (ours(x, edges, attr), ours(x, edges, attr, return_attention_weights=True)), probe, x)
        np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(weighted_out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-12, atol=1e-12)
        # PyG's weights: the edges without self loops, in order, then one self loop per node (when added).
        pairs, alpha = pairs.numpy(), alpha.detach().numpy()
        kept = edge_index[0] != edge_index[1] if self_loops else np.ones(edge_index.shape[1], bool)
        np.testing.assert_allclose(np.asarray(weights)[kept], alpha[:kept.sum()], rtol=1e-12, atol=1e-12)
        if self_loops:
            assert (np.asarray(weights)[~kept] == 0).all()
            np.testing.assert_allclose(own, alpha[kept.sum():], rtol=1e-12, atol=1e-12)

"""Padded mini-batches of small graphs (`jinsum.graphs.GraphLoader`, `GraphBatch`) and the pools over them: each graph
in a batch gives what it gives alone (float64, dense NumPy-style references), one compile for every batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jinsum.graphs as jg
import jinsum.nn as jnn
from jinsum.graphs._batch import COLUMN_ORDER_DEGREE
from jinsum.testing import CountingJit

F = 3


def _graphs(rng, sizes, edges_per_node=2):
    """Graphs of `sizes` nodes with random edges (duplicates and self loops included), features and a target."""
    graphs = []
    for n in sizes:
        e = rng.integers(0, n, (2, edges_per_node * n)) if n else np.zeros((2, 0), np.int64)
        graphs.append(dict(x=rng.standard_normal((n, F)), edge_index=e, y=np.float64(n)))
    return graphs


class _Model(nnx.Module):
    """A GIN layer, then the four pools side by side: per graph `(4 H,)`."""

    def __init__(self, rngs):
        self.mlp = nnx.Sequential(nnx.Linear(F, 4, param_dtype=jnp.float64, rngs=rngs), nnx.tanh)
        self.gin = jnn.GINConv(self.mlp, eps=0.3, param_dtype=jnp.float64)
        self.gate = nnx.Linear(4, 1, param_dtype=jnp.float64, rngs=rngs)
        self.attention = jnn.AttentionalAggregation(self.gate)

    def __call__(self, batch: jg.GraphBatch):
        h = self.gin(batch.x, batch.adjacency())  # (GINConv's SpMM casts the adjacency to the features' dtype)
        graph, count = batch.node_graph(), batch.budget.graphs
        return jnp.concatenate([jnn.global_add_pool(h, graph, count), jnn.global_mean_pool(h, graph, count),
                                jnn.global_max_pool(h, graph, count), self.attention(h, graph, count)], axis=1)

    def alone(self, graph):
        """The same model on one graph, with a dense adjacency and NumPy-style reductions."""
        x, (src, dst) = jnp.asarray(graph["x"]), graph["edge_index"]
        n = x.shape[0]
        if n == 0:
            return jnp.zeros(16)
        dense = np.zeros((n, n))
        np.add.at(dense, (dst, src), 1.0)
        h = self.mlp((1 + self.gin.eps[...]) * x + jnp.asarray(dense) @ x)
        weight = jax.nn.softmax(self.gate(h), axis=0)
        return jnp.concatenate([h.sum(0), h.mean(0), h.max(0), (weight * h).sum(0)])


def _batches(loader):
    return [jax.tree.map(np.asarray, b) for b in loader]


@pytest.mark.parametrize("sizes", [[3, 0, 1, 5, 4, 1, 2], [6, 6]])
def test_each_graph_in_a_batch_gives_what_it_gives_alone(rng, sizes):
    """Empty and one-node graphs, hubs of duplicate edges, padding graphs; `[6, 6]` fills the budget exactly."""
    with jax.enable_x64(True):
        graphs = _graphs(rng, sizes)
        budget = jg.GraphBudget(nodes=12, edges=24, graphs=3)
        loader = jg.GraphLoader(graphs, batch_size=3, budget=budget)
        model = _Model(nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        step = CountingJit(lambda state, batch: nnx.merge(graphdef, state)(batch))
        masked_grad = jax.jit(lambda state, batch, weights: nnx.grad(lambda m: jnp.sum(
            jnp.where(batch.graph_mask[:, None], m(batch) * weights, 0)))(nnx.merge(graphdef, state)))
        seen = 0
        for batch in loader:
            out = step(state, batch)
            real = int(np.sum(batch.graph_mask))
            assert out.shape == (3, 16) and real >= 1 and not np.asarray(batch.graph_mask)[real:].any()
            weights = jnp.asarray(rng.standard_normal(16))
            alone = graphs[seen: seen + real]
            # The batch's graphs alone, in one compiled program: each one's output, and the gradient of their
            # weighted sum (eagerly each operation would compile for every graph size).
            outputs, alone_grad = nnx.jit(lambda m, alone=alone, weights=weights: (
                [m.alone(g) for g in alone],
                nnx.grad(lambda m: sum(jnp.sum(m.alone(g) * weights) for g in alone))(m)))(model)
            for k in range(real):
                np.testing.assert_allclose(out[k], outputs[k], rtol=1e-10, atol=1e-12)
            np.testing.assert_array_equal(out[real:], 0)  # padding graphs pool nothing
            # gradients: the batch's masked loss against the sum of each graph's own
            masked = masked_grad(state, batch, weights)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12), masked, alone_grad)
            seen += real
        assert seen == len(graphs) and step.traces == 1
        if sizes == [6, 6]:
            (batch,) = _batches(loader)
            assert batch.n_node.sum() == 12 and batch.n_edge.sum() == 24  # exactly at budget, nothing padded


def test_loader_closes_batches_early_shuffles_and_drops(rng):
    graphs = _graphs(rng, [4, 4, 4, 1, 1, 1, 1, 1, 5])
    loader = jg.GraphLoader(graphs, batch_size=4, budget=jg.GraphBudget(nodes=9, edges=40, graphs=4))
    # 4 + 4 (a third 4 would pass 9 nodes), then 4 + 1 + 1 + 1 (four graphs), then 1 + 1 + 5
    assert [int(b.graph_mask.sum()) for b in _batches(loader)] == [2, 4, 3] and len(loader) == 3
    shuffled = jg.GraphLoader(graphs, batch_size=4, budget=loader.budget, shuffle=True, seed=1)
    ys = [np.sort(np.concatenate([b.y[b.graph_mask] for b in _batches(shuffled)])) for _ in range(2)]
    for y in ys:
        np.testing.assert_array_equal(y, np.sort([g["y"] for g in graphs]))  # every graph once per epoch
    dropped = jg.GraphLoader(graphs, batch_size=4, budget=loader.budget, drop_last=True)
    assert [int(b.graph_mask.sum()) for b in _batches(dropped)] == [4] and len(dropped) == 1


def test_batch_layout(rng):
    graphs = _graphs(rng, [2, 0, 3])
    (batch,) = _batches(jg.GraphLoader(graphs, batch_size=3, budget=jg.GraphBudget(8, 12, 4)))
    np.testing.assert_array_equal(batch.node_graph(), [0, 0, 2, 2, 2, 4, 4, 4])
    np.testing.assert_array_equal(batch.node_mask(), [1, 1, 1, 1, 1, 0, 0, 0])
    edges = np.asarray(batch.edges())

    def in_destination_order(edge_index):
        return edge_index[:, np.lexsort(edge_index)]

    np.testing.assert_array_equal(edges[:, :4], in_destination_order(graphs[0]["edge_index"]))
    np.testing.assert_array_equal(edges[:, 4:10], in_destination_order(graphs[2]["edge_index"]) + 2)
    assert (edges[:, 10:] == -1).all() and batch.x.shape == (8, F) and (batch.x[5:] == 0).all()
    np.testing.assert_array_equal(batch.y, [2, 0, 3, 0])


def test_budget_from_the_dataset(rng):
    graphs = _graphs(rng, rng.integers(10, 51, 500))
    budget = jg.GraphBudget.for_dataset(graphs, 128)
    nodes = np.array([g["x"].shape[0] for g in graphs])
    assert budget.graphs == 128 and budget.nodes % 64 == 0 and budget.edges % 64 == 0
    assert 128 * nodes.mean() < budget.nodes < 128 * nodes.mean() + 4 * np.sqrt(128) * nodes.std() + 64
    batches = _batches(jg.GraphLoader(graphs, 128, shuffle=True))
    assert sum(int(b.graph_mask.sum()) for b in batches) == 500
    assert all(b.x.shape == batches[0].x.shape for b in batches)


def test_the_column_order_is_built_where_the_dataset_has_hubs(rng):
    """The loader measures the most edges into or out of one node (`max_degree`); a batch's adjacency sorts its
    edges for the column order only above `COLUMN_ORDER_DEGREE`, or where the degree is not known."""
    hub = COLUMN_ORDER_DEGREE + 1
    star = dict(x=np.zeros((hub + 1, F)), edge_index=np.stack([np.arange(1, hub + 1), np.zeros(hub, int)]), y=0.0)
    small = _graphs(rng, [5, 3])
    degrees = [max(np.bincount(e, minlength=1).max() for e in g["edge_index"]) for g in small]
    for graphs, degree in ((small, max(degrees)), (small + [star], hub)):
        loader = jg.GraphLoader(graphs, 3, budget=jg.GraphBudget(nodes=64, edges=128, graphs=3))
        assert loader.budget.max_degree == degree == jg.GraphBudget.for_dataset(graphs, 3).max_degree
        (batch,) = _batches(loader)
        assert (batch.adjacency().transposed is not None) == (degree > COLUMN_ORDER_DEGREE)
    (batch,) = _batches(jg.GraphLoader(small, 3, budget=jg.GraphBudget(64, 128, 3, max_degree=None)))
    assert batch.budget.max_degree is not None  # (the loader measured it)


def test_a_graph_over_budget_is_an_error(rng):
    graphs = _graphs(rng, [2, 9, 3])
    with pytest.raises(ValueError, match=r"graph 1 has 9 nodes, more than the budget of 8 nodes"):
        jg.GraphLoader(graphs, 2, budget=jg.GraphBudget(nodes=8, edges=100, graphs=2))
    with pytest.raises(ValueError, match=r"graph 1 has 18 edges, more than the budget of 10 edges"):
        jg.GraphLoader(graphs, 2, budget=jg.GraphBudget(nodes=100, edges=10, graphs=2))
    with pytest.raises(ValueError, match=r"holds 2 graphs, fewer than batch_size = 3"):
        jg.GraphLoader(graphs, 3, budget=jg.GraphBudget(nodes=100, edges=100, graphs=2))
    with pytest.raises(ValueError, match=r"graph 1's edge_index holds node ids in \[0, 2\], outside its own 2 nodes"):
        jg.GraphLoader([graphs[0], dict(x=np.ones((2, F)), edge_index=np.array([[0], [2]]))], 2)
    with pytest.raises(ValueError, match="some graphs have y and some do not"):
        jg.GraphLoader([graphs[0], dict(x=np.ones((2, F)), edge_index=np.zeros((2, 0), int))], 2)


def test_pools_check_the_batch_vector():
    x = jnp.ones((4, 2))
    with pytest.raises(ValueError, match="sorted"):
        jnn.global_add_pool(x, jnp.array([0, 1, 0, 1]), 2)
    with pytest.raises(ValueError, match=r"ids in \[0, num_graphs = 2\)"):
        jnn.global_add_pool(x, jnp.array([0, 1, 3, 3]), 2)
    np.testing.assert_array_equal(jnn.global_add_pool(x, jnp.array([0, 0, 1, 2]), 2), [[2, 2], [1, 1]])


def test_attentional_aggregation_equals_pyg(rng):
    torch = pytest.importorskip("torch")
    pyg = pytest.importorskip("torch_geometric.nn.aggr")
    with jax.enable_x64(True):
        x = rng.standard_normal((9, 4))
        batch = np.array([0, 0, 0, 2, 2, 3, 3, 3, 3])
        gate = torch.nn.Linear(4, 4).double()
        expected = pyg.AttentionalAggregation(gate)(torch.tensor(x), torch.tensor(batch), dim_size=5)
        linear = nnx.Linear(4, 4, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        linear.kernel[...] = jnp.asarray(gate.weight.detach().numpy().T)
        linear.bias[...] = jnp.asarray(gate.bias.detach().numpy())
        found = jnn.AttentionalAggregation(linear)(jnp.asarray(x), jnp.asarray(batch), 5)
        np.testing.assert_allclose(found, expected.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_pyg_data_objects_are_graphs(rng):
    torch = pytest.importorskip("torch")
    data = pytest.importorskip("torch_geometric.data")
    graphs = [data.Data(x=torch.tensor(g["x"]), edge_index=torch.tensor(g["edge_index"]), y=torch.tensor([g["y"]]))
              for g in _graphs(rng, [3, 4])]
    (batch,) = _batches(jg.GraphLoader(graphs, 2, budget=jg.GraphBudget(8, 16, 2)))
    np.testing.assert_array_equal(batch.y, [[3], [4]])
    np.testing.assert_array_equal(batch.x[:7], np.concatenate([g.x.numpy() for g in graphs]).astype(batch.x.dtype))


def test_molecules_are_trees_with_their_label_of_rings():
    from jinsum.datasets import molecules  # noqa: PLC0415

    graphs = molecules(50, min_nodes=10, max_nodes=20, seed=3)
    for g in graphs:
        n, (src, dst) = g["x"].shape[0], g["edge_index"]
        assert 10 <= n <= 20 and g["x"].sum() == n and (g["x"].sum(1) == 1).all()
        assert g["edge_index"].shape[1] == 2 * (n - 1 + g["y"])  # bonds = tree + one per ring
        np.testing.assert_array_equal(np.sort(src * n + dst), np.sort(dst * n + src))  # both directions
    assert set(int(g["y"]) for g in graphs) == {0, 1, 2, 3}


def test_adjacency_and_edge_features_follow_each_edge(rng):
    """The batch's adjacency (a CSR index, no sort) with edge features as weights equals a dense sum over the
    original edges; with remaining self loops it goes through the general device builder."""
    graphs = _graphs(rng, [4, 0, 3])
    for g in graphs:
        g["edge_attr"] = rng.standard_normal((g["edge_index"].shape[1], 2))
    (batch,) = _batches(jg.GraphLoader(graphs, 3, budget=jg.GraphBudget(10, 30, 3)))
    expected, offset = np.zeros((10, 10)), 0
    for g in graphs:
        np.add.at(expected, (g["edge_index"][1] + offset, g["edge_index"][0] + offset), g["edge_attr"][:, 0])
        offset += g["x"].shape[0]
    ct = rng.standard_normal((10, 2)).astype(np.float32)
    for with_transpose in (True, False, None):  # (None: no column order, the dataset's degrees are small)
        A = batch.adjacency(batch.edge_attr[:, 0], with_transpose=with_transpose)
        assert (A.transposed is not None) == bool(with_transpose)
        np.testing.assert_allclose(A.todense(), expected, rtol=1e-6, atol=1e-6)
        (grad,) = jax.vjp(lambda x, A=A: A @ x, jnp.zeros((10, 2)))[1](jnp.asarray(ct))  # (over the column order)
        np.testing.assert_allclose(grad, expected.T @ ct, rtol=1e-5, atol=1e-5)
    loops = np.where(np.diag(expected) == 0, 1.0, 0.0)
    np.testing.assert_allclose(batch.adjacency(batch.edge_attr[:, 0], self_loops=True).todense(),
                               expected + np.diag(loops), rtol=1e-6, atol=1e-6)  # (padding nodes too: harmless)

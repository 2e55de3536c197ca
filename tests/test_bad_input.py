"""Bad and edge inputs on the public API, as a new user passes them: each gets the right answer (an empty result
where one makes sense, checked against NumPy) or an error from the function the user called, naming the argument,
what it got and what it needs, before JAX's internals see the input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch_geometric.nn.conv.gcn_conv import gcn_norm as pyg_gcn_norm

import jinsum
from jinsum.graphs import GraphLoader, adjacency, batch_graphs, gcn_norm
from jinsum import sequence_mask
from jinsum.nn import HeteroLinear, MoE, route_tokens


# --- Zero tokens, rows and graphs: empty results -------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6)])
def test_moe_takes_zero_tokens(shape):
    moe = MoE(6, 8, num_experts=4, top_k=2, rngs=nnx.Rngs(0))
    y, aux_loss = moe(jnp.zeros(shape))
    assert y.shape == shape and float(aux_loss) == 0.0
    y, aux_loss = nnx.jit(lambda m, x: m(x))(moe, jnp.zeros(shape))
    assert y.shape == shape and float(aux_loss) == 0.0
    grads = nnx.grad(lambda m, x: m(x)[0].sum() + m(x)[1])(moe, jnp.zeros(shape))
    assert not np.asarray(grads.w_up[...]).any() and not np.asarray(grads.router.kernel[...]).any()


def test_route_tokens_with_zero_tokens_has_zero_losses():
    routing = route_tokens(jnp.zeros((0, 4)), 2)
    assert routing.experts.shape == (0, 2) and routing.combine.shape == (4, 0)
    assert float(routing.balance_loss) == 0.0 and float(routing.z_loss) == 0.0


def test_hetero_linear_takes_zero_rows():
    layer = HeteroLinear(5, 3, num_types=3, rngs=nnx.Rngs(0))
    x, types = jnp.zeros((0, 5)), jnp.zeros((0,), jnp.int32)
    assert layer(x, types).shape == (0, 3)
    assert nnx.jit(lambda m, x, t: m(x, t))(layer, x, types).shape == (0, 3)
    assert jax.grad(lambda x: layer(x, types).sum())(x).shape == (0, 5)


def test_batch_graphs_of_no_graphs_is_empty():
    A, batch = batch_graphs([], [])
    assert A.shape == (0, 0) and A.nnz == 0 and batch.shape == (0,)
    A, batch = batch_graphs([np.zeros((2, 0))], [3])  # a graph without edges (NumPy's float default for empty)
    np.testing.assert_array_equal(A.todense(), np.zeros((3, 3)))
    np.testing.assert_array_equal(batch, [0, 0, 0])


# --- Sizes that are not positive ints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, error, message", [
    ((0, 8, 4, 2), ValueError, "MoE: in_features must be an int >= 1, got 0"),
    ((6, 0, 4, 2), ValueError, "MoE: hidden_features must be an int >= 1, got 0"),
    ((6, 8, 2.5, 2), TypeError, "MoE: num_experts must be an int, got 2.5"),
    ((6, 8, 0, 2), ValueError, "MoE: num_experts must be an int >= 1, got 0"),
    ((6, 8, 4, 5), ValueError, r"MoE: top_k must be an int in \[1, num_experts = 4\], got 5"),
    ((True, 8, 4, 2), TypeError, "MoE: in_features must be an int, got True"),
])
def test_moe_sizes(args, error, message):
    in_features, hidden, experts, top_k = args
    with pytest.raises(error, match=message):
        MoE(in_features, hidden, num_experts=experts, top_k=top_k, rngs=nnx.Rngs(0))


def test_route_tokens_group_size_names_route_tokens():
    with pytest.raises(ValueError, match=r"^route_tokens: group_size \(or None for automatic\) must be an int >= 1, "
                                         "got 0"):
        route_tokens(jnp.zeros((5, 4)), 2, group_size=0)


@pytest.mark.parametrize("length, block, window, error, message", [
    (64, 0, None, ValueError, "block must be an int >= 1, got 0"),
    (0, 16, None, ValueError, "length must be an int >= 1, got 0"),
    (64, 16.0, None, TypeError, "block must be an int, got 16.0"),
    (64, 16, 0, ValueError, r"window \(or None for no window\) must be an int >= 1, got 0"),
])
def test_sequence_mask_sizes(length, block, window, error, message):
    with pytest.raises(error, match=rf"^jinsum.sequence_mask: {message}"):
        sequence_mask(length, block, document_ids=jnp.zeros(max(length, 1), jnp.int32)[:length], window=window)


def test_batch_graphs_node_counts_and_edges():
    with pytest.raises(TypeError, match=r"batch_graphs: num_nodes\[0\] must be an int, got 2.5"):
        batch_graphs([np.zeros((2, 1), np.int64)], [2.5])
    with pytest.raises(ValueError, match=r"batch_graphs: graph 0's edge index must be an integer array of shape "
                                         r"\(2, E\), got float64\[2, 1\]"):
        batch_graphs([np.zeros((2, 1))], [3])


# --- Graph data: a field that does not match its graph ---------------------------------------------------------------

def _graph(edge_index, edge_attr=None, nodes=3):
    graph = dict(x=np.ones((nodes, 2), np.float32), edge_index=np.asarray(edge_index))
    if edge_attr is not None:
        graph["edge_attr"] = edge_attr
    return graph


@pytest.mark.parametrize("edge_attr, edges", [(np.ones((1, 1), np.float32), 3), (np.ones((5, 1), np.float32), 3)])
def test_graph_loader_edge_attr_rows(edge_attr, edges):
    graphs = [_graph([[0, 1], [1, 2]]), _graph([[0, 1, 2], [1, 2, 0]], edge_attr)]
    graphs[0]["edge_attr"] = np.ones((2, 1), np.float32)
    with pytest.raises(ValueError, match=rf"jinsum.graphs: graph 1's edge_attr has shape \({edge_attr.shape[0]}, "
                                         rf"1\), expected one row per edge: \({edges}, ...\) for its {edges} edges"):
        GraphLoader(graphs, 1)


def test_graph_loader_float_edge_index():
    with pytest.raises(ValueError, match=r"graph 0's edge_index must be an integer array of shape \(2, e\), got "
                                         r"float32\[2, 3\]"):
        GraphLoader([_graph([[0.7, 1.2, 2.9], [1, 2, 0]])], 1)


def test_graph_loader_edge_attr_too_long_is_refused():
    with pytest.raises(ValueError, match=r"graph 0's edge_attr has shape \(5, 1\), expected one row per edge: "
                                         r"\(2, ...\) for its 2 edges"):
        GraphLoader([_graph([[0, 1], [1, 2]], np.ones((5, 1), np.float32))], 1)


def test_gcn_norm_propagates_nan_weights_as_pyg():
    edge_index = np.array([[0, 1, 2, 3, 4, 5, 2], [1, 2, 3, 4, 5, 0, 2]])
    weights = np.ones(7, np.float32)
    weights[2] = np.nan  # the edge 2 -> 3: node 3's degree, and so its row and column, are NaN
    for improved in (False, True):
        ours = np.asarray(gcn_norm(edge_index, 6, values=weights, improved=improved).todense())
        index, values = pyg_gcn_norm(torch.tensor(edge_index), torch.tensor(weights), 6, improved=improved)
        reference = np.zeros((6, 6))
        np.add.at(reference, (index[1].numpy(), index[0].numpy()), values.numpy())
        np.testing.assert_array_equal(np.isnan(ours), np.isnan(reference))
        np.testing.assert_allclose(np.nan_to_num(ours), np.nan_to_num(reference), rtol=1e-6)
    assert np.isnan(ours[3, 3])  # its self loop too


def test_graph_errors_name_the_function_called():
    edge_index = np.array([[0, 1, 2], [1, 2, 0]])
    with pytest.raises(ValueError, match=r"^jinsum.graphs.gcn_norm: edge_index must be an integer array"):
        gcn_norm(edge_index.astype(float), 3)
    with pytest.raises(ValueError, match=r"^jinsum.graphs.gcn_norm: values must have shape \(E, \*dense_shape\) "
                                         "with E = 3 edges, got"):
        gcn_norm(edge_index, 3, values=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"^jinsum.graphs.gcn_norm: values must be edge weights of shape \(E,\)"):
        gcn_norm(edge_index, 3, values=np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match=r"^jinsum.graphs.adjacency: edge_index\[0, 2\] = 2 is out of range"):
        adjacency(edge_index, 2)
    with pytest.raises(TypeError, match=r"^jinsum.graphs.adjacency: num_nodes must be an int, got 2.5"):
        adjacency(edge_index, 2.5)


# --- Masks and attention -----------------------------------------------------------------------------------------

def test_attention_refuses_a_mask_mod_that_reads_the_head_without_heads(rng):
    q = jnp.asarray(rng.standard_normal((2, 64, 2, 8)), jnp.float32)
    mask = jinsum.block_mask(lambda b, h, i, j: (i >= j) | (h == 1), 64, 64, 16)
    assert mask.reads == {"h"}
    with pytest.raises(ValueError, match=r"^jinsum.attention: the block mask's mask_mod <lambda> reads h \(the head\), "
                                         r"but the mask was built with heads=None, one mask for every head, and q of "
                                         r"shape \(64, 2, 8\) has 2 heads: each would get the blocks of head 0; build "
                                         r"it with jinsum.block_mask\(..., heads=2\)"):
        jinsum.attention(q[0], q[0], q[0], mask)
    assert jinsum.attention(q[0, :, :1], q[0, :, :1], q[0, :, :1], mask).shape == (64, 1, 8)  # one head: h is 0
    mask = jinsum.block_mask(lambda b, h, i, j: (i >= j) | (b == 1), 64, 64, 16)
    with pytest.raises(ValueError, match=r"reads b \(the batch element\), but the mask was built with batch=None, one "
                                         r"mask for every batch element, and q of shape \(2, 64, 2, 8\) has 2 batch "
                                         r"elements: .* batch=2\)"):
        jinsum.attention(q, q, q, mask)


def test_block_mask_per_head_gives_the_intended_mask(rng):
    """The fix the error names: built with heads=, each head gets its own blocks (the float64 dense reference)."""
    L, H, D = 64, 2, 8
    q, k, v = (rng.standard_normal((L, H, D)).astype(np.float32) for _ in range(3))
    mask = jinsum.block_mask(lambda b, h, i, j: (i >= j) | (h == 1), L, L, 16, heads=H)
    out = np.asarray(jinsum.attention(q, k, v, mask))
    allowed = np.stack([np.tril(np.ones((L, L), bool)), np.ones((L, L), bool)])  # (H, L, L)
    scores = np.einsum("ihd,jhd->hij", q.astype(np.float64), k) / np.sqrt(D)
    weights = np.exp(np.where(allowed, scores, -np.inf) - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("hij,jhd->ihd", weights, v), rtol=2e-5, atol=2e-6)


def test_mask_mod_returning_an_int_is_reported_once():
    with pytest.raises(TypeError) as error:
        jinsum.block_mask(lambda b, h, i, j: i - j, 64, 64, 16)
    message = str(error.value)
    assert message == ("jinsum.block_mask: mask_mod <lambda> must return one boolean per call (True: attend), got "
                       "int32[]")


def test_attention_refuses_integer_inputs():
    q = jnp.ones((64, 2, 8), jnp.int32)
    mask = jinsum.block_mask(lambda b, h, i, j: i >= j, 64, 64, 16)
    with pytest.raises(TypeError, match=r"^jinsum.attention: q must be float16, bfloat16, float32 or float64, got "
                                        r"int32\[64, 2, 8\]; cast it"):
        jinsum.attention(q, q, q, mask)


def test_attention_with_a_per_batch_mask_and_unbatched_q_says_what_to_pass():
    q = jnp.ones((64, 2, 8))
    mask = sequence_mask(64, 16, document_ids=jnp.zeros((2, 64), jnp.int32))
    with pytest.raises(ValueError, match=r"one mask per batch element for a batch of 2 \(jinsum.block_mask's batch=, "
                                         r"or \(B, L\) document ids in jinsum.sequence_mask\), but got q of shape "
                                         r"\(64, 2, 8\) \(no batch axis: a batch of 1\); pass q, k and v with a "
                                         "leading batch axis of 2"):
        jinsum.attention(q, q, q, mask)

"""Bad and edge inputs on the formats, the einsum front end, sampling, sharding, routing and the switches, as a new
user passes them: each gets the right answer (an empty result where one makes sense, checked against NumPy) or an
error from the function the user called, naming the argument, what it got and what it needs, before JAX's internals
see the input. Traced inputs under `jinsum.check_indices` give a `checkify` error instead."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.experimental import checkify
from jax.sharding import Mesh

import jinsum
import jinsum.shard as sh
from jinsum import BlockGroupCOO, GroupCOO
from jinsum.graphs import adjacency
from jinsum.nn import expert_parallel_mlp, route_tokens
from jinsum.sampling import CSRGraph, hop_sizes, sample_neighbors

SPMM = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"
EDGES = np.array([[0, 1, 2, 2, 3, 4], [1, 2, 0, 1, 4, 0]])


def _mesh() -> Mesh:
    if len(jax.devices()) < 4:  # (conftest.py gives a CPU 4 devices; a machine of one GPU has 1)
        pytest.skip("needs 4 devices")
    return jax.make_mesh((4,), ("x",))


# --- einsum: a format's shape against the dense operands -----------------------------------------------------------

def test_einsum_refuses_a_format_with_more_columns_than_b_has_rows():
    with pytest.raises(ValueError, match=r"^jinsum: A= \(a GroupCOO of shape \(1, 3\)\) has 3 columns, addressed by "
                                         r"Ak in B\[Ak\[g,p\],n\], but dimension 0 of B \(shape \(2, 1\)\) has only 2; "
                                         r"pass B with at least 3"):
        jinsum.einsum(SPMM, C=np.zeros((1, 1), np.float32), A=GroupCOO.from_dense(np.ones((1, 3), np.float32)),
                      B=np.ones((2, 1), np.float32))


def test_einsum_refuses_a_format_with_more_rows_than_c():
    with pytest.raises(ValueError, match=r"A= \(a GroupCOO of shape \(2, 1\)\) has 2 rows, addressed by Ai in "
                                         r"C\[Ai\[g\],n\], but dimension 0 of C \(shape \(1, 1\)\) has only 1"):
        jinsum.einsum(SPMM, C=np.zeros((1, 1), np.float32), A=GroupCOO.from_dense(np.ones((2, 1), np.float32)),
                      B=np.ones((1, 1), np.float32))


def test_einsum_checks_a_traced_formats_shape_and_a_block_formats_grid():
    spmm = jax.jit(lambda A, B: jinsum.einsum(SPMM, C=jnp.zeros((1, 1)), A=A, B=B))
    with pytest.raises(ValueError, match=r"has 3 columns, addressed by Ak .* has only 2"):
        spmm(GroupCOO.from_dense(np.ones((1, 3), np.float32)), jnp.ones((2, 1)))
    A = BlockGroupCOO.from_dense(np.ones((4, 6), np.float32), block_shape=(2, 2))  # a grid of 2 x 3 blocks
    with pytest.raises(ValueError, match=r"has 3 block columns, addressed by Ak .* dimension 0 of B \(shape \(2, 2, "
                                         r"1\)\) has only 2"):
        jinsum.einsum("C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]", C=jnp.zeros((2, 2, 1)), A=A,
                      B=jnp.ones((2, 2, 1)))


def test_einsum_takes_dense_operands_larger_than_the_format():
    A = np.array([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]], np.float32)
    B, C = np.arange(8.0, dtype=np.float32).reshape(4, 2), np.ones((3, 2), np.float32)  # a row more than A's
    out = jinsum.einsum(SPMM, C=C, A=GroupCOO.from_dense(A), B=B)
    expected = C.copy()
    expected[:2] += A @ B[:3]
    np.testing.assert_allclose(out, expected)


@pytest.mark.parametrize("subscripts, message", [
    ("ik,kn->iz", r"^jinsum: 'ik,kn->iz': output index 'z' appears in no operand's subscripts"),
    ("ik,kn->inn", r"^jinsum: 'ik,kn->inn': output index 'n' appears more than once in the output"),
])
def test_einsum_subscripts_naming_no_or_a_repeated_output_axis(subscripts, message):
    with pytest.raises(ValueError, match=message):
        jinsum.einsum(subscripts, GroupCOO.from_dense(np.eye(2, dtype=np.float32)), np.ones((2, 2), np.float32))


def test_einsum_scalar_output_of_a_format_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"^jinsum: 'ik,kn->' has a scalar output"):
        jinsum.einsum("ik,kn->", GroupCOO.from_dense(np.eye(2, dtype=np.float32)), np.ones((2, 2), np.float32))
    assert float(jinsum.einsum("ij,ij->", np.ones((2, 2)), np.ones((2, 2)))) == 4.0  # (dense operands: NumPy's)


# --- from_csr / from_neighbors: index values --------------------------------------------------------------------

@pytest.mark.parametrize("indptr, indices, message", [
    ([0, 2], [0, 7], r"^GroupCOO.from_csr: indices\[1\] = 7 is out of range: expected a column < num_columns = 3, "
                     r"or a negative one \(padding\)"),
    ([0, 3, 2], [0, 1, 2], r"^GroupCOO.from_csr: indptr\[2\] = 2 is below the one before it: indptr must be "
                           r"non-decreasing row starts in \[0, 3\], got \[0, 3, 2\]"),
    ([0, 2, 9], [0, 1, 2], r"^GroupCOO.from_csr: indptr\[2\] = 9 is outside \[0, len\(indices\) = 3\]"),
    ([-1, 2], [0, 1, 2], r"^GroupCOO.from_csr: indptr\[0\] = -1 is outside \[0, len\(indices\) = 3\]"),
])
def test_from_csr_refuses_bad_concrete_indices(indptr, indices, message):
    with pytest.raises(ValueError, match=message):
        GroupCOO.from_csr(np.array(indptr), np.array(indices), num_columns=3)


def test_from_csr_reads_int64_values_before_narrowing_them():
    with pytest.raises(ValueError, match=r"indptr\[1\] = 8589934592 is outside"):
        GroupCOO.from_csr(np.array([0, 2 ** 33]), np.array([0, 1]), num_columns=3)


def test_from_neighbors_refuses_a_source_past_num_sources():
    with pytest.raises(ValueError, match=r"^GroupCOO.from_neighbors: neighbors\[0, 0\] = 5 is out of range: expected a "
                                         r"source id < num_sources = 3, or a negative one \(padding\)"):
        GroupCOO.from_neighbors(np.array([[5]]), num_sources=3)
    dense = GroupCOO.from_neighbors(np.array([[2, -1]]), num_sources=3, with_transpose=False).todense()  # (padding)
    np.testing.assert_array_equal(dense, [[0, 0, 1]])


@pytest.mark.parametrize("indptr, indices, message", [
    ([0, 3, 2], [0, 1, 2], "indptr must be non-decreasing row starts in [0, len(indices) = 3]"),
    ([0, 2, 9], [0, 1, 2], "indptr must be non-decreasing row starts in [0, len(indices) = 3]"),
    ([0, 2, 3], [0, 7, 1], "indices holds a column past num_columns = 3"),
])
def test_from_csr_under_jit_is_checked_under_check_indices(indptr, indices, message):
    build = checkify.checkify(jax.jit(lambda p, i: GroupCOO.from_csr(p, i, num_columns=3).todense()))
    with jinsum.check_indices(True):
        error, _ = build(np.array(indptr), np.array(indices))
        assert message in error.get()
        error, dense = build(np.array([0, 2, 3]), np.array([0, 1, 2]))
    assert error.get() is None
    np.testing.assert_array_equal(dense, [[1, 1, 0], [0, 0, 1]])


# --- Zero sizes: empty results ---------------------------------------------------------------------------------

def test_from_edge_index_with_a_capacity_and_zero_nodes_is_empty():
    padding = -np.ones((2, 2), np.int32)
    A = GroupCOO.from_edge_index(padding, num_nodes=0, capacity=2)
    assert A.shape == (0, 0) and A.todense().shape == (0, 0)
    assert (A @ np.ones((0, 3), np.float32)).shape == (0, 3)
    dense = jax.jit(lambda e: GroupCOO.from_edge_index(e, num_nodes=0, capacity=2).todense())(padding)
    assert dense.shape == (0, 0)


def test_from_neighbors_with_zero_fanout_has_no_entries():
    A = GroupCOO.from_neighbors(np.zeros((3, 0), np.int32), num_sources=3)
    assert A.shape == (3, 3) and A.group_size == 0
    np.testing.assert_array_equal(A.todense(), np.zeros((3, 3)))
    x = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    np.testing.assert_array_equal(A @ x, np.zeros((3, 2)))
    np.testing.assert_array_equal(jax.grad(lambda x: (A @ x).sum())(x), np.zeros((3, 2)))


# --- The converters -------------------------------------------------------------------------------------------

def test_complex_values_are_refused_not_cast():
    with pytest.raises(TypeError, match=r"^GroupCOO.from_scipy: complex values are not supported, got complex128"):
        GroupCOO.from_scipy(sp.csr_matrix(np.array([[1 + 2j]])))
    with pytest.raises(TypeError, match=r"^BlockGroupCOO.from_dense: complex values are not supported"):
        BlockGroupCOO.from_dense(np.array([[1 + 2j]]), block_shape=(1, 1))


def test_default_group_size_refuses_negative_row_lengths():
    with pytest.raises(ValueError, match=r"^default_group_size: row_lengths must be >= 0 \(stored entries per row\), "
                                         r"got row_lengths\[0\] = -3"):
        jinsum.default_group_size(np.array([-3, 2]))


def test_from_edge_index_num_nodes_must_be_an_int_or_a_pair():
    with pytest.raises(ValueError, match=r"^GroupCOO.from_edge_index: num_nodes must be an int or a pair \(N_src, "
                                         r"N_dst\), got \(3, 3, 3\)"):
        GroupCOO.from_edge_index(np.array([[0], [1]]), num_nodes=(3, 3, 3))


# --- The switches -------------------------------------------------------------------------------------------------

def test_switches_take_only_bools():
    with pytest.raises(TypeError, match=r"^jinsum.check_indices takes a bool \(True or False\), got 'false'"):
        with jinsum.check_indices("false"):
            pass
    with pytest.raises(TypeError, match=r"^jinsum.deterministic takes a bool \(True or False\), got 2"):
        with jinsum.deterministic(2):
            pass
    with jinsum.deterministic(np.bool_(True)):
        assert jinsum.deterministic.value is True
    assert jinsum.deterministic.value is False


# --- Routing: any integer top_k ---------------------------------------------------------------------------------

def test_route_tokens_takes_a_numpy_integer_top_k():
    logits = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    routing = jax.jit(route_tokens, static_argnums=1)(logits, np.int64(2))
    experts = np.argsort(-logits, axis=1)[:, :2]
    top = np.exp(np.take_along_axis(logits, experts, axis=1))
    np.testing.assert_array_equal(routing.experts, experts)
    np.testing.assert_allclose(routing.weights, top / top.sum(axis=1, keepdims=True), rtol=1e-6)
    with pytest.raises(TypeError, match=r"^route_tokens: top_k must be an int, got 2.5"):
        route_tokens(logits, 2.5)


def test_expert_parallel_mlp_takes_a_numpy_integer_top_k():
    # (top_k passes as 2 does, so the next check, of x against the logits, is the one to fail; a whole expert-parallel
    # call compiles for half a minute on a CPU)
    with pytest.raises(ValueError, match=r"^expert_parallel_mlp: expected x of shape \(tokens, features\) with "
                                         r"tokens = 8"):
        expert_parallel_mlp(np.ones((7, 3), np.float32), np.ones((8, 4), np.float32), np.int64(2),
                            np.ones((4, 3, 5), np.float32), np.ones((4, 5, 3), np.float32), mesh=_mesh(), axis="x")


# --- Sampling -------------------------------------------------------------------------------------------------

def _sample(graph, seeds, fanouts):
    """`sample_neighbors` under jit: one compile, where an eager call compiles each of its operations."""
    return jax.jit(lambda seeds: sample_neighbors(graph, seeds, fanouts, jax.random.key(0)))(seeds)


def test_sampling_a_graph_without_edges_gives_padding():
    sample = _sample(CSRGraph.from_edge_index(np.zeros((2, 0), int), 5), np.array([0, 1]), (2,))
    np.testing.assert_array_equal(sample.node_ids, [0, 1, -1, -1, -1, -1])
    np.testing.assert_array_equal(sample.adjacencies[0].todense(), np.zeros((2, 6)))
    empty = _sample(CSRGraph.from_edge_index(np.zeros((2, 0), int), 0), np.array([-1]), (2,))
    np.testing.assert_array_equal(empty.node_ids, [-1, -1, -1])


def test_a_hop_of_fanout_zero_adds_no_neighbors():
    sample = _sample(CSRGraph.from_edge_index(EDGES, 5), np.array([0, 1]), (0,))
    assert sample.sizes == tuple(reversed(hop_sizes(2, (0,)))) == (2, 2)
    np.testing.assert_array_equal(sample.node_ids, [0, 1])
    np.testing.assert_array_equal(sample.adjacencies[0].todense(), np.zeros((2, 2)))


@pytest.mark.parametrize("x", [jnp.arange(3.0)[:, None], np.ones((3, 2), np.float32)])
def test_sample_inputs_need_one_row_per_node(x):
    sample = _sample(CSRGraph.from_edge_index(EDGES, 5), np.array([0, 1]), (2,))
    with pytest.raises(ValueError, match=r"^NeighborSample.inputs: x must be the graph's feature table, one row per "
                                         r"node \(num_nodes = 5, \.\.\.\), got shape \(3, "):
        sample.inputs(x)
    features = np.arange(10.0).reshape(5, 2)
    x_src, _ = sample.inputs(features)
    np.testing.assert_array_equal(x_src, features[np.maximum(np.asarray(sample.node_ids), 0)])


@pytest.mark.parametrize("batch_size, fanouts, error, message", [
    (2.5, (2,), TypeError, r"^hop_sizes: batch_size must be an int, got 2.5"),
    (-1, (2,), ValueError, r"^hop_sizes: batch_size must be an int >= 0, got -1"),
    (2, (None,), TypeError, r"^hop_sizes: fanout must be an int, got None"),
    (2, (-2,), ValueError, r"^hop_sizes: fanout must be an int >= 0, got -2"),
    (2, 2, TypeError, r"^hop_sizes: fanouts must be a sequence of ints"),
])
def test_hop_sizes_checks_its_sizes(batch_size, fanouts, error, message):
    with pytest.raises(error, match=message):
        hop_sizes(batch_size, fanouts)


def test_hop_sizes_takes_numpy_integers():
    sizes = hop_sizes(np.int64(2), (np.int64(3),))
    assert sizes == (2, 8) and all(type(n) is int for n in sizes)  # (static sizes: Python ints)


@pytest.mark.parametrize("graph, fanouts, key, options, error, message", [
    ("csr", 2, "key", {}, TypeError, r"^sample_neighbors: fanouts must be a sequence of ints, the neighbors per node "
                                     r"at each hop \(e.g. \(10, 5\)\), got 2"),
    (np.array([[0], [1]]), (2,), "key", {}, TypeError, r"^sample_neighbors: graph must be a CSRGraph "
                                                       r"\(CSRGraph.from_edge_index\(edge_index, num_nodes\)\), got "
                                                       r"ndarray"),
    ("csr", (2,), 0, {}, TypeError, r"^sample_neighbors: key must be a jax.random key \(jax.random.key\(seed\)\), "
                                    r"got 0"),
    ("csr", (2,), "key", {"with_transpose": 1}, ValueError, r"^sample_neighbors: with_transpose must be a bool or one "
                                                             r"bool per layer \(1, outermost first\), got 1"),
])
def test_sample_neighbors_checks_its_arguments(graph, fanouts, key, options, error, message):
    graph = CSRGraph.from_edge_index(EDGES, 5) if isinstance(graph, str) else graph
    key = jax.random.key(0) if isinstance(key, str) else key
    with pytest.raises(error, match=message):
        sample_neighbors(graph, np.array([0]), fanouts, key, **options)


def test_sample_neighbors_takes_a_legacy_key_and_a_numpy_bool():
    graph = CSRGraph.from_edge_index(EDGES, 5)
    sample = jax.jit(lambda seeds: sample_neighbors(graph, seeds, (2,), jax.random.PRNGKey(0),
                                                    with_transpose=np.bool_(True)))(np.array([0]))
    assert sample.adjacencies[0].transposed is not None


# --- Sharding -------------------------------------------------------------------------------------------------

def _partitioned(**options):
    return sh.partition(adjacency(np.array([[0, 1], [1, 2]]), 8), _mesh(), **options)


def test_partition_refuses_an_overflowed_format():
    overflowed = jax.jit(lambda e: GroupCOO.from_edge_index(e, num_nodes=8, capacity=1))(np.array([[0, 1, 2],
                                                                                                   [1, 2, 3]]))
    with pytest.raises(ValueError, match=r"^jinsum.shard.partition: the GroupCOO overflowed: it was built under jit "
                                         r"with room for 1 distinct entries"):
        sh.partition(overflowed, _mesh())


def test_shard_attention_refuses_a_plain_format():
    with pytest.raises(TypeError, match=r"^jinsum.shard.attention: expected a jinsum.shard.Partitioned "
                                        r"\(jinsum.shard.partition\(A, mesh\)\), got GroupCOO; for a GroupCOO on one "
                                        r"device use jinsum.attention"):
        sh.attention(*[np.ones((8, 1, 4), np.float32)] * 3, adjacency(np.array([[0, 1], [1, 2]]), 8))


def test_shard_matmul_of_integer_features_is_the_float_product():
    P = _partitioned()
    x = np.arange(16, dtype=np.int32).reshape(8, 2)
    y = P.unshard_rows(P @ P.shard_rows(x))
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, adjacency(np.array([[0, 1], [1, 2]]), 8).todense() @ x)


def test_partitioned_with_values_needs_one_array_per_remote_matrix():
    P = _partitioned()
    with pytest.raises(ValueError, match=rf"^Partitioned.with_values: expected one values array per remote matrix "
                                         rf"\(one per piece of the exchange: {len(P.remote)}\), got 0"):
        P.with_values(np.ones(3), ())


def test_partition_takes_numpy_integer_chunks():
    assert repr(_partitioned(exchange="halo", chunks=np.int64(2))) == repr(_partitioned(exchange="halo", chunks=2))


@pytest.mark.parametrize("call, message", [
    (lambda P: sh.communication(3), r"^jinsum.shard.communication: fn must be callable \(called as fn\(\*args\)\), "
                                    r"got int"),
    (lambda P: sh.einsum(3, P), r"^jinsum.shard.einsum: subscripts must be a string of NumPy subscripts \(e.g. "
                                r"'ik,kn->in'\), got int"),
    (lambda P: sh.per_part(3, P, columns=(P.shard_rows(np.ones((8, 1), np.float32)),)),
     r"^jinsum.shard.per_part: fn must be callable \(fn\(part, \*arrays, out=None\)\), got int"),
])
def test_shard_functions_check_their_callables_and_subscripts(call, message):
    P = _partitioned()
    with pytest.raises(TypeError, match=message):
        call(P)

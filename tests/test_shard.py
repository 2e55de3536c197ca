"""`jinsum.shard`: every product over a partitioned matrix, and its gradient, equals the single-device result.

Runs on up to 4 devices (on a CPU, `conftest.py` makes XLA pretend to have 4), on graphs with empty rows, a hub row
whose entries come from every device, an empty part, and duplicate columns; references are float64 NumPy (dense
products) and the same call on the whole matrix.
"""

import functools

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import jinsum
import jinsum.graphs as jg
import jinsum.nn as jnn
import jinsum.shard
from jinsum.formats import GroupCOO

pytestmark = pytest.mark.filterwarnings("ignore::jinsum.FallbackWarning")

DEVICES = jax.devices()[:4]
# The fused attention's float64 kernels on a GPU agree with the XLA lowering to ~3e-7 (tests/test_gpu_attention.py).
ATTENTION_ATOL = 1e-6 if jax.default_backend() == "gpu" else 1e-10


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def mesh(count: int = len(DEVICES)) -> Mesh:
    if count > len(DEVICES):  # (a machine of one GPU)
        pytest.skip(f"needs {count} devices, {len(DEVICES)} visible")
    return Mesh(np.array(DEVICES[:count]), ("x",))


def graph(rng, n: int = 41, edges: int = 160, *, duplicates: bool = False) -> GroupCOO:
    """A weighted adjacency with a hub (row 3 reads from everywhere), empty rows, and optionally duplicate
    columns in a row (stored twice, as a GroupCOO may hold them)."""
    src, dst = rng.integers(0, n, (2, edges))
    dst[:40] = 3
    dst[dst >= n - 6] = 0  # the last rows are empty
    A = GroupCOO.from_edge_index(np.stack([src, dst]), rng.uniform(0.5, 1.5, edges), num_nodes=n, dtype=np.float64)
    if duplicates:  # every slot of the first group again, in a group of its own (same row, same columns)
        A = GroupCOO(jnp.concatenate([A.Ai[:1], A.Ai]), jnp.concatenate([A.Ak[:1], A.Ak]),
                     jnp.concatenate([A.Av[:1], A.Av]), A.shape)
    return A.with_transpose()


def dense(A: GroupCOO) -> np.ndarray:
    out = np.zeros(A.shape)
    np.add.at(out, (np.repeat(np.asarray(A.Ai), A.group_size), np.asarray(A.Ak).ravel()),
              np.asarray(A.Av).reshape(-1, *A.dense_shape))
    return out


SPLITS = [("dealt", "halo"), ("contiguous", "halo"), ("dealt", "all_gather"), ("contiguous", "all_gather")]


# -- the partition ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["dealt", "contiguous"])
def test_layout_places_every_row_once_and_balances(rng, split):
    A = graph(rng, n=203, edges=900)
    P = jinsum.shard.partition(A, mesh(), split=split)
    positions = P.layout.positions()
    assert len(set(positions.tolist())) == A.shape[0]
    assert positions.max() < P.padded_rows
    counts = P.layout.rows_per_device(P.num_parts)
    assert sum(counts) == A.shape[0]
    if split == "dealt":
        assert max(counts) - min(counts) <= 1
    else:  # ranges in order
        assert np.all(np.diff(P.layout.owner) >= 0)
    x = rng.standard_normal((A.shape[0], 3))
    np.testing.assert_array_equal(P.unshard_rows(P.shard_rows(x)), x)
    assert P.shard_rows(x).sharding.spec == P.sharding.spec


def test_halo_plan_moves_only_the_rows_read(rng):
    A = graph(rng, n=120, edges=300)
    P = jinsum.shard.partition(A, mesh(), split="dealt", exchange="halo")
    owner = P.layout.owner
    rows, cols = np.nonzero(dense(A))
    for d in range(P.num_parts):
        read = cols[owner[rows] == d]
        assert P.plan.needed[d] == np.unique(read[owner[read] != d]).size
    assert P.plan.received_rows == sum(P.plan.shift_rows) <= (P.num_parts - 1) * P.layout.rows_per_part
    assert jinsum.shard.partition(A, mesh(), exchange="auto").plan.received_rows <= P.plan.received_rows


# -- products ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split,exchange", SPLITS)
@pytest.mark.parametrize("duplicates", [False, True])
def test_spmm_and_gradient_equal_one_device(rng, split, exchange, duplicates):
    A = graph(rng, duplicates=duplicates)
    P = jinsum.shard.partition(A, mesh(), split=split, exchange=exchange)
    x = rng.standard_normal((A.shape[0], 5))
    xs = P.shard_rows(x)

    def loss(x, P):
        return jnp.sum(jnp.sin(P @ x) * P.shard_rows(np.arange(A.shape[0] * 5.0).reshape(-1, 5) / 100))

    def reference(x):
        return jnp.sum(jnp.sin(A @ x) * np.arange(A.shape[0] * 5.0).reshape(-1, 5) / 100)

    out, grad = jax.jit(lambda P, x: (P @ x, jax.grad(loss)(x, P)))(P, xs)  # (one compiled program for both)
    assert out.sharding.spec == P.sharding.spec  # row-sharded like the input: the next layer needs no resharding
    np.testing.assert_allclose(P.unshard_rows(out), dense(A) @ x, rtol=1e-12, atol=1e-12)
    assert grad.sharding.spec == P.sharding.spec
    np.testing.assert_allclose(P.unshard_rows(grad), jax.jit(jax.grad(reference))(x), rtol=1e-12, atol=1e-12)
    if (split, exchange, duplicates) == ("dealt", "halo", True):  # (numerical derivatives: slow, so once)
        jax.test_util.check_grads(jax.jit(lambda x: loss(x, P)), (xs,), order=1, modes=["fwd", "rev"])


@pytest.mark.parametrize("split", ["dealt", "contiguous"])
def test_two_devices(rng, split):
    """Two devices: one shift, each device's halo is every row the other reads from it."""
    A = graph(rng, duplicates=True)
    P = jinsum.shard.partition(A, mesh(2), split=split, exchange="halo")
    assert P.plan.shift_rows == (max(P.plan.needed),)
    x = rng.standard_normal((A.shape[0], 5))
    out, grad = jax.jit(lambda x: (P @ x, jax.grad(lambda x: jnp.sum(jnp.sin(P @ x)))(x)))(P.shard_rows(x))
    np.testing.assert_allclose(P.unshard_rows(out), dense(A) @ x, atol=1e-12)
    reference = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(A @ x))))(x)
    np.testing.assert_allclose(P.unshard_rows(grad), reference, atol=1e-12)


@pytest.mark.parametrize("devices,chunks,n,edges", [(3, 2, 41, 160), (2, 7, 12, 60)])
def test_chunked_exchange_equals_one_device(rng, devices, chunks, n, edges):
    """Each shift's rows in chunks (7: more chunks than the at most 6 rows of a shift of 12 rows over 2 devices, so
    some pieces are empty; a small graph, as every piece is one more remote matrix to compile): the same products,
    gradients and bytes moved as in one piece a shift."""
    A = graph(rng, n=n, edges=edges, duplicates=True)
    whole = jinsum.shard.partition(A, mesh(devices), split="dealt", exchange="halo")
    P = jinsum.shard.partition(A, mesh(devices), split="dealt", chunks=chunks)
    pieces = (devices - 1) * chunks  # (a remote matrix per piece: shift after shift, each cut in chunks)
    assert P.plan.exchange == "halo" and len(P.remote) == pieces and f"in {chunks} chunks" in repr(P)
    assert len(whole.remote) == devices - 1
    if chunks > 2:  # (more chunks than rows in every shift: empty pieces)
        assert chunks > max(whole.plan.shift_rows)
    assert sum(P.plan.columns) == P.plan.received_rows == whole.plan.received_rows
    piece, column = P.plan.received_at()  # every row received has one place in one piece
    assert len({(m, k) for m, k in zip(piece.tolist(), column.tolist())}) == P.plan.received_rows
    x = rng.standard_normal((A.shape[0], 5))
    xs = P.shard_rows(x)
    assert jinsum.shard.communication(lambda x: P @ x, xs) == jinsum.shard.communication(lambda x: whole @ x, xs)
    q, k = rng.standard_normal((A.shape[0], 4)), rng.standard_normal((A.shape[0], 4))
    qkv = [rng.standard_normal((A.shape[0], 2, 3)) for _ in range(3)]

    @jax.jit  # (the products, the gradient, the SDDMM and attention in one compiled program: each piece's remote
    def ours(xs, q, k, qkv):  # matrix compiles in every one of them)
        # An SDDMM keeps one matrix per piece; attention merges every piece's keys.
        S = jinsum.shard.einsum("ik,in,kn->ik", P, P.shard_rows(q), P.shard_rows(k))
        out, vjp = jax.vjp(lambda x: P @ x, xs)  # (the product and its gradient: one product traced)
        return (out, vjp(jnp.cos(out))[0], S, S @ xs,
                jinsum.shard.attention(*map(P.shard_rows, qkv), P, self_loops=True))

    @jax.jit
    def theirs(x, qkv):
        return jax.grad(lambda x: jnp.sum(jnp.sin(A @ x)))(x), jinsum.attention(*qkv, A, self_loops=True)

    out, grad, S, sddmm, attention = ours(xs, q, k, qkv)
    grad_reference, attention_reference = theirs(x, qkv)
    np.testing.assert_allclose(P.unshard_rows(out), dense(A) @ x, atol=1e-12)
    np.testing.assert_allclose(P.unshard_rows(grad), grad_reference, atol=1e-12)
    assert len(S.remote) == pieces
    np.testing.assert_allclose(P.unshard_rows(sddmm), (dense(A) * (q @ k.T)) @ x, atol=1e-12)
    np.testing.assert_allclose(P.unshard_rows(attention), attention_reference, atol=ATTENTION_ATOL)


def test_rows_sent_by_piece_and_their_cotangents_in_one_array(rng):
    """The gather of the rows each piece sends (`jinsum.shard._send`), piece after piece from what the piece before
    passed on: the rows, derivatives both ways, vmap over the features or over the indices equal to a loop, and
    reverse mode adds every piece into one array (one array of zeros, not one per piece)."""
    from jinsum.shard._send import send_rows  # noqa: PLC0415 (internal: the exchange's gather)

    x = rng.standard_normal((9, 2, 3))
    send = jnp.asarray([0, 2, 2, 5, 1, 4, 8, 3, 8], jnp.int32)  # sorted in each piece, padding repeats a row
    pieces = ((0, 4), (4, 3), (7, 2))

    def sent(x, send):
        out = []
        for start, count in pieces:
            rows, x = send_rows(x, send, start, count)
            out.append(rows)
        return out

    for ours, (start, count) in zip(jax.jit(sent)(x, send), pieces):
        np.testing.assert_array_equal(ours, x[np.asarray(send[start:start + count])])

    def loss(x):
        return sum(jnp.sum(jnp.sin(rows) * (k + 1)) for k, rows in enumerate(sent(x, send)))

    jax.test_util.check_grads(jax.jit(loss), (x,), order=1, modes=["fwd", "rev"])
    zeros = [e for e in jax.make_jaxpr(jax.grad(loss))(x).eqns
             if e.primitive.name == "broadcast_in_dim" and e.outvars[0].aval.shape == x.shape]
    assert len(zeros) == 1
    batched = rng.standard_normal((4, 9, 2, 3))
    for ours, (start, count) in zip(jax.vmap(lambda x: sent(x, send))(batched), pieces):
        np.testing.assert_array_equal(ours, batched[:, np.asarray(send[start:start + count])])
    sends = jnp.stack([send, jnp.asarray([1, 1, 3, 7, 0, 2, 6, 4, 5], jnp.int32)])
    for ours, (start, count) in zip(jax.vmap(lambda s: sent(x, s))(sends), pieces):
        np.testing.assert_array_equal(ours, np.stack([x[np.asarray(s[start:start + count])] for s in sends]))


def test_attention_dropout_over_several_remote_matrices(rng):
    """Dropout over the local and every piece's remote matrix (one a shift): the same seed draws the same masks,
    another seed others, and over many seeds the mean is the result without dropout (inverted dropout keeps the
    expectation)."""
    A = graph(rng)
    P = jinsum.shard.partition(A, mesh(), split="dealt", exchange="halo")
    assert len(P.remote) == P.num_parts - 1
    n = A.shape[0]
    q, k = rng.standard_normal((n, 1, 2)), rng.standard_normal((n, 1, 2))
    v = 1 + 0.1 * rng.standard_normal((n, 1, 1))
    q, k, v = map(P.shard_rows, (q, k, v))
    attend = jax.jit(lambda seed: jinsum.shard.attention(q, k, v, P, dropout=0.5, seed=seed))
    draws = np.stack([P.unshard_rows(attend(jax.random.key(s))) for s in range(200)])
    np.testing.assert_array_equal(draws[0], P.unshard_rows(attend(jax.random.key(0))))
    assert not np.allclose(draws[0], draws[1])
    rows = dense(A).sum(1) != 0
    expected = P.unshard_rows(jinsum.shard.attention(q, k, v, P))
    np.testing.assert_allclose(draws.mean(0)[rows], expected[rows], atol=0.15)


def test_one_device_and_an_empty_part(rng):
    A = graph(rng, n=3, edges=5)  # fewer rows than devices: some parts own nothing
    for count in sorted({1, len(DEVICES)}):
        P = jinsum.shard.partition(A, mesh(count))
        x = rng.standard_normal((3, 2))
        np.testing.assert_allclose(P.unshard_rows(P @ P.shard_rows(x)), dense(A) @ x, atol=1e-12)


def test_row_sums_sddmm_and_multi_head(rng):
    A = graph(rng)
    P = jinsum.shard.partition(A, mesh())
    n = A.shape[0]
    q, k, v = (rng.standard_normal((n, 4)) for _ in range(3))
    heads = GroupCOO(A.Ai, A.Ak, jnp.stack([A.Av, 2 * A.Av, -A.Av], -1), (n, n, 3)).with_transpose()
    H = jinsum.shard.partition(heads, mesh())
    x = rng.standard_normal((n, 3, 2))

    def sddmm(k):  # an SDDMM: P's entries
        return jinsum.shard.einsum("ik,in,kn->ik", P, P.shard_rows(q), k)

    @jax.jit  # (every product and the gradient in one compiled program)
    def ours(k, x):
        S = sddmm(k)
        return (jinsum.shard.row_sums(P), S, S @ P.shard_rows(v),
                jax.grad(lambda k: jnp.sum((sddmm(k) @ P.shard_rows(v)) ** 2))(k),
                jinsum.shard.einsum("ikh,khf->ihf", H, x))

    sums, S, product, grad, out = ours(P.shard_rows(k), H.shard_rows(x))
    np.testing.assert_allclose(P.unshard_rows(sums), dense(A).sum(1), atol=1e-12)
    assert isinstance(S, jinsum.shard.Partitioned)
    np.testing.assert_allclose(P.unshard_rows(product), (dense(A) * (q @ k.T)) @ v, atol=1e-12)
    reference = jax.jit(jax.grad(lambda k: jnp.sum(((dense(A) * (q @ k.T)) @ v) ** 2)))(k)
    np.testing.assert_allclose(P.unshard_rows(grad), reference, atol=1e-10)
    np.testing.assert_allclose(H.unshard_rows(out), np.einsum("ikh,khf->ihf", dense(heads), x), atol=1e-12)


@pytest.mark.parametrize("exchange,devices", [("halo", 4), ("all_gather", 4), ("halo", 2)])
def test_block_format_spmm_sddmm_and_gcn(rng, exchange, devices):
    n = 42  # (not a whole number of 4-row blocks)
    mask = rng.random((n, n)) < 0.08
    mask[5] = True  # a hub block row
    B = jinsum.BlockGroupCOO.from_dense(np.where(mask, rng.uniform(0.5, 1.5, (n, n)), 0), block_shape=(4, 4),
                                        dtype=np.float64).with_transpose()
    P = jinsum.shard.partition(B, mesh(devices), exchange=exchange)
    assert P.format is jinsum.BlockGroupCOO and P.padded_rows % 4 == 0
    x, q, k = (rng.standard_normal((n, 3)) for _ in range(3))
    conv = jnn.GCNConv(3, 2, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    graphdef, state = nnx.split(conv)

    @jax.jit  # (the sharded products, the gradient and the layer in one compiled program)
    def ours(xs, q, k, state):
        S = jinsum.shard.einsum("ik,in,kn->ik", P, q, k)
        return (P @ xs, jax.grad(lambda x: jnp.sum(jnp.sin(P @ x)))(xs), S @ xs, nnx.merge(graphdef, state)(xs, P))

    @jax.jit
    def theirs(x, state):
        return B.todense(), jax.grad(lambda x: jnp.sum(jnp.sin(B @ x)))(x), nnx.merge(graphdef, state)(x, B)

    out, grad, sddmm, layer = ours(*map(P.shard_rows, (x, q, k)), state)
    dense, reference, layer_reference = (np.asarray(a) for a in theirs(x, state))
    np.testing.assert_allclose(P.unshard_rows(out), dense @ x, atol=1e-12)
    np.testing.assert_allclose(P.unshard_rows(grad), reference, atol=1e-12)
    np.testing.assert_allclose(P.unshard_rows(sddmm), (dense * (q @ k.T)) @ x, atol=1e-12)
    np.testing.assert_allclose(P.unshard_rows(layer), layer_reference, atol=1e-12)


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_extreme_aggregation_and_gradient(rng, reduction):
    A = graph(rng)
    P = jinsum.shard.partition(A, mesh())
    x = rng.standard_normal((A.shape[0], 4))

    def output_and_gradient(graph):  # (one compiled program for both)
        return jax.jit(lambda x: (jnn.aggregate_by(graph, x, reduction),
                                  jax.grad(lambda x: jnp.sum(jnn.aggregate_by(graph, x, reduction) ** 2))(x)))

    ours, grad = output_and_gradient(P)(P.shard_rows(x))
    expected, reference = output_and_gradient(A)(x)
    np.testing.assert_array_equal(P.unshard_rows(ours), expected)
    np.testing.assert_allclose(P.unshard_rows(grad), reference, atol=1e-12)


def test_attention_merges_the_parts(rng):
    A = graph(rng)
    P = jinsum.shard.partition(A, mesh())
    n = A.shape[0]
    q, k, v = rng.standard_normal((n, 2, 3)), rng.standard_normal((n, 2, 3)), rng.standard_normal((n, 2, 4))

    def ours(q, k, v):
        return jinsum.shard.attention(P.shard_rows(q), P.shard_rows(k), P.shard_rows(v), P, self_loops=True)

    def theirs(q, k, v):
        return jinsum.attention(q, k, v, A, self_loops=True)

    def output_and_gradients(f):  # (one compiled program for both, not one each; the output the gradient's)
        def loss(*a):
            out = f(*a)
            return jnp.sum(out ** 2), out

        def both(*a):
            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*a)
            return out, grads

        return jax.jit(both)

    out, grads = output_and_gradients(lambda *a: P.unshard_rows(ours(*a)))(q, k, v)
    expected, reference = output_and_gradients(theirs)(q, k, v)
    np.testing.assert_allclose(out, expected, atol=ATTENTION_ATOL)
    for g, r in zip(grads, reference):
        np.testing.assert_allclose(g, r, atol=ATTENTION_ATOL)


def test_communication_counts_the_exchange(rng):
    A = graph(rng)
    P = jinsum.shard.partition(A, mesh(max(2, len(DEVICES))), exchange="halo")
    xs = P.shard_rows(rng.standard_normal((A.shape[0], 5)))
    forward = jinsum.shard.communication(lambda x: P @ x, xs)
    assert forward == {"ppermute": P.plan.received_rows * 5 * 8}
    backward = jinsum.shard.communication(jax.grad(lambda x: jnp.sum(P @ x)), xs)
    assert backward == {"ppermute": 2 * P.plan.received_rows * 5 * 8}  # the exchange, and its transpose
    # An all_to_all: every piece but the device's own, the pieces counted over the enclosing shard_map's mesh.
    spec = jax.sharding.PartitionSpec("x")
    swap = jax.shard_map(lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True), mesh=P.mesh, in_specs=spec,
                         out_specs=spec)
    parts, rows = P.num_parts, xs.shape[0]  # (each device's rows `rows`, cut into `parts` pieces)
    received = jinsum.shard.communication(swap, jnp.zeros((parts * rows, 5)))
    assert received == {"all_to_all": (parts - 1) * rows // parts * 5 * 8}


# -- layers --------------------------------------------------------------------------------------------------------

LAYERS = {
    "GCN": lambda: jnn.GCNConv(6, 5, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "SGConv": lambda: jnn.SGConv(6, 5, K=2, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "SAGE mean": lambda: jnn.SAGEConv(6, 5, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "SAGE max+std": lambda: jnn.SAGEConv(6, 5, aggr=["max", "std"], rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "GIN": lambda: jnn.GINConv(nnx.Linear(6, 5, rngs=nnx.Rngs(0), param_dtype=jnp.float64)),
    "GraphConv max": lambda: jnn.GraphConv(6, 5, aggr="max", rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "GAT": lambda: jnn.GATConv(6, 3, heads=2, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "Transformer": lambda: jnn.TransformerConv(6, 3, heads=2, beta=True, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "EdgeConv": lambda: jnn.EdgeConv(6, 5, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    "EdgeConv nn": lambda: jnn.EdgeConv(6, 5, nn=nnx.Sequential(
        nnx.Linear(12, 7, rngs=nnx.Rngs(0), param_dtype=jnp.float64), jnp.tanh,
        nnx.Linear(7, 5, rngs=nnx.Rngs(1), param_dtype=jnp.float64)), rngs=nnx.Rngs(0)),
}


def _apply(layer, x, graph, *attr):
    """A layer on a graph (whole, or partitioned) as one compiled program (op by op, each operation compiles);
    the layer is left as it was (its arrays not moved to the devices of the call)."""
    return _applied(*nnx.split(layer), x, graph, *attr)


@functools.partial(jax.jit, static_argnums=0)
def _applied(graphdef, state, x, graph, *attr):
    return nnx.merge(graphdef, state)(x, graph, *attr)


@nnx.jit
def _output_and_gradient(layer, x, graph, mask, *attr):
    """The layer's output and the gradient (in the layer and `x`) of a loss over the rows in `mask`: one compiled
    program, not one for the output and another for the gradient; the output the gradient's, traced once)."""
    def loss(layer, x):
        out = layer(x, graph, *attr)
        return jnp.sum(jnp.where(mask[:, None], jnp.tanh(out), 0)), out

    (_, out), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
    return out, grads


@pytest.mark.parametrize("name", LAYERS)
def test_layer_on_a_partitioned_adjacency(rng, name):
    """Every layer's output and gradients on the partitioned adjacency, which this graph's `"auto"` partition
    exchanges by halo: one remote matrix a shift, so the layers whose aggregation is not a sum (maxima and deviations,
    softmax merges) fold each remote matrix, one after another, into the running result."""
    A = graph(rng)
    P = jinsum.shard.partition(A, mesh())
    if P.num_parts > 1:  # (a machine of one GPU: one part)
        assert P.plan.exchange == "halo" and len(P.remote) == P.num_parts - 1
    layer = LAYERS[name]()
    x = rng.standard_normal((A.shape[0], 6))
    atol = ATTENTION_ATOL if name in ("GAT", "Transformer") else 1e-10
    out, ours = _output_and_gradient(layer, P.shard_rows(x), P, P.row_mask)
    expected, theirs = _output_and_gradient(layer, x, A, np.ones(A.shape[0], bool))
    np.testing.assert_allclose(P.unshard_rows(out), expected, rtol=1e-10, atol=atol)
    np.testing.assert_allclose(P.unshard_rows(ours[1]), theirs[1], rtol=1e-9, atol=atol)
    for a, b in zip(jax.tree.leaves(ours[0]), jax.tree.leaves(theirs[0])):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=atol)


EDGE_LAYERS = {  # layers whose messages depend on each edge's features: (layer, takes edge features)
    "GINE": lambda: jnn.GINEConv(nnx.Linear(6, 5, rngs=nnx.Rngs(0), param_dtype=jnp.float64), edge_dim=3,
                                 in_features=6, train_eps=True, param_dtype=jnp.float64, rngs=nnx.Rngs(1)),
    "GATv2": lambda: jnn.GATv2Conv(6, 3, heads=2, edge_dim=3, param_dtype=jnp.float64, rngs=nnx.Rngs(0)),
    "GATv2 no self loops": lambda: jnn.GATv2Conv(6, 3, heads=2, edge_dim=3, add_self_loops=False,
                                                 param_dtype=jnp.float64, rngs=nnx.Rngs(0)),
    "GAT": lambda: jnn.GATConv(6, 3, heads=2, edge_dim=3, concat=False, param_dtype=jnp.float64, rngs=nnx.Rngs(0)),
}


def edge_graph(rng, n: int = 41, count: int = 170):
    """An edge index with a hub (node 3 receives from everywhere), empty rows, duplicate edges and self loops, and
    edge features."""
    src, dst = rng.integers(0, n, (2, count))
    dst[:40] = 3
    dst[dst >= n - 6] = 0
    src[40:44], dst[40:44] = [7, 7, 9, 9], [5, 5, 9, 9]  # a duplicate edge, a self loop twice
    return np.stack([src, dst]), rng.standard_normal((count, 3))


@pytest.mark.parametrize("name", EDGE_LAYERS)
def test_edge_layer_on_a_partitioned_edge_adjacency(rng, name):
    edge_index, attr = edge_graph(rng)
    n = 41
    layer = EDGE_LAYERS[name]()
    x = rng.standard_normal((n, 6))
    edges = jg.edge_list(edge_index, n)
    A = jg.edge_adjacency(edge_index, n, attr)
    reference, theirs = _output_and_gradient(layer, x, edges, np.ones(n, bool), attr)
    np.testing.assert_allclose(_apply(layer, x, A), reference, rtol=1e-10, atol=1e-10)  # the same edges, in a format
    counts = sorted({min(2, len(DEVICES)), len(DEVICES)})
    for count in counts[:-1]:
        P = jinsum.shard.partition(A, mesh(count))
        np.testing.assert_allclose(P.unshard_rows(_apply(layer, P.shard_rows(x), P)), reference, rtol=1e-10,
                                   atol=1e-10)
    P = jinsum.shard.partition(A, mesh(counts[-1]))  # (every device: the output and gradient in one program)
    out, ours = _output_and_gradient(layer, P.shard_rows(x), P, P.row_mask)
    np.testing.assert_allclose(P.unshard_rows(out), reference, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(P.unshard_rows(ours[1]), theirs[1], rtol=1e-9, atol=1e-10)
    for a, b in zip(jax.tree.leaves(ours[0]), jax.tree.leaves(theirs[0])):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)


def test_rgcn_on_a_partitioned_relational_adjacency(rng):
    n, relations = 37, 3
    src, dst = rng.integers(0, n, (2, 150))
    rel = rng.integers(0, relations, 150)
    g = jg.relational_graph(src, dst, rel, n, relations)
    P = jinsum.shard.partition(jg.relational_adjacency(g), mesh())
    for aggr in ("mean", "add"):
        conv = jnn.RGCNConv(4, 5, num_relations=relations, aggr=aggr, num_bases=2, rngs=nnx.Rngs(0),
                            param_dtype=jnp.float64)
        x = rng.standard_normal((n, 4))
        graphdef, state = nnx.split(conv)

        def output_and_gradient(graph):  # (one compiled program for both)
            def apply(x, state):
                return nnx.merge(graphdef, state)(x, graph)
            def loss(x, state):
                return jnp.sum(jnp.tanh(apply(x, state)))
            return jax.jit(lambda x, state: (apply(x, state), jax.grad(loss)(x, state)))

        out, grad = output_and_gradient(P)(P.shard_rows(x), state)
        expected, reference = output_and_gradient(g)(x, state)
        np.testing.assert_allclose(P.unshard_rows(out), expected, atol=1e-12)
        np.testing.assert_allclose(P.unshard_rows(grad), reference, atol=1e-12)


def test_gcn_training_matches_one_device(rng):
    A = graph(rng, n=90, edges=500)
    P = jinsum.shard.partition(A, mesh())
    x, y = rng.standard_normal((90, 8)), rng.integers(0, 3, 90)

    def train(graph, x, y, mask):
        model = nnx.Sequential(jnn.GCNConv(8, 16, rngs=nnx.Rngs(0), param_dtype=jnp.float64))
        head = jnn.GCNConv(16, 3, rngs=nnx.Rngs(1), param_dtype=jnp.float64)
        optimizer = nnx.Optimizer((model, head), optax.adam(0.05), wrt=nnx.Param)

        @nnx.jit
        def step(model, head, optimizer, x, y, mask, graph):
            def loss_fn(modules):
                logits = modules[1](nnx.relu(modules[0].layers[0](x, graph)), graph)
                losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
                return jnp.sum(jnp.where(mask, losses, 0)) / jnp.sum(mask)
            loss, grads = nnx.value_and_grad(loss_fn)((model, head))
            optimizer.update((model, head), grads)
            return loss

        return [float(step(model, head, optimizer, x, y, mask, graph)) for _ in range(5)]

    single = train(A, x, y, np.ones(90, bool))
    sharded = train(P, P.shard_rows(x), P.shard_rows(y), P.row_mask)
    np.testing.assert_allclose(sharded, single, rtol=1e-10)
    assert single[-1] < single[0]


# -- errors --------------------------------------------------------------------------------------------------------

def test_errors_name_the_problem(rng):
    A = graph(rng)
    with pytest.raises(ValueError, match="square"):
        jinsum.shard.partition(GroupCOO.from_dense(np.ones((3, 4))), mesh())
    with pytest.raises(ValueError, match="axis 'y' is not an axis"):
        jinsum.shard.partition(A, mesh(), axis="y")
    with pytest.raises(ValueError, match="exchange must be one of"):
        jinsum.shard.partition(A, mesh(), exchange="broadcast")
    with pytest.raises(TypeError, match="Mesh"):
        jinsum.shard.partition(A, DEVICES)
    with pytest.raises(ValueError, match="chunks=2 cuts the halo exchange"):
        jinsum.shard.partition(A, mesh(), exchange="all_gather", chunks=2)
    with pytest.raises(ValueError, match="chunks must be an int >= 1, got 0"):
        jinsum.shard.partition(A, mesh(), chunks=0)
    P = jinsum.shard.partition(A, mesh(max(2, len(DEVICES))))  # (on one device the layout is the matrix's own)
    with pytest.raises(ValueError, match=r"laid out by the partition.*shard_rows"):
        P @ jnp.ones((A.shape[0], 2))
    with pytest.raises(ValueError, match=r"laid out by the partition.*shard_rows"):
        jnn.GCNConv(2, 2, rngs=nnx.Rngs(0))(jnp.ones((A.shape[0], 2)), P)
    with pytest.raises(ValueError, match="rows"):
        P.shard_rows(np.ones((A.shape[0] + 1, 2)))

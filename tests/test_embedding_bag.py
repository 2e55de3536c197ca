"""`jinsum.nn.EmbeddingBag`, `jinsum.graphs.bags` and `embedding_bag`: every mode and reading (offsets,
`include_last_offset`, padded rows) against torch's `nn.EmbeddingBag` and a NumPy reference in float64, forward and
gradients (table and per-sample weights), with empty bags, duplicates and padding; the sparse path (the touched rows)
against the dense gradient and torch's sparse Adagrad; one compile for many batches; `GroupCOO.from_csr`; and the
errors."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import jinsum
import jinsum.graphs as jg
import jinsum.nn as jnn
from jinsum.testing import CountingJit

from conftest import ON_GPU

V, F = 13, 4
MODES = ("sum", "mean", "max")
READINGS = ("offsets", "include_last_offset", "padded")


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _bag_lists(rng, num_bags=7, longest=5):
    """Bags of ids in [0, V): bag 0 repeats an id, bags 1 and 2 are empty."""
    bags = [[int(i) for i in rng.integers(0, V, rng.integers(1, longest + 1))] for _ in range(num_bags)]
    bags[0], bags[1], bags[2] = [3, 5, 3], [], []
    return bags


def _with_padding(rng, bags, marker):
    """Each bag with `marker` (padding) inserted at random places, and empty bag 1 padding only."""
    padded = [list(b) for b in bags]
    padded[1] = [marker, marker]
    for bag in padded[3:]:
        for _ in range(rng.integers(0, 2)):
            bag.insert(int(rng.integers(0, len(bag) + 1)), marker)
    return padded


def _encode(bags, reading, marker, weights=None, trailing=0):
    """`(indices, offsets, include_last_offset, weights)` of lists of ids (and of their weights) in torch's readings:
    flat with offsets (with include_last_offset, then `trailing` lookups past the last bag, which count for nothing),
    or one padded row per bag."""
    weights = [[1.0] * len(b) for b in bags] if weights is None else weights
    if reading == "padded":
        width = max(len(b) for b in bags)
        return (np.array([b + [marker] * (width - len(b)) for b in bags]), None, False,
                np.array([w + [1.0] * (width - len(w)) for w in weights]))
    trailing = trailing if reading == "include_last_offset" else 0
    indices = np.array([i for b in bags for i in b] + [1] * trailing)
    offsets = np.cumsum([0] + [len(b) for b in bags])
    if reading == "offsets":
        offsets = offsets[:-1]
    flat_weights = np.array([x for w in weights for x in w] + [1.0] * trailing)
    return indices, offsets, reading == "include_last_offset", flat_weights


def _reference(table, bags, weights, mode, cotangent):
    """Forward and table gradient of bags of ids (padding removed) in NumPy, `weights` per lookup or None."""
    out, grad = np.zeros((len(bags), table.shape[1])), np.zeros_like(table)
    for b, ids in enumerate(bags):
        if not ids:
            continue
        w = np.ones(len(ids)) if weights is None else np.asarray(weights[b])
        if mode == "max":
            winners = np.argmax(table[ids], axis=0)  # the first maximal lookup per feature
            out[b] = table[ids].max(axis=0)
            np.add.at(grad, (np.asarray(ids)[winners], np.arange(table.shape[1])), cotangent[b])
            continue
        scale = 1 / len(ids) if mode == "mean" else 1
        out[b] = scale * (w[:, None] * table[ids]).sum(axis=0)
        np.add.at(grad, ids, scale * w[:, None] * cotangent[b])
    return out, grad


def _torch(table, indices, offsets, mode, cotangent, *, weights=None, **options):
    """torch's `nn.EmbeddingBag` in float64: output, table gradient, per-sample weights' gradient."""
    torch = pytest.importorskip("torch")
    layer = torch.nn.EmbeddingBag(*table.shape, mode=mode, **options).double()
    layer.weight.data = torch.tensor(table)
    w = None if weights is None else torch.tensor(weights, requires_grad=True)
    out = layer(torch.tensor(indices), None if offsets is None else torch.tensor(offsets), per_sample_weights=w)
    (out * torch.tensor(cotangent)).sum().backward()
    return out.detach().numpy(), layer.weight.grad.numpy(), None if w is None else w.grad.numpy()


def _jinsum(table, indices, offsets, mode, cotangent, *, weights=None, unique=False, **options):
    """`embedding_bag` under jit: output, table gradient (for unique bags the touched rows' gradient, scattered into
    the table's shape), per-sample weights' gradient."""

    @jax.jit
    def run(table, indices, offsets, weights):
        def make(weights):
            return jg.bags(indices, offsets, weights, num_embeddings=table.shape[0], unique=unique, **options)

        b = make(weights)
        out, vjp = jax.vjp(lambda rows, weights: jnn.embedding_bag(rows, make(weights), mode),
                           b.take(table) if unique else table, weights)
        grad, grad_weights = vjp(jnp.asarray(cotangent))
        return out, (b.scatter_add(jnp.zeros_like(table), grad) if unique else grad), grad_weights

    return [None if x is None else np.asarray(x) for x in run(table, indices, offsets, weights)]


# --- against torch and NumPy --------------------------------------------------------------------------------------

@pytest.mark.parametrize("unique", [False, True], ids=["dense", "unique"])
@pytest.mark.parametrize("reading", READINGS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_torch_and_numpy(mode, reading, unique, rng):
    padding_idx = 7
    bags = [[i for i in b if i != padding_idx] for b in _bag_lists(rng)]
    padded = _with_padding(rng, bags, padding_idx)
    weights = [list(rng.uniform(0.5, 2.0, len(b))) for b in padded]
    indices, offsets, last, flat_weights = _encode(padded, reading, padding_idx, weights)
    flat_weights = flat_weights if mode == "sum" else None
    table = rng.standard_normal((V, F))
    cotangent = rng.standard_normal((len(bags), F))
    options = dict(padding_idx=padding_idx, include_last_offset=last)
    actual = _jinsum(table, indices, offsets, mode, cotangent, weights=flat_weights, unique=unique, **options)
    expected = _torch(table, indices, offsets, mode, cotangent, weights=flat_weights, **options)
    for name, got, want in zip(("output", "table gradient", "weights' gradient"), actual, expected):
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)
    # The same from the lists of ids, the padding removed.
    kept = [[x for i, x in zip(b, w) if i != padding_idx] for b, w in zip(padded, weights)]
    ref_out, ref_grad = _reference(table, bags, kept if mode == "sum" else None, mode, cotangent)
    np.testing.assert_allclose(actual[0], ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(actual[1], ref_grad, rtol=1e-12, atol=1e-12)


def test_negative_ids_are_padding(rng):
    """Negative ids (the project's padding) take no part, in either reading; nor do lookups past the last offset
    with include_last_offset (torch's CPU kernel runs the last bag to the end of the input instead; its documentation
    has the last offset equal to the input's length, and there the two agree)."""
    bags = _bag_lists(rng)
    table = rng.standard_normal((V, F))
    encoded = [_encode(_with_padding(rng, bags, -1), reading, -1, trailing=2) for reading in READINGS]
    outputs = _reduce(table, [(indices, offsets) for indices, offsets, _, _ in encoded],
                      tuple(last for _, _, last, _ in encoded))
    for reading, by_mode in zip(READINGS, outputs):
        for mode, out in zip(MODES, by_mode):
            expected = _reference(table, bags, None, mode, np.zeros((len(bags), F)))[0]
            np.testing.assert_allclose(np.asarray(out), expected, atol=1e-12, err_msg=f"{reading}, {mode}")


@functools.partial(jax.jit, static_argnums=2)
def _reduce(table, readings, include_last_offsets):
    """Every mode over each reading's `(indices, offsets)`, in one compiled program (not one per case)."""
    return [[jnn.embedding_bag(table, jg.bags(indices, offsets, num_embeddings=V, include_last_offset=last), mode)
             for mode in MODES] for (indices, offsets), last in zip(readings, include_last_offsets)]


@functools.partial(jax.jit, static_argnums=4)
def _fixed_capacity_step(table, indices, offsets, cotangent, mode):
    b = jg.bags(indices, offsets, num_embeddings=V)
    out, vjp = jax.vjp(lambda t: jnn.embedding_bag(t, b, mode), table)
    return out, vjp(cotangent)[0]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_fixed_capacity_batches(data):
    """Random bags (empty ones, duplicates, -1 padding inside and after) in a flat batch of static length 24: every
    mode against NumPy, forward and table gradient, all through one compiled function."""
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=6, max_size=6).filter(lambda n: sum(n) <= 24))
    bags = [data.draw(st.lists(st.integers(-1, V - 1), min_size=n, max_size=n)) for n in lengths]
    mode = data.draw(st.sampled_from(MODES))
    indices = np.array([i for b in bags for i in b] + [-1] * (24 - sum(lengths)))
    offsets = np.cumsum([0] + lengths[:-1])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table, cotangent = rng.standard_normal((V, F)), rng.standard_normal((6, F))
    out, grad = _fixed_capacity_step(jnp.asarray(table), indices, offsets, jnp.asarray(cotangent), mode)
    ref_out, ref_grad = _reference(table, [[i for i in b if i >= 0] for b in bags], None, mode, cotangent)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-12)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, atol=1e-12)


# --- the sparse path ----------------------------------------------------------------------------------------------

def test_unique_rows_and_their_gradient_are_the_dense_gradients_rows(rng):
    indices = np.array([[4, 9, 4, -1], [11, 0, 9, 2], [-1, -1, -1, -1]])
    table = rng.standard_normal((V, F))

    @jax.jit  # (built and read in one compiled program, not op by op; the ids concrete in it, as eagerly)
    def build(table):
        b = jg.bags(indices, num_embeddings=V, unique=True)
        return b, b.take(table)

    b, taken = build(table)
    np.testing.assert_array_equal(np.asarray(b.rows), [0, 2, 4, 9, 11, V] + [V] * 6)  # sorted, then padding
    np.testing.assert_array_equal(np.asarray(taken)[:5], table[[0, 2, 4, 9, 11]])
    assert not np.asarray(taken)[5:].any()
    cotangent = rng.standard_normal((3, F))

    @jax.jit  # (every mode's gradients in one compiled program, not op by op)
    def gradients(table):
        out = []
        for mode in MODES:
            grad_rows = jax.grad(lambda rows: jnp.sum(jnn.embedding_bag(rows, b, mode) * cotangent))(b.take(table))
            dense = jax.grad(lambda t: jnp.sum(jnn.embedding_bag(t, jg.bags(indices, num_embeddings=V), mode)
                                               * cotangent))(table)
            out.append((grad_rows, dense, b.scatter_add(jnp.zeros((V, F)), grad_rows)))
        return out

    for grad_rows, dense, scattered in gradients(jnp.asarray(table)):
        np.testing.assert_allclose(np.asarray(grad_rows)[:5], np.asarray(dense)[[0, 2, 4, 9, 11]], atol=1e-12)
        assert not np.asarray(grad_rows)[5:].any()
        np.testing.assert_allclose(np.asarray(scattered), np.asarray(dense), atol=1e-12)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # (torch's, about its own sparse gradients)
def test_sparse_adagrad_matches_torch_sparse_embedding_bag(rng):
    """Three steps of `sparse_adagrad` (element-wise) on the touched rows against torch's `EmbeddingBag(sparse=True)`
    with `torch.optim.Adagrad`; the row-wise accumulator against the dense row-wise step in NumPy."""
    torch = pytest.importorskip("torch")
    table = rng.standard_normal((V, F))
    layer = torch.nn.EmbeddingBag(V, F, mode="sum", sparse=True).double()
    layer.weight.data = torch.tensor(table)
    optimizer = torch.optim.Adagrad(layer.parameters(), lr=0.1)
    ours, accumulator = jnp.asarray(table), jnp.zeros((V, F))
    rowwise, rowwise_acc, numpy_table, numpy_acc = jnp.asarray(table), jnp.zeros(V), table.copy(), np.zeros(V)
    for _ in range(3):
        indices, cotangent = rng.integers(0, V, (7, 4)), rng.standard_normal((7, F))  # 28 lookups: duplicates
        optimizer.zero_grad()
        (layer(torch.tensor(indices)) * torch.tensor(cotangent)).sum().backward()
        optimizer.step()
        ours, accumulator = _adagrad_step(ours, accumulator, indices, cotangent)
        rowwise, rowwise_acc = _adagrad_step(rowwise, rowwise_acc, indices, cotangent)
        grad = np.zeros((V, F))
        np.add.at(grad, indices, cotangent[:, None])
        numpy_acc += (grad**2).mean(axis=1)
        numpy_table -= 0.1 * grad / (np.sqrt(numpy_acc)[:, None] + 1e-10)
        np.testing.assert_allclose(np.asarray(ours), layer.weight.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(rowwise), numpy_table, rtol=1e-12, atol=1e-12)


@jax.jit
def _adagrad_step(table, accumulator, indices, cotangent):
    b = jg.bags(indices, num_embeddings=V, unique=True)
    grad = jax.grad(lambda rows: jnp.sum(jnn.embedding_bag(rows, b, "sum") * cotangent))(b.take(table))
    return jnn.sparse_adagrad(table, accumulator, b, grad, 0.1)


# --- the layer ----------------------------------------------------------------------------------------------------

def test_layer_initialises_like_embed_and_matches_torch(rng):
    layer = jnn.EmbeddingBag(V, F, mode="max", padding_idx=-2, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    embed = nnx.Embed(V, F, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    expected = np.asarray(embed.embedding[...]).copy()
    expected[V - 2] = 0  # padding_idx's row is zero, as torch's
    np.testing.assert_array_equal(np.asarray(layer.embedding[...]), expected)
    assert layer.padding_idx == V - 2
    indices, offsets, _, _ = _encode(_with_padding(rng, _bag_lists(rng), V - 2), "offsets", V - 2)
    cotangent = rng.standard_normal((7, F))

    @nnx.jit  # (the output and the gradient in one compiled program, not op by op; the ids concrete in it, as eagerly)
    def output_and_gradient(layer):
        return layer(indices, offsets), nnx.grad(lambda m: jnp.sum(m(indices, offsets) * cotangent))(layer)

    out, grads = output_and_gradient(layer)
    ref_out, ref_grad, _ = _torch(np.asarray(layer.embedding[...]), indices, offsets, "max", cotangent,
                                  padding_idx=V - 2)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(grads.embedding[...]), ref_grad, rtol=1e-12, atol=1e-12)


def test_layer_sparse_path_and_dtypes(rng):
    layer = jnn.EmbeddingBag(V, F, mode="sum", param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=nnx.Rngs(1))
    assert layer.embedding[...].dtype == jnp.bfloat16
    indices = rng.integers(0, V, (5, 3))

    @nnx.jit  # (every call in one compiled program, not op by op; the ids concrete in it, as eagerly)
    def run(layer, plain):
        b = layer.bags(indices, unique=True)
        rows = b.take(layer.embedding[...])
        return (layer(indices), plain(indices), layer(b, rows=rows), layer(b),  # (the last: rows read from the table)
                jax.grad(lambda rows: jnp.sum(layer(b, rows=rows)))(rows))

    out, plain, from_rows, from_table, grad = run(layer, jnn.EmbeddingBag(V, F, param_dtype=jnp.bfloat16,
                                                                          rngs=nnx.Rngs(1)))
    assert out.dtype == jnp.float32 and out.shape == (5, F)
    assert plain.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(from_rows), np.asarray(out), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(from_table), np.asarray(out), rtol=1e-6)
    assert grad.shape == (indices.size, F)


# --- one compile ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reading", ["offsets", "padded"])
@pytest.mark.parametrize("unique", [False, True], ids=["dense", "unique"])
def test_one_compile_for_many_batches(reading, unique, rng):
    table = jnp.asarray(rng.standard_normal((V, F)))

    @CountingJit
    def step(table, indices, offsets, weights):
        b = jg.bags(indices, offsets, weights, num_embeddings=V, unique=unique)
        rows = b.take(table) if unique else table
        return jax.value_and_grad(lambda rows: jnp.sum(jnn.embedding_bag(rows, b, "sum") ** 2))(rows)

    results = []
    for _ in range(4):
        if reading == "padded":
            indices, offsets = rng.integers(-1, V, (6, 4)), None
        else:  # 6 bags of random lengths over 20 lookups, some of them padding (-1)
            indices, offsets = rng.integers(-1, V, 20), np.sort(rng.integers(0, 21, 6))
            offsets[0] = 0
        results.append(step(table, indices, offsets, rng.uniform(size=indices.shape))[0])
    assert step.traces == 1
    assert len({float(r) for r in results}) == 4


# --- through the generated kernels -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("features", [32, 128])
@pytest.mark.parametrize("unique", [False, True], ids=["dense", "unique"])
@pytest.mark.parametrize("mode", MODES)
def test_kernels_on_gpu(mode, unique, features, rng):
    """Every statement in a generated kernel (a fallback to XLA fails the test), float32, power-law ids (hot rows
    that split across programs), against NumPy: the output and the table's gradient."""
    rows, lengths = 5000, rng.integers(0, 41, 256)
    ids = np.minimum(rng.zipf(1.3, lengths.sum()) - 1, rows - 1).astype(np.int32)
    offsets = (np.cumsum(lengths) - lengths).astype(np.int32)
    table, cotangent = rng.standard_normal((rows, features)), rng.standard_normal((256, features))
    bags = [list(ids[s:s + n]) for s, n in zip(offsets, lengths)]
    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("error", jinsum.FallbackWarning)
        out, grad, _ = _jinsum(jnp.asarray(table, jnp.float32), ids, offsets, mode, jnp.asarray(cotangent, jnp.float32),
                               unique=unique)
    ref_out, ref_grad = _reference(table, bags, None, mode, cotangent)
    np.testing.assert_allclose(out, ref_out, rtol=2e-4, atol=2e-3)
    np.testing.assert_allclose(grad, ref_grad, rtol=2e-4, atol=2e-3)


# --- GroupCOO.from_csr --------------------------------------------------------------------------------------------

def test_from_csr_keeps_every_position_and_its_column_order(rng):
    indptr = np.array([1, 4, 4, 9])  # positions 0 and 9 are outside the rows
    indices = np.array([2, 5, 5, -1, 0, 5, 3, 3, 1, 4])
    values = rng.standard_normal(10)
    dense = np.zeros((3, 6))
    for r in range(3):
        for j in range(indptr[r], indptr[r + 1]):
            if indices[j] >= 0:
                dense[r, indices[j]] += values[j]
    x = rng.standard_normal((6, 3))

    @jax.jit
    def run(indptr, indices, values, x):
        A = jinsum.GroupCOO.from_csr(indptr, indices, values, num_columns=6, group_size=2)
        return A, A.todense(), jax.grad(lambda x: jnp.sum(jnp.sin(A @ x)))(x)

    A, todense, grad = run(indptr, indices, values, x)
    np.testing.assert_allclose(np.asarray(todense), dense, atol=1e-12)
    assert A.shape == (3, 6) and A.group_size == 2 and A.transposed is not None and not A.overflow
    np.testing.assert_allclose(np.asarray(grad), dense.T @ np.cos(dense @ x), atol=1e-12)  # over the column order


# --- errors -------------------------------------------------------------------------------------------------------

def test_errors(rng):
    table = rng.standard_normal((V, F))
    flat = np.array([1, 2, 3])
    with pytest.raises(ValueError, match=r"offsets must be an integer array \(B,\).*got float64\[2\]"):
        jg.bags(flat, np.array([0.0, 1.0]), num_embeddings=V)
    with pytest.raises(ValueError, match=r"offsets must be an integer array \(B,\).*got int64\[1, 2\]"):
        jg.bags(flat, np.array([[0, 1]]), num_embeddings=V)
    with pytest.raises(ValueError, match=r"\(B \+ 1,\) with include_last_offset"):  # ([0] is 0 bags, as torch)
        jg.bags(flat, np.zeros(0, int), num_embeddings=V, include_last_offset=True)
    with pytest.raises(ValueError, match="flat indices .* need offsets"):
        jg.bags(flat, num_embeddings=V)
    with pytest.raises(ValueError, match="offsets must be None"):
        jg.bags(flat.reshape(1, 3), np.array([0]), num_embeddings=V)
    for offsets in ([1, 2], [0, 2, 1], [0, 4]):
        with pytest.raises(ValueError, match=r"offsets must start at 0 and not decrease, up to len\(indices\) = 3"):
            jg.bags(flat, np.array(offsets), num_embeddings=V)
    with pytest.raises(ValueError, match=r"indices\[1, 0\] = 13 is out of range for a table of num_embeddings = 13"):
        jg.bags(np.array([[0, 1], [13, 2]]), num_embeddings=V)
    with pytest.raises(ValueError, match="indices must be an integer array"):
        jg.bags(flat.astype(np.float32), np.array([0]), num_embeddings=V)
    with pytest.raises(ValueError, match=r"per_sample_weights must be floating with the shape of indices \(3,\), "
                                         r"got float64\[2\]"):
        jg.bags(flat, np.array([0]), np.ones(2), num_embeddings=V)
    with pytest.raises(ValueError, match=r"padding_idx must be in \[-num_embeddings, num_embeddings\)"):
        jg.bags(flat, np.array([0]), num_embeddings=V, padding_idx=V)
    # (the bags below built in one compiled program, not op by op; the ids concrete in it, as eagerly)
    weighted, plain, compact = jax.jit(lambda: (jg.bags(flat, np.array([0]), np.ones(3), num_embeddings=V),
                                                jg.bags(flat, np.array([0]), num_embeddings=V),
                                                jg.bags(flat, np.array([0]), num_embeddings=V, unique=True)))()
    for mode in ("mean", "max"):
        with pytest.raises(NotImplementedError, match=f"only supported for mode='sum' \\(got mode='{mode}'\\)"):
            jnn.embedding_bag(table, weighted, mode)
        with pytest.raises(NotImplementedError, match="per_sample_weights was not None"):
            jnn.EmbeddingBag(V, F, mode=mode, rngs=nnx.Rngs(0))(flat, np.array([0]), np.ones(3))
    with pytest.raises(ValueError, match="mode must be one of"):
        jnn.embedding_bag(table, weighted, "min")
    with pytest.raises(ValueError, match=r"expected a table \(rows, F\) of num_embeddings = 13 rows, got shape "
                                         r"\(12, 4\)"):
        jnn.embedding_bag(table[:12], plain, "sum")
    with pytest.raises(ValueError, match=r"U = 3 rows that bags built with unique=True read \(pass bags.take"):
        jnn.embedding_bag(table, compact, "sum")
    with pytest.raises(ValueError, match="build them with jinsum.graphs.bags\\(..., unique=True\\)"):
        plain.take(table)
    with pytest.raises(ValueError, match=r"expected an update of shape \(U, F\) = \(3, 4\)"):
        compact.scatter_add(table, np.ones((2, F)))
    with pytest.raises(ValueError, match=r"accumulator of shape \(num_embeddings, F\) = \(13, 4\)"):
        jnn.sparse_adagrad(table, np.zeros(F), compact, np.ones((3, F)), 0.1)


def test_ids_past_the_table_are_checkify_errors_under_jit():
    def run(indices):
        return jnn.embedding_bag(jnp.ones((V, F)), jg.bags(indices, num_embeddings=V), "sum")

    with jinsum.check_indices(True):
        error, _ = checkify.checkify(jax.jit(run))(np.array([[0, V]]))
        with pytest.raises(checkify.JaxRuntimeError, match="indices holds an id past num_embeddings = 13"):
            error.throw()
    out = jax.jit(run)(np.array([[0, V]]))  # unchecked: left out, as padding
    np.testing.assert_array_equal(np.asarray(out), np.ones((1, F)))

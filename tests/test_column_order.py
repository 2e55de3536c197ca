"""Derivatives over a format's entries in column order (`GroupCOO.with_transpose`, `ColumnOrder`, `by_columns`).

A cotangent that scatters into the format's columns (`dB = A^T dC`) runs as a sorted segment reduction over the
entries in column order instead of an atomic addition per entry. Checked against float64 dense references, the
same gradients without the order, `check_grads`, vmap, and the generated kernel in Triton's interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.test_util import check_grads

import jinsum
from jinsum._rules import _derive
from jinsum._lang import ColumnOrder, Operand, parse
from jinsum._lowering._triton import interpret
from jinsum.kernels import make_plan
from jinsum.testing import assert_allclose, check_vmap, random_operands, reference, specs_in

from conftest import ON_GPU

ORDER = ColumnOrder("Av", "Ai", "Ak", *(Operand(n, shape, np.dtype(np.int32)) for n, shape in (
    ("A_columns", (9,)), ("A_rows", (9, 2)), ("A_slots", (9, 2)))))


@pytest.mark.parametrize("statement, expected", [
    ("dB[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]", "dB[A_columns[h],n] += Av_t[h,q] * C[A_rows[h,q],n]"),  # SpMM
    ("dY[Ak[g,p],d] += Av[g,p] * X[Ai[g],d] * S[g,p]",  # SDDMM: the cotangent is read at the entries too
     "dY[A_columns[h],d] += Av_t[h,q] * X[A_rows[h,q],d] * S_t[h,q]"),
    ("dB[Ak[g,p],n,b] += Av[g,p,h] * W[g] * C[Ai[g],n,b,h]",  # dense value axes, a batch, a per-group factor
     "dB[A_columns[h_1],n,b] += Av_t[h_1,q,h] * W_t[h_1,q] * C[A_rows[h_1,q],n,b,h]"),
    ("dB[Ak[g,p],n] += C[Ai[g],n]", None),  # no values factor: unlisted (zero) entries would count
    ("dB[Ak[g,p],n] += Av[g,p] * C[n,g]", None),  # g not leading
    ("dAv[g,p] += B[Ak[g,p],n] * C[Ai[g],n]", None),  # not a scatter into the columns
    # a matrix per row contracted with the entries' rows (MoE's input gradient): a matrix per entry in column order
    ("dX[Ak[g,p],c] += Av[g,p] * dY[Ak[g,p],n] * W[Ai[g],c,n]", None),
])
def test_by_columns_rewrites_a_scatter_into_the_columns(statement, expected):
    rewritten = _derive.by_columns(parse(statement), ORDER)
    assert (None if rewritten is None else str(rewritten[0])) == expected


def _matrix(rng, shape=(37, 23), density=0.15):
    """A matrix with an empty row and column, a hub row, and a stored zero (left out of the order)."""
    dense = (rng.random(shape) < density) * rng.standard_normal(shape)
    dense[3] = 0
    dense[:, 5] = 0
    dense[7, ::2] = rng.standard_normal(dense[7, ::2].shape)
    A = jinsum.GroupCOO.from_dense(dense, group_size=4)
    A = A.with_values(A.Av.at[1, 0].set(0.0))
    return A, np.asarray(A.todense(), np.float64)


def _column_order_specs(fn, *args):
    return [s for s in specs_in(fn, *args) if s.sorted_indices == {"A_columns"}]


def test_spmm_gradient_runs_over_the_columns_and_equals_the_dense_one(rng):
    with jax.enable_x64(True):
        A, dense = _matrix(rng)
        T = A.with_transpose()
        B = jnp.asarray(rng.standard_normal((23, 6)))
        W = rng.standard_normal((37, 6))
        loss = lambda A, B: jnp.sum(jnp.sin(A @ B) * W)  # noqa: E731
        expected = dense.T @ (np.cos(dense @ np.asarray(B)) * W)
        np.testing.assert_allclose(jax.grad(loss, argnums=1)(T, B), expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(jax.grad(loss, argnums=1)(A, B), expected, rtol=1e-12, atol=1e-12)
        [spec] = _column_order_specs(jax.grad(loss, argnums=1), T, B)
        assert str(spec.statement) == "dX1[A_columns[h],n] += Av_t[h,q] * Out[A_rows[h,q],n]"
        # The forward SpMM's kernel form: narrow rows in tiles (added per group of entries), wide ones segmented
        # (each row of dB accumulated in registers and written once); not an atomic addition per entry.
        [forward] = specs_in(lambda B: T @ B, B)
        assert [(p.write, p.config.schedule) for p in map(make_plan, (spec, forward))] == [("atomic", "tile")] * 2
        wide = jnp.ones((23, 130))
        [spec] = _column_order_specs(jax.grad(lambda B: jnp.sum(T @ B)), wide)
        [forward] = specs_in(lambda B: T @ B, wide)
        assert [(p.write, p.config.schedule) for p in map(make_plan, (spec, forward))] == [("segmented", "split")] * 2
        assert not _column_order_specs(jax.grad(loss, argnums=1), A, B)
        check_grads(lambda B: T @ B, (B,), order=2, modes=("fwd", "rev"))
        check_grads(lambda v: T.with_values(v) @ B, (T.Av,), order=1, modes=("rev",))


def test_derivatives_in_column_order_keep_their_kernel_on_small_inputs(rng):
    """On CUDA a small statement runs on XLA's lowering (`jinsum.small_terms`), but not a derivative in column
    order: XLA would add each hub column's entries atomically, one after another."""
    from jinsum._lowering import _route  # noqa: PLC0415
    A, _ = _matrix(rng)
    T, B = A.with_transpose(), jnp.ones((23, 6))
    [forward] = specs_in(lambda B: T @ B, B)
    [backward] = _column_order_specs(jax.grad(lambda B: jnp.sum(T @ B)), B)
    [atomic] = [s for s in specs_in(jax.grad(lambda B: jnp.sum(A @ B)), B) if s.lhs.name != "Out"]
    assert (forward.by_columns, backward.by_columns) == (False, True)
    with jinsum.small_terms(1 << 40):
        assert (_route.small(forward), _route.small(backward)) == (True, False)
        assert not atomic.by_columns and _route.small(atomic)


def test_the_order_serves_spmv_sddmm_dense_axes_and_the_notation(rng):
    with jax.enable_x64(True):
        A, dense = _matrix(rng)
        T = A.with_transpose()
        x = jnp.asarray(rng.standard_normal(23))
        np.testing.assert_allclose(jax.grad(lambda x: jnp.sum((T @ x) ** 3))(x),
                                   dense.T @ (3 * (dense @ np.asarray(x)) ** 2), rtol=1e-12)
        X, Y = (jnp.asarray(rng.standard_normal((n, 5))) for n in (37, 23))
        sddmm = lambda Y: jnp.sum(jinsum.einsum("ij,ik,jk->ij", T, X, Y).Av ** 2)  # noqa: E731
        mask = dense != 0
        expected = (2 * (dense * (np.asarray(X) @ np.asarray(Y).T)) * dense * mask).T @ np.asarray(X)
        np.testing.assert_allclose(jax.grad(sddmm)(Y), expected, rtol=1e-10)
        assert _column_order_specs(jax.grad(sddmm), Y)

        heads = jinsum.GroupCOO.from_dense(np.stack([dense, 2 * dense], axis=-1), group_size=4).with_transpose()
        H = jnp.asarray(rng.standard_normal((23, 2, 3)))
        expected = np.einsum("ijh,ihf->jhf", np.stack([dense, 2 * dense], -1), np.ones((37, 2, 3)))
        np.testing.assert_allclose(jax.grad(lambda H: jnp.sum(jinsum.einsum("ijh,jhf->ihf", heads, H)))(H), expected,
                                   rtol=1e-12)
        assert _column_order_specs(jax.grad(lambda H: jnp.sum(jinsum.einsum("ijh,jhf->ihf", heads, H))), H)

        B = jnp.asarray(rng.standard_normal((23, 4)))
        C = jax.ShapeDtypeStruct((37, 4), B.dtype)
        notation = lambda B: jnp.sum(jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=C, A=T, B=B) ** 2)  # noqa
        np.testing.assert_allclose(jax.grad(notation)(B), 2 * dense.T @ (dense @ np.asarray(B)), rtol=1e-12)
        assert _column_order_specs(jax.grad(notation), B)


def test_vmap_keeps_the_order_for_batched_features_and_drops_it_for_batched_values(rng):
    with jax.enable_x64(True):
        A, dense = _matrix(rng)
        T = A.with_transpose()
        Bs = jnp.asarray(rng.standard_normal((3, 23, 4)))
        grad = jax.grad(lambda B: jnp.sum((T @ B) ** 2))
        check_vmap(grad, (Bs,), (0,))
        assert _column_order_specs(jax.vmap(grad), Bs)
        values = jnp.stack([T.Av, 2 * T.Av])
        per_values = lambda v, B: jax.grad(lambda B: jnp.sum((T.with_values(v) @ B) ** 2))(B)  # noqa: E731
        check_vmap(per_values, (values, Bs[0]), (0, None))
        # A batch of values may have other zeros than the order lists: its entries are no longer trusted.
        def batched_values(B, A=T):
            def with_values(v):
                return jinsum.GroupCOO.tree_unflatten((A.shape, A.nnz), (A.Ai, A.Ak, v, A.transposed, None))
            return jnp.sum(jax.vmap(lambda v: with_values(v) @ B)(values) ** 2)

        assert not _column_order_specs(jax.grad(batched_values), Bs[0])
        np.testing.assert_allclose(jax.grad(batched_values)(Bs[0]), jax.grad(batched_values)(Bs[0], A), rtol=1e-12)


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")
def test_the_column_order_kernel_runs_in_the_interpreter(rng):
    A = jinsum.GroupCOO.from_scipy(sp.random(300, 200, 0.03, random_state=2, dtype=np.float32)).with_transpose()
    B = jnp.asarray(rng.standard_normal((200, 40)).astype(np.float32))
    for spec in _column_order_specs(jax.grad(lambda B: jnp.sum((A @ B) ** 2)), B):
        operands = random_operands(spec, rng)
        assert_allclose(interpret(spec, operands), reference(str(spec.statement), **operands), np.float32)


def test_a_gcn_step_shares_each_forward_kernel_with_its_backward():
    """The transpose over the column order is the forward SpMM up to names: on an undirected graph (the transpose's
    groups as long as the rows') it runs the same compiled kernel. A two-layer GCN's gradient binds six statements
    (each layer's row sums, two SpMMs, their two transposes) and compiles three kernels."""
    from flax import nnx  # noqa: PLC0415

    import jinsum.graphs as jg  # noqa: PLC0415

    import jinsum.nn as jnn  # noqa: PLC0415
    from jinsum._lowering._route import plan_for  # noqa: PLC0415
    from jinsum._lowering._triton import _metaparameters  # noqa: PLC0415
    from jinsum.datasets import rmat  # noqa: PLC0415
    from jinsum.kernels import generate  # noqa: PLC0415

    A = jg.adjacency(rmat(9, seed=0, undirected=True), 512)
    x = jnp.ones((512, 16))
    convs = (jnn.GCNConv(16, 32, rngs=nnx.Rngs(0)), jnn.GCNConv(32, 8, rngs=nnx.Rngs(1)))
    loss = lambda x: jnp.sum(convs[1](jax.nn.relu(convs[0](x, A)), A))  # noqa: E731
    plans = [plan_for(spec) for spec in specs_in(jax.grad(loss), x)]
    kernels = {(generate(p), tuple(_metaparameters(p).items()), p.config.num_warps) for p in plans}
    assert len(plans) == 6 and len(kernels) == 3


def test_the_layers_keep_the_order_through_a_cast_of_the_values(rng):
    import jinsum.graphs as jg  # noqa: PLC0415
    from jinsum.nn._graph import aggregate  # noqa: PLC0415

    A = jg.adjacency(np.stack([rng.integers(0, 30, 90), rng.integers(0, 30, 90)]), 30)
    h = jnp.asarray(rng.standard_normal((30, 8)), jnp.bfloat16)
    assert _column_order_specs(jax.grad(lambda h: jnp.sum(aggregate(A, h).astype(jnp.float32))), h)


def test_a_malformed_column_order_is_refused_and_an_unused_one_dropped():
    from jinsum._lang import check  # noqa: PLC0415

    statement = parse("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]")
    operands = tuple(Operand(n, s, np.dtype(d)) for n, s, d in (
        ("C", (4, 3), np.float32), ("Ai", (9,), np.int32), ("Av", (9, 2), np.float32), ("B", (5, 3), np.float32),
        ("Ak", (9, 2), np.int32)))
    assert check(statement, operands, column_order=ORDER).column_order == ORDER
    bad = ColumnOrder("Av", "Ai", "Ak", ORDER.columns, ORDER.rows, Operand("A_slots", (9, 3), np.dtype(np.int32)))
    with pytest.raises(ValueError, match=r"\(H,\), \(H, Q\), \(H, Q\)"):
        check(statement, operands, column_order=bad)
    row_sums = parse("D[Ai[g]] += Av[g,p]")  # reads no column: the order is of no use, and equal Specs stay equal
    assert check(row_sums, (Operand("D", (4,), np.dtype(np.float32)), *operands[1:3]), column_order=ORDER
                 ).column_order is None


def _block_matrix(rng, dtype=np.float64):
    """75 x 60 in 16 x 16 blocks (edge blocks overhang), with an empty block row and block column."""
    mask = rng.random((5, 4)) < 0.5
    mask[2], mask[:, 1] = False, False
    dense = (np.kron(mask, np.ones((16, 16))) * rng.standard_normal((80, 64)))[:75, :60]
    return jinsum.BlockGroupCOO.from_dense(dense, block_shape=(16, 16), dtype=dtype), dense


def test_block_spmm_gradient_runs_over_the_block_columns(rng):
    """The block transpose over the column order is the forward's owned-row Tensor Core plan: fp16 stays fp16, no
    atomics (without the order: atomic, accumulated in fp32)."""
    with jax.enable_x64(True):
        A, dense = _block_matrix(rng)
        T = A.with_transpose()
        B = jnp.asarray(rng.standard_normal((60, 20)))
        W = rng.standard_normal((75, 20))
        loss = lambda A, B: jnp.sum((A @ B) * W)  # noqa: E731
        for matrix in (T, A):
            np.testing.assert_allclose(jax.grad(loss, argnums=1)(matrix, B), dense.T @ W, rtol=1e-12, atol=1e-12)
        [spec] = _column_order_specs(jax.grad(loss, argnums=1), T, B)
        assert str(spec.statement) == "dX1[A_columns[h],_k,n] += Av_t[h,q,_m,_k] * Out[A_rows[h,q],_m,n]"
        check_grads(lambda B: T @ B, (B,), order=2, modes=("fwd", "rev"))
    from jinsum._lowering._route import plan_for  # noqa: PLC0415

    half = jinsum.BlockGroupCOO.from_dense(np.kron(rng.random((8, 8)) < 0.3, np.ones((32, 32))), block_shape=(32, 32),
                                           dtype=jnp.float16)
    B = jnp.ones((256, 64), jnp.float16)
    grad = jax.grad(lambda B, A: jnp.sum((A @ B).astype(jnp.float32)))
    [spec] = _column_order_specs(grad, B, half.with_transpose())
    [atomic] = specs_in(grad, B, half)[1:]
    assert [(p.template, p.write, p.out_dtype) for p in map(plan_for, (spec, atomic))] == [
        ("dot", "segmented", np.float16), ("dot", "atomic", np.float32)]


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")
def test_the_block_column_order_kernel_runs_in_the_interpreter(rng):
    A, _ = _block_matrix(rng, np.float32)
    T = A.with_transpose()
    B = jnp.asarray(rng.standard_normal((60, 20)).astype(np.float32))
    [spec] = _column_order_specs(jax.grad(lambda B: jnp.sum((T @ B) ** 2)), B)
    operands = random_operands(spec, rng)
    assert_allclose(interpret(spec, operands), reference(str(spec.statement), **operands), np.float32)

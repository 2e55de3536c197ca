"""Deterministic mode (`jinsum.deterministic`): the switch, the sorted-scatter rewrite, and plans without atomics
for every statement of the catalog and every statement its grads and vmaps derive (checked in the generated
source, and run in Triton's interpreter against the float64 reference). Attention: test_attention.py. Bitwise
reproducibility itself is a GPU property: test_gpu_deterministic.py runs it five times there."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum._rules import _derive, _deterministic, _primitive
from jinsum._lowering import _triton
from jinsum._lowering._route import route
from jinsum._lang import parse, tensor_names
from jinsum.kernels import KernelConfig, canonical, generate, make_plan
from jinsum.testing import assert_allclose, check_vmap, kernel_specs_in, random_operands, reference, specs_in

from _catalog import CATALOG
from conftest import ON_GPU

interpreted = pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")


# --- the switch ---------------------------------------------------------------------------------------------------

def test_the_switch_is_a_jax_option_a_context_manager_and_part_of_the_jit_key():
    B = jnp.ones((3, 2))
    Ai, Ak, Av = jnp.array([0, 2], jnp.int32), jnp.array([[1, 0], [2, 2]], jnp.int32), jnp.ones((2, 2))
    traces = []

    @jax.jit
    def spmm(B):
        traces.append(jinsum.deterministic.value)
        return jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=jnp.zeros((3, 2)), Ai=Ai, Ak=Ak, Av=Av, B=B)

    assert not jinsum.deterministic.value
    spmm(B)
    with jinsum.deterministic(True):
        assert [s.deterministic for s in kernel_specs_in(spmm, B)] == [True]
        spmm(B)
    spmm(B)
    assert traces == [False, True]  # specs_in traced in the mode; spmm reused that trace, then the first one
    jax.config.update("jinsum_deterministic", True)
    try:
        assert [s.deterministic for s in kernel_specs_in(spmm, B)] == [True]
    finally:
        jax.config.update("jinsum_deterministic", False)


def test_derived_statements_keep_the_mode_of_the_forward(rng):
    """A vjp built in deterministic mode stays deterministic when it is called outside the context."""
    case = next(c for c in CATALOG if c.name == "group_spmm")
    ops = case.make(rng, np.float32)
    with jinsum.deterministic(True):
        out, vjp = jax.vjp(lambda B: jinsum.einsum(case.expression, **{**ops, "B": B}, sorted_indices=("Ai",)),
                           ops["B"])
    specs = kernel_specs_in(vjp, out)
    assert specs and all(s.deterministic for s in specs)


# --- the sorted-scatter rewrite ------------------------------------------------------------------------------------

@pytest.mark.parametrize("statement, expected", [
    ("O[R[e],f] += X[C[e],c] * W[T[e],c,f]", "O[R_sorted[h],f] += X[C[e_at[h]],c] * W[T[e_at[h]],c,f]"),
    ("dB[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]", "dB[Ak_sorted[h],n] += Av[g_at[h],p_at[h]] * C[Ai[g_at[h]],n]"),
    ("dQ[b,Ai[g],d] += S[b,g,p] * K[b,Ak[g,p],d]", "dQ[b,Ai_sorted[h],d] += S[b,g_at[h],p] * K[b,Ak[g_at[h],p],d]"),
    # a sorted segment reduction too (its targets are then already in order: positions, no sort)
    ("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", "C[Ai_sorted[h],n] += Av[g_at[h],p] * B[Ak[g_at[h],p],n]"),
    # the transpose of a sorted scatter: the target is an index read at the sorted entries
    ("dB[Col[e_at[h]],n] += V[e_at[h]] * C[R_sorted[h],n]",
     "dB[Col_sorted[h_1],n] += V[e_at[h_at[h_1]]] * C[R_sorted[h_at[h_1]],n]"),
])
def test_sorted_scatter_reads_every_operand_at_the_sorted_entries(statement, expected):
    rewritten, sorting = _derive.sorted_scatter(parse(statement))
    assert str(rewritten) == expected
    assert sorting.sorted_index == f"{sorting.target.tensor}_sorted" and str(sorting.target) in statement


@pytest.mark.parametrize("statement", [
    "O[R[e],f] = X[e,f]",  # `=`: no addition to order
    "O[R[e],S[e]] += X[e]",  # two indirections on the left
    "O[R[e,b],f,b] += X[e,f,b]",  # a batch axis of the index array on the left too
    "C[i,n] += A[i,k] * B[k,n]",  # no indirection
])
def test_sorted_scatter_does_not_apply(statement):
    assert _derive.sorted_scatter(parse(statement)) is None


@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap over the index"])
def test_scatters_through_several_indices_add_their_products_in_order(vmapped, rng):
    """`O[R[e],S[e]] += X[e]` (two indirections) and a vmap over an index array (a batch axis beside it on the
    left): products first, then a sorted scatter keyed by the flat target; out-of-range targets are dropped."""
    R = jnp.asarray(rng.integers(-1, 4, (3, 9)), jnp.int32)  # -1 and 3: out of range of O's 3 rows
    S = jnp.asarray(rng.integers(0, 2, 9), jnp.int32)
    X = jnp.asarray(rng.standard_normal(9), jnp.float32)
    scatter = lambda R: jinsum.einsum("O[R[e],S[e]] += X[e]", O=jnp.zeros((3, 2)), R=R, S=S, X=X)  # noqa: E731
    expected = np.zeros((3, 3, 2))
    for b in range(3):
        for e in range(9):
            if 0 <= R[b, e] < 3:
                expected[b, R[b, e], S[e]] += X[e]
    with jinsum.deterministic(True):
        fn = jax.vmap(scatter) if vmapped else scatter
        specs = kernel_specs_in(fn, R if vmapped else R[0])
        actual = jax.jit(fn)(R if vmapped else R[0])
    np.testing.assert_allclose(actual, expected if vmapped else expected[0], rtol=1e-6, atol=1e-6)
    assert all(not make_plan(canonical(s)).adds_atomically for s in specs)
    assert any("products" in str(s.statement) for s in specs)


@pytest.mark.parametrize("features, schedule", [(4, "tile"), (32, "tile"), (40, "owned"), (256, "owned")])
def test_narrow_rows_are_summed_as_tiles_and_wide_ones_a_row_at_a_time(features, schedule):
    """Deterministic segmented writes: narrow features take the tile schedule with its rows summed per row inside
    the program (a segmented scan, no atomics); wider ones, where the scan costs more than it saves, `owned`."""
    arrays = dict(C=np.zeros((5, features), np.float32), R=np.array([0, 0, 1, 3, 3, 3], np.int32),
                  X=np.ones((6, features), np.float32))
    spec = _primitive.make_spec(parse("C[R[h],n] += X[h,n]"), arrays, sorted_indices={"R"}, deterministic=True)
    plan = make_plan(spec)
    assert (plan.config.schedule, plan.write, plan.tiled_window) == (schedule, "segmented", schedule == "tile")
    assert not plan.adds_atomically and "atomic" not in generate(plan)
    default = make_plan(dataclasses.replace(spec, deterministic=False))
    assert default.adds_atomically  # (what deterministic mode replaces: split hub rows, atomic tiles)


def test_the_cuda_lowering_refuses_an_atomic_plan_in_deterministic_mode():
    """The rewrites leave none, so this is a guard: a deterministic spec bound as written is not run atomically."""
    arrays = dict(O=jnp.zeros((2, 2)), R=jnp.array([1, 0, 1], jnp.int32), S=jnp.array([0, 0, 1], jnp.int32),
                  X=jnp.ones(3))
    spec = _primitive.make_spec(parse("O[R[e],S[e]] += X[e]"), arrays, deterministic=True)
    assert make_plan(spec).adds_atomically
    with pytest.raises(NotImplementedError, match=r"deterministic mode: O\[R\[e\],S\[e\]\] \+= X\[e\] would add "
                                                  r"into its left-hand side atomically"):
        _triton.evaluate(route(spec, rewrite=False), list(arrays.values()))


# --- every catalog statement and what it derives --------------------------------------------------------------------

def _deterministic_specs():
    """The statements the catalog binds in deterministic mode: each forward, its grads with respect to every linear
    operand, and a vmap over its last linear operand."""
    found = {}
    rng = np.random.default_rng(0)
    with jinsum.deterministic(True):
        for case in CATALOG:
            ops = case.make(rng, np.float32)
            rows = ("Ai",) if "Ai" in ops else ()

            def loss(values, case=case, ops=ops, rows=rows):
                return jnp.sum(jinsum.einsum(case.expression, **{**ops, **values}, sorted_indices=rows) ** 2)

            for spec in kernel_specs_in(jax.grad(loss), {n: ops[n] for n in case.differentiated}):
                found.setdefault(str(spec.statement), spec)
            name = case.differentiated[-1]
            for spec in kernel_specs_in(jax.vmap(lambda x, case=case, ops=ops, name=name, rows=rows: jinsum.einsum(
                    case.expression, **{**ops, name: x}, sorted_indices=rows)), np.stack([ops[name]] * 2)):
                found.setdefault(str(spec.statement), spec)
    return list(found.values())


DETERMINISTIC = _deterministic_specs()


def test_the_catalog_sorts_its_scatters():
    statements = {str(s.statement) for s in DETERMINISTIC}
    assert "dB[Ak_sorted[h],n] += Av[g_at[h],p_at[h]] * C[Ai[g_at[h]],n]" in statements  # SpMM's transpose
    # the embedding bag's gradient: sorted by target, and (over 32 entries) summed in pieces, then per row
    assert "pieces[piece_of[h],d] += Wt[b_at[h],p_at[h]] * O[b_at[h],d]" in statements
    assert "dW[piece_rows[q],d] += pieces[q,d]" in statements
    assert "O[R_sorted[h],f] += X[C[e_at[h]],c] * W[T[e_at[h]],c,f]" in statements  # RGCN: unsorted relations
    # ... whose gradients are the transposes of the forward as written, sorted by their own targets
    assert "dW[T_sorted[h],c,f] += X[C[e_at[h]],c] * O[R[e_at[h]],f]" in statements


@pytest.mark.parametrize("spec", DETERMINISTIC, ids=lambda s: str(s.statement))
def test_deterministic_plans_add_nothing_atomically(spec):
    for config in (KernelConfig(), KernelConfig(schedule="split"), KernelConfig(schedule="tile", window=4)):
        plan = make_plan(canonical(spec), config)
        assert spec.deterministic and not plan.adds_atomically, config
        assert "atomic" not in generate(plan)


@interpreted
@pytest.mark.parametrize("spec", DETERMINISTIC, ids=lambda s: str(s.statement))
def test_deterministic_kernels_match_the_reference(spec, rng):
    pytest.importorskip("torch")
    operands = random_operands(spec, rng)
    assert_allclose(_triton.interpret(spec, operands), reference(str(spec.statement), **operands), np.float32)


@pytest.mark.parametrize("piece_groups", [2, _deterministic.PIECE_ENTRIES], ids=lambda p: f"pieces of {p}")
@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_deterministic_grads_equal_the_default_ones(case, piece_groups, rng, monkeypatch):
    monkeypatch.setattr(_deterministic, "PIECE_ENTRIES", piece_groups)
    ops = case.make(rng, np.float32)
    rows = ("Ai",) if "Ai" in ops else ()

    def loss(values):
        return jnp.sum(jnp.sin(jinsum.einsum(case.expression, **{**ops, **values}, sorted_indices=rows)))

    values = {n: ops[n] for n in case.differentiated}
    expected = jax.jit(jax.grad(loss))(values)
    with jinsum.deterministic(True):
        actual = jax.jit(jax.grad(loss))(values)
    for name in values:
        assert_allclose(actual[name], np.asarray(expected[name], np.float64), np.float32, err_msg=name)


def test_long_rows_are_summed_in_pieces_then_per_row(rng):
    """A hub row of 301 groups, empty rows, and rows out of range under jit (dropped): rows of at most
    PIECE_ENTRIES groups are summed whole, the hub in pieces, then the pieces per row."""
    rows = np.sort(np.concatenate([np.full(301, 3), rng.integers(0, 9, 60), [-1, -1, 9, 12]])).astype(np.int32)
    Ak = rng.integers(0, 7, (len(rows), 2)).astype(np.int32)
    Av = rng.standard_normal((len(rows), 2)).astype(np.float32)
    B = rng.standard_normal((7, 5)).astype(np.float32)
    spmm = jax.jit(lambda Ai: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=jnp.zeros((9, 5)), Ai=Ai,
                                            Ak=Ak, Av=Av, B=B, sorted_indices=("Ai",)))
    expected = np.zeros((9, 5))
    for g, r in enumerate(rows):
        if 0 <= r < 9:
            expected[r] += Av[g] @ B[Ak[g]]
    with jinsum.deterministic(True):
        statements = [str(s.statement) for s in kernel_specs_in(spmm, rows)]
        np.testing.assert_allclose(spmm(rows), expected, rtol=2e-5, atol=2e-5)
    assert statements == ["C[Ai_sorted[h],n] += Av[g_at[h],p] * B[Ak[g_at[h],p],n]",
                          "pieces[piece_of[h],n] += Av[g_at[h],p] * B[Ak[g_at[h],p],n]",
                          "C[piece_rows[q],n] += pieces[q,n]"]
    with jinsum.deterministic(True):  # and batched over the dense operand
        check_vmap(jax.jit(lambda B: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=jnp.zeros((9, 5)),
                                                   Ai=rows, Ak=Ak, Av=Av, B=B, sorted_indices=("Ai",))),
                   (np.stack([B, 2 * B]),), (0,))


@interpreted
@pytest.mark.parametrize("piece_entries", [4, _deterministic.PIECE_ENTRIES], ids=lambda p: f"pieces of {p}")
@pytest.mark.parametrize("statement, sorted_indices", [
    ("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", ("Ai",)), ("B[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]", ()),
    ("D[Ai[g]] += Av[g,p]", ("Ai",))], ids=["sorted rows", "scatter into columns", "no lane variable"])
def test_the_rewritten_statements_run_in_the_interpreter(statement, sorted_indices, piece_entries, rng,
                                                         monkeypatch):
    """Every kernel of the rewrite, run by Triton's interpreter on the padded lists it gets: a hub row (long, in
    pieces), empty rows and targets out of range (dropped without computing their terms)."""
    pytest.importorskip("torch")
    monkeypatch.setattr(_deterministic, "PIECE_ENTRIES", piece_entries)
    rows = np.sort(np.concatenate([np.full(75, 3), rng.integers(0, 9, 30), [-1, 9, 12]])).astype(np.int32)
    Ak = np.concatenate([rng.integers(0, 7, (len(rows) - 40, 2)), np.full((40, 2), 5)]).astype(np.int32)
    operands = dict(Ai=rows, Ak=rng.permuted(Ak, axis=0), Av=rng.standard_normal((len(rows), 2)).astype(np.float32),
                    B=rng.standard_normal((7, 4)).astype(np.float32), C=rng.standard_normal((9, 4)).astype(np.float32),
                    D=np.zeros(9, np.float32))
    operands = {n: operands[n] for n in tensor_names(parse(statement))}
    with jinsum.deterministic(True):
        [spec] = specs_in(lambda ops: jinsum.einsum(statement, **ops, sorted_indices=sorted_indices), operands)
    ran = []

    def interpret(derived, arrays):
        ran.append(derived)
        return jnp.asarray(_triton.interpret(derived, {n: np.asarray(arrays[n]) for n in derived.names}))

    actual = _deterministic.evaluate(spec, {n: jnp.asarray(operands[n]) for n in spec.names}, interpret)
    assert len(ran) == 3 and all(not make_plan(canonical(s)).adds_atomically for s in ran)
    kept = (rows >= 0) & (rows < 9)  # (the reference reads in range only: an out-of-range row adds nothing)
    in_range = {n: a[kept] if n in ("Ai", "Ak", "Av") else a for n, a in operands.items()}
    assert_allclose(actual, reference(statement, **in_range), np.float32)


def test_out_of_range_targets_are_dropped_as_before(rng):
    """Sorting puts out-of-range targets first and last; the segmented write drops them as the atomic one did."""
    R = jnp.array([3, -1, 0, 7, 0, 2], jnp.int32)
    X = jnp.arange(12.0).reshape(6, 2)
    scatter = jax.jit(lambda R, X: jinsum.einsum("O[R[e],f] += X[e,f]", O=jnp.zeros((4, 2)), R=R, X=X))
    expected = np.zeros((4, 2))
    for r, x in zip(np.asarray(R), np.asarray(X)):
        if 0 <= r < 4:
            expected[r] += x
    with jinsum.deterministic(True):
        [spec] = kernel_specs_in(scatter, R, X)
        np.testing.assert_array_equal(scatter(R, X), expected)
    assert "R_sorted" in str(spec.statement)
    if not ON_GPU:
        operands = {"O": np.zeros((4, 2), np.float32), "X": np.asarray(X, np.float32),
                    "R_sorted": np.sort(np.asarray(R)), "e_at": np.argsort(np.asarray(R), stable=True).astype(np.int32)}
        np.testing.assert_array_equal(_triton.interpret(spec, operands), expected)


def test_triton_source_shows_the_statements_a_scatter_becomes(rng):
    case = next(c for c in CATALOG if c.name == "spmm_transpose")
    ops = case.make(rng, np.float32)
    with jinsum.deterministic(True):
        source = jinsum.triton_source(case.expression, **ops)
    assert "# ---- statement: pieces[piece_of[h],n] += Av[g_at[h],p_at[h]] * C[Ai[g_at[h]],n]" in source
    assert "# ---- statement: B[piece_rows[q],n] += pieces[q,n]" in source
    assert "atomic" not in source
    assert "atomic" in jinsum.triton_source(case.expression, **ops)

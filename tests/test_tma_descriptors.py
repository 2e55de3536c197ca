"""Dot plans reading their factors' tiles through TMA descriptors (`KernelConfig.descriptors`, tried by autotune on
Hopper):
the block SpMM and SparseLinear's three statements, run in Triton's interpreter on CPU, equal the same kernels
loading by pointers and a float64 reference, with gathered indices out of range; descriptors appear exactly where a
tile is a whole box of the operand's row-major view (`jinsum.kernels.described`), and pointers stay where a box
would read a neighbour's elements. (bfloat16 is left out: Triton 3.6's interpreter computes bfloat16 tl.dot
wrongly.) On a Hopper GPU the same cases run compiled, bfloat16 included."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum import _autotune
from jinsum._frontend import _einsum
from jinsum._lowering import _launch, _route, _triton
from jinsum._lowering._triton import interpret
from jinsum._rules import _primitive
from jinsum.kernels import (KernelConfig, _tuned, canonical, described, forced_config, generate, kernel_name,
                            kernel_scratch, make_plan)
from jinsum.testing import assert_allclose, reference

from conftest import ON_GPU

interpreted = pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")

DTYPES = [np.dtype(np.float32), np.dtype(np.float16)]
SORTED = ("Ai", "Ac")


def _spec(expression, operands):
    """The checked statement (from the operands' shapes: the front end refuses indices out of range)."""
    operands = {n: np.zeros_like(a) if a.dtype == np.int32 else a for n, a in operands.items()}
    statement, arrays, flags = _einsum.prepare(expression, operands,
                                               sorted_indices=[n for n in SORTED if n in operands])
    return _primitive.make_spec(statement, arrays, **flags)


def _values(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _gathered(rng, columns, shape):
    """Indices of a gathered operand's blocks, every fifth out of range (-1, `columns`, far past): reads zeros."""
    index = rng.integers(0, columns, shape).astype(np.int32)
    index.flat[::5] = np.array([-1, columns, columns + 7], np.int32)[np.arange(index.flat[::5].size) % 3]
    return index


def _zeroed(operands, index, bound, values, dims):
    """The operands the float64 reference reads: out-of-range entries of `index` moved into range, and their terms
    zero through `values`, whose dimensions `dims` are `index`'s."""
    outside = (operands[index] < 0) | (operands[index] >= bound)
    shape = [1] * operands[values].ndim
    for axis, dim in enumerate(dims):  # (increasing)
        shape[dim] = outside.shape[axis]
    where = np.broadcast_to(outside.reshape(shape), operands[values].shape)
    return {**operands, index: np.where(outside, 0, operands[index]),
            values: np.where(where, 0, operands[values].astype(np.float64))}, where


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    expression: str
    make: Callable  # (rng, dtype) -> operands
    expected: Callable  # operands -> the float64 result
    config: KernelConfig  # tiles (`descriptors` set by the tests)
    described: dict  # dtype name -> the factors read through descriptors

    def __repr__(self):
        return self.name


BLOCK_SPMM = "C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]"


def _block_spmm(Mb, Kb, bm, bk, N, G, P):
    def make(rng, dtype):
        return dict(C=_values(rng, (Mb, bm, N), dtype), Ai=np.sort(rng.integers(0, Mb, G)).astype(np.int32),
                    Ak=_gathered(rng, Kb, (G, P)), Av=_values(rng, (G, bm, bk, P), dtype),
                    B=_values(rng, (Kb, bk, N), dtype))

    def expected(operands):
        return reference(BLOCK_SPMM, **_zeroed(operands, "Ak", Kb, "Av", (0, 3))[0])

    return make, expected


# SparseLinear's blocks (jinsum.nn._sparse_linear): the forward, dX over the entries in column order, and dW (an
# SDDMM: one dot per stored block over the batch).
FORWARD = "Y[n,Ai[g],m] += X[n,Ak[g,p],k] * Wv[g,m,k,p]"
BACKWARD_X = "dX[n,Ac[h],k] += Wt[h,q,m,k] * dY[n,Ar[h,q],m]"
BACKWARD_W = "dW[g,m,k,p] += X[n,Ak[g,p],k] * dY[n,Ai[g],m]"


def _forward(batch, Ob, Ib, b, G):
    def make(rng, dtype):
        return dict(Y=_values(rng, (batch, Ob, b), dtype), Ai=np.sort(rng.integers(0, Ob, G)).astype(np.int32),
                    Ak=_gathered(rng, Ib, (G, 1)), Wv=_values(rng, (G, b, b, 1), dtype),
                    X=_values(rng, (batch, Ib, b), dtype))

    return make, lambda operands: reference(FORWARD, **_zeroed(operands, "Ak", operands["X"].shape[1], "Wv",
                                                               (0, 3))[0])


def _backward_x(batch, Ob, Ib, b, H, Q):
    def make(rng, dtype):
        return dict(dX=_values(rng, (batch, Ib, b), dtype), Ac=np.sort(rng.integers(0, Ib, H)).astype(np.int32),
                    Ar=_gathered(rng, Ob, (H, Q)), Wt=_values(rng, (H, Q, b, b), dtype),
                    dY=_values(rng, (batch, Ob, b), dtype))

    return make, lambda operands: reference(BACKWARD_X, **_zeroed(operands, "Ar", operands["dY"].shape[1], "Wt",
                                                                  (0, 1))[0])


def _backward_w(batch, Ob, Ib, b, G):
    def make(rng, dtype):
        return dict(dW=_values(rng, (G, b, b, 1), dtype), Ai=np.sort(rng.integers(0, Ob, G)).astype(np.int32),
                    Ak=_gathered(rng, Ib, (G, 1)), X=_values(rng, (batch, Ib, b), dtype),
                    dY=_values(rng, (batch, Ob, b), dtype))

    def expected(operands):  # (an out-of-range block keeps its value: its terms are all zero)
        zeroed, where = _zeroed(operands, "Ak", Ib, "dW", (0, 3))
        return np.where(where, operands["dW"], reference(BACKWARD_W, **{**zeroed, "dW": operands["dW"]}))

    return make, expected


TILES = KernelConfig(block_m=16, block_n=32, block_k=16)
BOTH = {"float32": {"Av", "B"}, "float16": {"Av", "B"}}
CASES = [
    # Slots of two blocks: the block values' tile is no box (its columns are strided by the slots), B's is; the
    # last column tile crosses N = 24, the view's own edge (TMA's zeros).
    Case("block_spmm", BLOCK_SPMM, *_block_spmm(Mb=4, Kb=3, bm=16, bk=16, N=24, G=6, P=2), TILES,
         {"float32": {"B"}, "float16": {"B"}}),
    Case("block_spmm_one_slot", BLOCK_SPMM, *_block_spmm(Mb=3, Kb=3, bm=32, bk=16, N=32, G=5, P=1), TILES, BOTH),
    # k tiles of 16 over blocks of 24 columns: B's box would read the next block's rows (pointers); the values'
    # box ends at the view's own edge.
    Case("block_spmm_odd_k", BLOCK_SPMM, *_block_spmm(Mb=3, Kb=3, bm=16, bk=24, N=32, G=5, P=1), TILES,
         {"float32": {"Av"}, "float16": {"Av"}}),
    # 24-row blocks in 16-row tiles: the values' box would read the next block (pointers), B's too.
    Case("block_spmm_odd_m_k", BLOCK_SPMM, *_block_spmm(Mb=3, Kb=3, bm=24, bk=24, N=32, G=5, P=1), TILES,
         {"float32": set(), "float16": set()}),
    # Rows of B of 20 elements: 80 bytes in float32, 40 in float16 (TMA wants multiples of 16 bytes).
    Case("block_spmm_narrow", BLOCK_SPMM, *_block_spmm(Mb=3, Kb=3, bm=16, bk=16, N=20, G=5, P=2), TILES,
         {"float32": {"B"}, "float16": set()}),
    # A batch of 40 in tiles of 32: the batch is the view's first axis (TMA's zeros past it).
    Case("sparse_linear_forward", FORWARD, *_forward(batch=40, Ob=3, Ib=4, b=32, G=5),
         KernelConfig(block_m=32, block_n=32, block_k=16), {"float32": {"X", "Wv"}, "float16": {"X", "Wv"}}),
    Case("sparse_linear_dx", BACKWARD_X, *_backward_x(batch=40, Ob=4, Ib=3, b=32, H=5, Q=1),
         KernelConfig(block_m=32, block_n=32, block_k=16), {"float32": {"Wt", "dY"}, "float16": {"Wt", "dY"}}),
    Case("sparse_linear_dw", BACKWARD_W, *_backward_w(batch=40, Ob=3, Ib=4, b=16, G=4),
         KernelConfig(block_m=16, block_n=16, block_k=16), {"float32": {"X", "dY"}, "float16": {"X", "dY"}}),
    # The batch cut into chunks whose programs add atomically (a long batch's default), and windows of groups
    # (`owned`): the boxes follow the loops.
    Case("sparse_linear_dw_chunks", BACKWARD_W, *_backward_w(batch=40, Ob=3, Ib=4, b=16, G=4),
         KernelConfig(block_m=16, block_n=16, block_k=16, k_chunks=3), {"float32": {"X", "dY"},
                                                                         "float16": {"X", "dY"}}),
    Case("block_spmm_owned", BLOCK_SPMM, *_block_spmm(Mb=4, Kb=3, bm=16, bk=16, N=32, G=7, P=1),
         KernelConfig(block_m=16, block_n=16, block_k=16, schedule="owned", window=2), BOTH),
]


def _described_names(spec, config):
    """The factors of `spec` (by their names) that its kernel reads through descriptors."""
    plan = make_plan(canonical(spec), config)
    names = dict(zip(plan.spec.names, spec.names))
    factors = plan.spec.statement.factors
    return {names[factors[plan.dot.a if role == "a" else plan.dot.b].tensor] for role in described(plan)}, plan


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_descriptor_loads_equal_pointer_loads_and_the_reference(case, dtype, rng):
    pytest.importorskip("torch")
    operands = case.make(rng, dtype)
    spec = _spec(case.expression, operands)
    config = dataclasses.replace(case.config, descriptors=True)
    names, plan = _described_names(spec, config)
    assert names == case.described[dtype.name]
    source = generate(plan)
    assert source.count("tl.make_tensor_descriptor(") == len(names) == source.count(".load([")
    assert (f"def {kernel_name(plan)}(" in source) and (kernel_name(plan).endswith("_tma") == bool(names))
    assert (", scratch, " in source) == bool(names) and kernel_scratch(plan) == 128 * len(names)
    for name, tensor in zip(spec.names, plan.spec.names):  # the other factors load by pointers
        if name not in names and name in {f.tensor for f in spec.statement.factors}:
            assert f"tl.load(p_{tensor} + " in source
    pointers = interpret(spec, operands, dataclasses.replace(config, descriptors=False))
    actual = interpret(spec, operands, config)
    np.testing.assert_array_equal(actual, pointers)
    assert_allclose(actual, case.expected(operands), dtype)


def test_descriptors_only_for_dot_plans(rng):
    """A lanes plan (an element SpMM) ignores the switch: the same source as without it."""
    operands = dict(C=_values(rng, (9, 8), np.float32), Ai=np.sort(rng.integers(0, 9, 12)).astype(np.int32),
                    Ak=rng.integers(0, 7, (12, 3)).astype(np.int32), Av=_values(rng, (12, 3), np.float32),
                    B=_values(rng, (7, 8), np.float32))
    spec = canonical(_spec("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", operands))
    plan = make_plan(spec, KernelConfig(descriptors=True))
    assert plan.template == "lanes" and not described(plan)
    assert generate(plan) == generate(make_plan(spec, KernelConfig()))


@interpreted
def test_statement_kernels_launch_with_their_name_and_scratch(rng):
    pytest.importorskip("torch")
    case = CASES[1]
    operands = case.make(rng, np.float32)
    spec = _spec(case.expression, operands)
    calls = []

    def call(kernel, *args, **options):
        shown = {k: options[k] for k in ("name", "global_scratch") if k in options}
        calls.append(dict(kernel=kernel.__name__, **shown))
        return _launch.INTERPRETER.call(kernel, *args, **options)

    launcher = _launch.Launcher("recording", np, call)
    for descriptors, expected in ((True, dict(kernel="jinsum_dot_segmented_tma", name="jinsum_dot_segmented_tma",
                                              global_scratch=256)),
                                  (False, dict(kernel="jinsum_dot_segmented", name="jinsum"))):
        found = _route.route(spec, config=dataclasses.replace(case.config, descriptors=descriptors), rewrite=False)
        env = dict(zip(found.plan.spec.names, (operands[n] for n in spec.names)))
        _triton.run(found, env, launcher)
        assert calls.pop() == expected


@interpreted
def test_statements_read_tiles_by_pointers_unless_tuned_to_descriptors(rng, monkeypatch):
    """Descriptors lost on SparseLinear's 32 x 32 blocks on an H200 (DESIGN.md, "Measured and not kept"): the default
    reads tiles by pointers on any device; `jinsum.autotune` tries descriptors too where the GPU has TMA, and a stored
    or forced configuration keeps its own value."""
    operands = CASES[1].make(rng, np.float16)
    operands["Ak"] = np.clip(operands["Ak"], 0, 2)
    spec = _spec(BLOCK_SPMM, operands)
    monkeypatch.setattr(_tuned, "has_tma", lambda: True)
    assert _tuned.tuned_config(spec) is None
    assert "tl.make_tensor_descriptor(" not in jinsum.triton_source(BLOCK_SPMM, sorted_indices=("Ai",), **operands)
    monkeypatch.setattr(_autotune, "has_tma", lambda: True)
    tried = _autotune.candidate_configs(spec)
    assert {c.descriptors for c in tried} == {False, True} and not tried[0].descriptors
    monkeypatch.setattr(_autotune, "has_tma", lambda: False)
    assert not any(c.descriptors for c in _autotune.candidate_configs(spec))
    with forced_config(KernelConfig(descriptors=True)):
        assert "tl.make_tensor_descriptor(" in jinsum.triton_source(BLOCK_SPMM, sorted_indices=("Ai",), **operands)
    monkeypatch.setattr(_tuned, "_stored", lambda: {_tuned._key(spec): {"block_n": 64, "descriptors": True}})
    assert _tuned.tuned_config(spec) == KernelConfig(block_n=64, descriptors=True)


@pytest.mark.skipif(not (ON_GPU and _tuned.has_tma()), reason="TMA descriptors need a Hopper (or later) GPU")
@pytest.mark.parametrize("dtype", [np.dtype(jnp.bfloat16), *DTYPES], ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_on_hopper_descriptor_loads_equal_pointer_loads(case, dtype, rng):
    operands = case.make(rng, dtype)
    sorted_rows = [n for n in SORTED if n in operands]
    results = []
    for descriptors in (True, False):
        config = dataclasses.replace(case.config, descriptors=descriptors)
        clipped = {n: np.zeros_like(a) if a.dtype == np.int32 else a for n, a in operands.items()}
        source = jinsum.triton_source(case.expression, config=config, sorted_indices=sorted_rows, **clipped)
        expected_names = case.described["float16" if dtype.itemsize == 2 else "float32"]
        assert ("tl.make_tensor_descriptor(" in source) == (descriptors and bool(expected_names))
        with forced_config(config):  # (a new function: traced and lowered inside)
            run = jax.jit(lambda ops: jinsum.einsum(case.expression, sorted_indices=sorted_rows, **ops))
            results.append(np.asarray(run({n: jnp.asarray(a) for n, a in operands.items()}), np.float64))
    expected = case.expected(operands)
    assert_allclose(results[0], expected, dtype, err_msg="descriptors")
    assert_allclose(results[1], expected, dtype, err_msg="pointers")

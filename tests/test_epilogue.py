"""Statement epilogues (`jinsum.einsum(..., epilogue=fn)`): the function applied to every element of the result, with
the arrays it captures, against a float64 NumPy reference: through the XLA lowering, through every kernel that
fuses it (Triton's interpreter on CPU), under `grad` (`check_grads`, captured arrays included), `vmap` (against a
loop) and `jit` (new captured values compile nothing)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jinsum
from jinsum._frontend import _einsum
from jinsum._lang import _elementwise, epilogue_names
from jinsum._lowering._triton import interpret
from jinsum._rules import _primitive
from jinsum.kernels import KernelConfig, generate, make_plan
from jinsum.testing import CountingJit, assert_allclose, reference

from _catalog import CATALOG
from conftest import ON_GPU

CASES = {c.name: c for c in CATALOG}


def _epilogue(operands, expression):
    """The float64 reference of a nonlinear epilogue capturing a bias (indexed by the last position), a row scale
    (by the first) and a residual of the output's shape (`_bound`), and those arrays."""
    shape = np.shape(operands[expression.split("[")[0].strip()])
    rng = np.random.default_rng(7)
    bias = rng.standard_normal(shape[-1])
    scale = rng.random(shape[0]) + 0.5
    residual = rng.standard_normal(shape)

    def expected(result):
        rows = scale.reshape((-1,) + (1,) * (len(shape) - 1))
        return np.tanh(result * rows + bias) + residual

    return expected, (bias, scale, residual)


def _bound(captured):
    """The epilogue over the captured arrays as float32 jax arrays (closures over jax arrays, as users write)."""
    bias, scale, residual = (jnp.asarray(c, jnp.float32) for c in captured)

    def bound(value, *position):
        return jnp.tanh(value * scale[position[0]] + bias[position[-1]]) + residual[position]

    return bound


def _spec(expression, operands, epilogue, given_lhs=True):
    sorted_rows = ("Ai",) if "Ai" in operands else ()
    named = dict(operands)
    lhs = expression.split("[")[0].strip()
    if not given_lhs:
        named[lhs] = jax.ShapeDtypeStruct(np.shape(operands[lhs]), operands[lhs].dtype)
    statement, arrays, flags = _einsum.prepare(expression, named, sorted_indices=sorted_rows)
    traced, captured = _elementwise.trace(epilogue, "epilogue", "test", len(statement.lhs.indices))
    arrays.update(zip(epilogue_names(len(captured)), captured))
    spec = _primitive.make_spec(statement, arrays, epilogue=traced, **flags)
    return spec, {name: np.asarray(a) for name, a in arrays.items()}


# (The empty one launches no kernel; the transpose writes atomically and fuses nothing: see below.)
FUSING = ["group_spmm", "group_spmm_empty", "block_spmm", "block_spmm_tiles", "sddmm", "block_sddmm", "ell",
          "embedding_bag", "multihead_spmm", "spmm_transpose"]


@pytest.mark.parametrize("given_lhs", [True, False], ids=["into C", "into zeros"])
@pytest.mark.parametrize("name", FUSING)
def test_xla_lowering_applies_the_epilogue_to_every_element(name, given_lhs, rng):
    case = CASES[name]
    operands = case.make(rng, np.float32)
    lhs = case.expression.split("[")[0].strip()
    if not given_lhs:
        operands[lhs] = np.zeros_like(operands[lhs])
    expected, captured = _epilogue(operands, case.expression)
    named = dict(operands)
    if not given_lhs:
        named[lhs] = jax.ShapeDtypeStruct(operands[lhs].shape, operands[lhs].dtype)
    sorted_rows = ("Ai",) if "Ai" in operands else ()
    out = jinsum.einsum(case.expression, sorted_indices=sorted_rows, epilogue=_bound(captured), **named)
    assert out.dtype == np.float32
    assert_allclose(out, expected(reference(case.expression, **operands)), np.float32)


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")
@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig(block=4, block_rows=2, window=3, block_m=16,
                                                                   block_n=16, block_k=16, num_stages=2)],
                         ids=["default", "stress"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)], ids=str)
@pytest.mark.parametrize("given_lhs", [True, False], ids=["into C", "into zeros"])
@pytest.mark.parametrize("name", [n for n in FUSING if n not in ("group_spmm_empty", "spmm_transpose")])
def test_kernels_fuse_the_epilogue(name, given_lhs, dtype, config, rng):
    pytest.importorskip("torch")
    case = CASES[name]
    operands = case.make(rng, dtype)
    lhs = case.expression.split("[")[0].strip()
    if not given_lhs:
        operands[lhs] = np.zeros_like(operands[lhs])
    expected, captured = _epilogue(operands, case.expression)
    spec, arrays = _spec(case.expression, operands, _bound(captured), given_lhs)
    if make_plan(spec.without_epilogue, config).write in ("segmented", "atomic") and "Ai" in operands:
        config = dataclasses.replace(config, schedule="rows")  # (sums of a format's rows fuse in row programs)
    plan = make_plan(spec, config)
    assert plan.fuses_epilogue, (plan.write, plan.config.schedule)
    assert "tanh" not in generate(make_plan(spec.without_epilogue, config))
    out = interpret(spec, arrays, config)
    assert out.dtype == dtype
    assert_allclose(out, expected(reference(case.expression, **operands)), dtype)


def test_row_programs_give_empty_rows_the_epilogue(rng):
    """Rows no group reaches hold epilogue(0) (here the bias), not 0: each row has its own program."""
    operands = CASES["group_spmm"].make(rng, np.float32)
    operands["Ai"] = np.where(operands["Ai"] == 1, 0, operands["Ai"]).astype(np.int32)  # row 1 empty
    bias = jnp.arange(operands["C"].shape[1], dtype=jnp.float32) + 1
    spec, arrays = _spec(CASES["group_spmm"].expression, operands, lambda c, i, n: c + bias[n], given_lhs=False)
    rows = KernelConfig(schedule="rows")
    plan = make_plan(spec, rows)
    assert plan.row_programs and plan.covers_output and plan.fuses_epilogue and "atomic" not in generate(plan)
    if not ON_GPU:
        pytest.importorskip("torch")
        out = interpret(spec, arrays, rows)
        np.testing.assert_array_equal(out[1], np.asarray(bias))


def test_plans_are_not_changed_to_fuse_an_epilogue(rng):
    """A format's rows split across programs (the default of lanes plans: hub rows balanced) keep their schedule,
    and the epilogue runs after the kernel; block products (row programs by default) fuse it."""
    group = CASES["group_spmm"].make(rng, np.float32)
    spec, _ = _spec(CASES["group_spmm"].expression, group, lambda c, i, n: jax.nn.relu(c))
    for config in (KernelConfig(block=128), KernelConfig()):
        plan = make_plan(spec, config)
        assert plan.config.schedule == make_plan(spec.without_epilogue, config).config.schedule
        assert not plan.fuses_epilogue
    block = CASES["block_spmm_tiles"].make(rng, np.float32)
    spec, _ = _spec(CASES["block_spmm_tiles"].expression, block, lambda c, i, m, n: jax.nn.relu(c))
    assert make_plan(spec).template == "dot" and make_plan(spec).fuses_epilogue


def test_atomic_writes_apply_the_epilogue_after_the_kernel(rng):
    """A left-hand side written atomically (several programs add into one element) cannot apply it in the kernel:
    the lowering applies it after, and the interpreter refuses to run it fused."""
    case = CASES["coo_spmm"]
    operands = case.make(rng, np.float32)
    expected, captured = _epilogue(operands, case.expression)
    spec, arrays = _spec(case.expression, operands, _bound(captured))
    assert not make_plan(spec).fuses_epilogue
    out = jinsum.einsum(case.expression, epilogue=_bound(captured), **operands)
    assert_allclose(out, expected(reference(case.expression, **operands)), np.float32)
    if not ON_GPU:
        pytest.importorskip("torch")
        with pytest.raises(ValueError, match="does not apply the epilogue"):
            interpret(spec, arrays)


def test_max_statement_with_an_epilogue(rng):
    expression = "C[Ai[g],n] max= Av[g,p] * B[Ak[g,p],n]"
    Ai = np.array([0, 0, 2, 3], np.int32)
    Ak = rng.integers(0, 5, (4, 3)).astype(np.int32)
    operands = dict(C=np.full((4, 6), -np.inf, np.float32), Ai=Ai, Ak=Ak,
                    Av=rng.standard_normal((4, 3)).astype(np.float32), B=rng.standard_normal((5, 6)).astype(np.float32))
    epilogue = lambda v, i, n: jnp.where(jnp.isinf(v), 0.0, jax.nn.relu(v))  # noqa: E731
    out = jinsum.einsum(expression, sorted_indices=("Ai",), epilogue=epilogue, **operands)
    ref = reference(expression, **operands)
    np.testing.assert_allclose(out, np.where(np.isinf(ref), 0, np.maximum(ref, 0)), rtol=1e-6)
    if not ON_GPU:
        pytest.importorskip("torch")
        spec, arrays = _spec(expression, operands, epilogue)
        rows = KernelConfig(schedule="rows")
        np.testing.assert_allclose(interpret(spec, arrays, rows), out, rtol=1e-6)


# --- derivatives, batching, compiles ----------------------------------------------------------------------------

def _layer(A, h, bias, scale):
    """A GCN-style layer: the degree scales as factors of the statement, bias, residual and activation in the
    epilogue."""
    h, bias, scale = map(jnp.asarray, (h, bias, scale))  # (check_grads perturbs NumPy arrays)
    return jinsum.einsum("C[Ai[g],n] += S[Ai[g]] * Av[g,p] * S[Ak[g,p]] * H[Ak[g,p],n]", A=A, H=h, S=scale,
                         C=jax.ShapeDtypeStruct(h.shape, h.dtype),
                         epilogue=lambda c, i, n: jax.nn.softplus(c + scale[i] ** 2 * h[i, n] + bias[n]))


def _graph(rng, N=11, F=5):
    dense = (rng.random((N, N)) < 0.3) * rng.standard_normal((N, N))
    dense[3] = 0  # an empty row
    A = jinsum.GroupCOO.from_dense(dense, group_size=2)
    return A, dense, rng.standard_normal((N, F)), rng.standard_normal(F), rng.random(N) + 0.5


def test_layer_against_float64_numpy(rng):
    with jax.enable_x64(True):
        A, dense, h, bias, scale = _graph(rng)
        A = A.astype(jnp.float64)
        out = _layer(A, jnp.asarray(h), jnp.asarray(bias), jnp.asarray(scale))
        c = scale[:, None] * (dense @ (scale[:, None] * h))
        softplus = np.logaddexp(0, c + scale[:, None] ** 2 * h + bias)
        np.testing.assert_allclose(out, softplus, rtol=1e-12)


def test_gradients_reach_the_operands_and_the_captured_arrays(rng):
    with jax.enable_x64(True):
        A, _, h, bias, scale = _graph(rng)
        A = A.astype(jnp.float64)
        check_grads(lambda h, b, s: _layer(A, h, b, s), (jnp.asarray(h), jnp.asarray(bias), jnp.asarray(scale)),
                    order=2, modes=["fwd", "rev"])


def test_vmap_matches_a_loop(rng):
    A, _, h, bias, scale = _graph(rng)
    A = A.astype(jnp.float32)
    hs = jnp.asarray(np.stack([h, 2 * h, -h]), jnp.float32)
    biases = jnp.asarray(np.stack([bias, bias + 1, bias * 0]), jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    layer = jax.jit(lambda h, b: _layer(A, h, b, scale))  # (the loop's three calls: one compiled program)
    for in_axes, args in (((0, 0), (hs, biases)), ((0, None), (hs, biases[0])), ((None, 0), (hs[0], biases))):
        batched = jax.jit(jax.vmap(layer, in_axes=in_axes))(*args)
        loop = [layer(*(a[k] if ax == 0 else a for a, ax in zip(args, in_axes))) for k in range(3)]
        np.testing.assert_allclose(batched, np.stack(loop), rtol=1e-5, atol=1e-6)


def test_new_captured_values_compile_nothing(rng):
    A, _, h, bias, scale = (x if k == 0 else jnp.asarray(x, jnp.float32) for k, x in enumerate(_graph(rng)))
    A = A.astype(jnp.float32)
    layer = CountingJit(_layer)
    first = layer(A, h, bias, scale)
    second = layer(A, h, bias + 1, scale * 2)
    assert layer.traces == 1
    assert not np.allclose(first, second)


def test_epilogue_errors_say_what_to_write(rng):
    A, _, h, bias, scale = _graph(rng)
    A, h = A.astype(jnp.float32), jnp.asarray(h, jnp.float32)
    expression = "C[Ai[g],n] += Av[g,p] * H[Ak[g,p],n]"
    out = jax.ShapeDtypeStruct(h.shape, h.dtype)
    with pytest.raises(TypeError, match=r"epilogue <lambda> must take \(value, i0, i1\)"):
        jinsum.einsum(expression, A=A, H=h, C=out, epilogue=lambda c, i: c)
    with pytest.raises(TypeError, match="reads a slice of a captured array"):
        jinsum.einsum(expression, A=A, H=h, C=out, epilogue=lambda c, i, n: c + h[i].sum())
    with pytest.raises(TypeError, match="one floating-point value"):
        jinsum.einsum(expression, A=A, H=h, C=out, epilogue=lambda c, i, n: c > 0)
    with pytest.raises(TypeError, match="needs the indirect notation"):
        jinsum.einsum("ik,kn->in", A, h, epilogue=lambda c, i, n: c)


def test_reads_at_the_positions_are_broadcasts_and_their_gradients_sums():
    """Applied after a kernel (and differentiated), `bias[n]`, `scale[row]` and `h[row, n]` are the captured arrays
    broadcast: no gather forward, no scatter backward (a scatter of N x F updates into F biases serialises)."""
    h, bias, scale = jnp.ones((6, 4)), jnp.ones(4), jnp.ones(6)
    traced, captured = _elementwise.trace(lambda c, row, n: jax.nn.relu(scale[row] * (c + h[row, n]) + bias[n]),
                                          "epilogue", "test", 2)
    loss = lambda value, *captures: jnp.sum(_elementwise.on_grid(traced, captures, value))  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(jnp.ones((6, 4)), *captured).as_text()
    assert "gather" not in text and "scatter" not in text
    ramp = jnp.arange(4.0)
    shifted, captured = _elementwise.trace(lambda c, row, n: c + ramp[3 - n] + ramp[row % 4], "epilogue", "test", 2)
    out = _elementwise.on_grid(shifted, captured, jnp.zeros((6, 4)))  # (gathers at indices computed on the host)
    np.testing.assert_array_equal(out, np.arange(4.0)[::-1][None, :] + (np.arange(6) % 4)[:, None])

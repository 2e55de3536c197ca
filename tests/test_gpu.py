"""The catalog through real generated kernels on a CUDA GPU: jit, grad and vmap against the XLA lowering and the
float64 reference. Run with `pytest -m gpu` on a machine with a GPU and jax-triton; skipped elsewhere."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.test_util import check_grads

import jinsum
import jinsum.nn._graph
from jinsum._lowering import _xla
from jinsum._lowering._launch import KERNEL_NODE
from jinsum._rules import _primitive
from jinsum.testing import assert_allclose, check_vmap, reference

from _catalog import CATALOG, EXTREMA, group_spmm
from conftest import ON_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]

DTYPES = [np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)]


@pytest.fixture(autouse=True)
def no_fallback():
    """Every statement here must run in a generated kernel: a fallback to XLA fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", jinsum.FallbackWarning)
        yield


def _sorted(operands):
    return ("Ai",) if "Ai" in operands else ()


def _jinsum(case, operands):
    return jax.jit(lambda ops: jinsum.einsum(case.expression, **ops, sorted_indices=_sorted(ops)))(operands)


def _on_xla(case, operands):
    """The same statement forced onto the XLA lowering, on the same device."""
    from jinsum._frontend import _einsum  # noqa: PLC0415

    statement, arrays, flags = _einsum.prepare(case.expression, operands, sorted_indices=_sorted(operands))
    spec = _primitive.make_spec(statement, arrays, **flags)
    return jax.jit(functools.partial(_xla.evaluate, spec=spec))(*(arrays[n] for n in spec.names))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_catalog_kernels_on_gpu(case, dtype, rng):
    operands = case.make(rng, dtype)
    lowered = jax.jit(lambda ops: jinsum.einsum(case.expression, **ops)).lower(operands).as_text()
    assert KERNEL_NODE in lowered or case.name == "group_spmm_empty"
    actual = _jinsum(case, operands)
    assert_allclose(actual, reference(case.expression, **operands), dtype)
    assert_allclose(actual, np.asarray(_on_xla(case, operands), np.float64), dtype, err_msg="against XLA")


@pytest.mark.parametrize("name", ["block_spmm_tiles", "grouped_matmul"])
def test_float32_products_are_tf32_by_default_as_jnp_dot(name, rng):
    """Outside the tests' float32 fixture (conftest.py), float32 Tensor Core products follow JAX's default matmul
    precision, TensorFloat-32 on GPUs: its rounding shows (10 bits of mantissa), within TF32's error; asked for
    float32 (the fixture), they keep float32's accuracy."""
    case = next(c for c in CATALOG if c.name == name)
    operands = case.make(rng, np.float32)
    expected = reference(case.expression, **operands)
    precise = _jinsum(case, operands)
    with jax.default_matmul_precision("default"):
        tf32 = _jinsum(case, operands)
    assert_allclose(precise, expected, np.float32)
    error = np.abs(np.asarray(tf32, np.float64) - expected).max() / np.abs(expected).max()
    assert 1e-6 < error < 1e-2, error


@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_grads_on_gpu(case, rng):
    with jax.enable_x64(True):
        operands = case.make(rng, np.float64)

        def fn(*values):
            return jinsum.einsum(case.expression, **{**operands, **dict(zip(case.differentiated, values))},
                                 sorted_indices=_sorted(operands))

        check_grads(jax.jit(fn), tuple(operands[n] for n in case.differentiated), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_vmap_on_gpu(case, rng):
    operands = case.make(rng, np.float32)
    name = case.differentiated[-1]
    batched = np.stack([operands[name] * (b + 1) for b in range(3)])
    fn = jax.jit(lambda x: jinsum.einsum(case.expression, **{**operands, name: x}, sorted_indices=_sorted(operands)))
    check_vmap(fn, (batched,), (0,))


def test_large_group_spmm_with_hub_rows(rng):
    """Windows, split rows and many programs: a power-law row-length distribution at scale."""
    rows = np.sort(np.minimum(rng.zipf(1.5, 200_000), 5000) - 1).astype(np.int32)
    operands = group_spmm(rng, np.float32, M=5000, K=7000, N=96, G=200_000, P=8)
    operands["Ai"] = rows
    A = jinsum.GroupCOO(operands["Ai"], operands["Ak"], operands["Av"], (5000, 7000))
    out = jax.jit(lambda A, B: A @ B)(A, operands["B"])
    dense = np.zeros((5000, 7000))
    np.add.at(dense, (np.repeat(rows, 8), operands["Ak"].reshape(-1)), operands["Av"].reshape(-1))
    assert_allclose(out, dense @ operands["B"], np.float32)


@pytest.mark.parametrize("features", [8, 40, 256])
def test_spmm_gradient_over_the_column_order_with_hub_columns(rng, features):
    """dB = A^T dC over the entries in column order (narrow: tiles; wide: segmented rows split across programs)
    on a power-law matrix whose hub columns hold thousands of entries, against float64 and the atomic transpose."""
    rows = np.minimum(rng.zipf(1.5, 60_000), 3000) - 1
    cols = np.minimum(rng.zipf(1.4, 60_000), 2000) - 1
    csr = sp.csr_matrix((rng.standard_normal(60_000).astype(np.float32), (rows, cols)), shape=(3000, 2000))
    A = jinsum.GroupCOO.from_scipy(csr)
    T = A.with_transpose()
    W = rng.standard_normal((3000, features)).astype(np.float32)
    B = jnp.asarray(rng.standard_normal((2000, features)).astype(np.float32))
    grad = jax.jit(lambda A, B: jax.grad(lambda B: jnp.sum((A @ B) * W))(B))
    expected = csr.toarray().astype(np.float64).T @ W
    assert_allclose(grad(T, B), expected, np.float32)
    assert_allclose(grad(A, B), expected, np.float32)


def test_block_spmm_gradient_over_the_block_columns_fp16(rng):
    """The block transpose over the column order: Tensor Core tiles, owned rows, an fp16 output."""
    mask = rng.random((32, 32)) < 0.1
    dense = np.kron(mask, np.ones((32, 32))) * rng.standard_normal((1024, 1024))
    A = jinsum.BlockGroupCOO.from_dense(dense.astype(np.float32), block_shape=(32, 32), dtype=jnp.float16)
    W = jnp.asarray(rng.standard_normal((1024, 128)), jnp.float16)
    B = jnp.asarray(rng.standard_normal((1024, 128)), jnp.float16)
    grad = jax.jit(lambda A, B: jax.grad(lambda B: jnp.sum((A @ B).astype(jnp.float32) * W))(B))
    expected = np.asarray(A.todense(), np.float64).T @ np.asarray(W, np.float64)
    assert_allclose(grad(A.with_transpose(), B), expected, np.float16)
    assert_allclose(grad(A, B), expected, np.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", EXTREMA, ids=repr)
def test_extrema_and_their_winners_on_gpu(case, dtype, rng):
    """max= / min= kernels against float64, and their winners against the XLA lowering's on the same result."""
    from jinsum._frontend import _einsum  # noqa: PLC0415

    operands = case.make(rng, dtype)
    actual = _jinsum(case, operands)
    assert_allclose(actual, reference(case.expression, **operands), dtype)
    statement, arrays, flags = _einsum.prepare(case.expression, operands, sorted_indices=_sorted(operands))
    spec = _primitive.make_spec(statement, {**arrays, statement.lhs.tensor: actual}, **flags, winners=True)
    args = [actual if n == spec.lhs.name else arrays[n] for n in spec.names]
    kernel = jax.jit(lambda *args: _primitive.jinsum_p.bind(*args, spec=spec))(*args)
    xla = jax.jit(functools.partial(_xla.evaluate, spec=spec))(*args)
    np.testing.assert_array_equal(kernel, xla)


@pytest.mark.parametrize("case", EXTREMA, ids=repr)
def test_extrema_grads_on_gpu(case, rng):
    with jax.enable_x64(True):
        operands = case.make(rng, np.float64)

        def fn(*values):
            return jinsum.einsum(case.expression, **{**operands, **dict(zip(case.differentiated, values))},
                                 sorted_indices=_sorted(operands))

        values = tuple(jnp.where(jnp.isinf(operands[n]), -5.0, operands[n]) for n in case.differentiated)
        check_grads(jax.jit(fn), values, order=2, modes=("fwd", "rev"), eps=1e-4)


@pytest.mark.parametrize("features", [16, 256])
def test_max_aggregation_with_hub_rows(rng, features):
    """Hub rows split across programs (atomic maxima at the windows' edges) and their gradient at the winners."""
    rows = np.minimum(rng.zipf(1.5, 60_000), 3000) - 1
    cols = rng.integers(0, 2000, 60_000)
    A = jinsum.GroupCOO.from_scipy(sp.csr_matrix((np.ones(60_000, np.float32), (rows, cols)), shape=(3000, 2000)))
    B = jnp.asarray(rng.standard_normal((2000, features)).astype(np.float32))
    W = jnp.asarray(rng.standard_normal((3000, features)).astype(np.float32))
    out = jax.jit(lambda B: jinsum.nn._graph.aggregate_extreme(A, B))(B)
    dense = A.todense() != 0
    expected = np.where(dense[:, :, None], np.asarray(B)[None], -np.inf).max(axis=1)
    assert_allclose(out, np.where(np.isinf(expected), 0, expected), np.float32)
    grad = jax.jit(jax.grad(lambda B: jnp.sum(jinsum.nn._graph.aggregate_extreme(A, B) * W)))(B)
    first = np.where(dense[:, :, None], np.asarray(B)[None], -np.inf).argmax(axis=1)  # (ties: none, normal draws)
    expected_grad = np.zeros((2000, features))
    has = dense.any(axis=1)
    np.add.at(expected_grad, (first[has], np.arange(features)[None, :].repeat(has.sum(), 0)), np.asarray(W)[has])
    assert_allclose(grad, expected_grad, np.float32)


def test_autotune_stores_and_reuses_a_config(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("JINSUM_CACHE_DIR", str(tmp_path / "kernels"))
    operands = group_spmm(rng, np.float32, M=300, K=200, N=64, G=900, P=4)
    operands = {k: jnp.asarray(v) for k, v in operands.items()}
    config = jinsum.autotune("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", sorted_indices=("Ai",), **operands)
    assert (tmp_path / "autotune.json").exists() and str(config.window) in (tmp_path / "autotune.json").read_text()
    out = jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", sorted_indices=("Ai",), **operands)
    assert_allclose(out, reference("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **operands), np.float32)
    # A format operand that carries its column order: the primitive takes three more operands.
    A = jinsum.GroupCOO(operands["Ai"], operands["Ak"], operands["Av"], (300, 200)).with_transpose()
    jinsum.autotune("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=operands["C"], A=A, B=operands["B"])


def test_a_second_process_loads_the_compiled_kernels(tmp_path):
    """jinsum's persistent kernel cache: a new process compiles nothing that an earlier one compiled (counted)."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = (
        "import json, jax, jax.numpy as jnp, numpy as np, scipy.sparse as sp, jinsum\n"
        "A = jinsum.GroupCOO.from_scipy(sp.random(300, 200, 0.05, random_state=0, dtype=np.float32))\n"
        "B = jnp.ones((200, 24), jnp.float32)\n"
        "y, vjp = jax.vjp(lambda B: A @ B, B)\n"
        "jax.block_until_ready(vjp(y))\n"
        "print(json.dumps(jinsum.kernel_cache_info()))\n")
    env = {**os.environ, "JINSUM_CACHE_DIR": str(tmp_path), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        counts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert counts[0]["compiled"] >= 2 and counts[0]["loaded"] == 0  # the product and its transpose
    assert counts[1]["compiled"] == 0 and counts[1]["loaded"] == counts[0]["compiled"]

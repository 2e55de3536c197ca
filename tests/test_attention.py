"""Fused attention chains (`jinsum.attention`): the unfused reference lowering against dense float64 NumPy, its
derivatives and batching, and every generated chain kernel in Triton's interpreter against that reference."""

import functools
import importlib.util
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.test_util import check_grads

import jinsum
from jinsum import _attention
from jinsum._attention import _chain_reference, _chain_route, _chain_triton
from jinsum.formats._row_starts import count_below
from jinsum.kernels import ChainConfig, Fallback, generate_chain, make_chain_plan
from jinsum.testing import assert_allclose
from jinsum.testing import dense_attention as reference_attention

from conftest import ON_GPU

# --- patterns and a dense float64 reference ---------------------------------------------------------------------


def block_pattern(rng, length=80, keys=71, block=16, density=0.4, partial=True, hub_key=False):
    """A random block pattern with a long (global) first block row, an empty last one and, if `partial`, stored
    zeros inside the stored blocks (query row 0 only zeros); `length`, `keys` need not be multiples of `block`.
    With `hub_key`, the first block column is stored in every row but the last (a long key)."""
    rows, cols = -(-length // block), -(-keys // block)
    stored = rng.random((rows, cols)) < density
    stored[0] = True  # a long row: cut into pieces when the chunk is small
    if hub_key:
        stored[:, 0] = True
    stored[-1] = False  # a block row with nothing to attend to
    mask = np.kron(stored, np.ones((block, block)))[:length, :keys]
    if partial:
        mask = mask * (rng.random(mask.shape) < 0.8)
        mask[0] = 0
    padded = np.zeros((rows * block, cols * block))
    padded[:length, :keys] = mask
    r, c = np.nonzero(stored)  # every stored block, all-zero ones too
    blocks = padded.reshape(rows, block, cols, block).transpose(0, 2, 1, 3)[r, c]
    indptr = np.concatenate([[0], np.cumsum(stored.sum(1))])
    bsr = sp.bsr_matrix((blocks, c, indptr), shape=padded.shape, blocksize=(block, block))
    full = jinsum.BlockGroupCOO.from_scipy(bsr, block_shape=(block, block))
    return jinsum.BlockGroupCOO(full.Ai, full.Ak, full.Av, (length, keys))


def graph_pattern(rng, nodes=40, keys=None, heads=None, group_size=4, hubs=False):
    """A random graph (GroupCOO): empty rows, a hub row, self loops, stored zeros; one value per head if `heads`.
    With `hubs`, the hub row stores every key and key 0 is stored in every row but the empty one (a hub key): on a
    small graph, both longer than the chunks the kernel tests force. Returns the pattern and where it allows
    attention, `(nodes, keys[, heads])` booleans."""
    keys = keys or nodes
    dense = rng.random((nodes, keys)) < 0.12
    dense[1] = rng.random(keys) < 0.9  # a hub row
    if hubs:
        dense[1] = dense[:, 0] = True
    dense[2] = False  # an empty row
    csr = sp.csr_matrix(dense.astype(float))
    csr.data = (rng.random(csr.nnz) < 0.9).astype(float)  # some stored zeros
    pattern = jinsum.GroupCOO.from_scipy(csr, group_size=group_size)
    if heads is not None:
        pattern = pattern.with_values(pattern.Av[..., None] * (rng.random((*pattern.Av.shape, heads)) < 0.8))
    return pattern, np.asarray(pattern.todense()) != 0


def dense_attention(q, k, v, allowed, *, scale=None, score_mod=None, causal=False, key_mask=None,
                    self_loops=False):
    """`(out, lse)` by brute force in float64 (`jinsum.testing.dense_attention`) with the chain's rules: the
    pattern's `allowed`, `score_mod`, causal, key padding and self loops."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batched = q.ndim == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = raw = np.einsum("blhd,bshd->bhls", q, k) * scale
    b, h, i, j = np.meshgrid(*map(np.arange, s.shape), indexing="ij")
    if score_mod is not None:  # (the reference adds it to the raw scores as a bias)
        with jax.enable_x64(True):
            s = np.asarray(jax.vmap(score_mod)(*(jnp.asarray(x.reshape(-1)) for x in (s, b, h, i, j))),
                           np.float64).reshape(s.shape)
    allowed = np.asarray(allowed, bool)
    allowed = allowed.transpose(2, 0, 1)[None] if allowed.ndim == 3 else allowed[None, None]
    allowed = np.broadcast_to(allowed, s.shape).copy()
    if self_loops:
        allowed |= i == j
    if causal:
        allowed &= i >= j
    if key_mask is not None:
        allowed &= np.asarray(key_mask).reshape(-1 if batched else 1, 1, 1, s.shape[-1])
    return reference_attention(q if batched else q[0], k if batched else k[0], v if batched else v[0], allowed,
                               bias=s - raw, scale=scale)


def _qkv(rng, length, keys, heads=2, dim=16, value_dim=8, batch=None, dtype=np.float32):
    lead = () if batch is None else (batch,)
    return (rng.standard_normal((*lead, length, heads, dim)).astype(dtype),
            rng.standard_normal((*lead, keys, heads, dim)).astype(dtype),
            rng.standard_normal((*lead, keys, heads, value_dim)).astype(dtype))


def softcap(s, b, h, i, j):
    return 5.0 * jnp.tanh(s / 5.0)


def alibi(s, b, h, i, j):
    """A positional bias per head (ALiBi) and a batch-dependent shift: uses every coordinate."""
    return s - 0.1 * (h + 1) * jnp.abs(i - j).astype(jnp.float32) + 0.05 * b


def leaky(s, b, h, i, j):
    return jax.nn.leaky_relu(s, 0.2)


def built_mask(mask_mod, *args, **kwargs):
    """`jinsum.block_mask` built inside `jit`: one compile (eagerly every operation compiles on its own)."""
    return jax.jit(lambda: jinsum.block_mask(mask_mod, *args, **kwargs))()


def _id(value) -> str:
    """Test ids that are the same in every process (function names, not addresses)."""
    if isinstance(value, dict):
        return ",".join(f"{k}={_id(v)}" for k, v in value.items()) or "plain"
    if isinstance(value, ChainConfig):
        return ",".join(f"{k}={v}" for k, v in vars(value).items() if v) or "default"
    return getattr(value, "__name__", str(value))


# --- the reference lowering against dense float64 ---------------------------------------------------------------

BLOCK_CASES = [
    dict(),
    dict(causal=True),
    dict(score_mod=softcap),
    dict(score_mod=alibi, batch=2),
    dict(key_mask=True, batch=2),
    dict(causal=True, score_mod=alibi, key_mask=True),
]
GRAPH_CASES = [
    dict(),
    dict(score_mod=leaky, self_loops=True),
    dict(heads_in_pattern=True),
    dict(causal=True, batch=3),
    dict(key_mask=True),
    dict(score_mod=alibi, batch=2, self_loops=True),
]


def _case(rng, fmt, case, dtype=np.float32, kernels=False):
    """`(q, k, v, pattern), kwargs, (out, lse)` of `case`. With `kernels`, the smaller patterns of the interpreter's
    tests (its time grows with the work items, rows and keys): block patterns of 64 x 55 (blocks of 16) with a long
    first key block column as well, a graph of 14 nodes (17 keys) with a hub row and a hub key longer than any
    forced chunk; and no dense reference (None)."""
    batch = case.get("batch")
    if fmt == "block":
        block = case.get("block", 16)
        small = kernels and block == 16  # (blocks of 32: 3 x 3 of them already)
        pattern = block_pattern(rng, *((64, 55) if small else ()), block=block, hub_key=small)
        allowed = np.asarray(pattern.todense()) != 0
        length, keys = pattern.shape
    else:
        heads = 2 if case.get("heads_in_pattern") else None
        nodes, keys = (14, 17) if kernels else (40, 33)
        pattern, allowed = graph_pattern(rng, nodes, None if case.get("self_loops") else keys, heads=heads,
                                         hubs=kernels)
        if case.get("transposed"):  # the keys' entries built on the host: the schedule sorts nothing
            pattern = pattern.with_transpose()
        length, keys = pattern.shape[:2]
    q, k, v = _qkv(rng, length, keys, batch=batch, dim=case.get("dim", 16), dtype=dtype)
    key_mask = None
    if case.get("key_mask"):
        key_mask = rng.random((batch, keys) if batch else (keys,)) < 0.8
    kwargs = dict(score_mod=case.get("score_mod"), causal=case.get("causal", False), key_padding_mask=key_mask,
                  self_loops=case.get("self_loops", False))
    expected = None if kernels else dense_attention(q, k, v, allowed, score_mod=kwargs["score_mod"],
                                                    causal=kwargs["causal"], key_mask=key_mask,
                                                    self_loops=kwargs["self_loops"])
    return (q, k, v, pattern), kwargs, expected


@pytest.mark.parametrize("fmt,case", [("block", c) for c in BLOCK_CASES] + [("graph", c) for c in GRAPH_CASES],
                         ids=_id)
def test_attention_matches_dense_float64(fmt, case, rng):
    with jax.enable_x64(True):
        (q, k, v, pattern), kwargs, (out, lse) = _case(rng, fmt, case, np.float64)
        call = functools.partial(jinsum.attention, pattern=pattern, return_lse=True, **kwargs)
        # One compiled program (eagerly every operation compiles alone), the pattern concrete inside it as outside;
        # but for a block pattern's key padding mask, whose blocks are classified on the host only where it is
        # concrete: eagerly.
        if not (fmt == "block" and case.get("key_mask")):
            call = jax.jit(call)
        actual, actual_lse = call(q, k, v)
    assert_allclose(actual, out, np.float64)
    # (atol too: a log-sum-exp can be near 0, -0.0016 in one case here, where an error of one ulp of the scores'
    #  magnitude, whose rounding is that of XLA's CPU kernels, picked per CPU, is 0.14 of rtol=1e-12 alone)
    np.testing.assert_allclose(actual_lse, lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_16_and_32_bit_inputs(fmt, dtype, rng):
    (q, k, v, pattern), kwargs, (out, _) = _case(rng, fmt, dict(causal=True), dtype)
    actual = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern, **kwargs))(q, k, v)
    assert actual.dtype == dtype
    assert_allclose(actual, dense_attention(q, k, v, np.asarray(pattern.todense()) != 0, causal=True)[0]
                    if fmt == "block" else out, dtype)


def test_rows_with_nothing_to_attend_to_give_zero_and_finite_gradients(rng):
    pattern = block_pattern(rng)  # the last block row stores nothing; query row 0 stores only zeros
    q, k, v = _qkv(rng, *pattern.shape)
    out, lse = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern, return_lse=True))(q, k, v)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(out)[-10:] == 0) and np.isinf(lse[0]).all()
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jinsum.attention(q, k, v, pattern) ** 2), argnums=(0, 1, 2)))(
        q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[0] == 0)


# --- derivatives and batching -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,case", [("block", dict(causal=True, score_mod=softcap)), ("block", dict(batch=2)),
                                      ("graph", dict(score_mod=leaky, self_loops=True)),
                                      ("graph", dict(heads_in_pattern=True, key_mask=True))], ids=_id)
def test_gradients_forward_and_reverse(fmt, case, rng):
    with jax.enable_x64(True):
        (q, k, v, pattern), kwargs, _ = _case(rng, fmt, case, np.float64)

        def f(q, k, v):
            out, lse = jinsum.attention(q, k, v, pattern, return_lse=True, **kwargs)
            return out, jnp.where(jnp.isfinite(lse), lse, 0)  # the log-sum-exp is differentiable too

        check_grads(jax.jit(f), (q, k, v), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_gradients_with_dropout(rng):
    """A fixed seed fixes the mask, so the function is smooth in q, k, v and its gradient checkable."""
    with jax.enable_x64(True):
        (q, k, v, pattern), _, _ = _case(rng, "graph", dict(self_loops=True), np.float64)
        f = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern, self_loops=True, dropout=0.3, seed=7))
        check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_vmap_over_values_equals_a_loop(fmt, rng):
    (q, k, v, pattern), kwargs, _ = _case(rng, fmt, dict(score_mod=softcap))
    stacked = [np.stack([x * (b + 1) for b in range(3)]) for x in (q, k, v)]
    f = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern, **kwargs))
    batched = jax.vmap(f)(*stacked)
    for b in range(3):
        assert_allclose(batched[b], f(*(x[b] for x in stacked)), np.float32, err_msg=f"batch {b}")
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))
    grads = jax.jit(jax.vmap(grad))(*stacked)
    for b in range(3):
        looped = grad(*(x[b] for x in stacked))
        for g, expected in zip(grads, looped):
            assert_allclose(g[b], expected, np.float32)


def test_vmap_over_the_pattern_runs_a_loop(rng):
    pattern = block_pattern(rng, partial=False)
    q, k, v = _qkv(rng, *pattern.shape)
    values = np.stack([np.asarray(pattern.Av) * (rng.random(pattern.Av.shape) < p) for p in (0.5, 0.9)])
    # (one compiled program; eagerly every operation compiled alone. The batched pattern is traced either way.)
    batched = jax.jit(jax.vmap(lambda av: jinsum.attention(q, k, v, pattern.with_values(av))))(values)
    for b in range(2):
        expected = dense_attention(q, k, v, np.asarray(pattern.with_values(values[b]).todense()) != 0)[0]
        assert_allclose(batched[b], expected, np.float32)


def test_dropout_keeps_the_expected_fraction_and_is_reproducible(rng):
    pattern, _ = graph_pattern(rng, 60)
    q, k, v = _qkv(rng, 60, 60)
    v = np.ones_like(v)
    f = jax.jit(lambda seed, rate: jinsum.attention(q, k, v, pattern, dropout=rate, seed=seed), static_argnums=1)
    a, b, c = f(1, 0.25), f(1, 0.25), f(2, 0.25)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # With v = 1, each output is the sum of the kept weights / (1 - rate): its mean over rows is close to 1.
    rows = np.asarray(pattern.todense()).any(1)
    assert abs(float(np.asarray(a)[rows].mean()) - 1) < 0.05
    assert_allclose(f(1, 0.0), jinsum.attention(q, k, v, pattern), np.float32)


# --- the schedule: work lists from the pattern ------------------------------------------------------------------

@pytest.mark.parametrize("fmt,case", [("block", dict(causal=True)), ("graph", dict(self_loops=True)),
                                      ("graph", dict(self_loops=True, transposed=True))], ids=_id)
def test_traced_schedule_equals_the_host_schedule(fmt, case, rng):
    """A pattern passed to a jitted function gets its work lists from XLA ops; they must equal NumPy's."""
    (q, k, v, pattern), kwargs, _ = _case(rng, fmt, case)
    config = ChainConfig(entries=4, chunk=3)  # several pieces per long row and key
    def schedule(pattern):
        chain, arrays = _attention.build_chain(q, k, v, pattern, **kwargs)[:2]
        return _chain_route.schedule(_chain_route.route_chain(chain, config), arrays)

    host, traced = schedule(pattern), jax.jit(schedule)(pattern)
    assert host.keys() == traced.keys()
    for name in host:
        np.testing.assert_array_equal(np.asarray(traced[name]), host[name], err_msg=name)


@pytest.mark.parametrize("seed", range(5))
def test_count_below_matches_searchsorted(seed):
    rng = np.random.default_rng(seed)
    values = np.sort(rng.integers(-3, 40, rng.integers(0, 60))).astype(np.int32)
    n = int(rng.integers(1, 50))
    expected = np.searchsorted(values, np.arange(n), side="left")
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: count_below(v, n, jnp))(values)),
                                  expected)


# --- the generated kernels, in Triton's interpreter ------------------------------------------------------------

interpreted = pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is (test_gpu.py covers GPUs)")
KERNEL_CASES = [  # (with float32 and float16: both formats, dropout, key masks and the atomic dQ in half precision)
    ("block", dict(key_mask=True, dropout=0.2), ChainConfig(chunk=3)),
    ("block", dict(block=32, causal=True, dropout=0.1), ChainConfig(block_m=16, block_k=16, chunk=2)),  # tiles
    # TMA descriptors (Hopper): boxes in place of pointer loads, an index out of range read as zeros past the end
    ("block", dict(key_mask=True, batch=2, causal=True), ChainConfig(chunk=3, descriptors=True)),
    ("block", dict(block=32), ChainConfig(block_m=16, block_k=16, chunk=2, descriptors=True)),
    ("graph", dict(key_mask=True, score_mod=softcap), ChainConfig(entries=16, chunk=16)),
    # GAT's rank-2 scores: dQ is added atomically by the dkdv kernel
    ("graph", dict(dim=2, score_mod=leaky, self_loops=True, dropout=0.2, batch=2), ChainConfig(entries=8, chunk=8)),
]
FLOAT32_KERNEL_CASES = [  # (float16 would run the same kernel source again)
    ("block", dict(), ChainConfig(chunk=2)),  # long rows in pieces, combined
    ("block", dict(causal=True, score_mod=alibi, batch=2), ChainConfig()),
    ("graph", dict(), ChainConfig(entries=4, chunk=8)),
    ("graph", dict(score_mod=leaky, self_loops=True, dropout=0.3), ChainConfig(entries=8, chunk=8)),
    ("graph", dict(heads_in_pattern=True, causal=True, batch=2), ChainConfig()),
    # a pattern carrying its transposed index: stored self loops and per-head zeros are masked by the kernel
    ("graph", dict(dim=2, score_mod=leaky, self_loops=True, heads_in_pattern=True, transposed=True),
     ChainConfig(entries=4, chunk=4)),
]


@interpreted
@pytest.mark.parametrize("fmt,case,config,dtype",
                         [(*c, d) for c in KERNEL_CASES for d in (np.float32, np.float16)]
                         + [(*c, np.float32) for c in FLOAT32_KERNEL_CASES], ids=_id)
def test_fused_kernels_match_the_reference(fmt, case, config, dtype, rng):
    pytest.importorskip("torch")
    (q, k, v, pattern), kwargs, _ = _case(rng, fmt, case, dtype, kernels=True)
    kwargs.update(dropout=case.get("dropout", 0.0), seed=11)
    chain, arrays, _ = _attention.build_chain(q, k, v, pattern, **kwargs)
    assert chain.differentiable == ("Q", "K", "V")
    # The long first block row (the hub row) is cut into pieces wherever a chunk is forced and no causal rule
    # masks it; the long first key block column (the hub key) where that chunk is 2 blocks (8 graph entries) or less.
    rows_cut, keys_cut = _pieces(chain, arrays, config)
    assert rows_cut == (config.chunk > 0 and not kwargs["causal"])
    assert keys_cut == (0 < config.chunk <= (2 if fmt == "block" else 8) and not kwargs["causal"]
                        and case.get("block", 16) == 16)
    check_chain_kernels(chain, arrays, config, dtype, rng)


def _pieces(chain, arrays, config):
    """Whether the kernels' work lists cut some row, and some key, into pieces (combined after)."""
    work = _chain_route.schedule(_chain_route.route_chain(chain, config), arrays)
    return bool((work["row_combine"][:, 0] >= 0).any()), bool((work["key_combine"][:, 0] >= 0).any())


# The unfused reference lowering as one compiled program each (op by op, it compiled every operation alone)
_reference_forward = jax.jit(_chain_reference.forward, static_argnums=0)
_reference_backward = jax.jit(_chain_reference.backward, static_argnums=0)


def check_chain_kernels(chain, arrays, config, dtype, rng, *, nonzero: bool = False):
    """The interpreted forward and backward kernels of `chain` against its unfused reference lowering: the output,
    the finite log-sum-exps (rows that attend somewhere), and the gradient of every differentiable operand (with
    `nonzero`, each one not all zeros). Returns the fused output and where the log-sum-exp is finite."""
    out, lse = _reference_forward(chain, arrays)
    fused_out, fused_lse = _chain_triton.interpret_forward(chain, arrays, config)
    assert fused_out.dtype == dtype
    assert_allclose(fused_out, np.asarray(out, np.float64), dtype, err_msg="forward")
    finite = np.isfinite(np.asarray(lse))
    assert np.array_equal(finite, np.isfinite(fused_lse))
    np.testing.assert_allclose(fused_lse[finite], np.asarray(lse)[finite], rtol=1e-5, atol=1e-5)

    d_out = rng.standard_normal(out.shape).astype(dtype)
    d_lse = np.where(finite, rng.standard_normal(lse.shape), 0).astype(np.float32)
    expected = _reference_backward(chain, arrays, (d_out, d_lse))
    fused = _chain_triton.interpret_backward(chain, {**arrays, "O": out, "LSE": lse, "dO": d_out, "dLSE": d_lse},
                                            config)
    assert len(fused) == len(expected) == len(chain.differentiable)
    for name, actual, want in zip(chain.differentiable, fused, expected):
        assert actual.shape == want.shape and actual.dtype == want.dtype, name
        assert not nonzero or np.abs(np.asarray(want)).max() > 0, name
        assert_allclose(actual, np.asarray(want, np.float64), dtype, err_msg=f"d{name}")
    return fused_out, finite


@interpreted
def test_bfloat16_lanes_kernels(rng):
    """(bfloat16 tl.dot is wrong in Triton 3.6's interpreter, so only element patterns run here in bfloat16.)"""
    pytest.importorskip("torch")
    (q, k, v, pattern), kwargs, _ = _case(rng, "graph", dict(score_mod=leaky, self_loops=True), jnp.bfloat16,
                                          kernels=True)
    chain, arrays, _ = _attention.build_chain(q, k, v, pattern, **kwargs)
    out, _ = _reference_forward(chain, arrays)
    assert_allclose(_chain_triton.interpret_forward(chain, arrays)[0], np.asarray(out, np.float64), jnp.bfloat16)


# --- what the generator emits, and when it does not ---------------------------------------------------------------

def test_block_kernels_use_tensor_cores_and_skip_the_mask_of_full_blocks(rng):
    pattern = block_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape, dtype=jnp.bfloat16)
    source = jinsum.triton_source(lambda q, k, v: jinsum.attention(q, k, v, pattern, causal=True), q, k, v)
    forward = source.split("# ---- combine")[0]
    assert forward.count("tl.dot(") == 2 and "input_precision" not in forward  # bf16: Tensor Cores
    # The pattern's values (p_Av) are read, and the scores masked, only inside the partial-block branch.
    branch = forward.index("if (flag != 2)")
    assert [m.start() > branch for m in re.finditer(r"tl\.load\(p_Av", forward)] == [True]
    assert [m.start() > branch for m in re.finditer(r"tl\.where\(allowed", forward)] == [True]
    backward = jinsum.triton_source(jax.grad(lambda q, k, v: jnp.sum(jinsum.attention(q, k, v, pattern)),
                                             argnums=(0, 1, 2)), q, k, v)
    assert "# ---- dq" in backward and "# ---- dkdv" in backward and "p_perm" in backward


def test_descriptor_loads_where_the_layout_allows(rng):
    """With `descriptors` (Hopper), the Tensor Core operands whose tiles are whole boxes of a row-major view are
    read through TMA descriptors (the kernel takes its global scratch last, under its own name); a head size the
    tile pads is read by pointers."""
    from jinsum import sequence_mask  # noqa: PLC0415 (imports flax)

    mask = sequence_mask(256, 128, causal=True)
    config = ChainConfig(descriptors=True)
    for dim, described in ((128, ("Q", "K", "V")), (72, ())):
        q, k, v = (jnp.zeros((256, h, dim), jnp.bfloat16) for h in (8, 2, 2))
        chain, _, _ = _attention.build_chain(q, k, v, mask)
        source = generate_chain(make_chain_plan(chain, "forward", config))
        made = re.findall(r"d_(\w+) = tl\.make_tensor_descriptor", source)
        assert tuple(made) == described
        assert ("def jinsum_attention_forward_tma(" in source) == bool(described)
        assert source.split("):")[0].endswith(", scratch") == bool(described)
        dkdv = generate_chain(make_chain_plan(chain, "dkdv", config))
        assert len(re.findall(r"make_tensor_descriptor", dkdv)) == (4 if described else 0)


@pytest.mark.parametrize("causal", [True, False])
def test_host_patterns_without_holes_are_read_as_block_flags(causal, rng):
    """`jinsum.block_pattern`'s blocks hold zeros only where the causal rule masks anyway: the kernels read one
    flag per block, never its elements, with the same results; a traced pattern, or one with a zero the rule does
    not mask, keeps its elements; with a mask_mod, no block is full."""
    from jinsum import block_pattern as nn_block_pattern  # noqa: PLC0415 (imports flax)

    pattern = nn_block_pattern(96, 16, local_blocks=1, global_blocks=1, random_blocks=1, causal=causal)
    q, k, v = _qkv(rng, 96, 96)
    expected, _ = dense_attention(q, k, v, np.asarray(pattern.todense()) != 0, causal=causal)
    chain, arrays, _ = _attention.build_chain(q, k, v, pattern, causal=causal)
    assert [str(i) for i in chain.mask.indices] == ["g", "p"] and arrays["Av"].dtype == jnp.int8
    flags = np.asarray(_chain_route.block_flags(chain, arrays, np))
    assert (flags == 2).any() and (flags == 1).any() == causal  # (the diagonal blocks: partial)
    source = jinsum.triton_source(lambda q, k, v: jinsum.attention(q, k, v, pattern, causal=causal), q, k, v)
    assert "p_Av +" not in source.split("# ---- combine")[0]
    # (each call one compiled program, its pattern closed over: concrete, classified on the host, as eagerly)
    assert_allclose(jax.jit(lambda q: jinsum.attention(q, k, v, pattern, causal=causal))(q), expected, np.float32)
    traced = jax.jit(lambda q, pattern: jinsum.attention(q, k, v, pattern, causal=causal))
    assert_allclose(traced(q, pattern), expected, np.float32)

    holed = pattern.with_values(pattern.Av.at[0, 5, 2, 0].set(0.0))  # below the diagonal: a hole of its own
    assert len(_attention.build_chain(q, k, v, holed, causal=causal)[0].mask.indices) == 4
    allowed = np.asarray(holed.todense()) != 0
    assert_allclose(jax.jit(lambda q: jinsum.attention(q, k, v, holed, causal=causal))(q),
                    dense_attention(q, k, v, allowed, causal=causal)[0], np.float32)
    chain, arrays, _ = _attention.build_chain(q, k, v, pattern, causal=causal, mask_mod=lambda b, h, i, j: i != j)
    assert 2 not in np.asarray(arrays["Av"])
    allowed = (np.asarray(pattern.todense()) != 0) & ~np.eye(96, dtype=bool)
    assert_allclose(jax.jit(lambda q: jinsum.attention(q, k, v, pattern, causal=causal,
                                                       mask_mod=lambda b, h, i, j: i != j))(q),
                    dense_attention(q, k, v, allowed, causal=causal)[0], np.float32)


@pytest.mark.parametrize("traced", [False, True])
def test_blocks_are_classified_per_batch_element_of_the_key_padding_mask(traced, rng):
    """With a key padding mask the kernels read it on partial blocks only: for each batch element, a block whose
    keys are all valid stays full, one with some is partial, one with none attends nowhere (concrete or traced)."""
    from jinsum import sequence_mask  # noqa: PLC0415 (imports flax)

    mask = sequence_mask(64, 16)  # every block full
    q, k, v = _qkv(rng, 64, 64, batch=2)
    valid = np.ones((2, 64), bool)
    valid[1, 37] = False  # key block 2 partial in the second batch element
    valid[0, 48:] = False  # key block 3 padding in the first
    chain, arrays, _ = _attention.build_chain(q, k, v, mask, key_padding_mask=valid)
    route = _chain_route.route_chain(chain)
    schedule = jax.jit(lambda a: _chain_route.schedule(route, a)) if traced else functools.partial(
        _chain_route.schedule, route)
    flags = np.asarray(schedule({n: arrays[n] for n in (*chain.names, "seed")})["flags"])
    blocks = np.asarray(arrays["Ak"]).reshape(-1)
    assert flags.shape == (2, blocks.size)
    assert (flags[0] == np.where(blocks == 3, 0, 2)).all() and (flags[1] == np.where(blocks == 2, 1, 2)).all()
    expected, _ = dense_attention(q, k, v, np.ones((64, 64), bool), key_mask=valid)
    assert_allclose(jinsum.attention(q, k, v, mask, key_padding_mask=valid), expected, np.float32)


@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_patterns_of_other_sizes_run_the_same_kernels(fmt, rng):
    """Row, key and entry counts are runtime arguments (`chain_sizes`): a pattern of another size with the same
    heads and widths generates the same kernels, forward and backward."""
    sources = set()
    for size in (40, 67):
        if fmt == "block":
            pattern = block_pattern(rng, length=size * 2, keys=size + 9)
        else:
            pattern, _ = graph_pattern(rng, size)
        q, k, v = _qkv(rng, *pattern.shape[:2])

        def loss(q, pattern=pattern, k=k, v=v):
            out = jinsum.attention(q, k, v, pattern, score_mod=leaky, self_loops=fmt == "graph", dropout=0.2, seed=1)
            return jnp.sum(out)

        sources.add(jinsum.triton_source(jax.grad(loss), q))
    assert len(sources) == 1


def test_graph_kernels_gather_rows_and_need_no_scores_buffer(rng):
    pattern, _ = graph_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape[:2])
    source = jinsum.triton_source(lambda q: jinsum.attention(q, k, v, pattern, score_mod=leaky), q)
    assert "tl.dot" not in source and "tl.maximum" in source and "S[" not in source.split('"""')[-1]


def test_unfused_fallbacks_say_why(rng):
    pattern = block_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape, dim=300)
    chain, arrays, _ = _attention.build_chain(q, k, v, pattern)
    assert "300" in _chain_route.route_chain(chain).forward.reason
    with pytest.warns(jinsum.FallbackWarning, match="runs unfused: heads of 300"):  # (warned as it is traced)
        out, _ = jax.jit(lambda *a: _chain_triton.forward(_chain_route.route_chain(chain), a))(
            *(arrays[n] for n in chain.names))
    assert_allclose(out, np.asarray(_reference_forward(chain, arrays)[0], np.float64), np.float32)
    with jax.enable_x64(True):
        chain64, _, _ = _attention.build_chain(*(x.astype(np.float64) for x in _qkv(rng, *pattern.shape)), pattern)
    assert "float64" in _chain_route.route_chain(chain64).forward.reason
    assert "runs on XLA" in jinsum.triton_source(lambda q: jinsum.attention(q, k, v, pattern), q)


def test_chain_plans_split_long_rows_only(rng):
    pattern = block_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape)
    chain, _, _ = _attention.build_chain(q, k, v, pattern)
    plan = make_chain_plan(chain, "forward", ChainConfig(chunk=2))
    assert plan.template == "dot" and plan.items == chain.rows + chain.entries // 2
    assert plan.grid_shape == (plan.items, 2)


@pytest.mark.parametrize("config", [ChainConfig(), ChainConfig(entries=32), ChainConfig(entries=8, chunk=40)], ids=_id)
def test_sum_kernels_share_the_main_kernels_work_lists(config, rng):
    """The combine and sum kernels read the scratch the main kernels write: same pieces, slots and chunk, also
    when a configuration is forced (a mismatch wrote out of bounds on a GPU)."""
    pattern, _ = graph_pattern(rng)
    chain, _, _ = _attention.build_chain(*_qkv(rng, *pattern.shape[:2], dim=2), pattern)
    for main, merge in (("forward", "combine"), ("dq", "dq_sum"), ("dkdv", "dkdv_sum")):
        a, b = make_chain_plan(chain, main, config), make_chain_plan(chain, merge, config)
        assert (a.parts, a.split_segments, a.config.chunk) == (b.parts, b.split_segments, b.config.chunk)
    assert make_chain_plan(chain, "dkdv", config).dq_in_dkdv  # rank-2 scores: no dq kernel


def test_a_fused_forward_keeps_its_work_lists_when_the_backward_runs_unfused(rng):
    """Deterministic mode keeps the backward of a chain whose score_mod captures a differentiable array unfused (its
    gradient would be added atomically) while the forward stays fused: the route says so, and the work lists made at
    bind still hold the forward's rows (they were left empty once the backward fell back, for a fused forward)."""
    pattern, _ = graph_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape[:2])
    bias = jnp.asarray(rng.standard_normal(2), jnp.float32)  # (one per head: a captured array with a gradient)
    with jinsum.deterministic(True):
        chain, arrays, _ = _attention.build_chain(q, k, v, pattern, score_mod=lambda s, b, h, i, j: s + bias[h])
    route = _chain_route.route_chain(chain)
    assert route.plan("forward") is not None and "captures are added atomically" in route.backward.reason
    work = _chain_route.schedule(route, arrays)
    assert work["row_items"].shape[0] == route.plan("forward").items and (work["row_items"][:, 0] >= 0).any()
    assert work["key_items"].shape[0] == 0  # (no backward kernel reads them)


@pytest.mark.parametrize("setting", ["triton", "fuse"])
def test_a_chain_unfused_by_a_setting_runs_unfused_silently(setting):
    """`jinsum.fuse(False)` (or `jinsum.triton(False)`) routes every chain to its unfused statements, a choice that
    does not warn; a chain the kernels cannot take does (`FallbackWarning`)."""
    mask = built_mask(lambda b, h, i, j: i >= j, 64, 64, 16)
    chain, _, _ = _attention.build_chain(*(jnp.zeros((64, 1, 16), jnp.float16),) * 3, mask)
    with getattr(jinsum, setting)(False):
        found = _chain_route.route_chain(chain).plans(_chain_route.FORWARD)
    assert isinstance(found, Fallback) and found.reason == f"jinsum.{setting} is off"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _chain_triton._fallback(chain, found)
    with pytest.warns(jinsum.FallbackWarning, match="runs unfused: no kernel for it"):
        _chain_triton._fallback(chain, Fallback("no kernel for it"))


def test_row_work_items_skip_the_empty_blocks_at_either_end_of_a_row():
    """A row's work covers its blocks from the first that attends to the last (a paged cache's causal rows hold
    every page of the table, the later ones empty); a row with none gets one empty item (its output zeros). The
    same on the host and traced, with long rows in pieces."""
    block = built_mask(lambda b, h, i, j: i >= j, 64, 64, 16)
    chain, _, _ = _attention.build_chain(*(jnp.zeros((64, 1, 16), jnp.float16),) * 3, block)
    plan = make_chain_plan(chain, "forward", ChainConfig(chunk=2))
    rows = np.repeat(np.arange(3), 4)
    flags = np.array([0, 2, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1], np.int8)
    env = {"Ai": rows, "flags": flags}
    for items, _ in (_chain_route.row_items(plan, env, np),
                     jax.jit(lambda env: _chain_route.row_items(plan, env, jnp))(env)):
        work = {tuple(item[:3]) for item in np.asarray(items).tolist() if item[0] >= 0}
        assert work == {(0, 1, 3), (1, 4, 4), (2, 8, 10), (2, 10, 12), (3, 12, 12)}, work  # (row 3: no blocks)


def test_blocks_out_of_range_attend_nowhere_in_the_schedule():
    """A stored block whose key block is outside the keys (a page index past the pool) gets flag 0, whatever its
    value says: kernels that skip reading positions in full tiles (the Hopper form over pages) never see it full."""
    block = built_mask(lambda b, h, i, j: i >= 0, 32, 64, 16)
    chain, _, _ = _attention.build_chain(*(jnp.zeros((n, 1, 16), jnp.float16) for n in (32, 64, 64)), block)
    arrays = {"Ai": np.array([0, 0, 0, 1, 1, 1]), "Ak": np.array([[0], [4], [-1], [3], [2], [9]]),
              "Av": np.array([[2], [2], [2], [1], [2], [1]], np.int8)}
    for flags in (_chain_route.block_flags(chain, arrays, np),
                  jax.jit(lambda arrays: _chain_route.block_flags(chain, arrays, jnp))(arrays)):
        assert np.asarray(flags).tolist() == [2, 0, 0, 1, 2, 0]


def test_rows_are_cut_into_pieces_where_too_few_programs_would_run():
    """Few rows (decoding a few long sequences) are cut into pieces that fill the GPU (`FILL` programs), while rows
    that fill it already run whole up to twice the mean row (causal attention's longest rows are not split)."""
    from jinsum.kernels._chain_plan import FILL  # noqa: PLC0415

    def chunk(queries, keys, heads):
        mask = built_mask(lambda b, h, i, j: i >= 0, queries, keys, 16)
        q = jnp.zeros((queries, heads, 16), jnp.float16)
        k = jnp.zeros((keys, heads, 16), jnp.float16)
        chain, _, _ = _attention.build_chain(q, k, k, mask)
        plan = make_chain_plan(chain, "forward")
        return plan.config.chunk, chain.entries, plan.segments * plan.grid_size

    few, entries, programs = chunk(64, 4096, 2)  # 4 rows of 256 blocks, 2 heads: 8 programs whole
    assert programs < FILL and few * FILL >= entries * 2 and few < entries // 4
    many, entries, programs = chunk(4096, 1024, 4)  # 256 rows of 64 blocks, 4 heads
    assert programs >= FILL and many == 2 * entries // 256


# --- attention ------------------------------------------------------------------------------------------------------

def test_attention_backward_adds_no_dq_atomically(rng):
    """GAT's rank-2 scores add dQ inside the dkdv kernel atomically by default; deterministic mode runs the dq
    kernel instead."""
    pattern, _ = graph_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape[:2], dim=2)
    default, _, _ = _attention.build_chain(q, k, v, pattern)
    with jinsum.deterministic(True):
        chain, arrays, _ = _attention.build_chain(q, k, v, pattern)
    assert make_chain_plan(default, "dkdv").dq_in_dkdv
    assert not make_chain_plan(chain, "dkdv").dq_in_dkdv
    route = _chain_route.route_chain(chain)
    plans = [route.plan(kind) for kind in ("forward", "dq", "dkdv")]
    assert not any("atomic" in generate_chain(p) for p in plans)
    if not ON_GPU and importlib.util.find_spec("torch"):
        out, lse = _reference_forward(chain, arrays)
        d_out = rng.standard_normal(out.shape).astype(np.float32)
        d_lse = np.zeros(lse.shape, np.float32)
        expected = _reference_backward(chain, arrays, (jnp.asarray(d_out), jnp.asarray(d_lse)))
        fused = _chain_triton.interpret_backward(chain, {**arrays, "O": out, "LSE": lse, "dO": d_out, "dLSE": d_lse})
        for name, actual, want in zip("QKV", fused, expected):
            assert_allclose(actual, np.asarray(want, np.float64), np.float32, err_msg=f"d{name}")


# --- errors -------------------------------------------------------------------------------------------------------

def test_bad_arguments_are_refused_clearly(rng):
    pattern = block_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape)
    with pytest.raises(TypeError, match="GroupCOO, jinsum.BlockGroupCOO or jinsum.BlockMask, got ndarray"):
        jinsum.attention(q, k, v, np.ones(pattern.shape))
    with pytest.raises(ValueError, match=r"pattern must be \(L, S\) = \(80, 70\) for these queries and keys; got q"):
        jinsum.attention(q, k[:-1], v[:-1], pattern)
    with pytest.raises(ValueError, match="must agree in head size D"):
        jinsum.attention(q, k[..., :4], v, pattern)
    with pytest.raises(ValueError, match="dropout needs a seed"):
        jinsum.attention(q, k, v, pattern, dropout=0.1)
    with pytest.raises(ValueError, match="dropout must be in"):
        jinsum.attention(q, k, v, pattern, dropout=1.0, seed=0)
    with pytest.raises(ValueError, match="self_loops needs a square GroupCOO"):
        jinsum.attention(q, k, v, pattern, self_loops=True)
    with pytest.raises(ValueError, match="key_padding_mask must be booleans of shape"):
        jinsum.attention(q, k, v, pattern, key_padding_mask=np.ones(3, bool))
    with pytest.raises(TypeError, match="uses a captured array in reduce_sum"):
        table = jnp.arange(4.0)
        jinsum.attention(q, k, v, pattern, score_mod=lambda s, b, h, i, j: s + table.sum())
    with pytest.raises(TypeError, match="mask_mod <lambda> must return one boolean"):
        jinsum.attention(q, k, v, pattern, mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(TypeError, match="must return one floating-point score"):
        jinsum.attention(q, k, v, pattern, score_mod=lambda s, b, h, i, j: i)


def test_repr_shows_the_chain_in_a_jaxpr(rng):
    pattern, _ = graph_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape[:2])
    text = str(jax.make_jaxpr(lambda q: jinsum.attention(q, k, v, pattern, score_mod=leaky, causal=True))(q))
    assert "softmax(S)" in text and "Q[Ai[g],h,d] * K[Ak[g,p],h,d]" in text and "score_mod=leaky" in text


def test_no_warning_on_the_reference_path(rng):
    pattern, _ = graph_pattern(rng)
    q, k, v = _qkv(rng, *pattern.shape[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.block_until_ready(jinsum.attention(q, k, v, pattern))


def test_block_sparse_attention_layer_with_batch_causal_and_key_padding(rng):
    from flax import nnx  # noqa: PLC0415

    import jinsum.nn  # noqa: PLC0415

    pattern = jinsum.block_pattern(64, 16, local_blocks=1, global_blocks=1, random_blocks=1, causal=True)
    layer = jinsum.nn.BlockSparseAttention(12, num_heads=2, head_dim=8, causal=True, rngs=nnx.Rngs(0))
    x = rng.standard_normal((3, 64, 12)).astype(np.float32)
    keep = rng.random((3, 64)) < 0.8
    out = nnx.jit(lambda layer, x, keep: layer(x, pattern, key_padding_mask=keep))(layer, x, keep)
    q, k, v = np.split(np.asarray(layer.qkv(x)).reshape(3, 64, 6, 8), 3, axis=2)
    heads = dense_attention(q, k, v, np.asarray(pattern.todense()) != 0, causal=True, key_mask=keep)[0]
    assert_allclose(out, np.asarray(layer.out(heads.reshape(3, 64, 16).astype(np.float32)), np.float64), np.float32)

"""One route from a statement to what runs (`jinsum._lowering._route`): the CUDA lowering and `jinsum.triton_source`
read the same decision. The CUDA lowering runs here too: `lower(lowering_platforms=("cuda",))` lowers for a GPU on
a CPU-only machine, without launching anything."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum._config import SMALL_TERMS
from jinsum._lowering._route import route
from jinsum.testing import specs_in

EXPRESSION = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"


def _spmm(rng, rows=40, features=8):
    A = jinsum.GroupCOO.from_dense((rng.random((rows, rows)) < 0.2).astype(np.float32))
    return A, rng.standard_normal((rows, features)).astype(np.float32)


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_a_small_statement_runs_on_xla_and_inspection_says_so(rng):
    """Below `jinsum.small_terms` the CUDA lowering emits XLA's operations (no kernel call), and `triton_source`
    reports that fallback with its reason (the terms against the threshold, and how to see the kernel anyway)
    instead of showing a kernel that never runs."""
    A, B = _spmm(rng)
    [spec] = specs_in(lambda B: A @ B, B)
    terms = int(np.prod(list(spec.extent.values())))
    with jinsum.small_terms(SMALL_TERMS):  # (the suite sends every statement to a kernel)
        assert terms < SMALL_TERMS
        assert route(spec).reason == "small" and not route(spec).kernel and not route(spec).warns
        assert "triton" not in _cuda_text(lambda B: A @ B, B)
        assert "no generated kernel (small); it runs on XLA" in jinsum.triton_source(lambda B: A @ B, B)
        with pytest.raises(ValueError, match=rf"{terms:,} terms \(g=\d+ x n=8 x p=\d+\) are fewer than "
                           rf"jinsum.small_terms = {SMALL_TERMS:,}.*`with jinsum.small_terms\(0\):`"):
            jinsum.triton_source(EXPRESSION, C=jnp.zeros(B.shape), Ai=A.Ai, Ak=A.Ak, Av=A.Av, B=B,
                                 sorted_indices=("Ai",))
    with jinsum.small_terms(0):
        assert route(spec).kernel
        assert "@triton.jit" in jinsum.triton_source(lambda B: A @ B, B)


def test_routes_by_platform_and_switch(rng):
    """Lowerings that launch no kernels route to XLA's lowering, as does `jinsum.triton(False)`, silently; a
    deterministic scatter through an unsorted index is split (rewritten into sorted segment reductions) on every
    platform, and each part routed again as written."""
    A, B = _spmm(rng)
    [spec] = specs_in(lambda B: A @ B, B)
    assert route(spec, kernels=False).reason == "not CUDA" and not route(spec, kernels=False).warns
    with jinsum.triton(False):
        assert route(spec).reason == "jinsum.triton is off" and not route(spec).warns
        with pytest.raises(ValueError, match=r"jinsum.triton is off; call triton_source under "):
            jinsum.triton_source(EXPRESSION, C=jnp.zeros(B.shape), Ai=A.Ai, Ak=A.Ak, Av=A.Av, B=B,
                                 sorted_indices=("Ai",))
    R = jnp.asarray(rng.integers(0, 5, 12), jnp.int32)
    with jinsum.deterministic(True):
        [scatter] = specs_in(lambda X: jinsum.einsum("O[R[e],f] += X[e,f]", O=jnp.zeros((5, 3)), R=R, X=X),
                             jnp.ones((12, 3)))
    for kernels in (True, False):
        assert route(scatter, kernels=kernels).rewritten
        assert not route(scatter, kernels=kernels, rewrite=False).rewritten


def test_the_triton_setting_changed_after_a_first_call_changes_the_next_call(rng):
    """`jinsum.triton` is a JAX configuration state in the jit cache key: the same jitted function called again
    under another value traces and lowers again (kNN's kernel path, here in Triton's interpreter, then the tiled XLA
    path), instead of reusing the first executable; back at the first value it reuses that one. The same through
    `jax.config.update`."""
    pytest.importorskip("torch")
    import jinsum.graphs as jg  # noqa: PLC0415
    from jinsum._lowering import _launch  # noqa: PLC0415

    pos = jnp.asarray(rng.standard_normal((20, 3)), jnp.float32)
    f = jax.jit(lambda p: jg.knn(p, 3))
    with _launch.interpreted():
        kernel = np.asarray(f(pos))
        assert "callback" in f.lower(pos).as_text()  # (the interpreter's host callback: the kernel path)
        with jinsum.triton(False):
            tiled = np.asarray(f(pos))
            assert "callback" not in f.lower(pos).as_text()
        assert f._cache_size() == 2
        f(pos)
        assert f._cache_size() == 2
        jax.config.update("jinsum_triton", False)
        try:
            assert "callback" not in f.lower(pos).as_text()
        finally:
            jax.config.update("jinsum_triton", True)
    np.testing.assert_array_equal(kernel, tiled)


def test_small_terms_is_in_the_jit_key_and_read_when_a_statement_is_lowered(rng):
    """`jinsum.small_terms` keys the jit cache too (a call under another value compiles anew), and the CUDA
    lowering reads it: a statement above the threshold gets a kernel, below it XLA's operations. Settings of the
    wrong type are refused."""
    A, B = _spmm(rng)
    f = jax.jit(lambda B: A @ B)
    f(B)
    with jinsum.small_terms(SMALL_TERMS):
        f(B)
        assert "triton" not in f.trace(B).lower(lowering_platforms=("cuda",)).as_text()
    assert f._cache_size() == 2
    for setting, wrong, error in (("small_terms", -1, r"jinsum.small_terms takes an int of 0 or more, got -1"),
                                  ("small_terms", "0", r"int config value must be None or of type int"),
                                  ("triton", "false", r"jinsum.triton takes a bool"),
                                  ("fuse", 0, r"jinsum.fuse takes a bool")):
        with pytest.raises((TypeError, ValueError), match=error):
            getattr(jinsum, setting)(wrong)

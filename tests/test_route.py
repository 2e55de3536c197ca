"""One route from a statement to what runs (`jinsum._lowering._route`): the CUDA lowering and `jinsum.triton_source`
read the same decision. The CUDA lowering runs here too: `lower(lowering_platforms=("cuda",))` lowers for a GPU on
a CPU-only machine, without launching anything."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum._lowering._route import SMALL_TERMS, route
from jinsum.testing import specs_in

EXPRESSION = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"


def _spmm(rng, rows=40, features=8):
    A = jinsum.GroupCOO.from_dense((rng.random((rows, rows)) < 0.2).astype(np.float32))
    return A, rng.standard_normal((rows, features)).astype(np.float32)


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_a_small_statement_runs_on_xla_and_inspection_says_so(rng, monkeypatch):
    """Below `SMALL_TERMS` the CUDA lowering emits XLA's operations (no kernel call), and `triton_source` reports
    that fallback with its reason instead of showing a kernel that never runs."""
    monkeypatch.delenv("JINSUM_SMALL_TERMS", raising=False)  # (the suite sends every statement to a kernel)
    A, B = _spmm(rng)
    [spec] = specs_in(lambda B: A @ B, B)
    assert np.prod(list(spec.extent.values())) < SMALL_TERMS
    assert route(spec).reason == "small" and not route(spec).kernel and not route(spec).warns
    assert "triton" not in _cuda_text(lambda B: A @ B, B)
    assert "no generated kernel (small); it runs on XLA" in jinsum.triton_source(lambda B: A @ B, B)
    with pytest.raises(ValueError, match=r"has no generated kernel: small"):
        jinsum.triton_source(EXPRESSION, C=jnp.zeros(B.shape), Ai=A.Ai, Ak=A.Ak, Av=A.Av, B=B,
                             sorted_indices=("Ai",))
    monkeypatch.setenv("JINSUM_SMALL_TERMS", "0")
    assert route(spec).kernel
    assert "@triton.jit" in jinsum.triton_source(lambda B: A @ B, B)


def test_routes_by_platform_and_switch(rng, monkeypatch):
    """Lowerings that launch no kernels route to XLA's lowering, as does `JINSUM_TRITON=0`, silently; a
    deterministic scatter through an unsorted index is split (rewritten into sorted segment reductions) on every
    platform, and each part routed again as written."""
    A, B = _spmm(rng)
    [spec] = specs_in(lambda B: A @ B, B)
    assert route(spec, kernels=False).reason == "not CUDA" and not route(spec, kernels=False).warns
    monkeypatch.setenv("JINSUM_TRITON", "0")
    assert route(spec).reason == "JINSUM_TRITON=0" and not route(spec).warns
    monkeypatch.delenv("JINSUM_TRITON")
    R = jnp.asarray(rng.integers(0, 5, 12), jnp.int32)
    with jinsum.deterministic(True):
        [scatter] = specs_in(lambda X: jinsum.einsum("O[R[e],f] += X[e,f]", O=jnp.zeros((5, 3)), R=R, X=X),
                             jnp.ones((12, 3)))
    for kernels in (True, False):
        assert route(scatter, kernels=kernels).rewritten
        assert not route(scatter, kernels=kernels, rewrite=False).rewritten

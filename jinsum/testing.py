"""Independent references and checkers, shared by the tests, the benchmarks and users checking their own calls.

`reference` evaluates an indirect Einsum in float64 NumPy by enumerating every assignment of its index variables:
no gathers-as-slices, no einsum, no scatter fusion, nothing shared with the lowerings but the parser. It is meant
for small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jinsum._lang import Access, Operand, Spec, Var, check, parse, tensor_names, walk
from jinsum._inspect import equations, kernel_specs
from jinsum._rules._primitive import jinsum_p

__all__ = ["reference", "assert_allclose", "tolerance", "check_vmap", "random_operands", "specs_in",
           "kernel_specs_in"]


def reference(expression: str, **operands) -> np.ndarray:
    """The indirect Einsum `expression` on `operands`, in float64 NumPy, by brute-force enumeration.

    Every name of the expression must be given (the left-hand side too). Indices must be in range.
    `max=` and `min=` reduce the products with `np.maximum.at` / `np.minimum.at`.
    """
    statement = parse(expression)
    arrays = {n: _host(operands[n]) for n in tensor_names(statement)}
    spec = check(statement, tuple(Operand(n, a.shape, _checked_dtype(operands[n])) for n, a in arrays.items()))
    loop = tuple(spec.extent[v] for v in spec.loop_variables)
    summed = tuple(spec.extent[v] for v in spec.summed_variables)
    # Loop variables vary slowest, so the products of one loop assignment are one row of a (loop, summed) table.
    everything = _grid((*spec.loop_variables, *spec.summed_variables), (*loop, *summed))
    products = np.ones(int(np.prod(loop + summed)))
    for factor in statement.factors:
        products = products * _read(factor, arrays, everything)
    table = products.reshape(int(np.prod(loop)), int(np.prod(summed)))
    reduce = {"sum": np.add, "max": np.maximum, "min": np.minimum}[statement.reduction]
    sums = reduce.reduce(table, axis=1, initial={"sum": 0.0, "max": -np.inf, "min": np.inf}[statement.reduction])
    lhs = statement.lhs
    target = tuple(_read(i, arrays, _grid(spec.loop_variables, loop)) if isinstance(i, Access)
                   else _grid(spec.loop_variables, loop)[i.name] for i in lhs.indices)
    out = arrays[lhs.tensor].copy()
    if statement.accumulate:
        reduce.at(out, target, sums)
    else:
        out[target] = sums
    return out


def _grid(names: tuple[str, ...], extents: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Every assignment of `names`, the first varying slowest: name -> its value in each assignment."""
    mesh = np.meshgrid(*map(np.arange, extents), indexing="ij")
    return {n: m.reshape(-1) for n, m in zip(names, mesh)}


def _read(access: Access, arrays: dict[str, np.ndarray], grid: dict[str, np.ndarray]) -> np.ndarray:
    index = tuple(grid[i.name] if isinstance(i, Var) else _read(i, arrays, grid) for i in access.indices)
    return arrays[access.tensor][index]


def _host(x) -> np.ndarray:
    x = np.asarray(x)
    return x if np.issubdtype(x.dtype, np.integer) else x.astype(np.float64)


def _checked_dtype(x) -> np.dtype:
    return np.dtype(getattr(x, "dtype", np.asarray(x).dtype))


# Relative tolerances (max |out - ref| / max |ref|) per value dtype: float32 accumulations of a few hundred terms,
# and 16-bit operands rounded once on input and once on output (their 8 / 11 significant bits).
_RTOL = {
    np.dtype(jnp.float64): 1e-12,
    np.dtype(jnp.float32): 1e-5,
    np.dtype(jnp.float16): 4e-3,
    np.dtype(jnp.bfloat16): 2e-2,
}


def dense_attention(q, k, v, allowed, *, bias=None, scale=None):
    """`(out, lse)` of softmax attention by brute force in float64: every score of `q` `(B?, L, H, D)` against `k`
    `(B?, S, H_kv, D)` (repeated to `H` heads: grouped-query attention), plus `bias`, masked where `allowed` is
    False (both broadcast to `(B, H, L, S)`), softmaxed per query row. A row with nothing to attend to gives 0
    and a log-sum-exp of +inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batched = q.ndim == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    group = q.shape[-2] // k.shape[-2]
    k, v = np.repeat(k, group, axis=-2), np.repeat(v, group, axis=-2)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("blhd,bshd->bhls", q, k) * scale
    if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64), s.shape)
    allowed = np.broadcast_to(np.asarray(allowed, bool), s.shape)
    s = np.where(allowed, s, -np.inf)
    top = s.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    w = np.where(allowed, np.exp(s - top), 0)
    total = w.sum(-1, keepdims=True)
    out = np.einsum("bhls,bshe->blhe", w / np.where(total > 0, total, 1), v)
    some = total[..., 0] > 0
    lse = np.where(some, top[..., 0] + np.log(np.where(some, total[..., 0], 1)), np.inf).transpose(0, 2, 1)
    return (out, lse) if batched else (out[0], lse[0])


def tolerance(dtype) -> float:
    """The relative tolerance the tests allow for results of `dtype` (float32 accumulation inside)."""
    return _RTOL[np.dtype(dtype)]


def assert_allclose(actual, expected, dtype, *, err_msg: str = "") -> None:
    """Asserts `max|actual - expected| <= tolerance(dtype) * max(1, max|expected|)` over the finite expected
    elements, the infinite ones equal (a `max=` row that no term reaches), and no NaN anywhere."""
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected, np.float64)
    dtype = np.dtype(dtype)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} != expected {expected.shape}. {err_msg}")
    if np.isnan(actual).any():
        raise AssertionError(f"NaN in the result. {err_msg}")
    infinite = np.isinf(expected)
    if (actual[infinite] != expected[infinite]).any() or np.isinf(actual[~infinite]).any():
        raise AssertionError(f"infinite elements differ: {int((np.isinf(actual) != infinite).sum())} of "
                             f"{actual.size}. {err_msg}")
    actual, expected = actual[~infinite], expected[~infinite]
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    error = float(np.abs(actual - expected).max(initial=0.0))
    if error > tolerance(dtype) * scale:
        raise AssertionError(f"max abs error {error:.3g} > {tolerance(dtype):.1g} x {scale:.3g} ({dtype}). {err_msg}")


def check_vmap(fn, args, in_axes, out_axes=0) -> None:
    """`jax.vmap(fn, in_axes, out_axes)(*args)` equals stacking `fn` over a Python loop of the batch."""
    batched = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes)(*args)
    size = next(np.shape(a)[ax] for a, ax in zip(args, in_axes) if ax is not None)
    looped = [fn(*(a if ax is None else jnp.take(a, b, axis=ax) for a, ax in zip(args, in_axes)))
              for b in range(size)]
    expected = np.stack([np.asarray(x, np.float64) for x in looped], axis=out_axes)
    assert_allclose(batched, expected, np.asarray(batched).dtype, err_msg="vmap vs loop")


def random_operands(spec: Spec, rng: np.random.Generator, dtype=None) -> dict[str, np.ndarray]:
    """Random operands for a checked statement: normal values (in `dtype`, default each operand's own) and index
    arrays in range of every dimension they address (sorted where the spec says so). The left-hand side is zeros
    where the spec promises that (`Spec.zero_lhs`)."""
    statement = spec.statement
    bounds: dict[str, int] = {}
    for access in statement.accesses:
        for node in walk(access):
            for dim, index in enumerate(node.indices):
                if isinstance(index, Access):
                    size = spec.operand[node.tensor].shape[dim]
                    bounds[index.tensor] = min(bounds.get(index.tensor, size), size)
    operands = {}
    for operand in spec.operands:
        if operand.name == spec.lhs.name and spec.zero_lhs:
            operands[operand.name] = np.zeros(operand.shape, dtype or operand.dtype)
        elif operand.name in bounds:
            values = rng.integers(0, max(bounds[operand.name], 1), operand.shape).astype(operand.dtype)
            operands[operand.name] = np.sort(values) if operand.name in spec.sorted_indices else values
        else:
            operands[operand.name] = rng.standard_normal(operand.shape).astype(dtype or operand.dtype)
    return operands


class CountingJit:
    """`jax.jit(fn, **jit_kwargs)` that counts its traces (`.traces`): how many programs it compiled, for tests that
    the jit cache does not grow with the data. (The C++ dispatch cache behind `_cache_size()` stayed empty for every
    function after some tests of a full run, so it cannot count compiles there.) Also a decorator."""

    def __init__(self, fn, **jit_kwargs):
        self.traces = 0

        def counted(*args, **kwargs):
            self.traces += 1
            return fn(*args, **kwargs)

        self._jitted = jax.jit(counted, **jit_kwargs)

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs)


def specs_in(fn, *args) -> list[Spec]:
    """The checked statements `fn(*args)` binds, in order, including those inside nested jaxprs (jit, grad, ...)."""
    return [eqn.params["spec"] for eqn in equations(fn, *args) if eqn.primitive is jinsum_p]


def kernel_specs_in(fn, *args) -> list[Spec]:
    """The statements that reach the default device's lowering when `fn(*args)` runs, split as their routes say
    (`jinsum._lowering._route`; on a GPU the CUDA lowering's): `specs_in`, with deterministic mode's scatters
    replaced by the sorted segment reductions they become."""
    return list(kernel_specs(fn, *args))

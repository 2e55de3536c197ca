"""Mixture of experts (issue 43): the expert matmul of a dropless MoE layer, `Y[rows of e] = X[rows of e] @ W[e]`,
in jinsum beside `jax.lax.ragged_dot`, `torch._grouped_mm` and one dense matmul of the same rows, forward and
forward + backward; and jinsum's whole `MoE` layer against its three grouped matmuls.

    python benchmarks/moe.py [--shapes mixtral fine] [--calls 20] [--out benchmarks/results]
    python benchmarks/moe.py --small --out /tmp/moe     # CPU: tiny sizes in float32, every JAX system, < 1 min
    python benchmarks/moe.py --small --torch-cpu ...    # also torch._grouped_mm on the CPU (bf16; where it has one)

Workloads (bfloat16; the routing from random router logits `(tokens, experts)`, standard normal, fixed seed, top-k
with Mixtral's renormalised weights: the groups are of uneven sizes, listed under the table):
- `mixtral`, Mixtral-like: 8,192 tokens, top-2 of 8 experts, 4096 -> 14336 (16,384 routed rows);
- `fine`, fine-grained: 16,384 tokens, top-8 of 128 experts, 2048 -> 768 (131,072 routed rows).

Systems, each timed forward and forward + backward:
1. jinsum, the grouped statements as `jinsum.nn.MoE` runs them, over the routing `GroupCOO` (experts x tokens) of
   `route_tokens`, which is built once outside the timed functions and passed to them as an argument:
   - `routed_linear` (`Y[Ak[g,p],n] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,n]`, run as the grouped product below and
     the combine `Y[Ak[g,p],n] += Av[g,p] * O[g,p,n]`): the tokens' weighted sums, `(tokens, N)`; and the same
     statement written as one, which the CUDA route splits (`contracted_first`);
   - the grouped-order form `H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]` (`jinsum.einsum`; the MoE layer's up and
     gate projections): one row per routed pair, `(groups, group size, N)`, the groups' padding included;
   - with several devices, the same layer with its experts and the tokens split over all of them
     (`MoE(..., mesh=, axis=)`: rows to their experts' devices and back with `all_to_all`), beside the layer on one;
   - the whole `MoE` layer (SwiGLU, `in_features = K`, `hidden_features = N`, bf16 parameters: router, routing,
     three expert matmuls, combine; its own router's routing) and `routed_mlp` on that layer's routing given (the
     three matmuls and the SwiGLU alone), each against three times the grouped form's time ("x 3 matmuls"; issue
     target for the layer, forward + backward: within 1.3x), and `route_tokens` alone (forward).
2. `jax.lax.ragged_dot(X_sorted, W, group_sizes)` on the rows sorted by expert (`X_sorted = X[token of each row]`,
   gathered outside the timed function). A failure (out of memory is expected on the fine-grained shape on an
   80 GB card) is a row with its error.
   On a GPU where tokamax is installed, also `tokamax.ragged_dot(X_sorted, W, group_sizes,
   implementation="mosaic")` (openxla's Mosaic GPU kernel for sm_90; `benchmarks/_tokamax.py`), checked the same way.
3. `torch._grouped_mm(X_sorted, W, offs=cumulative group sizes (int32))`, bf16 (the only dtype it takes), where
   torch has CUDA (with `--torch-cpu`, also on the CPU where torch has a CPU kernel: a check of the code path), in
   two layouts of W: `(E, K, N)` row-major, and stored `(E, N, K)` passed as its transposed view (torchtitan's
   `GroupedExperts`). Forward and backward: the forward, then `torch.autograd.grad` w.r.t. X_sorted and W, eager.
4. one dense matmul of the same rows, `X_sorted (T*k, K) @ W[0] (K, N)` in JAX: the Tensor Core limit.

Forward + backward, for every system: one jitted function `y, pullback = jax.vjp(f, x, w); return y, pullback(dy)`
returning the output and the gradients w.r.t. X and W for a random cotangent `dy` passed as an argument (the
grouped form's cotangent is zero on the groups' padding, as the MoE layer's combine gives it; the layer's: the
output's and 1 for its auxiliary loss, gradients w.r.t. all its parameters and x). Before it is timed, each
system's output and gradients are checked against a float32 reference, each expert's own matmul (precision
HIGHEST; batched over the experts, their rows padded with zeros to the largest group's, which compiles once where a
Python loop of E dots compiles hundreds for the fine-grained shape) differentiated by `jax.vjp` (relative error:
largest difference over largest magnitude, at most 2e-2 in bf16, 1e-3 in float32, twice that for the SwiGLU
layers' three products in a row); `routed_mlp`'s output and its gradients w.r.t. x and the three weights, the MoE
layer's output only (its gradients: tests/test_moe.py). The dense matmul is a different product and is not
checked. Timing: `jinsum.timing.time_calls` (back-to-back calls, one sync per round, median of rounds).

FLOPs: forward 2 * rows * K * N with rows = tokens * k, the routed rows (the grouped form also multiplies its groups'
padding, listed under the table, and the layers the router's 2 * tokens * K * E: neither is counted); forward +
backward 3x that; the MoE layer and `routed_mlp` three such matmuls. TFLOP/s over each time, "% peak" over the
device's dense bf16 Tensor Core peak (`sparse_linear.PEAKS`; float32 rows against TF32's). Ratios: the peer's
time over the system's (above 1: the system is faster): x ragged_dot, x torch (the faster torch layout), x dense;
"x 3 matmuls": the layer's time over three times the grouped form's (below 1.3 meets the issue's target). Results
go to `--out` as `moe_<device>.{md,csv}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jinsum  # noqa: E402
import jinsum.nn as jnn  # noqa: E402
from jinsum.timing import time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, baseline, command, device_file_name, device_name, ratio, sync_torch,
    text, torch_on_cuda, versions_text, write)
from _tokamax import import_tokamax  # noqa: E402
from sparse_linear import peak_tflops  # noqa: E402 (the peak table: one copy, there)

RESULTS = Results()
HIGHEST = jax.lax.Precision.HIGHEST

# The grouped-order statement of the MoE layer's up and gate projections (jinsum/nn/_moe.py, `_GATHERED`).
GROUPED = "H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"

ROUTED_LINEAR = "jinsum routed_linear (grouped product, combine)"
# The statement as a user writes it: the CUDA route splits it (and its derivatives) into Tensor Core parts.
COMBINED = "Y[Ak[g,p],n] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,n]"
ONE_STATEMENT = f"jinsum one statement {COMBINED} (split by the route)"
GROUPED_FORM = "jinsum grouped order H[g,p,h] (einsum)"
MOE_LAYER = "jinsum MoE layer (router, routing, SwiGLU: 3 matmuls, combine)"
ROUTED_MLP = "jinsum routed_mlp (SwiGLU: 3 matmuls, the layer's routing given)"
ROUTE_TOKENS = "jinsum route_tokens alone (the layer's routing)"
PARALLEL_LAYER = "jinsum MoE layer, experts and tokens over {} devices (all_to_all)"
RAGGED = "jax.lax.ragged_dot"
TOKAMAX = "tokamax ragged_dot (Mosaic GPU)"
TORCH_KN = "torch._grouped_mm, W (E, K, N)"
TORCH_NK = "torch._grouped_mm, W stored (E, N, K), transposed view"
DENSE = "dense X_sorted @ W[0] (JAX)"

PASSES = ("forward", "forward_backward")  # (the column keys' prefixes: forward_ms, forward_backward_tflops, ...)
PEERS = ("ragged_dot", "torch", "dense")  # (x ragged_dot, x torch, x dense)
CSV_FIELDS = ("workload", "system", "rows", "flops", "matmuls", "peak_tflops", "error",
              *(f"{p}_{c}" for p in PASSES for c in ("ms", "tflops", "of_peak", *(f"vs_{q}" for q in PEERS),
                                                     "vs_matmuls")), "note")
COLUMNS = (WORKLOAD, SYSTEM,
           *(column for p, shown in zip(PASSES, ("fwd", "fwd+bwd")) for column in (
               Column(f"{shown} ms", f"{p}_ms", "{:.3f}"), Column(f"{shown} TFLOP/s", f"{p}_tflops", "{:.0f}"),
               Column(f"{shown} % peak", f"{p}_of_peak", "{:.0%}"),
               *(Column(f"{shown} x {q}", f"{p}_vs_{q}", "{:.2f}") for q in PEERS),
               Column(f"{shown} x 3 matmuls", f"{p}_vs_matmuls", "{:.2f}"))),
           text("target (fwd+bwd x 3 matmuls)", "target"), Column("rel. error", "error", "{:.1e}"), NOTE)
TARGET = 1.3  # issue 43: the MoE layer's forward + backward within 1.3x of its three grouped matmuls


@dataclasses.dataclass(frozen=True)
class Shape:
    """A workload: `tokens` routed to `top_k` of `experts`, each expert a `k_in -> n_out` matrix."""

    name: str
    tokens: int
    experts: int
    top_k: int
    k_in: int
    n_out: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    def title(self, dtype) -> str:
        return (f"{self.name}: {self.tokens:,} tokens, top-{self.top_k} of {self.experts}, {self.k_in} -> "
                f"{self.n_out}, {jnp.dtype(dtype).name}")


SHAPES = {"mixtral": Shape("Mixtral-like", 8192, 8, 2, 4096, 14336),
          "fine": Shape("fine-grained", 16384, 128, 8, 2048, 768)}
SMALL = {"mixtral": Shape("Mixtral-like, small", 256, 8, 2, 64, 128),  # (multiples of 8: torch's 16-byte strides)
         "fine": Shape("fine-grained, small", 512, 32, 8, 64, 32)}


# --- the routing and its sorted rows ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Sorted:
    """A routing's (token, expert) pairs as rows sorted by expert (tokens in order within one), and where each row
    sits in the routing `GroupCOO`'s grouped order (`slot_g`, `slot_p`)."""

    token: np.ndarray  # (rows,) the token of each row
    expert: np.ndarray  # (rows,)
    weight: np.ndarray  # (rows,) its combine weight
    sizes: np.ndarray  # (E,) rows per expert
    slot_g: np.ndarray  # (rows,)
    slot_p: np.ndarray  # (rows,)
    groups: int
    group_size: int

    @property
    def layout(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The rows as experts x places (each expert's rows padded to the largest group's): `index` (E, M) the row
        at each place (0 past the group's end), `mask` (E, M) the places that hold one, `back` (rows,) the place
        of each row in the flattened (E * M)."""
        width = int(self.sizes.max())
        place = np.arange(len(self.token)) - (np.cumsum(self.sizes) - self.sizes)[self.expert]
        index = np.zeros((len(self.sizes), width), np.int32)
        index[self.expert, place] = np.arange(len(self.token))
        mask = np.arange(width)[None, :] < self.sizes[:, None]
        return jnp.asarray(index), jnp.asarray(mask), jnp.asarray(self.expert * width + place, jnp.int32)

    def describe(self) -> str:
        slots = self.groups * self.group_size
        return (f"{len(self.token):,} rows, {len(self.sizes)} experts of {self.sizes.min():,} to {self.sizes.max():,} "
                f"rows (mean {self.sizes.mean():,.0f}); grouped order: {self.groups:,} groups of {self.group_size} "
                f"slots, {slots - len(self.token):,} of padding ({1 - len(self.token) / slots:.1%})")


def sort_routing(routing: jnn.Routing) -> Sorted:
    """The rows of `routing`, checked against its `GroupCOO` (every row in one slot, of its token and expert)."""
    experts, weights = np.asarray(routing.experts), np.asarray(routing.weights, np.float32)
    top_k = experts.shape[1]
    A = routing.combine
    num_experts = A.shape[0]
    order = np.argsort(experts.reshape(-1), kind="stable")  # (pairs token-major, so tokens in order per expert)
    token = (order // top_k).astype(np.int32)
    expert = experts.reshape(-1)[order].astype(np.int32)
    weight = weights.reshape(-1)[order]
    sizes = np.bincount(expert, minlength=num_experts)
    Ai, Ak, Av = np.asarray(A.Ai), np.asarray(A.Ak), np.asarray(A.Av, np.float32)
    groups, group_size = Ak.shape
    place = np.arange(len(token)) - (np.cumsum(sizes) - sizes)[expert]  # the row's place among its expert's
    slot_g = np.searchsorted(Ai, expert, side="left") + place // group_size
    slot_p = place % group_size
    if not (np.array_equal(Ai[slot_g], expert) and np.array_equal(Ak[slot_g, slot_p], token)
            and np.allclose(Av[slot_g, slot_p], weight)):
        raise AssertionError("the routing GroupCOO's slots do not hold the rows sorted by expert in token order")
    if not np.isclose(Av.sum(), weight.sum()):  # (the other slots, the padding, hold 0)
        raise AssertionError("the routing GroupCOO holds weight outside the routed rows")
    return Sorted(token, expert, weight, sizes, slot_g.astype(np.int32), slot_p.astype(np.int32), groups,
                  group_size)


# --- float32 references: per-expert matmuls -------------------------------------------------------------------------

def per_expert(xs, w, layout):
    """`Y[rows of e] = X[rows of e] @ W[e]` in float32, precision HIGHEST: each expert's own matmul, the experts'
    matmuls batched as one dot over their rows padded to the largest group with zeros (`Sorted.layout`; a loop of
    E dots compiles E times over, hundreds of them for the fine-grained shape and its gradients)."""
    index, mask, back = layout
    padded = jnp.where(mask[..., None], xs[index].astype(jnp.float32), 0)  # (E, M, K)
    y = jnp.einsum("emk,ekn->emn", padded, w.astype(jnp.float32), precision=HIGHEST)
    return y.reshape(-1, y.shape[-1])[back]


def reference(fn, *args):
    """`fn(x, w)`'s value and its gradients w.r.t. `x` and `w` for the cotangent `args[-1]`, in float32."""
    *inputs, dy = (a.astype(jnp.float32) for a in args)

    @jax.jit
    def run(inputs, dy):
        y, pullback = jax.vjp(fn, *inputs)
        return y, pullback(dy)

    return run(inputs, dy)


def relative_error(actual, expected) -> float:
    """The largest difference over the largest magnitude of `expected` (the harness's measure, on the device)."""
    expected = jnp.asarray(expected, jnp.float32)
    return float(jnp.max(jnp.abs(jnp.asarray(actual).astype(jnp.float32) - expected))
                 / jnp.maximum(jnp.max(jnp.abs(expected)), 1e-30))


def check(actual, expected, tolerance: float, names=("output", "dX", "dW")) -> float:
    """The largest relative error of the leaves of `actual` from `expected`; raises past `tolerance`."""
    worst = 0.0
    for name, a, e in zip(names, jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        error = relative_error(a, e)
        if not error <= tolerance:
            raise AssertionError(f"{name} differs from the per-expert float32 reference: relative error {error:.3g}"
                                 f" > {tolerance:g}")
        worst = max(worst, error)
    return worst


def tolerance(dtype) -> float:
    return 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-3


# --- timing -----------------------------------------------------------------------------------------------------------

def jax_times(apply, diff: tuple, rest: tuple, dy, calls: int, expected=None, tol: float = 0.0,
              project=lambda y: y) -> dict:
    """The ms of `apply(*diff, *rest)` alone and of it with its backward in one jitted call returning the output
    and the gradients w.r.t. `diff` for the cotangent `dy`; checked first (`project(output)` and the gradients)
    against `expected = (output, gradients)` where given."""
    forward = jax.jit(apply)

    def forward_backward(diff, rest, dy):
        y, pullback = jax.vjp(lambda *d: apply(*d, *rest), *diff)
        return y, pullback(dy)

    both = jax.jit(forward_backward)
    measured = {}
    if expected is not None:
        measured["error"] = check(project(forward(*diff, *rest)), expected[0], tol, ("output",))
        y, grads = both(diff, rest, dy)
        measured["error"] = max(measured["error"], check((project(y), grads), expected, tol))
        del y, grads
    measured["forward_ms"] = 1e3 * time_calls(forward, *diff, *rest, calls=calls)
    measured["forward_backward_ms"] = 1e3 * time_calls(both, diff, rest, dy, calls=calls)
    return measured


def run(shape: Shape, dtype, calls: int, torch, torch_device: str | None, seed: int = 0) -> list[str]:
    """`shape`'s rows; returns the lines that describe its routings."""
    workload = shape.title(dtype)
    print(f"\n{workload}")
    tol, peak = tolerance(dtype), peak_tflops(dtype)
    K, N, E, k = shape.k_in, shape.n_out, shape.experts, shape.top_k
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (shape.tokens, K), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (E, K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
    logits = jax.random.normal(keys[2], (shape.tokens, E), jnp.float32)
    routing = jax.jit(jnn.route_tokens, static_argnums=1)(logits, k)  # (built once, outside the timed functions)
    rows = sort_routing(routing)
    combine = routing.combine.astype(dtype)
    token, layout = jnp.asarray(rows.token), rows.layout
    slot_g, slot_p = jnp.asarray(rows.slot_g), jnp.asarray(rows.slot_p)
    weight = jnp.asarray(rows.weight)
    xs = x[token]  # the rows sorted by expert
    sizes = jnp.asarray(rows.sizes, jnp.int32)
    dy_rows = jax.random.normal(keys[3], (shape.rows, N), jnp.float32).astype(dtype)
    dy_tokens = jax.random.normal(keys[4], (shape.tokens, N), jnp.float32).astype(dtype)
    grouped_shape = (rows.groups, rows.group_size, N)
    dh = jnp.zeros(grouped_shape, dtype).at[slot_g, slot_p].set(dy_rows)  # (zero on the padding)
    valid = jnp.zeros(grouped_shape[:2], bool).at[slot_g, slot_p].set(True)
    flops = 2.0 * shape.rows * K * N
    common = {"rows": shape.rows, "flops": flops, "matmuls": 1, "peak_tflops": peak}
    described = [f"- {workload}: {rows.describe()}."]

    # 1. jinsum, the routing given.
    def token_sums(apply):
        """`apply(x, w, A)`, each token's weighted sum of its experts' rows, timed against the float32 reference."""
        expected = reference(
            lambda x, w: jax.ops.segment_sum(weight[:, None] * per_expert(x[token], w, layout), token,
                                             shape.tokens), x, w, dy_tokens)
        return jax_times(apply, (x, w), (combine,), dy_tokens, calls, expected, tol)

    def grouped():
        expected = reference(
            lambda x, w: jnp.zeros(grouped_shape, jnp.float32).at[slot_g, slot_p].set(
                per_expert(x[token], w, layout)), x, w, dh)
        out = jax.ShapeDtypeStruct(grouped_shape, dtype)
        return jax_times(lambda x, w, A: jinsum.einsum(GROUPED, A=A, X=x, W=w, H=out), (x, w), (combine,), dh,
                         calls, expected, tol, project=lambda h: jnp.where(valid[..., None], h, 0))

    tokens_out = jax.ShapeDtypeStruct((shape.tokens, N), dtype)
    RESULTS.attempt(workload, ROUTED_LINEAR, lambda: token_sums(lambda x, w, A: jnn.routed_linear(x, A, w)),
                    **common)
    RESULTS.attempt(workload, ONE_STATEMENT, lambda: token_sums(
        lambda x, w, A: jinsum.einsum(COMBINED, A=A, X=x, W=w, Y=tokens_out)), **common)
    RESULTS.attempt(workload, GROUPED_FORM, grouped, **common)

    # 2. ragged_dot and 4. the dense matmul, on the sorted rows.
    try:
        expected_rows = reference(lambda xs, w: per_expert(xs, w, layout), xs, w, dy_rows)
    except Exception as error:  # noqa: BLE001 (the peers run unchecked then: said in their notes)
        print(f"  (the float32 reference of the sorted rows failed: {error})")
        expected_rows = None
    unchecked = {} if expected_rows is not None else {"note": "not checked: its float32 reference failed"}
    RESULTS.attempt(workload, RAGGED, lambda: {**unchecked, **jax_times(
        lambda xs, w, sizes: jax.lax.ragged_dot(xs, w, sizes), (xs, w), (sizes,), dy_rows, calls, expected_rows,
        tol)}, **common)
    tokamax = import_tokamax() if jax.default_backend() == "gpu" else None
    if tokamax is not None:
        def tokamax_times():
            apply = lambda xs, w, sizes: tokamax.ragged_dot(xs, w, sizes, implementation="mosaic")  # noqa: E731
            try:
                return {**unchecked, **jax_times(apply, (xs, w), (sizes,), dy_rows, calls, expected_rows, tol)}
            except AssertionError as error:  # (a wrong gradient is timed all the same, and said in the note)
                return {"note": f"timed, but {error}", **jax_times(apply, (xs, w), (sizes,), dy_rows, calls)}

        RESULTS.attempt(workload, TOKAMAX, tokamax_times, **common)
    RESULTS.attempt(workload, DENSE, lambda: {"note": "a different product (one matrix): not checked", **jax_times(
        lambda xs, w0: xs @ w0, (xs, w[0]), (), dy_rows, calls)}, **common)

    # 3. torch._grouped_mm.
    if torch is not None and torch_device is not None:
        torch_rows(torch, torch_device, workload, xs, w, rows.sizes, dy_rows, expected_rows, calls, common)

    # 1. the MoE layer, with its own router.
    # (three products in a row, the hidden activations rounded to the dtype between them: twice the tolerance)
    described.append(moe_rows(shape, dtype, x, keys[5], calls, workload, 2 * tol, peak))
    return described


def torch_rows(torch, device: str, workload: str, xs, w, sizes, dy_rows, expected, calls: int, common) -> None:
    """The two rows of `torch._grouped_mm` (layouts of W) on the sorted rows, bf16."""
    def tensor(a):
        return torch.from_numpy(np.array(a.astype(jnp.float32))).to(device=device, dtype=torch.bfloat16)

    sync = sync_torch if device == "cuda" else (lambda _: None)
    txs, tw, tdy = tensor(xs), tensor(w), tensor(dy_rows)
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).to(device)
    bf16_tol = tolerance(jnp.bfloat16)
    dtype_note = "" if jnp.dtype(xs.dtype) == jnp.bfloat16 else "bf16 (the only dtype it takes)"

    def measure(stored, view) -> dict:
        """`stored`: W as kept (the leaf of the gradient); `view(stored)`: the (E, K, N) operand passed."""
        def forward():
            return torch._grouped_mm(txs, view(stored), offs=offs)

        xg, wg = txs.clone().requires_grad_(), stored.clone().requires_grad_()

        def both():
            y = torch._grouped_mm(xg, view(wg), offs=offs)
            return y, torch.autograd.grad(y, (xg, wg), tdy)

        measured = {"note": dtype_note}
        if expected is not None:
            y, (dx, dw) = both()
            host = [jnp.asarray(t.detach().float().cpu().numpy()) for t in (y, dx, view(dw))]
            del y, dx, dw
            measured["error"] = check(host, expected, bf16_tol)
            del host
        else:
            measured["note"] = f"{dtype_note}; not checked: its float32 reference failed".lstrip("; ")
        measured["forward_ms"] = 1e3 * time_calls(forward, calls=calls, sync=sync)
        measured["forward_backward_ms"] = 1e3 * time_calls(both, calls=calls, sync=sync)
        return measured

    RESULTS.attempt(workload, TORCH_KN, lambda: measure(tw, lambda v: v), **common)
    RESULTS.attempt(workload, TORCH_NK, lambda: measure(tw.transpose(-2, -1).contiguous(),
                                                        lambda v: v.transpose(-2, -1)), **common)
    if device == "cuda":  # (the tensors above go with this call; the cache's blocks to JAX)
        torch.cuda.empty_cache()


def moe_rows(shape: Shape, dtype, x, key, calls: int, workload: str, tol: float, peak) -> str:
    """The rows of the MoE layer, `routed_mlp` on its routing, and `route_tokens` alone; returns the line that
    describes the layer's routing."""
    K, N = shape.k_in, shape.n_out
    layer = jnn.MoE(K, N, shape.experts, shape.top_k, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    _, _, layer_routing = jax.jit(lambda p, x: nnx.merge(graphdef, p, rest)(x, return_routing=True))(params, x)
    rows = sort_routing(layer_routing)
    token, layout, weight = jnp.asarray(rows.token), rows.layout, jnp.asarray(rows.weight)
    combine = layer_routing.combine.astype(dtype)
    w_up, w_gate, w_down = (layer.w_up[...], layer.w_gate[...], layer.w_down[...])
    keys = jax.random.split(key, 2)
    dy = jax.random.normal(keys[0], (shape.tokens, K), jnp.float32).astype(dtype)
    common = {"rows": shape.rows, "flops": 3 * 2.0 * shape.rows * K * N, "matmuls": 3, "peak_tflops": peak}

    def mlp_reference(x, w_up, w_gate, w_down):
        xs = x[token]
        hidden = jax.nn.silu(per_expert(xs, w_gate, layout)) * per_expert(xs, w_up, layout)
        return jax.ops.segment_sum(weight[:, None] * per_expert(hidden, w_down, layout), token, shape.tokens)

    def apply_mlp(x, w_up, w_gate, w_down, A):
        return jnn.routed_mlp(x, A, w_up, w_down, w_gate=w_gate)

    def routed_mlp():
        inputs = (x, w_up, w_gate, w_down)

        @jax.jit
        def expected(inputs, dy):
            y, pullback = jax.vjp(mlp_reference, *(a.astype(jnp.float32) for a in inputs))
            return y, pullback(dy.astype(jnp.float32))

        @jax.jit
        def forward_backward(inputs, dy):
            y, pullback = jax.vjp(lambda *d: apply_mlp(*d, combine), *inputs)
            return y, pullback(dy)

        error = check(forward_backward(inputs, dy), expected(inputs, dy), tol,
                      ("output", "dX", "dW_up", "dW_gate", "dW_down"))
        return {"error": error, **jax_times(apply_mlp, inputs, (combine,), dy, calls)}

    def moe_layer():
        def apply(params, x):
            return nnx.merge(graphdef, params, rest)(x)

        aux = jax.eval_shape(apply, params, x)[1]
        cotangent = (dy, jnp.ones(aux.shape, aux.dtype))
        y = jax.jit(apply)(params, x)[0]
        error = check(y, jax.jit(mlp_reference)(*(a.astype(jnp.float32) for a in (x, w_up, w_gate, w_down))), tol,
                      ("output",))
        del y
        return {**jax_times(apply, (params, x), (), cotangent, calls), "error": error,
                "note": "output checked (gradients: tests/test_moe.py)"}

    RESULTS.attempt(workload, MOE_LAYER, moe_layer, **common)
    RESULTS.attempt(workload, ROUTED_MLP, routed_mlp, **common)

    def route_alone():
        route = jax.jit(lambda params, x: jnn.route_tokens(
            nnx.merge(graphdef, params, rest).router(x.astype(jnp.float32)), shape.top_k))
        return {"forward_ms": 1e3 * time_calls(route, params, x, calls=calls),
                "note": "forward only: the router's logits and the routing GroupCOO"}

    RESULTS.attempt(workload, ROUTE_TOKENS, route_alone)

    devices = jax.device_count()
    if devices > 1 and shape.experts % devices == 0 and shape.tokens % devices == 0:
        def parallel_layer():
            mesh = jax.make_mesh((devices,), ("x",))
            split = jnn.MoE(K, N, shape.experts, shape.top_k, dtype=dtype, param_dtype=dtype, mesh=mesh, axis="x",
                            rngs=nnx.Rngs(0))  # (the same parameters as `layer`'s: the same seed and order)
            split_graphdef, split_params, split_rest = nnx.split(split, nnx.Param, ...)

            def apply(params, x):
                return nnx.merge(split_graphdef, params, split_rest)(x)

            # The tokens split over the devices as a data-parallel step holds them (the weights: by the layer).
            tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
            xs, dys = jax.device_put(x, tokens), jax.device_put(dy, tokens)
            aux = jax.eval_shape(apply, split_params, xs)[1]
            y = jax.jit(apply)(split_params, xs)[0]
            error = check(y, jax.jit(mlp_reference)(*(a.astype(jnp.float32) for a in (x, w_up, w_gate, w_down))),
                          tol, ("output",))
            del y
            measured = jax_times(apply, (split_params, xs), (), (dys, jnp.ones(aux.shape, aux.dtype)), calls)
            one = next((r for r in RESULTS.rows if r["workload"] == workload and r["system"] == MOE_LAYER), {})
            speedups = [f"{name} {one[f'{p}_ms'] / measured[f'{p}_ms']:.2f}x" for name, p in
                        (("fwd", "forward"), ("fwd+bwd", "forward_backward")) if one.get(f"{p}_ms")]
            return {**measured, "error": error, "note": "dropless (a capacity of every pair per destination); "
                    f"against the layer on one device: {', '.join(speedups) or 'not run'}"}

        # (% of peak: of all the devices' peaks together)
        RESULTS.attempt(workload, PARALLEL_LAYER.format(devices), parallel_layer,
                        **{**common, "peak_tflops": common["peak_tflops"] * devices})
    return f"- {workload}, the MoE layer's own router: {rows.describe()}."


# --- results ----------------------------------------------------------------------------------------------------------

def write_results(out: pathlib.Path, started: float, described: list[str], dtype) -> None:
    rows = RESULTS.rows
    for row in rows:
        for factor, p in ((1, "forward"), (3, "forward_backward")):  # (fwd+bwd: output, dX and dW)
            ms = row.get(f"{p}_ms")
            flops = row.get("flops")
            tflops = None if ms is None or not flops else factor * flops / (ms * 1e-3) / 1e12
            row[f"{p}_tflops"] = tflops
            row[f"{p}_of_peak"] = ratio(tflops, row.get("peak_tflops"))
            if row[f"{p}_of_peak"] and row[f"{p}_of_peak"] > 1:
                row["note"] = (f"{row.get('note') or ''} {p}: above the {row['peak_tflops']:.0f} TFLOP/s peak, a bug "
                               "in the benchmark").strip()
            if row.get("matmuls") == 1:
                torch_ms = [r[f"{p}_ms"] for r in rows if r["workload"] == row["workload"]
                            and r["system"] in (TORCH_KN, TORCH_NK) and r.get(f"{p}_ms")]
                row[f"{p}_vs_ragged_dot"] = ratio(baseline(rows, row, lambda r: r["system"] == RAGGED, f"{p}_ms"), ms)
                row[f"{p}_vs_torch"] = ratio(min(torch_ms, default=None), ms)
                row[f"{p}_vs_dense"] = ratio(baseline(rows, row, lambda r: r["system"] == DENSE, f"{p}_ms"), ms)
            elif row.get("matmuls") == 3:
                one = baseline(rows, row, lambda r: r["system"] == GROUPED_FORM, f"{p}_ms")
                row[f"{p}_vs_matmuls"] = ratio(ms, 3 * one if one else None)
        if row["system"] == MOE_LAYER:
            reached = row.get("forward_backward_vs_matmuls")
            row["target"] = f"<= {TARGET:g}x: " + ("not run" if reached is None else
                                                    "met" if reached <= TARGET else "missed")
    peaks = sorted({row["peak_tflops"] for row in rows if row.get("peak_tflops")})
    preamble = (
        f"{versions_text(('triton', 'jax_triton', 'torch'))}; `{command(__file__)}` ({time.time() - started:.0f} "
        f"s). The expert matmul of a dropless MoE layer, `Y[rows of e] = X[rows of e] @ W[e]`, "
        f"{jnp.dtype(dtype).name}, routing from random router logits (fixed seed). ms: median over rounds of "
        "back-to-back calls; fwd: the forward alone; fwd+bwd: the forward and the backward in one call (output, dX "
        "and dW for a random cotangent; torch: the forward, then `torch.autograd.grad`). jinsum's routing (the "
        "`GroupCOO` of `route_tokens`) and the peers' sorted rows and group sizes are built once, outside the timed "
        "functions; the MoE layer's row runs its router and routing inside. TFLOP/s: 2 x rows x K x N forward "
        "(rows: tokens x k, the routed rows; the MoE layer and routed_mlp three such matmuls; fwd+bwd 3x that) "
        "over the time; % peak: over the device's dense Tensor Core peak "
        f"({' / '.join(f'{p:.0f}' for p in peaks) or 'unknown device'} TFLOP/s). x ragged_dot, x torch (the faster "
        "torch layout), x dense: the peer's time over the system's (above 1: faster than the peer); x 3 matmuls: "
        "the time over three times the grouped form's (issue 43's target for the layer, fwd+bwd: within 1.3x). "
        "rel. error: the largest over output and gradients of (largest difference from a float32 per-expert "
        "reference) / (its largest magnitude).")
    write(out / f"moe_{device_file_name()}", f"Mixture of experts on {device_name()}", [preamble], COLUMNS, rows,
          csv_fields=CSV_FIELDS, after=["", "Routings:", *described])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["mixtral", "fine"])
    p.add_argument("--small", action="store_true", help="tiny sizes in float32: a check on the CPU")
    p.add_argument("--torch-cpu", action="store_true",
                   help="run torch._grouped_mm on the CPU where torch has no CUDA (a check of its code path)")
    p.add_argument("--calls", type=int, default=None, help="calls per timing round (default 20; --small: 2)")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    started = time.time()
    dtype = jnp.float32 if args.small else jnp.bfloat16
    calls = args.calls or (2 if args.small else 20)
    torch = torch_on_cuda()
    torch_device = "cuda" if torch is not None else None
    if torch is None and args.torch_cpu:
        import torch  # noqa: PLC0415
        torch_device = "cpu"
    described = []
    for name in args.shapes:
        described += run((SMALL if args.small else SHAPES)[name], dtype, calls, torch, torch_device)
    write_results(args.out, started, described, dtype)


if __name__ == "__main__":
    main()

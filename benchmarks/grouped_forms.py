"""A grouped product's forward in its two forms on one GPU: the Hopper form of the tile core (Gluon, a persistent
warp-specialised program; sm_90) against the Triton form, the same statements, timed interleaved.

    python benchmarks/grouped_forms.py [--calls 20] [--out benchmarks/results] [--shapes ...] [--statements 0 1 2 3]

Workloads (bf16; the routing from random router logits, top-k, `jinsum.nn.route_tokens`: groups of 128 rows of one
expert, padded): Mixtral-like, 8,192 tokens to 2 of 8 experts, 4096 -> 14336; fine-grained, 16,384 tokens to 8 of
128 experts, 2048 -> 768. Statements: the up projection, its rows gathered by token
(`H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]`), and the down projection, its rows in grouped order
(`O[g,p,n] += H[g,p,h] * W[Ai[g],h,n]`, the same sizes), and the up projection's input gradient
(`dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]`: in the Hopper form the products stored in grouped order, then added
into their tokens' rows; in the Triton form each tile added atomically into float32 rows, cast after) and weight
gradient (`dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]`: its rows gathered first, then each expert's groups summed; in
the Triton form gathered in its loop where the columns are fewer than 8 tiles). Each form is forced with
`jinsum.kernels.forced_config` while its function is traced (a function of its own each: two jits of one
function share its lowering). TFLOP/s count the routed rows (2 * tokens * k * K * N; the groups' padding is
multiplied too and not counted); the forms' outputs are compared (max abs difference). This is the measurement
that decides the route's default for grouped products (`jinsum.kernels.statement_config`).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jinsum
from jinsum.kernels import KernelConfig, forced_config, statement_config
from jinsum.nn import route_tokens
from jinsum.timing import time_interleaved

from _harness import Results, record_forms, write_forms

HERE = pathlib.Path(__file__).parent
SHAPES = {"Mixtral-like": (8192, 8, 2, 4096, 14336), "fine-grained": (16384, 128, 8, 2048, 768)}
GATHERED = "H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"
IN_ORDER = "O[g,p,n] += H[g,p,h] * W[Ai[g],h,n]"
SCATTER = "dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]"
SUMS = "dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--statements", nargs="+", type=int, choices=range(4), default=range(4),
                        help="which statements, by position (0: up projection, 1: down, 2: input gradient, 3: weight)")
    args = parser.parse_args()
    forms = {"Hopper form (Gluon)": statement_config(), "Triton form": KernelConfig()}
    results = Results()
    rng = np.random.default_rng(0)
    for shape, (tokens, experts, top_k, k, n) in ((s, SHAPES[s]) for s in args.shapes):
        routing = route_tokens(jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32), top_k).combine
        x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((experts, k, n)) / np.sqrt(k), jnp.bfloat16)
        rows = jnp.asarray(rng.standard_normal((*routing.Ak.shape, k)), jnp.bfloat16)
        products = jnp.asarray(rng.standard_normal((*routing.Ak.shape, n)), jnp.bfloat16)
        out = jax.ShapeDtypeStruct((*routing.Ak.shape, n), jnp.bfloat16)
        statements = {
            GATHERED: lambda x, w: jinsum.einsum(GATHERED, Ak=routing.Ak, Ai=routing.Ai, X=x, W=w, H=out,
                                                 sorted_indices=("Ai",)),
            IN_ORDER: lambda x, w: jinsum.einsum(IN_ORDER, H=rows, Ai=routing.Ai, W=w, O=out, sorted_indices=("Ai",)),
            SCATTER: lambda x, w: jinsum.einsum(SCATTER, Ak=routing.Ak, Ai=routing.Ai, dH=products, W=w,
                                                dX=jax.ShapeDtypeStruct(x.shape, x.dtype), sorted_indices=("Ai",)),
            SUMS: lambda x, w: jinsum.einsum(SUMS, Ak=routing.Ak, Ai=routing.Ai, X=x, dH=products,
                                             dW=jax.ShapeDtypeStruct(w.shape, w.dtype), sorted_indices=("Ai",)),
        }
        flops = 2 * tokens * top_k * k * n
        groups, size = routing.Ak.shape
        padding = f"{groups} groups of {size}: {groups * size / (tokens * top_k) - 1:.1%} padding"
        for position, (statement, fn) in enumerate(statements.items()):
            if position not in args.statements:
                continue
            name = f"{shape} ({tokens} tokens, top-{top_k} of {experts}, {k} -> {n}): {statement}"
            calls, outputs = {}, {}
            for form, config in forms.items():
                with forced_config(config):  # (a function of its own: jit's caches know the function, not the form)
                    run = jax.jit(lambda x, w, fn=fn: fn(x, w))
                    outputs[form] = np.asarray(run(x, w), np.float32)
                calls[form] = lambda run=run: run(x, w)
            times = time_interleaved(calls, calls=args.calls, rounds=7)
            record_forms(results, name, times, outputs, flops, padding)
    write_forms(results, args.out, "grouped_forms", "A grouped product's two forms", __file__, args.calls)


if __name__ == "__main__":
    main()

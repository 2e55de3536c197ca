"""Attention in its two forms on one GPU: the Hopper form of the tile core (Gluon, warp-specialised; sm_90: the
forward and both backward kernels) against the Triton form, the same chains and work lists, timed interleaved.

    python benchmarks/attention_forms.py [--calls 20] [--out benchmarks/results]

Workloads (bf16, batch 1, blocks of 128, masks from `jinsum.sequence_mask`): causal attention within 15 packed
documents at 16,384 positions (16 heads of 64, and of 128), a causal sliding window of 1,024 at 32,768 (16 x 64),
causal grouped-query attention at 8,192 (32 query and 8 key/value heads of 128) and causal multi-head attention at
8,192 (16 x 128). Each form is forced with `jinsum.kernels.forced_config` while its function is first traced, so
the route (made when the chain is bound) takes it. Forward, and forward+backward (the gradients of a random
cotangent, every kernel in the form timed). TFLOP/s count the attended pairs only:
4 * pairs * D * H forward, 3.5 times that forward+backward (FlashAttention's count); the outputs (the key
gradients) of the two forms are compared (max abs difference). This is the measurement that decides which head
sizes the route gives the Hopper form (`jinsum.kernels._chain_plan.HOPPER_HEADS`).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jinsum
from jinsum.kernels import ChainConfig, forced_config
from jinsum.kernels._chain_plan import HOPPER_HEADS
from jinsum.timing import time_interleaved

from _harness import Results, record_forms, write_forms

HERE = pathlib.Path(__file__).parent
FORMS = {"Hopper form (Gluon)": ChainConfig(descriptors=True, hopper=True),
         "Triton form": ChainConfig(descriptors=True)}


def _documents(length: int, count: int, seed: int = 0) -> np.ndarray:
    """Each position's document: `count` documents of random lengths."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
    starts = np.zeros(length, np.int32)
    starts[cuts] = 1
    return np.cumsum(starts).astype(np.int32)


def workloads():
    """`(name, length, heads, kv_heads, dim, mask, attended pairs)` of each workload."""
    for dim in (64, 128):
        doc = _documents(16384, 15)
        pairs = sum(n * (n + 1) // 2 for n in np.bincount(doc))
        yield (f"documents L=16384 (15 docs, 16x{dim})", 16384, 16, 16, dim,
               jinsum.sequence_mask(16384, 128, document_ids=jnp.asarray(doc), causal=True), pairs)
    window = 1024
    yield ("window 1024 L=32768 (16x64)", 32768, 16, 16, 64,
           jinsum.sequence_mask(32768, 128, causal=True, window=window),
           sum(min(i + 1, window) for i in range(32768)))
    causal = jinsum.sequence_mask(8192, 128, causal=True)
    yield "gqa causal L=8192 (32q/8kv x128)", 8192, 32, 8, 128, causal, 8192 * 8193 // 2
    yield "dense causal L=8192 (16x128)", 8192, 16, 16, 128, causal, 8192 * 8193 // 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = parser.parse_args()
    results = Results()
    rng = np.random.default_rng(0)
    for name, length, heads, kv_heads, dim, mask, pairs in workloads():
        q = jnp.asarray(rng.standard_normal((length, heads, dim)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((length, kv_heads, dim)), jnp.bfloat16) for _ in range(2))
        cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
        note = "" if dim in HOPPER_HEADS else f"heads of {dim}: the route keeps the Triton form (HOPPER_HEADS)"
        for backward in (False, True):
            calls, outputs = {}, {}
            for form, config in FORMS.items():
                with forced_config(config):  # (the route is made while the function is traced)
                    if backward:
                        run = jax.jit(lambda q, k, v, t: jax.vjp(lambda q, k, v: jinsum.attention(q, k, v, mask),
                                                                 q, k, v)[1](t))
                        outputs[form] = np.asarray(run(q, k, v, cotangent)[1], np.float32)
                        calls[form] = lambda run=run: run(q, k, v, cotangent)
                    else:
                        run = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, mask))
                        outputs[form] = np.asarray(run(q, k, v), np.float32)
                        calls[form] = lambda run=run: run(q, k, v)
            times = time_interleaved(calls, calls=args.calls, rounds=7)
            flops = 4 * pairs * dim * heads * (3.5 if backward else 1)
            record_forms(results, f"{name} {'forward+backward' if backward else 'forward'}", times, outputs, flops,
                         note)
    write_forms(results, args.out, "attention_forms", "Attention's two forms", __file__, args.calls)


if __name__ == "__main__":
    main()

"""Fused attention on a GPU: block-sparse and masked attention against their peers, and a GAT training step.

    python benchmarks/attention.py [--workloads bigbird,document,window,gqa,dense] [--lengths 4096 8192 16384]
                                   [--gat-scale 17] [--out benchmarks/results]
    JINSUM_TRITON=0 python benchmarks/attention.py --smoke --gat-scale 0    # tiny sizes, jinsum only, runs on CPU

Attention workloads (`--workloads`, comma-separated; all by default): bf16, batch 1, blocks of 128, `L = S`, each
timed forward and forward+backward (`jax.vjp` / `torch.autograd.grad` of the output against a random cotangent).

1. `bigbird`: block-sparse attention, 16 heads of 64, BigBird pattern (1 local, 1 global and 2 random blocks per
   block row: `jinsum.block_pattern`), at each of `--lengths`:
   - jinsum fused: `jinsum.attention` (one generated kernel, plus the combine of the split global row; the
     FlashAttention-2 backward);
   - jinsum unfused: the same chain as separate statements (block SDDMM, segment max/sum, block SpMM);
   - FlexAttention: `torch.compile(flex_attention)` with a `BlockMask` of the same blocks (full blocks);
   - dense FlashAttention: `torch.nn.functional.scaled_dot_product_attention` (no mask: all L^2 scores);
   - dense cuDNN: `jax.nn.dot_product_attention(implementation="cudnn")`.
2. `document`: causal attention within packed documents: one sequence of 16,384 positions cut into 15 documents of
   random (seeded) lengths, 16 heads of 64:
   - jinsum fused (mask prebuilt): `jinsum.sequence_mask(L, 128, document_ids=doc, causal=True)` built once and
     closed over by the jitted function (its work lists are then computed on the host, once), as Flex's block
     mask is built once outside its timed call;
   - jinsum fused (mask prebuilt, tight capacity): the same mask from `jinsum.block_mask` with exactly as many slots
     as blocks attend (`sequence_mask` leaves the causal half's slots for any document boundaries);
   - jinsum fused (mask prebuilt, an argument): the prebuilt `BlockMask` passed to the jitted function (work lists
     computed on the device at every call, as for a mask that changes every step);
   - jinsum fused (mask on device): `sequence_mask` inside the jitted function, the document ids its argument: the
     mask is built at every call, as in a training step whose batches pack new documents;
   - FlexAttention: `create_block_mask` of `mask_mod = (doc[q] == doc[kv]) & (q >= kv)` over a torch tensor of the
     document ids, built once, and `torch.compile(flex_attention)`;
   - cuDNN packed segments: `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (JAX's internal cuDNN
     entry point; the public `jax.nn.dot_product_attention` has no segments) with the documents' starts as
     `q_offsets`/`kv_offsets` and their lengths as `q_seqlen`/`kv_seqlen`, causal within each document;
   - dense FlashAttention (torch SDPA, causal): `is_causal=True` over the whole sequence, ignoring the documents:
     a speed reference only (not compared).
   And the mask building alone (`document mask build`): jinsum's `jax.jit(sequence_mask)` of the document ids,
   Flex's `create_block_mask` (eager, and `torch.compile(create_block_mask)`), and the host way for reference: the
   element mask in NumPy and `BlockGroupCOO.from_dense` (one call, `time.perf_counter`).
3. `window`: causal sliding window of 1,024 positions at 32,768 positions, 16 heads of 64: jinsum
   (`sequence_mask(L, 128, causal=True, window=1024)` built outside the timed call, and built inside it),
   FlexAttention (`create_block_mask` of `(q >= kv) & (q - kv < 1024)`), cuDNN's own sliding window
   (`jax.nn.dot_product_attention(is_causal=True, local_window_size=(1023, 0), implementation="cudnn")`) and dense
   causal FlashAttention (torch SDPA, ignoring the window: a speed reference only).
4. `gqa`: causal grouped-query attention at 8,192 positions, 32 query heads and 8 key/value heads of 128: jinsum
   (`k`, `v` of 8 heads read in place; `sequence_mask(L, 128, causal=True)`), the same through a block pattern
   (`block_pattern(L, 128, local_blocks=L // 128, causal=True)`: every block at or below the diagonal stored, the
   diagonal ones lower triangular, passed with `causal=True`, as the README's example does; issue 42: its `x
   jinsum`, over the `sequence_mask` row, should be <= 1.05), FlexAttention (`enable_gqa=True`, a causal block
   mask), FlashAttention (torch SDPA, flash backend, `is_causal=True` with `enable_gqa=True`, or `k`, `v` repeated
   where the backend refuses it: the note says which), cuDNN (`jax.nn.dot_product_attention`, `is_causal=True`;
   grouped heads natively, else repeated: the note says which), tokamax's Mosaic GPU kernel
   (`tokamax.dot_product_attention(is_causal=True, implementation="mosaic")`, openxla's JAX kernels for sm_90;
   where tokamax is installed: `benchmarks/_tokamax.py`). Printed once per workload: how many stored blocks
   the kernels treat as full (no mask read), partial (masked element by element) or empty, for both jinsum
   patterns (`_chain_route.block_flags`, the library's own classification).
5. `dense`: causal multi-head attention at 8,192 positions, 16 heads of 128: jinsum (`sequence_mask` causal, and
   `block_pattern` with `causal=True` as for `gqa`), FlexAttention (causal block mask), FlashAttention (torch SDPA,
   flash backend, `is_causal=True`), cuDNN, tokamax's Mosaic GPU kernel.

TFLOP/s count the attended (query, key) pairs only, the same count for every system of a workload (BigBird: the
stored blocks; causal: L(L+1)/2; documents: the sum over documents; so a dense reference that computes more pairs
shows fewer TFLOP/s): 4 * pairs * D * H forward, 3.5x that forward+backward. Outputs and gradients of the systems
computing the same mask are checked against FlexAttention (max abs difference).

6. GAT training step (2 layers: 4 heads x 64, then 1 head; forward, backward and Adam; dropout 0.6) on an
   R-MAT graph made undirected (scale 17: 131k nodes, ~3.7M edges), 128 synthetic input features, 40 classes:
   jinsum `GATConv` (fused; and with `dtype=bfloat16`, float32 parameters), the same layer unfused
   (`JINSUM_FUSE=0`: the chain's statements as separate kernels), the same model with gathers and
   `jax.ops.segment_*` (examples/gat), and PyG's `GATConv` where torch_geometric is installed (`--gat-scale 0`
   skips it).

`--smoke` runs every attention workload at tiny sizes (512 positions, BigBird 1,024; a few heads) through the jinsum
systems only and checks them against a dense XLA reference with the element mask (exits non-zero on a mismatch): it
runs on CPU (with `JINSUM_TRITON=0`), so the code paths can be checked without a GPU.

Every system is timed the same way (`jinsum.timing.time_calls`: warm-up, back-to-back calls, one
synchronisation, median of rounds). Results go to `--out` as `attention_<device>.{md,csv}` (`_harness.write`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import os
import pathlib
import sys
import time
from collections.abc import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
# JAX grows its memory pool on demand up to this fraction of the GPU and keeps what it took; the rest stays for
# torch (Flex's eager `create_block_mask` materialises the L x S mask and its index arithmetic: ~10 GB at 32k).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jinsum  # noqa: E402
import jinsum.graphs as jg  # noqa: E402
import jinsum.nn as jnn  # noqa: E402
from jinsum import _attention  # noqa: E402
from jinsum._attention import _chain_reference, _chain_route  # noqa: E402
from jinsum.datasets import rmat  # noqa: E402
from jinsum.kernels import ChainConfig, forced_config  # noqa: E402
from jinsum.timing import kernel_times, time_calls  # noqa: E402

from _harness import (  # noqa: E402 (benchmarks/, this script's folder)
    NOTE, SYSTEM, WORKLOAD, Column, Results, baseline, command, device_file_name, device_name, ratio, sync_torch,
    versions_text, write)
from _tokamax import import_tokamax  # noqa: E402
from _training import train_step  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = Results()
WORKLOADS = ("bigbird", "document", "window", "gqa", "dense")
PASSES = ("forward", "forward+backward")
BLOCK = 128
FLEX = "FlexAttention (torch.compile)"
REFERENCE = "dense XLA, element mask (smoke reference)"
SDPA_CAUSAL = "dense FlashAttention (torch SDPA, causal)"
NO_MASK = "no mask: all L^2 scores"
SMOKE_TOLERANCE = 0.1  # max abs difference from the float32 reference, bf16 inputs of unit variance
TORCH_DEVICE = "cuda"


class Options:
    """What this run does: set once by `main`."""

    def __init__(self):
        self.calls = 20
        self.smoke = False        # tiny sizes, jinsum systems only, checked against a dense reference
        self.on_gpu = False
        self.jax_peers = False    # cuDNN through JAX (a CUDA GPU, not --smoke)
        self.torch_peers = False  # FlexAttention, torch SDPA, PyG (also torch with CUDA)
        self.mismatches: list[str] = []  # --smoke: results off the reference


OPTS = Options()

# The sizes of the workloads (--smoke: tiny ones).
SIZES = {
    "full": dict(document=dict(length=16384, documents=15, heads=16, dim=64),
                 window=dict(length=32768, window=1024, heads=16, dim=64),
                 gqa=dict(length=8192, heads=32, kv_heads=8, dim=128),
                 dense=dict(length=8192, heads=16, kv_heads=16, dim=128),
                 bigbird=dict(heads=16, dim=64)),  # lengths: --lengths
    "smoke": dict(bigbird=dict(heads=2, dim=32),
                  document=dict(length=512, documents=5, heads=2, dim=32),
                  window=dict(length=512, window=256, heads=2, dim=32),
                  gqa=dict(length=512, heads=4, kv_heads=2, dim=32),
                  dense=dict(length=512, heads=2, kv_heads=2, dim=32)),
}


def _flops(pairs: int, heads: int, dim: int) -> dict[str, float]:
    """Floating-point operations of attending `pairs` (query, key) pairs: two products of `dim` per pair and head
    forward; the backward's five products make forward+backward 3.5x the forward."""
    forward = 4 * pairs * dim * heads
    return {"forward": forward, "forward+backward": 3.5 * forward}


def _timed(seconds: float, flops: float) -> dict[str, float]:
    """A row's columns of a call of `flops` operations that took `seconds`."""
    return {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}


def _inputs(seed: int, length: int, heads: int, kv_heads: int, dim: int):
    """bf16 `q`, `d_out` `(L, H, D)` and `k`, `v` `(L, H_kv, D)` of unit variance."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (length, heads, dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (length, kv_heads, dim), jnp.bfloat16) for key in keys[1:3])
    d_out = jax.random.normal(keys[3], (length, heads, dim), jnp.bfloat16)
    return q, k, v, d_out


def _leaves(result) -> list[np.ndarray]:
    """A system's output (or its gradients) as float32 NumPy arrays `(L, H, D)`, off the device; torch's
    `(1, H, L, D)` tensors are laid out as JAX's."""
    items = result if isinstance(result, tuple) else (result,)
    if torch is not None and all(isinstance(r, torch.Tensor) for r in items):
        return [np.asarray(r.detach().permute(0, 2, 1, 3)[0].float().cpu()) for r in items]
    return [np.asarray(r, np.float32) for r in jax.tree.leaves(result)]


def time_jax(name: str, system: str, fn, arrays, flops, outputs, *, extra=(), note=None, keep=True,
             show=False, hlo_copies=False) -> None:
    """Times `fn(q, k, v, *extra)` forward and forward+backward (`jax.vjp` with respect to `q`, `k`, `v`), each
    jitted with `q`, `k`, `v` and `extra` its arguments. `keep`: its results go to `outputs` for `_compare`;
    `show` (on a GPU): where the device time goes; `hlo_copies`: the copies in the optimized HLO."""
    q, k, v, d_out = arrays

    def gradients(q, k, v, *rest):
        *others, cotangent = rest
        return jax.vjp(lambda q, k, v: fn(q, k, v, *others), q, k, v)[1](cotangent)

    for pass_name in PASSES:
        compiled, args = ((jax.jit(fn), (q, k, v, *extra)) if pass_name == "forward" else
                          (jax.jit(gradients), (q, k, v, *extra, d_out)))
        timed = RESULTS.attempt(f"{name} {pass_name}", system, lambda: _timed(
            time_calls(compiled, *args, calls=OPTS.calls), flops[pass_name]), note=note)
        if timed is None:
            continue
        if keep:
            outputs[system, pass_name] = _leaves(compiled(*args))
        if show and OPTS.on_gpu:
            breakdown(compiled, args)
        if hlo_copies and OPTS.on_gpu:
            copies = [line.strip()[:150] for line in compiled.lower(*args).compile().as_text().splitlines()
                      if " copy(" in line or "copy-start" in line]
            print(f"    {len(copies)} copies in the optimized HLO", *copies[:6], sep="\n      ")


def time_torch(name: str, system: str, fn, tensors, flops, outputs, *, note=None, keep=True) -> None:
    """Times `fn(q, k, v)` on torch tensors `(1, H, L, D)` forward (`no_grad`) and forward+backward
    (`torch.autograd.grad` with respect to `q`, `k`, `v`), synchronising the device as `time_calls` does for JAX."""
    q, k, v, d_out = tensors
    for pass_name in PASSES:
        if pass_name == "forward":
            def run(fn=fn):
                with torch.no_grad():
                    return fn(q, k, v)
        else:
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

            def run(fn=fn, qg=qg, kg=kg, vg=vg):
                return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), d_out)
        timed = RESULTS.attempt(f"{name} {pass_name}", system, lambda run=run: _timed(
            time_calls(run, calls=OPTS.calls, sync=sync_torch), flops[pass_name]), note=note)
        if timed is not None and keep:
            outputs[system, pass_name] = _leaves(run())


def _to_torch(arrays):
    """JAX `(L, H, D)` arrays as torch bf16 `(1, H, L, D)` tensors on the device."""
    return tuple(torch.from_numpy(np.array(x.astype(jnp.float32))).to(TORCH_DEVICE, torch.bfloat16)
                 .permute(1, 0, 2)[None].contiguous() for x in arrays)


def _flex():
    """A fresh `torch.compile(flex_attention)`: dynamo's caches are reset first, so no workload runs into its
    recompilation limit (which would fall back to the eager, dense flex_attention) or into dynamic shapes."""
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def _create_block_mask(mask_mod, length):
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

    return create_block_mask(mask_mod, None, None, length, length, device=TORCH_DEVICE, BLOCK_SIZE=BLOCK)


def _sdpa_flash(**kwargs):
    """torch SDPA restricted to the FlashAttention backend (the backward follows the forward's backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    def fn(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return fn


def _cudnn(**options):
    """cuDNN's attention through JAX (`jax.nn.dot_product_attention`) with `options`, on `(L, H, D)` arrays."""
    def fn(q, k, v):
        return jax.nn.dot_product_attention(q[None], k[None], v[None], implementation="cudnn", **options)[0]
    return fn


def _reference(mask: np.ndarray, arrays, outputs) -> None:
    """--smoke: the dense float32 XLA attention with the element mask `(L, S)`, forward and gradients."""
    allowed = jnp.asarray(mask)[None, None]

    def fn(q, k, v):
        out = jax.nn.dot_product_attention(*(x.astype(jnp.float32)[None] for x in (q, k, v)), mask=allowed,
                                           implementation="xla")[0]
        return out.astype(q.dtype)
    q, k, v, d_out = arrays
    outputs[REFERENCE, "forward"] = _leaves(jax.jit(fn)(q, k, v))
    outputs[REFERENCE, "forward+backward"] = _leaves(jax.vjp(fn, q, k, v)[1](d_out))


def _compare(name, outputs) -> None:
    """Max abs difference of each system's outputs and gradients from FlexAttention's (from the dense reference
    under --smoke); recorded as `max_abs_diff_vs_flex`. `outputs` holds only the systems that compute the same
    mask."""
    for pass_name in PASSES:
        for against in (FLEX, REFERENCE):
            reference = outputs.get((against, pass_name))
            if reference is not None:
                break
        else:
            continue
        for (system, other_pass), mine in outputs.items():
            if other_pass != pass_name or system == against:
                continue
            error = max(float(np.abs(m - r).max()) for m, r in zip(mine, reference, strict=True))
            print(f"  {name} {pass_name}: {system} vs {against} max abs diff {error:.2e}")
            if against == FLEX:
                for row in RESULTS.rows:
                    if row["workload"] == f"{name} {pass_name}" and row["system"] == system:
                        row["max_abs_diff_vs_flex"] = error
            elif error > SMOKE_TOLERANCE or not np.isfinite(error):
                OPTS.mismatches.append(f"{name} {pass_name}: {system} differs from the reference by {error:.2e}")


def _free() -> None:
    """Drops what a workload left on the device (torch's cached blocks, dynamo's graphs holding its tensors)."""
    gc.collect()
    if torch is not None and OPTS.torch_peers:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


# --- the peers of every workload: cuDNN, FlexAttention, torch SDPA -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer system: its name, its function of `q, k, v`, a note for its rows; `same_mask`: it computes the
    workload's mask, so its outputs are compared (a dense system that computes more pairs is a speed reference)."""

    system: str
    fn: Callable
    note: str | None = None
    same_mask: bool = True


def time_peers(name: str, arrays, flops, outputs, mask: Callable, tables=(), *, sdpa: Callable,
               cudnn: Callable | None = None, tokamax: Callable | None = None) -> None:
    """A workload through its peers, then every system's outputs compared. `mask(*tables)` is the workload's
    `mask_mod(b, h, q_idx, kv_idx)`, written for index arrays of any library: FlexAttention's block mask is built
    from it over torch's copies of the NumPy `tables`, and --smoke's element mask (for the dense reference that
    stands in for the peers) over NumPy's. `cudnn(arrays) -> Peer` and `tokamax(arrays) -> Peer | None` (through
    JAX) and `sdpa(tensors) -> Peer` (torch) are built only where they run (torch's tensors exist, a probe may
    compile)."""
    for make in (cudnn, tokamax) if OPTS.jax_peers else ():
        peer = None if make is None else make(arrays)
        if peer is not None:
            time_jax(name, peer.system, peer.fn, arrays, flops, outputs, note=peer.note, keep=peer.same_mask,
                     show=True)
    if OPTS.smoke:
        length = arrays[0].shape[0]
        _reference(mask(*tables)(None, None, *np.indices((length, length))), arrays, outputs)
    if OPTS.torch_peers:
        _torch_peers(name, arrays, flops, outputs, mask, tables, sdpa)
    _compare(name, outputs)


def _torch_peers(name: str, arrays, flops, outputs, mask: Callable, tables, sdpa: Callable) -> None:
    """FlexAttention over the block mask of `mask`, with grouped heads where `k` has fewer than `q`, then torch SDPA,
    on torch's copies of `arrays` (freed on return, before the outputs are compared)."""
    tensors = _to_torch(arrays)
    q, k = tensors[:2]
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    block_mask = _create_block_mask(mask(*(torch.from_numpy(t).to(TORCH_DEVICE) for t in tables)), q.shape[2])
    flex = _flex()
    time_torch(name, FLEX, functools.partial(flex, block_mask=block_mask, **gqa), tensors, flops, outputs,
               note="enable_gqa=True" if gqa else None)
    peer = sdpa(tensors)
    time_torch(name, peer.system, peer.fn, tensors, flops, outputs, note=peer.note, keep=peer.same_mask)


# The workloads' masks: `mask(*tables)` -> `mask_mod(b, h, q_idx, kv_idx)`, whether query q_idx attends key kv_idx.

def _blocks(block: int, table):
    """Blocks of `block` x `block` positions: those where `table` (block rows x block columns) is true."""
    def mask_mod(b, h, q_idx, kv_idx):
        return table[q_idx // block, kv_idx // block]
    return mask_mod


def _document_causal(doc):
    """Causal within documents: `doc` holds each position's document id."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return mask_mod


def _sliding_window(window: int):
    """Causal, the `window` positions up to and including the query's."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return mask_mod


def _causal():
    """Causal: each position attends itself and those before it."""
    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return mask_mod


# --- 1. block-sparse attention (BigBird) --------------------------------------------------------------------------

def block_attention(length: int, heads: int = 16, dim: int = 64, block: int = BLOCK) -> None:
    pattern = jinsum.block_pattern(length, block, local_blocks=1, global_blocks=1, random_blocks=2, seed=0)
    blocks = (length // block) ** 2
    flops = _flops(pattern.nnz * block * block, heads, dim)
    name = f"block attention L={length} ({100 * pattern.nnz / blocks:.1f}% blocks)"
    print(f"\n{name}: {pattern.nnz} of {blocks} blocks stored")
    keys = jax.random.split(jax.random.key(length), 4)
    q, k, v, d_out = (jax.random.normal(key, (length, heads, dim), jnp.bfloat16) for key in keys)

    chain, arrays, unpad = _attention.build_chain(q, k, v, pattern)

    def unfused(q, k, v):
        return unpad(_chain_reference.forward(chain, {**arrays, "Q": q.reshape(arrays["Q"].shape),
                                                      "K": k.reshape(arrays["K"].shape),
                                                      "V": v.reshape(arrays["V"].shape)})[0])

    def fused(q, k, v):
        return jinsum.attention(q, k, v, pattern)

    table = np.zeros((length // block, length // block), bool)  # (the stored blocks)
    table[np.repeat(np.array(pattern.Ai), pattern.group_size), np.array(pattern.Ak).reshape(-1)] = True
    outputs = {}
    time_jax(name, "jinsum fused", fused, (q, k, v, d_out), flops, outputs, show=True, hlo_copies=True)
    time_jax(name, "jinsum unfused", unfused, (q, k, v, d_out), flops, outputs)
    time_peers(name, (q, k, v, d_out), flops, outputs, functools.partial(_blocks, block), (table,),
               cudnn=lambda _: Peer("dense cuDNN (JAX)", _cudnn(), NO_MASK, same_mask=False),
               sdpa=lambda _: Peer("dense FlashAttention (torch SDPA)",
                                   torch.nn.functional.scaled_dot_product_attention, NO_MASK, same_mask=False))


def breakdown(compiled, args, calls: int = 10) -> None:
    """Where a jinsum call's device time goes: the kernels above 1% of it, longest first."""
    kernels = kernel_times(compiled, *args, calls=calls)
    total = sum(kernels.values())
    print(f"    device time {1e3 * total:.3f} ms:", ", ".join(
        f"{name[:40]} {1e6 * t:.0f} us" for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])
        if t > 0.01 * total))


# --- 2. packed documents, causal -----------------------------------------------------------------------------------

def _documents(length: int, documents: int, seed: int = 0) -> np.ndarray:
    """The document id of each position: `documents` documents of random lengths (cut at distinct random places)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), documents - 1, replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [length]]))
    return np.repeat(np.arange(documents, dtype=np.int32), sizes)


def document_attention(length: int, documents: int, heads: int, dim: int) -> None:
    doc_np = _documents(length, documents)
    sizes = np.bincount(doc_np).astype(np.int64)
    flops = _flops(int((sizes * (sizes + 1) // 2).sum()), heads, dim)
    name = f"document causal L={length} ({documents} docs, {heads}x{dim})"
    doc = jnp.asarray(doc_np)
    arrays = _inputs(1, length, heads, heads, dim)

    prebuilt = jinsum.sequence_mask(length, BLOCK, document_ids=doc, causal=True)
    attending = int(jnp.count_nonzero(prebuilt.flags))
    tight = jinsum.block_mask(_document_causal(doc), length, length, BLOCK, capacity=attending)
    if bool(prebuilt.overflow) or bool(tight.overflow):
        raise AssertionError(f"{name}: the block mask overflowed its capacity")
    print(f"\n{name}: document lengths {sizes.tolist()}; {attending} of {prebuilt.grid[0] * prebuilt.grid[1]} "
          f"blocks attend ({prebuilt.capacity} slots in sequence_mask's mask)")

    def on_device(q, k, v, doc):
        return jinsum.attention(q, k, v, jinsum.sequence_mask(length, BLOCK, document_ids=doc, causal=True))

    outputs = {}
    time_jax(name, "jinsum fused (mask prebuilt)", lambda q, k, v: jinsum.attention(q, k, v, prebuilt), arrays,
             flops, outputs, show=True)
    time_jax(name, "jinsum fused (mask prebuilt, tight capacity)", lambda q, k, v: jinsum.attention(q, k, v, tight),
             arrays, flops, outputs, note=f"capacity {attending}")
    time_jax(name, "jinsum fused (mask prebuilt, an argument)", lambda q, k, v, m: jinsum.attention(q, k, v, m),
             arrays, flops, outputs, extra=(prebuilt,))
    time_jax(name, "jinsum fused (mask on device)", on_device, arrays, flops, outputs, extra=(doc,), show=True,
             note="sequence_mask inside the jitted call")
    time_peers(name, arrays, flops, outputs, _document_causal, (doc_np,), cudnn=lambda _: _cudnn_documents(doc_np),
               sdpa=lambda _: Peer(SDPA_CAUSAL, _sdpa_flash(is_causal=True),
            "ignores the documents: all L(L+1)/2 causal pairs (speed reference)", same_mask=False))
    document_mask_build(length, documents, doc_np, attending)


def _cudnn_documents(doc: np.ndarray) -> Peer:
    """cuDNN's attention over packed segments, causal within each: JAX's internal cuDNN entry point (the public
    `jax.nn.dot_product_attention` has no segments) with the documents' starts as `q_offsets`/`kv_offsets` and their
    lengths as `q_seqlen`/`kv_seqlen`, one batch row of all the documents."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 (internal, GPU only)

    sizes = np.bincount(doc)
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)])[None], jnp.int32)  # (1, documents + 1)
    lengths = jnp.asarray(sizes[None], jnp.int32)  # (1, documents)

    def fn(q, k, v):
        return cudnn.dot_product_attention(q[None], k[None], v[None], None, None, lengths, lengths, offsets, offsets,
                                           scale=q.shape[-1] ** -0.5, mask_type=cudnn.MaskType.CAUSAL)[0]
    return Peer("cuDNN packed segments (JAX internal, causal)", fn)


def _document_mask(doc: np.ndarray) -> np.ndarray:
    """The element mask of causal attention within documents, `(L, L)` booleans, as the host builds it."""
    return (doc[:, None] == doc[None, :]) & np.tri(len(doc), dtype=bool)


def document_mask_build(length: int, documents: int, doc_np: np.ndarray, attending: int) -> None:
    """The block mask alone: jinsum on the device, Flex's `create_block_mask`, and the host way."""
    name = f"document mask build L={length} ({documents} docs)"
    print(f"\n{name}")
    build = jax.jit(lambda doc: jinsum.sequence_mask(length, BLOCK, document_ids=doc, causal=True))
    doc = jnp.asarray(doc_np)
    RESULTS.attempt(name, "jinsum sequence_mask (jit)", lambda: {"ms": 1e3 * time_calls(build, doc, calls=OPTS.calls)},
                    note=f"{attending} blocks attend")
    start = time.perf_counter()
    pattern = jinsum.BlockGroupCOO.from_dense(_document_mask(doc_np), block_shape=(BLOCK, BLOCK))
    seconds = time.perf_counter() - start
    RESULTS.record(name, "NumPy element mask + BlockGroupCOO.from_dense (host)", 1e3 * seconds,
                   note=f"one call (time.perf_counter); {pattern.nnz} blocks stored")
    if pattern.nnz != attending:
        OPTS.mismatches.append(f"{name}: BlockGroupCOO.from_dense stores {pattern.nnz} blocks, sequence_mask "
                               f"{attending}")
    del pattern
    if OPTS.torch_peers:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

        mask_mod = _document_causal(torch.from_numpy(doc_np).to(TORCH_DEVICE))
        torch._dynamo.reset()
        compiled = torch.compile(create_block_mask)
        for system, builder in (("FlexAttention create_block_mask", create_block_mask),
                                ("FlexAttention torch.compile(create_block_mask)", compiled)):
            def run(builder=builder):
                return builder(mask_mod, None, None, length, length, device=TORCH_DEVICE, BLOCK_SIZE=BLOCK)

            def timed(run=run):
                seconds = time_calls(run, calls=OPTS.calls, sync=sync_torch)
                mask = run()
                blocks = int(mask.kv_num_blocks.sum()) + (int(mask.full_kv_num_blocks.sum())
                                                          if mask.full_kv_num_blocks is not None else 0)
                return {"ms": 1e3 * seconds, "note": f"{blocks} blocks attend"}
            RESULTS.attempt(name, system, timed)


# --- 3. sliding window, causal ------------------------------------------------------------------------------------

def window_attention(length: int, window: int, heads: int, dim: int) -> None:
    flops = _flops(int(np.minimum(np.arange(length) + 1, window).sum()), heads, dim)
    name = f"sliding window {window} causal L={length} ({heads}x{dim})"
    arrays = _inputs(2, length, heads, heads, dim)
    prebuilt = jinsum.sequence_mask(length, BLOCK, causal=True, window=window)
    print(f"\n{name}: {int(jnp.count_nonzero(prebuilt.flags))} blocks attend ({prebuilt.capacity} slots)")

    def on_device(q, k, v):
        return jinsum.attention(q, k, v, jinsum.sequence_mask(length, BLOCK, causal=True, window=window))

    outputs = {}
    time_jax(name, "jinsum fused (mask prebuilt)", lambda q, k, v: jinsum.attention(q, k, v, prebuilt), arrays,
             flops, outputs, show=True)
    time_jax(name, "jinsum fused (mask on device)", on_device, arrays, flops, outputs,
             note="sequence_mask inside the jitted call")
    time_peers(name, arrays, flops, outputs, functools.partial(_sliding_window, window),
               cudnn=lambda _: Peer("cuDNN sliding window (JAX)",
                                    _cudnn(is_causal=True, local_window_size=(window - 1, 0)),
                                    f"local_window_size=({window - 1}, 0)"),
               sdpa=lambda _: Peer(SDPA_CAUSAL, _sdpa_flash(is_causal=True),
                                   "ignores the window: all L(L+1)/2 causal pairs (speed reference)", same_mask=False))


# --- 4, 5. causal attention: grouped-query and dense ----------------------------------------------------------------

def causal_attention(kind: str, length: int, heads: int, kv_heads: int, dim: int) -> None:
    """Causal attention over the whole sequence, `heads` query heads and `kv_heads` key/value heads."""
    flops = _flops(length * (length + 1) // 2, heads, dim)
    heads_shown = f"{heads}q/{kv_heads}kv heads" if kv_heads != heads else f"{heads} heads"
    name = f"{kind} causal L={length} ({heads_shown} x{dim})"
    arrays = _inputs(3, length, heads, kv_heads, dim)
    group = heads // kv_heads
    mask = jinsum.sequence_mask(length, BLOCK, causal=True)
    # Issue 42: the same attention through a block pattern (the README's way), every causal block stored.
    pattern = jinsum.block_pattern(length, BLOCK, local_blocks=length // BLOCK, causal=True)
    print(f"\n{name}: {int(jnp.count_nonzero(mask.flags))} blocks attend")
    print(f"  sequence_mask(L, {BLOCK}, causal=True): {_block_classes(arrays, mask, causal=False)}")
    print(f"  block_pattern(L, {BLOCK}, local_blocks={length // BLOCK}, causal=True) with causal=True: "
          f"{_block_classes(arrays, pattern, causal=True)}")

    outputs = {}
    in_place = f"k, v of {kv_heads} heads read in place" if group > 1 else None
    time_jax(name, "jinsum fused", lambda q, k, v: jinsum.attention(q, k, v, mask), arrays, flops, outputs,
             show=True, note=in_place)
    time_jax(name, "jinsum fused (block_pattern, causal=True)",
             lambda q, k, v: jinsum.attention(q, k, v, pattern, causal=True), arrays, flops, outputs, show=True,
             note="; ".join(filter(None, (f"{pattern.nnz} blocks stored, elements {pattern.Av.dtype}", in_place))))
    time_peers(name, arrays, flops, outputs, _causal, cudnn=lambda arrays: _cudnn_causal(arrays, group),
               tokamax=_tokamax_causal, sdpa=lambda tensors: _sdpa_causal(tensors, group))


def _block_classes(arrays, pattern, causal: bool) -> str:
    """How the fused kernels treat `pattern`'s stored blocks in `jinsum.attention(q, k, v, pattern, causal=causal)`:
    the library's own classification (`_chain_route.block_flags`, 2: full, no mask read or evaluated; 1: partial,
    masked element by element; 0: empty), computed on the host as the schedule computes it for a pattern closed
    over by a jitted function."""
    q, k, v, _ = arrays
    chain, operands, _ = _attention.build_chain(q, k, v, pattern, causal=causal)
    flags = np.asarray(_chain_route.block_flags(chain, {n: np.asarray(operands[n]) for n in ("Ai", "Ak", "Av")}, np))
    full, partial, empty = (int((flags == f).sum()) for f in (2, 1, 0))
    return f"{full} full, {partial} partial, {empty} empty of {flags.size} stored blocks (mask {chain.mask})"


def _tokamax_causal(arrays) -> Peer | None:
    """tokamax's Mosaic GPU attention (`implementation="mosaic"`), causal, the grouped key/value heads as they are;
    None where tokamax is not installed."""
    tokamax = import_tokamax()
    if tokamax is None:
        return None

    def fn(q, k, v):
        return tokamax.dot_product_attention(q[None], k[None], v[None], is_causal=True, implementation="mosaic")[0]
    return Peer("tokamax Mosaic GPU (JAX, causal)", fn)


def _cudnn_causal(arrays, group: int) -> Peer:
    """cuDNN's causal attention through JAX, with its grouped key/value heads if it takes them, else repeated."""
    system, native = "dense cuDNN (JAX, causal)", _cudnn(is_causal=True)
    if group == 1:
        return Peer(system, native)
    q, k, v, d_out = arrays
    try:
        jax.jit(lambda q, k, v, t: jax.vjp(native, q, k, v)[1](t)).lower(q, k, v, d_out).compile()
        return Peer(system, native, "grouped k, v heads (native GQA)")
    except Exception as error:  # noqa: BLE001 (then repeat the heads, as a user would)
        reason = f"{type(error).__name__}: {str(error)[:60]}"

    def repeated(q, k, v):
        return native(q, jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1))
    return Peer(system, repeated, f"k, v repeated to {group}x the heads (native GQA refused: {reason})")


def _sdpa_causal(tensors, group: int) -> Peer:
    """torch SDPA's FlashAttention, causal, with `enable_gqa=True` if the flash backend takes it (forward and
    backward tried once), else with `k`, `v` repeated inside the call."""
    if group == 1:
        return Peer(SDPA_CAUSAL, _sdpa_flash(is_causal=True))
    gqa = _sdpa_flash(is_causal=True, enable_gqa=True)
    q, k, v, d_out = tensors
    try:
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        torch.autograd.grad(gqa(qg, kg, vg), (qg, kg, vg), d_out)
        sync_torch(None)
        return Peer(SDPA_CAUSAL, gqa, "enable_gqa=True")
    except Exception as error:  # noqa: BLE001 (then repeat the heads, as a user would)
        reason = f"{type(error).__name__}: {str(error)[:60]}"
    flash = _sdpa_flash(is_causal=True)

    def repeated(q, k, v):
        return flash(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    return Peer(SDPA_CAUSAL, repeated, f"k, v repeated to {group}x the heads (enable_gqa=True refused: {reason})")


# --- 6. GAT training step ---------------------------------------------------------------------------------------

def _gat_example():
    spec = importlib.util.spec_from_file_location("gat_example", HERE.parent / "examples" / "gat" / "main.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HERE.parent / "examples"))
    spec.loader.exec_module(module)
    return module


def gat_step(scale: int, calls: int, sweep: list[ChainConfig]) -> None:
    from flax import nnx  # noqa: PLC0415

    example = _gat_example()
    nodes = 1 << scale
    edge_index = rmat(scale, seed=0, undirected=True)
    name = f"GAT training step, R-MAT {scale} undirected ({edge_index.shape[1] / 1e6:.2f}M edges)"
    print(f"\n{name}")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((nodes, 128)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 40, nodes).astype(np.int32))

    def step_of(model, graph):
        step, state = train_step(model, 0.005)
        compiled = jax.jit(step).lower(state, x, y, graph).compile()
        return lambda: compiled(state, x, y, graph)

    adjacency = jg.adjacency(edge_index, nodes)
    systems = {"jinsum GATConv (fused)": (jnn.GATConv, adjacency),
               "jinsum GATConv (fused), dtype=bfloat16": (functools.partial(jnn.GATConv, dtype=jnp.bfloat16),
                                                          adjacency),
               "jinsum GATConv unfused (JINSUM_FUSE=0)": (jnn.GATConv, adjacency),
               "gathers + jax.ops.segment_*": (example.SegmentGATConv,
                                               example.edges_with_self_loops(edge_index, nodes))}
    for system, (conv, graph) in systems.items():
        model = example.GAT(conv, 128, 40, heads=4, hidden=64, dropout=0.6, rngs=nnx.Rngs(0))
        with jinsum.fuse("unfused" not in system):
            run = step_of(model, graph)  # (compiles now, under the setting)
        timed = RESULTS.attempt(name, system, lambda run=run: {"ms": 1e3 * time_calls(run, calls=calls)})
        if timed is not None and system.startswith("jinsum") and OPTS.on_gpu:
            breakdown(run, ())
    for config in sweep:  # other kernel configurations of the fused GATConv (the call happens in the context)
        with forced_config(config):
            model = example.GAT(jnn.GATConv, 128, 40, heads=4, hidden=64, dropout=0.6, rngs=nnx.Rngs(0))
            run = step_of(model, systems["jinsum GATConv (fused)"][1])
        RESULTS.attempt(name, f"jinsum GATConv {config}", lambda run=run: {"ms": 1e3 * time_calls(run, calls=calls)})
    if OPTS.torch_peers:
        RESULTS.attempt(name, "PyG GATConv", lambda: {"ms": 1e3 * _pyg_gat_step(edge_index, x, y, calls)})


def _pyg_gat_step(edge_index, x, y, calls) -> float:
    """Seconds per step of the same GAT in PyG."""
    from torch_geometric.nn import GATConv  # noqa: PLC0415

    class GAT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = GATConv(128, 64, heads=4, dropout=0.6)
            self.conv2 = GATConv(256, 40, heads=1, concat=False, dropout=0.6)

        def forward(self, x, edge_index):
            x = torch.nn.functional.dropout(x, 0.6, self.training)
            x = torch.nn.functional.elu(self.conv1(x, edge_index))
            x = torch.nn.functional.dropout(x, 0.6, self.training)
            return self.conv2(x, edge_index)

    model = GAT().cuda().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
    xt = torch.from_numpy(np.asarray(x)).cuda()
    yt = torch.from_numpy(np.asarray(y)).long().cuda()
    et = torch.from_numpy(edge_index).long().cuda()

    def step(*_):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xt, et), yt)
        loss.backward()
        optimizer.step()
        return loss

    return time_calls(step, calls=calls, sync=sync_torch)


# --- output -------------------------------------------------------------------------------------------------------

COLUMNS = (WORKLOAD, SYSTEM, *(Column(header, key, form, missing, align="---") for header, key, form, missing in (
    ("ms", "ms", "{:.3f}", "failed"), ("TFLOP/s (attended pairs)", "tflops", "{:.1f}", ""),
    ("x jinsum", "vs_jinsum", "{:.2f}", ""), ("max abs diff vs Flex", "max_abs_diff_vs_flex", "{:.1e}", ""))),
    NOTE)


def write_results(out: pathlib.Path, started: float) -> None:
    rows = RESULTS.rows
    for row in rows:
        row["vs_jinsum"] = ratio(row["ms"], baseline(rows, row, lambda r: r["system"].startswith("jinsum")))
    preamble = (f"{versions_text()}; `{command(__file__)}` ({time.time() - started:.0f} s). ms: median over rounds of "
                "back-to-back calls (`jinsum.timing.time_calls`); TFLOP/s: over the attended pairs only, the same "
                "count for every system of a workload; `x jinsum`: the system's time over the workload's first "
                "jinsum system's (above 1: jinsum is faster).")
    write(out / f"attention_{device_file_name()}", f"Fused attention on {device_name()}", [preamble], COLUMNS, rows,
          csv_fields=[c.key for c in COLUMNS])


def _workloads(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; choose among {', '.join(WORKLOADS)}")
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=_workloads, default=list(WORKLOADS),
                   help=f"comma-separated attention workloads (default: {','.join(WORKLOADS)})")
    p.add_argument("--lengths", type=int, nargs="*", default=None,
                   help="sequence lengths of the bigbird workload (default 4096 8192 16384; --smoke: 1024)")
    p.add_argument("--gat-scale", type=int, default=17, help="R-MAT scale of the GAT graph (0: skip)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time other kernel configurations of GATConv")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes through the jinsum systems only, checked against a dense reference (runs on CPU)")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    OPTS.on_gpu = jax.devices()[0].platform == "gpu"
    if not OPTS.on_gpu and not args.smoke:
        sys.exit("benchmarks/attention.py times generated Triton kernels: it needs a CUDA GPU (or --smoke)")
    OPTS.smoke = args.smoke
    OPTS.calls = min(args.calls, 2) if args.smoke else args.calls
    OPTS.jax_peers = OPTS.on_gpu and not args.smoke
    OPTS.torch_peers = OPTS.jax_peers and torch is not None and torch.cuda.is_available()
    sizes = SIZES["smoke" if args.smoke else "full"]
    lengths = args.lengths if args.lengths is not None else [1024] if args.smoke else [4096, 8192, 16384]
    started = time.time()
    for workload in args.workloads:
        if workload == "bigbird":
            for length in lengths:
                block_attention(length, **sizes["bigbird"])
                _free()
        elif workload == "document":
            document_attention(**sizes["document"])
        elif workload == "window":
            window_attention(**sizes["window"])
        else:
            causal_attention(workload, **sizes[workload])
        _free()
    if args.gat_scale:
        sweep = [ChainConfig(entries=e, num_warps=w) for e, w in ((8, 2), (32, 2))]
        gat_step(args.gat_scale, OPTS.calls, sweep if args.sweep else [])
    write_results(args.out, started)
    if OPTS.mismatches:
        sys.exit("mismatches:\n  " + "\n  ".join(OPTS.mismatches))


if __name__ == "__main__":
    main()

"""Attention over a paged key/value cache (serving): decoding and ragged prefill against their peers.

    python benchmarks/paged_attention.py [--calls 20] [--out benchmarks/results]
    python benchmarks/paged_attention.py --smoke --out /tmp/paged     # CPU: tiny sizes, every system run and checked
    python benchmarks/paged_attention.py --sweep "num_stages=2;span=8"  # jinsum with other ChainConfigs too

Workloads (bf16; pages of 16 tokens placed at random in the pool, so no sequence's pages are contiguous):
1. `decode 64 x 4096, 32/8 heads`: one new token for each of 64 sequences of 4,096 cached tokens, 32 query heads
   over 8 kv heads of 128 (issue targets: at least 80% of the HBM bandwidth in K/V bytes read, and 2x JAX's Pallas
   kernel);
2. `decode 64 x 4096, 32/2 heads`: the same with 16 query heads per kv head, the ratio JAX's Pallas kernel accepts;
3. `decode 4 x 131072, 32/8 heads`: few long sequences (target: 70% of the HBM bandwidth);
4. `prefill 16 prompts, 32/8 heads`: 16 prompts of 256-4,096 tokens (seeded), causal, every token new (target: no
   slower than cuDNN's packed segments);
5. `prefill after a 2,048 prefix`: the same prompts after 2,048 cached tokens each (target: within 1.2x of the
   prefill without the prefix plus the time to read the prefix's keys and values at the bandwidth of workload 1).
Each decode workload is also timed as a model's step runs it (`--layers L`, rows `..., per layer of a step of L`):
one jitted call of L attention layers, each its own queries over the same page table and lengths (a model's layers
share them), the time per layer. The pool is shared too (each layer reads it from HBM: it is 10-40x the L2), and
XLA's contiguous peer is left out there (XLA merges dots that share an operand, which layers with their own keys
would not).

Systems:
- jinsum `paged_attention` (`query_starts` packing the tokens of all sequences);
- JAX's Pallas GPU `paged_attention` (`jax.experimental.pallas.ops.gpu`, decoding only; its layout `(Hkv, P, page,
  D)` prepared outside the timed call; it does not scale the scores, so its `q` is scaled first, inside the call);
  four configurations tried on the first decode workload it accepts, the fastest kept for all;
- XLA over the same keys and values laid out contiguously (`(B, S, Hkv, D)`, each sequence padded to the longest):
  einsum, masked softmax, einsum: what a JAX user writes without a paged kernel (decoding only: prefill's scores
  would not fit);
- cuDNN over packed segments (prefill; JAX's internal `fused_attention_stablehlo` entry point, the prompts' tokens
  and keys contiguous, `q_offsets` / `kv_offsets`); a GPU only;
- cuDNN's paged attention (the same module's `paged_attention`: the same pool and page table, the queries padded
  per sequence outside the timed call); a GPU only.
FlashInfer has no wheel on the benchmark machine (no network, and none for JAX), so it is not among them.
`--sweep` also times jinsum under each given `jinsum.kernels.ChainConfig` (fields over this GPU's defaults, forced
around a function jitted afresh), a row each. Every system's output is compared with jinsum's (max abs difference);
on `--smoke` jinsum's is also compared with a float64 NumPy reference. On a GPU, jinsum's kernels are printed with
their device times (`jinsum.timing.kernel_times`). Timing: `jinsum.timing.time_calls`. Bandwidth: the K and V bytes
of the attended tokens, each read once, over the time, against the device's HBM (`HBM_TBPS`); prefill also TFLOP/s
over the attended (query, key) pairs (4 x pairs x D x Hq).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jinsum
from jinsum.kernels import chain_config, forced_config
from jinsum.timing import kernel_times, time_calls

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, baseline, command, device_file_name, device_name, ratio, versions_text,
    write)

RESULTS = Results()
JINSUM = "jinsum paged_attention"
HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # (nominal HBM bandwidth, TB/s)
COLUMNS = (WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}"), Column("K/V TB/s", "tbps", "{:.2f}"),
           Column("of HBM", "of_hbm", "{:.0%}"), Column("TFLOP/s", "tflops", "{:.0f}"),
           Column("x jinsum", "vs_jinsum", "{:.2f}"), Column("max abs diff vs jinsum", "diff", "{:.1e}"), NOTE)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    lengths: tuple[int, ...]       # cached tokens of each sequence, the new ones included
    new: tuple[int, ...]           # new (query) tokens of each sequence
    heads: int
    kv_heads: int
    dim: int = 128
    page: int = 16

    @property
    def decode(self) -> bool:
        return all(n == 1 for n in self.new)


def workloads(smoke: bool, seed: int = 0) -> list[Workload]:
    rng = np.random.default_rng(seed)
    if smoke:
        prompts = tuple(int(n) for n in rng.integers(8, 40, 3))
        return [Workload("decode 6 x 70", (70,) * 6, (1,) * 6, 8, 2, 16, 4),
                Workload("decode 6 x 70, 8/1 heads", (70,) * 6, (1,) * 6, 8, 1, 16, 4),
                Workload("prefill 3 prompts", prompts, prompts, 8, 2, 16, 4),
                Workload("prefill 3 prompts after a 20 prefix", tuple(n + 20 for n in prompts), prompts, 8, 2, 16, 4)]
    prompts = tuple(int(n) for n in rng.integers(256, 4097, 16))
    return [Workload("decode 64 x 4096, 32/8 heads", (4096,) * 64, (1,) * 64, 32, 8),
            Workload("decode 64 x 4096, 32/2 heads", (4096,) * 64, (1,) * 64, 32, 2),
            Workload("decode 4 x 131072, 32/8 heads", (131072,) * 4, (1,) * 4, 32, 8),
            Workload(f"prefill 16 prompts ({sum(prompts):,} tokens), 32/8 heads", prompts, prompts, 32, 8),
            Workload("prefill after a 2,048 prefix", tuple(n + 2048 for n in prompts), prompts, 32, 8)]


def build(w: Workload, seed: int = 0) -> dict:
    """The pools (every sequence's pages at random places), its page table, lengths, query starts and queries."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // w.page) for n in w.lengths]
    total = sum(pages)
    order = rng.permutation(total)
    table = np.zeros((len(w.lengths), max(pages)), np.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[at:at + n]
        at += n
    key = jax.random.key(seed)
    k_pages = jax.random.normal(key, (total, w.page, w.kv_heads, w.dim), jnp.bfloat16)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (total, w.page, w.kv_heads, w.dim), jnp.bfloat16)
    starts = np.concatenate([[0], np.cumsum(w.new)]).astype(np.int32)
    q = jax.random.normal(jax.random.fold_in(key, 2), (int(starts[-1]), w.heads, w.dim), jnp.bfloat16)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, table=jnp.asarray(table), lengths=jnp.asarray(w.lengths,
                jnp.int32), starts=jnp.asarray(starts), table_np=table, starts_np=starts)


def measure(w: Workload, fn, args: tuple, calls: int, expected=None, layers: int = 1) -> dict:
    """ms of the jitted `fn(*args)`, the K/V bandwidth and TFLOP/s it reaches, and its difference from `expected`;
    with `layers`, `fn` runs a step of that many layers (`stepped`), its first layer's output compared, and the
    figures are per layer."""
    compiled = jax.jit(stepped(fn, layers) if layers > 1 else fn)
    out = compiled(*args)
    seconds = time_calls(compiled, *args, calls=calls) / layers
    out = out[0] if layers > 1 else out
    kv_bytes = sum(w.lengths) * w.kv_heads * w.dim * 2 * 2  # (K and V, bf16, each attended token's once)
    pairs = sum(m * (length - m) + m * (m + 1) // 2 for m, length in zip(w.new, w.lengths))  # (causal)
    hbm = next((tbps for name, tbps in HBM_TBPS.items() if name in device_name()), None)
    tbps = kv_bytes / seconds / 1e12
    measured = dict(ms=1e3 * seconds, tbps=tbps, of_hbm=ratio(tbps, hbm), tflops=4 * pairs * w.dim * w.heads /
                    seconds / 1e12)
    if expected is not None:
        measured["diff"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))
    return measured, out


def stepped(fn, layers: int):
    """`fn(q, *rest)` as a model's step runs it: `layers` calls, one per layer's queries (`qs[l]`), the rest shared."""
    def step(qs, *rest):
        return tuple(fn(qs[layer], *rest) for layer in range(layers))
    return step


def reference(w: Workload, data: dict) -> np.ndarray:
    """float64 NumPy: each token over its sequence's gathered keys, causal."""
    q = np.asarray(data["q"], np.float64)
    k, v = (np.asarray(data[n], np.float64) for n in ("k_pages", "v_pages"))
    out = np.zeros(q.shape)
    group = w.heads // w.kv_heads
    for b, (length, new) in enumerate(zip(w.lengths, w.new)):
        pages = data["table_np"][b, :-(-length // w.page)]
        keys, values = (x[pages].reshape(-1, w.kv_heads, w.dim)[:length] for x in (k, v))
        for i in range(new):
            t, seen = data["starts_np"][b] + i, length - new + i + 1
            scores = np.einsum("hgd,shd->hgs", q[t].reshape(w.kv_heads, group, w.dim), keys[:seen]) / np.sqrt(w.dim)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[t] = np.einsum("hgs,shd->hgd", weights / weights.sum(-1, keepdims=True),
                               values[:seen]).reshape(w.heads, w.dim)
    return out


def contiguous(data: dict, w: Workload):
    """The keys and values of each sequence contiguous, padded to the longest: `(B, S, Hkv, D)`."""
    index = jnp.asarray(data["table_np"])
    k = data["k_pages"][index].reshape(len(w.lengths), -1, w.kv_heads, w.dim)
    v = data["v_pages"][index].reshape(len(w.lengths), -1, w.kv_heads, w.dim)
    return k, v


def xla_decode(q, k, v, lengths):
    """Decoding over contiguous `(B, S, Hkv, D)` keys and values: einsum, masked softmax, einsum."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    scores = jnp.einsum("bhgd,bshd->bhgs", q.reshape(batch, kv_heads, heads // kv_heads, dim), k,
                        preferred_element_type=jnp.float32) / np.sqrt(dim)
    scores = jnp.where(jnp.arange(k.shape[1])[None, None, None, :] < lengths[:, None, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhgs,bshd->bhgd", weights, v).reshape(batch, heads, dim)


PALLAS_CONFIGS = [dict(block_h=16, pages_per_compute_block=8, k_splits=16, num_warps=8, num_stages=2),
                  dict(block_h=16, pages_per_compute_block=16, k_splits=8, num_warps=8, num_stages=2),
                  dict(block_h=16, pages_per_compute_block=4, k_splits=32, num_warps=4, num_stages=2),
                  dict(block_h=16, pages_per_compute_block=8, k_splits=32, num_warps=4, num_stages=3)]


def pallas_decode(config: dict):
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas  # noqa: PLC0415 (GPU only)

    def fn(q, k_pages, v_pages, table, lengths):
        scaled = (q.astype(jnp.float32) / np.sqrt(q.shape[-1])).astype(q.dtype)
        return pallas.paged_attention(scaled, k_pages, v_pages, table, lengths, **config)
    return fn


def cudnn_prefill(w: Workload, data: dict):
    """cuDNN over packed segments: the prompts' queries, and each sequence's keys and values contiguous."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 (internal, GPU only)

    k, v = contiguous(data, w)
    keys = jnp.concatenate([k[b, :n] for b, n in enumerate(w.lengths)])[None]
    values = jnp.concatenate([v[b, :n] for b, n in enumerate(w.lengths)])[None]
    q_offsets = jnp.asarray(data["starts_np"][None], jnp.int32)
    kv_offsets = jnp.asarray(np.concatenate([[0], np.cumsum(w.lengths)])[None], jnp.int32)
    q_len, kv_len = jnp.asarray([w.new], jnp.int32), jnp.asarray([w.lengths], jnp.int32)
    if any(n != m for n, m in zip(w.new, w.lengths)):
        raise NotImplementedError("a cached prefix: cuDNN's packed causal mask aligns queries and keys at the start")

    def fn(q, keys, values):
        return cudnn.dot_product_attention(q[None], keys, values, None, None, q_len, kv_len, q_offsets, kv_offsets,
                                           scale=q.shape[-1] ** -0.5, mask_type=cudnn.MaskType.CAUSAL)[0]
    return fn, (data["q"], keys, values)


def cudnn_paged(w: Workload, data: dict, calls: int, expected, layers: int = 1) -> dict:
    """cuDNN's paged attention (JAX's internal entry point) over the same pool and page table, the queries padded to
    the most new tokens of a sequence, `(B, T, Hq, D)`, outside the timed call; compared on the real tokens. It
    takes a pool of at least `B * max_pages` pages: a smaller one is padded with pages nothing reads."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 (internal, GPU only)

    if not w.decode and any(n != m for n, m in zip(w.new, w.lengths)):
        raise NotImplementedError("a cached prefix: cuDNN's causal mask aligns queries and keys at the start")
    starts, longest = data["starts_np"], max(w.new)
    index = np.minimum(starts[:-1, None] + np.arange(longest)[None, :], starts[-1] - 1)
    mask = cudnn.MaskType.PADDING if w.decode else cudnn.MaskType.PADDING_CAUSAL

    def fn(q, k_pages, v_pages, table, q_len, kv_len):
        return cudnn.paged_attention(q, k_pages, v_pages, q_len, kv_len, table, table, scale=q.shape[-1] ** -0.5,
                                     mask_type=mask)
    short = max(0, data["table_np"].size - data["k_pages"].shape[0])
    k_pages, v_pages = (jnp.pad(data[n], ((0, short), (0, 0), (0, 0), (0, 0))) for n in ("k_pages", "v_pages"))
    q = data["qs"][:, jnp.asarray(index)] if layers > 1 else data["q"][jnp.asarray(index)]
    args = (q, k_pages, v_pages, data["table"][:, None, :, None], jnp.asarray(w.new, jnp.int32),
            jnp.asarray(w.lengths, jnp.int32))
    measured, out = measure(w, fn, args, calls, layers=layers)
    real = np.arange(longest)[None, :] < np.asarray(w.new)[:, None]
    measured["diff"] = float(jnp.max(jnp.abs(out[real].astype(jnp.float32) - expected[index[real]].astype(
        jnp.float32))))
    return measured


def run(w: Workload, calls: int, smoke: bool, pallas: dict, sweep: list[dict], layers: int) -> None:
    print(f"\n{w.name}: {len(w.lengths)} sequences, {sum(w.lengths):,} cached tokens, {sum(w.new):,} new")
    data = build(w)
    args = tuple(data[n] for n in ("q", "k_pages", "v_pages", "table", "lengths", "starts"))
    paged = lambda q, kp, vp, table, lengths, starts: jinsum.paged_attention(  # noqa: E731
        q, kp, vp, table, lengths, query_starts=starts)
    row = RESULTS.attempt(w.name, JINSUM, lambda: measure(w, paged, args, calls)[0])
    if row is None:
        return
    ours = jax.jit(paged)(*args)
    for fields in sweep:  # (a fresh function each: JAX's caches do not see a forced configuration)
        with forced_config(dataclasses.replace(chain_config(), **fields)):
            RESULTS.attempt(w.name, f"{JINSUM} {fields}", lambda: measure(w, lambda *a: paged(*a), args, calls,
                                                                          ours)[0])
    if jax.default_backend() == "gpu":  # where jinsum's device time goes, kernel by kernel
        kernels = sorted(kernel_times(jax.jit(paged), *args, calls=calls).items(), key=lambda kv: -kv[1])
        print("    kernels:", ", ".join(f"{name[:40]} {1e6 * t:.0f} us" for name, t in kernels[:6]))
    if smoke:
        error = float(np.abs(np.asarray(ours, np.float64) - reference(w, data)).max())
        print(f"  jinsum against float64 NumPy: max abs diff {error:.1e}")
        if error > 3e-2:
            raise AssertionError(f"{w.name}: jinsum differs from the float64 reference by {error:.3g}")
    if w.decode:
        k, v = contiguous(data, w)
        RESULTS.attempt(w.name, "XLA, K/V contiguous (einsum, softmax, einsum)", lambda: measure(
            w, xla_decode, (data["q"], k, v, data["lengths"]), calls, ours)[0], note=f"padded to {k.shape[1]}")
        if jax.default_backend() == "gpu" and (w.heads // w.kv_heads) >= 16:
            RESULTS.attempt(w.name, "JAX Pallas GPU paged_attention", lambda: pallas_run(w, data, calls, ours,
                                                                                          pallas))
    elif jax.default_backend() == "gpu":
        def cudnn():
            fn, cudnn_args = cudnn_prefill(w, data)
            return measure(w, fn, cudnn_args, calls, ours)[0]
        RESULTS.attempt(w.name, "cuDNN packed segments (JAX internal, causal)", cudnn)
    if jax.default_backend() == "gpu":
        RESULTS.attempt(w.name, "cuDNN paged attention (JAX internal)", lambda: cudnn_paged(w, data, calls, ours))
    if w.decode and layers > 1:
        run_layers(w, data, calls, pallas, layers, ours)


def run_layers(w: Workload, data: dict, calls: int, pallas: dict, layers: int, expected) -> None:
    """The decode workload as a step of `layers` layers runs it: each system's time per layer (see the docstring)."""
    name = f"{w.name}, per layer of a step of {layers}"
    data["qs"] = jnp.concatenate([data["q"][None], jax.random.normal(
        jax.random.key(layers), (layers - 1, *data["q"].shape), data["q"].dtype)])
    args = tuple(data[n] for n in ("qs", "k_pages", "v_pages", "table", "lengths", "starts"))
    paged = lambda q, kp, vp, table, lengths, starts: jinsum.paged_attention(  # noqa: E731
        q, kp, vp, table, lengths, query_starts=starts)
    RESULTS.attempt(name, JINSUM, lambda: measure(w, paged, args, calls, expected, layers)[0])
    if jax.default_backend() == "gpu" and (w.heads // w.kv_heads) >= 16:
        RESULTS.attempt(name, "JAX Pallas GPU paged_attention", lambda: pallas_run(w, data, calls, expected, pallas,
                                                                                    layers))
    if jax.default_backend() == "gpu":
        RESULTS.attempt(name, "cuDNN paged attention (JAX internal)", lambda: cudnn_paged(w, data, calls, expected,
                                                                                           layers))


def pallas_run(w: Workload, data: dict, calls: int, expected, chosen: dict, layers: int = 1) -> dict:
    """Pallas's layout `(Hkv, P, page, D)` made outside the timed call; the fastest of `PALLAS_CONFIGS` on the
    first workload, kept in `chosen` for the rest."""
    k, v = (jnp.moveaxis(data[n], 2, 0) for n in ("k_pages", "v_pages"))
    args = (data["q"], k, v, data["table"], data["lengths"])
    if "config" not in chosen:
        tried = {}
        for i, config in enumerate(PALLAS_CONFIGS):
            try:
                tried[i] = measure(w, pallas_decode(config), args, calls, expected)[0]["ms"]
            except Exception as error:  # noqa: BLE001 (a configuration it refuses)
                print(f"  Pallas {config}: {type(error).__name__}: {str(error)[:100]}")
        chosen["config"] = PALLAS_CONFIGS[min(tried, key=tried.get)]
    if layers > 1:
        args = (data["qs"], *args[1:])
    measured = measure(w, pallas_decode(chosen["config"]), args, calls, expected, layers)[0]
    return {**measured, "note": ", ".join(f"{k}={v}" for k, v in chosen["config"].items())}


def write_results(out: pathlib.Path, started: float) -> None:
    rows = RESULTS.rows
    for row in rows:
        row["vs_jinsum"] = ratio(row.get("ms"), baseline(rows, row, lambda r: r["system"] == JINSUM))
    preamble = (f"{versions_text(('triton', 'jax_triton'))}; `{command(__file__)}` ({time.time() - started:.0f} s). "
                "ms: median over rounds of back-to-back calls (`jinsum.timing.time_calls`); K/V TB/s: the keys and "
                "values of the attended tokens (bf16), each read once, over the time; of HBM: over the device's "
                f"nominal bandwidth ({', '.join(f'{k} {v} TB/s' for k, v in HBM_TBPS.items())}); TFLOP/s: 4 x "
                "attended pairs x D x query heads over the time; x jinsum: the system's time over jinsum's (above 1: "
                "jinsum is faster).")
    write(out / f"paged_attention_{device_file_name()}", f"Paged attention on {device_name()}", [preamble],
          COLUMNS, rows, csv_fields=[c.key for c in COLUMNS])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: every system run and checked (CPU)")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    p.add_argument("--layers", type=int, default=8, help="decode also timed per layer of a step of this many")
    p.add_argument("--sweep", default="", help='ChainConfigs to time jinsum with too: "num_stages=3;span=8,chunk=64"')
    args = p.parse_args()
    sweep = [{k: int(v) for k, v in (f.split("=") for f in text.split(","))} for text in args.sweep.split(";") if text]
    started, pallas = time.time(), {}
    for w in workloads(args.smoke):
        run(w, 2 if args.smoke else args.calls, args.smoke, pallas, sweep, 2 if args.smoke else args.layers)
    write_results(args.out, started)


if __name__ == "__main__":
    main()

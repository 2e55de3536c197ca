"""Fused attention chains on a GPU: block-sparse attention and a GAT training step, against their peers.

    python benchmarks/attention.py [--lengths 4096 8192 16384] [--gat-scale 17] [--out benchmarks/results]

1. Block-sparse attention, bf16, batch 1, 16 heads of 64, blocks of 128, BigBird pattern (1 local, 1 global and
   2 random blocks per block row: `jinsum.nn.block_pattern`), forward and forward+backward, at each length:
   - jinsum fused: `jinsum.attention` (one generated kernel, plus the combine of the split global row; the
     FlashAttention-2 backward);
   - jinsum unfused: the same chain as separate statements (block SDDMM, segment max/sum, block SpMM);
   - FlexAttention: `torch.compile(flex_attention)` with a `BlockMask` of the same blocks (full blocks);
   - dense FlashAttention: `torch.nn.functional.scaled_dot_product_attention` (no mask: all L^2 scores);
   - dense cuDNN: `jax.nn.dot_product_attention(implementation="cudnn")`.
   TFLOP/s count the stored blocks only (4 * pairs * D * H forward; 3.5x that forward+backward).
2. GAT training step (2 layers: 4 heads x 64, then 1 head; forward, backward and Adam; dropout 0.6) on an
   R-MAT graph made undirected (scale 17: 131k nodes, ~3.7M edges), 128 synthetic input features, 40 classes:
   jinsum `GATConv` (fused), the same layer unfused (`JINSUM_FUSE=0`: the chain's statements as separate
   kernels), the same model with gathers and `jax.ops.segment_*` (examples/gat), and PyG's `GATConv` where
   torch_geometric is installed.

Every system is timed the same way (`jinsum.timing.time_calls`: warm-up, back-to-back calls, one
synchronisation, median of rounds). Results go to `--out` as `attention_<device>.{md,csv}`.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import pathlib
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jinsum  # noqa: E402
import jinsum.nn as jnn  # noqa: E402
from jinsum import _attention  # noqa: E402
from jinsum._attention import _chain_reference
from jinsum.datasets import rmat  # noqa: E402
from jinsum.kernels import ChainConfig, forced_config  # noqa: E402
from jinsum.timing import kernel_times, time_calls  # noqa: E402

from _training import package_versions, train_step  # noqa: E402 (benchmarks/, this script's folder)

try:
    import torch
except ImportError:
    torch = None

HERE = pathlib.Path(__file__).resolve().parent
ROWS: list[dict] = []


def record(workload: str, system: str, ms: float | None, **extra) -> None:
    ROWS.append(dict(workload=workload, system=system, ms=ms, **extra))
    shown = "failed" if ms is None else f"{ms:.3f} ms"
    print(f"  {workload:<40} {system:<34} {shown}  {extra.get('note', '')}", flush=True)


def _torch_sync(_):
    torch.cuda.synchronize()


def attempt(workload: str, system: str, run) -> float | None:
    """Runs `run() -> seconds`, recording a failure (with its reason) instead of stopping the benchmark."""
    try:
        seconds = run()
    except Exception as error:  # noqa: BLE001 (a peer that cannot run is reported, not fatal)
        traceback.print_exc(limit=2)
        record(workload, system, None, note=f"{type(error).__name__}: {str(error)[:100]}")
        return None
    return seconds


# --- 1. block-sparse attention ------------------------------------------------------------------------------------

def block_attention(length: int, calls: int, heads: int = 16, dim: int = 64, block: int = 128) -> None:
    pattern = jnn.block_pattern(length, block, local_blocks=1, global_blocks=1, random_blocks=2, seed=0)
    blocks = (length // block) ** 2
    pairs = pattern.nnz * block * block
    flops = {"forward": 4 * pairs * dim * heads}
    flops["forward+backward"] = 3.5 * flops["forward"]
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

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q[None], k[None], v[None], implementation="cudnn")[0]

    outputs = {}
    for system, fn in [("jinsum fused", fused), ("jinsum unfused", unfused), ("dense cuDNN (JAX)", cudnn)]:
        for pass_name in ("forward", "forward+backward"):
            if pass_name == "forward":
                compiled = jax.jit(fn)
                args = (q, k, v)
            else:
                compiled = jax.jit(lambda q, k, v, t, fn=fn: jax.vjp(fn, q, k, v)[1](t))
                args = (q, k, v, d_out)
            seconds = attempt(f"{name} {pass_name}", system, lambda: time_calls(compiled, *args, calls=calls))
            if seconds is not None:
                outputs[system, pass_name] = compiled(*args)
                record(f"{name} {pass_name}", system, 1e3 * seconds, tflops=flops[pass_name] / seconds / 1e12)
                if system == "jinsum fused":
                    breakdown(compiled, args)
                    copies = [line.strip()[:150] for line in compiled.lower(*args).compile().as_text().splitlines()
                              if " copy(" in line or "copy-start" in line]
                    print(f"    {len(copies)} copies in the optimized HLO", *copies[:6], sep="\n      ")
    if torch is not None:
        _torch_attention(name, pattern, (q, k, v, d_out), flops, calls, outputs, block)
    _compare(name, outputs)


def breakdown(compiled, args, calls: int = 10) -> None:
    """Where a jinsum call's device time goes: the kernels above 1% of it, longest first."""
    kernels = kernel_times(compiled, *args, calls=calls)
    total = sum(kernels.values())
    print(f"    device time {1e3 * total:.3f} ms:", ", ".join(
        f"{name[:40]} {1e6 * t:.0f} us" for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])
        if t > 0.01 * total))


def _torch_attention(name, pattern, arrays, flops, calls, outputs, block):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415

    q, k, v, d_out = (torch.from_numpy(np.array(x.astype(jnp.float32))).to("cuda", torch.bfloat16)
                      .permute(1, 0, 2)[None].contiguous() for x in arrays)  # (1, H, L, D)
    length = q.shape[2]
    table = torch.zeros((length // block, length // block), dtype=torch.bool, device="cuda")
    rows = np.asarray(pattern.Ai)
    table[torch.from_numpy(np.repeat(rows, pattern.group_size)).cuda(),
          torch.from_numpy(np.asarray(pattern.Ak).reshape(-1)).cuda()] = True

    def mask_mod(b, h, q_idx, kv_idx):
        return table[q_idx // block, kv_idx // block]

    block_mask = create_block_mask(mask_mod, None, None, length, length, device="cuda", BLOCK_SIZE=block)
    flex = torch.compile(flex_attention)
    systems = {"FlexAttention (torch.compile)": lambda q, k, v: flex(q, k, v, block_mask=block_mask),
               "dense FlashAttention (torch SDPA)": torch.nn.functional.scaled_dot_product_attention}
    for system, fn in systems.items():
        for pass_name in ("forward", "forward+backward"):
            if pass_name == "forward":
                def run(fn=fn):
                    with torch.no_grad():
                        return fn(q, k, v)
            else:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

                def run(fn=fn, qg=qg, kg=kg, vg=vg):
                    return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), d_out)
            seconds = attempt(f"{name} {pass_name}", system,
                              lambda run=run: time_calls(run, calls=calls, sync=_torch_sync))
            if seconds is not None:
                result = run()
                outputs[system, pass_name] = (result.permute(0, 2, 1, 3)[0] if pass_name == "forward" else
                                              tuple(g.permute(0, 2, 1, 3)[0] for g in result))
                record(f"{name} {pass_name}", system, 1e3 * seconds, tflops=flops[pass_name] / seconds / 1e12)


def _compare(name, outputs) -> None:
    """Max abs difference of each sparse system from FlexAttention (outputs and gradients)."""
    for pass_name in ("forward", "forward+backward"):
        reference = outputs.get(("FlexAttention (torch.compile)", pass_name))
        if reference is None:
            continue
        reference = [np.asarray(r.float().cpu()) for r in (reference if isinstance(reference, tuple) else
                                                           (reference,))]
        for system in ("jinsum fused", "jinsum unfused"):
            if (system, pass_name) in outputs:
                mine = jax.tree.leaves(outputs[system, pass_name])
                error = max(float(np.abs(np.asarray(m, np.float32) - r).max()) for m, r in zip(mine, reference))
                print(f"  {name} {pass_name}: {system} vs FlexAttention max abs diff {error:.2e}")
                for row in ROWS:
                    if row["workload"] == f"{name} {pass_name}" and row["system"] == system:
                        row["max_abs_diff_vs_flex"] = error


# --- 2. GAT training step ---------------------------------------------------------------------------------------

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

    adjacency = jnn.adjacency(edge_index, nodes)
    systems = {"jinsum GATConv (fused)": (jnn.GATConv, adjacency),
               "jinsum GATConv unfused (JINSUM_FUSE=0)": (jnn.GATConv, adjacency),
               "gathers + jax.ops.segment_*": (example.SegmentGATConv,
                                               example.edges_with_self_loops(edge_index, nodes))}
    for system, (conv, graph) in systems.items():
        model = example.GAT(conv, 128, 40, heads=4, hidden=64, dropout=0.6, rngs=nnx.Rngs(0))
        os.environ["JINSUM_FUSE"] = "0" if "unfused" in system else "1"
        run = step_of(model, graph)  # (compiles now, so the switch applies)
        os.environ.pop("JINSUM_FUSE")
        seconds = attempt(name, system, lambda run=run: time_calls(run, calls=calls))
        if seconds is not None:
            record(name, system, 1e3 * seconds)
            if system.startswith("jinsum"):
                breakdown(run, ())
    for config in sweep:  # other kernel configurations of the fused GATConv (the call happens in the context)
        with forced_config(config):
            model = example.GAT(jnn.GATConv, 128, 40, heads=4, hidden=64, dropout=0.6, rngs=nnx.Rngs(0))
            run = step_of(model, systems["jinsum GATConv (fused)"][1])
        seconds = attempt(name, f"jinsum GATConv {config}", lambda run=run: time_calls(run, calls=calls))
        if seconds is not None:
            record(name, f"jinsum GATConv {config}", 1e3 * seconds)
    if torch is not None:
        attempt(name, "PyG GATConv", lambda: _pyg_gat_step(name, edge_index, nodes, x, y, calls))


def _pyg_gat_step(name, edge_index, nodes, x, y, calls) -> float:
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

    seconds = time_calls(step, calls=calls, sync=_torch_sync)
    record(name, "PyG GATConv", 1e3 * seconds)
    return seconds


# --- output -------------------------------------------------------------------------------------------------------

def write(out: pathlib.Path, started: float) -> None:
    device = jax.devices()[0].device_kind
    versions = package_versions()
    stem = out / f"attention_{device.replace(' ', '_')}"
    out.mkdir(parents=True, exist_ok=True)
    fields = ["workload", "system", "ms", "tflops", "vs_jinsum", "max_abs_diff_vs_flex", "note"]
    for row in ROWS:
        first = next((r for r in ROWS if r["workload"] == row["workload"] and r["system"].startswith("jinsum")
                      and r["ms"]), None)
        row["vs_jinsum"] = row["ms"] / first["ms"] if first and row["ms"] else None
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(ROWS)
    lines = [f"# Fused attention on {device}", "",
             f"{', '.join(f'{k} {v}' for k, v in versions.items())}; `python benchmarks/attention.py` "
             f"({time.time() - started:.0f} s). ms: median over rounds of back-to-back calls "
             "(`jinsum.timing.time_calls`); `x jinsum`: the system's time over jinsum fused's (above 1: jinsum "
             "is faster).", "",
             "| workload | system | ms | TFLOP/s (stored blocks) | x jinsum | max abs diff vs Flex |",
             "|---|---|---|---|---|---|"]
    for row in ROWS:
        def fmt(key, spec):
            return format(row[key], spec) if row.get(key) is not None else ""
        ms = fmt("ms", ".3f") or "failed: " + row.get("note", "")
        lines.append(f"| {row['workload']} | {row['system']} | {ms} | {fmt('tflops', '.1f')} | "
                     f"{fmt('vs_jinsum', '.2f')} | {fmt('max_abs_diff_vs_flex', '.1e')} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384])
    p.add_argument("--gat-scale", type=int, default=17, help="R-MAT scale of the GAT graph (0: skip)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time other kernel configurations of GATConv")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    if jax.devices()[0].platform != "gpu":
        sys.exit("benchmarks/attention.py times generated Triton kernels: it needs a CUDA GPU")
    started = time.time()
    for length in args.lengths:
        block_attention(length, args.calls)
    if args.gat_scale:
        sweep = [ChainConfig(entries=e, num_warps=w) for e, w in ((8, 2), (32, 2))]
        gat_step(args.gat_scale, args.calls, sweep if args.sweep else [])
    write(args.out, started)


if __name__ == "__main__":
    main()

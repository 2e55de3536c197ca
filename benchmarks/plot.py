"""The headline chart and table of the README: jinsum's speed-up over the best peer measured in the same run, for
each headline workload, read from the committed results (`benchmarks/results/*.csv`).

    python benchmarks/plot.py [--device NVIDIA_H100_80GB_HBM3] [--out benchmarks/results]

Writes `summary_<device>.png` (needs matplotlib) and prints the table as markdown. Each headline names the results
file and workload it reads, jinsum's system, and the peers it is compared with; the best (fastest) peer that ran
is the one shown. Speed-up = the peer's time / jinsum's (above 1: jinsum is faster).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import pathlib

HERE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Headline:
    group: str
    label: str
    results: str  # results file stem, before _<device>
    workload: str
    jinsum: str  # jinsum's system
    peers: tuple[str, ...]
    column: str = "ms"
    command: str = ""


SPMM = ("segment_sum (sorted)", "jax.experimental.sparse BCOO", "cuSPARSE CSR (torch.sparse)")
SDDMM = ("gather idiom", "jax.experimental.sparse bcoo_dot_general_sampled", "torch.sparse.sampled_addmm")
FLEX = ("FlexAttention (torch.compile)", "dense FlashAttention (torch SDPA)",
        "dense FlashAttention (torch SDPA, causal)", "dense cuDNN (JAX)", "dense cuDNN (JAX, causal)",
        "cuDNN sliding window (JAX)")
RUN, ATTENTION, TRAINING = "benchmarks/run.py", "benchmarks/attention.py", "benchmarks/training.py"
HEADLINES = [
    Headline("SpMM / SDDMM", "SpMM, R-MAT 20, F=128", "", "SpMM fp32 rmat20 F=128", "jinsum", SPMM, command=RUN),
    Headline("SpMM / SDDMM", "SpMM, R-MAT 17, F=128", "", "SpMM fp32 rmat17 F=128", "jinsum", SPMM, command=RUN),
    Headline("SpMM / SDDMM", "SpMM gradient A^T dC, R-MAT 20, F=128", "", "SpMM transpose (A^T dC) fp32 rmat20 F=128",
             "jinsum", ("segment_sum over A^T (sorted)", "cuSPARSE CSR of A^T (torch.sparse)"), command=RUN),
    Headline("SpMM / SDDMM", "SDDMM, R-MAT 20, F=128", "", "SDDMM fp32 rmat20 F=128", "jinsum", SDDMM, command=RUN),
    Headline("SpMM / SDDMM", "block SpMM fp16, 32x32 blocks at 5%", "", "Block SpMM fp16 4096^3 32x32 5%", "jinsum",
             ("dense matmul fp16 (cuBLAS)", "torch bsr_dense_mm (Triton)"), command=RUN),
    Headline("attention (fwd+bwd)", "BigBird 16k", "attention_masks",
             "block attention L=16384 (5.4% blocks) forward+backward", "jinsum fused", FLEX, command=ATTENTION),
    Headline("attention (fwd+bwd)", "document mask 16k", "attention_masks",
             "document causal L=16384 (15 docs, 16x64) forward+backward", "jinsum fused (mask prebuilt)", FLEX,
             command=ATTENTION),
    Headline("attention (fwd+bwd)", "sliding window 1024 at 32k", "attention_masks",
             "sliding window 1024 causal L=32768 (16x64) forward+backward", "jinsum fused (mask prebuilt)", FLEX,
             command=ATTENTION),
    Headline("attention (fwd+bwd)", "GQA 32/8 heads, 8k, causal", "attention_masks",
             "gqa causal L=8192 (32q/8kv heads x128) forward+backward", "jinsum fused", FLEX, command=ATTENTION),
    Headline("training step", "GCN, R-MAT 17", "training", "GCN step, R-MAT 17 undirected (3.73M edges)", "jinsum",
             ("gathers + segment_sum", "BCOO", "PyG GCN (CSR adj_t)"), command=TRAINING),
    Headline("training step", "GraphSAGE, R-MAT 17", "training", "GraphSAGE step, R-MAT 17 undirected (3.73M edges)",
             "jinsum", ("gathers + segment_sum", "PyG GraphSAGE (CSR adj_t)"), command=TRAINING),
    Headline("training step", "GAT, R-MAT 17", "attention_gat", "GAT training step, R-MAT 17 undirected (3.73M edges)",
             "jinsum GATConv (fused)", ("gathers + jax.ops.segment_*", "PyG GATConv"), command=ATTENTION),
    Headline("training step", "SAGE-max, R-MAT 17", "training_max", "SAGE-max step, R-MAT 17 undirected (3.73M edges)",
             "jinsum", ("gathers + segment_max", "PyG SAGE-max (CSR adj_t)", "PyG SAGE-max (edge_index)"),
             command=TRAINING),
    Headline("training step", "mini-batch SAGE, R-MAT 20", "minibatch",
             "SAGE step, R-MAT 20 (31,400,456 edges), batch 1024, fanouts (15, 10)", "jinsum, in place",
             ("plain JAX (same sampler), in place", "plain JAX (same sampler), PyG reading", "PyG (host sampler)"),
             command="benchmarks/minibatch.py"),
    Headline("sparse weights", "SparseLinear 4096^2, 32x32 blocks at 10%, fwd+bwd", "sparse_linear",
             "4096x4096, 32x32 blocks at 10%, bf16, batch 8192", "jinsum SparseLinear",
             ("dense x @ W (JAX)", "dense F.linear (torch)", "torch F.linear, BSR weight (Triton)"),
             column="forward_backward_ms", command="benchmarks/sparse_linear.py"),
]


def read(results: pathlib.Path, device: str) -> list[dict]:
    """One row per headline whose results exist: the label, jinsum's time, the best peer and its time."""
    rows, tables = [], {}
    for h in HEADLINES:
        path = results / f"{h.results + '_' if h.results else ''}{device}.csv"
        if not path.exists():
            continue
        if path not in tables:
            with open(path, newline="") as f:
                tables[path] = list(csv.DictReader(f))
        times = {r["system"]: float(r[h.column]) for r in tables[path]
                 if r["workload"] == h.workload and r.get(h.column)}
        ran = {p: times[p] for p in h.peers if p in times}
        if h.jinsum not in times or not ran:
            raise LookupError(f"{path.name}: no '{h.jinsum}' or none of {h.peers} for workload {h.workload!r}")
        peer = min(ran, key=ran.get)
        rows.append(dict(group=h.group, label=h.label,
                         jinsum=times[h.jinsum], peer=peer, peer_ms=ran[peer], speedup=ran[peer] / times[h.jinsum],
                         command=h.command))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| | workload | jinsum ms | best peer in the same run | its ms | speed-up |",
             "|---|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['label']} | {r['jinsum']:.3f} | {r['peer']} | {r['peer_ms']:.3f} | "
                     f"**{r['speedup']:.2f}x** |")
    return "\n".join(lines)


def plot(rows: list[dict], device: str, path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    groups = list(dict.fromkeys(r["group"] for r in rows))
    colours = dict(zip(groups, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(rows) + 1.4))
    ys = range(len(rows))[::-1]
    ax.barh(list(ys), [r["speedup"] for r in rows], color=[colours[r["group"]] for r in rows], height=0.7)
    for y, r in zip(ys, rows):
        ax.text(r["speedup"] * 1.03, y, f"{r['speedup']:.2f}x vs {r['peer']}", va="center", fontsize=7)
    ax.set_yticks(list(ys), [r["label"] for r in rows], fontsize=8)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0.3, max(r["speedup"] for r in rows) * 6)
    ax.set_xlabel("speed-up over the best peer in the same run (log scale; > 1: jinsum faster)")
    ax.set_title(f"jinsum on one {device.replace('_', ' ')}", fontsize=10)
    ax.legend(handles=[matplotlib.patches.Patch(color=colours[g], label=g) for g in groups], fontsize=7,
              loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="NVIDIA_H100_80GB_HBM3", help="the results' device suffix")
    p.add_argument("--results", type=pathlib.Path, default=HERE / "results", help="where the CSVs are")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results", help="where the PNG goes")
    args = p.parse_args()
    rows = read(args.results, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.device, args.out / f"summary_{args.device}.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()

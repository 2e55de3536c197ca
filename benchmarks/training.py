"""GNN training steps: GCN, GraphSAGE (mean and max) and EdgeConv, full batch, against plain JAX, BCOO and PyG, every
system timed the same way.

    python benchmarks/training.py [--scale 17] [--graphs rmat uniform pubmed] [--models GCN GraphSAGE SAGE-max EdgeConv]
                                  [--calls 20] [--dtype float32] [--breakdown N] [--tag T] [--out benchmarks/results]

Graphs: an R-MAT graph made undirected (scale 17: 131k nodes, 3.7M edges, hubs of 10^4 edges), a uniform random
graph of the same size (no hubs) and PubMed (the real graph, shipped; random features). Models: 128 -> 256 -> 40
(PubMed: 128 -> 256 -> 3), ReLU, dropout 0.5; one step is forward, backward and an Adam update
(`_training.train_step`). Systems:

- jinsum's `GCNConv` / `SAGEConv` on `jinsum.graphs.adjacency` (which carries the entries in column order, so the
  gradient with respect to node features is an owned-row SpMM), and the same without the column order (that
  gradient adds every edge's product atomically); both again in deterministic mode (`jinsum.deterministic`: no
  atomics; without the column order the gradient sorts the edges by column in every step); GCN also on its
  normalised adjacency computed once on the host (`jinsum.graphs.gcn_norm`, as PyG's `cached=True`);
- the same models on gathers and a sorted `jax.ops.segment_sum` (`_training.segment_convs`), and GCN on a
  `jax.experimental.sparse` BCOO;
- PyG's `GCNConv` / `SAGEConv` (where torch_geometric is installed) on a CSR `adj_t` (`torch.sparse_csr_tensor`),
  with GCN's normalisation cached.
Max aggregation (`SAGEConv(aggr="max")`, `EdgeConv` with linear messages, `jinsum.nn` against
`_training.segment_max_convs`, which use a sorted `jax.ops.segment_max`): jinsum, the segment_max models, and PyG's
`SAGEConv(aggr="max")` / `EdgeConv(Linear(2F, out))` on a CSR `adj_t` and on the edge index.

Mixed precision (`--dtype bfloat16`): GCN and GraphSAGE with the layers' `dtype=bfloat16` (float32 parameters and
Adam), jinsum (default and deterministic) and the segment-op layers computing in bfloat16 likewise.

Timing: back-to-back steps, one sync per round, median of rounds, for every system: the JAX systems of a workload
in interleaved rounds (`jinsum.timing.time_interleaved`: the small graphs' steps are the host's, whose speed drifts),
PyG with `jinsum.timing.time_calls`; and each jinsum step's device time by kernel. Results go to `--out` as
`training_<device>.{md,csv}`.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
import time
from collections.abc import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jinsum  # noqa: E402
import jinsum.graphs as jg  # noqa: E402
import jinsum.nn as jnn  # noqa: E402
from jinsum.datasets import load_planetoid, rmat  # noqa: E402
from jinsum.timing import kernel_times, time_calls, time_interleaved  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, baseline, command, device_file_name, device_name, ratio, sync_torch,
    versions_text, write)
from _training import segment_convs, segment_graph, segment_max_convs, train_step  # noqa: E402
from gcn.main import GCN, BCOOGCNConv  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

RESULTS = Results()
BREAKDOWN = 0  # --breakdown N: print the N longest kernels of each jinsum step
MODELS = ["GCN", "GraphSAGE", "SAGE-max", "EdgeConv"]
COLUMNS = (WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}", "failed"), Column("x jinsum", "vs_jinsum", "{:.2f}"), NOTE)


def graphs(scale: int, chosen: list[str]):
    """(name, edge_index, nodes, x, y) for each graph in `chosen` (of "rmat", "uniform", "pubmed")."""
    rng = np.random.default_rng(0)
    nodes = 1 << scale
    skewed = rmat(scale, seed=0, undirected=True)
    edges = skewed.shape[1] // 2
    src, dst = rng.integers(0, nodes, (2, edges))
    keep = src != dst
    pairs = np.unique(np.stack([np.concatenate([src[keep], dst[keep]]), np.concatenate([dst[keep], src[keep]])]),
                      axis=1)
    features = jnp.asarray(rng.standard_normal((nodes, 128)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 40, nodes).astype(np.int32))
    if "rmat" in chosen:
        yield f"R-MAT {scale} undirected ({skewed.shape[1] / 1e6:.2f}M edges)", skewed, nodes, features, labels
    if "uniform" in chosen:
        yield f"uniform random ({pairs.shape[1] / 1e6:.2f}M edges)", pairs, nodes, features, labels
    if "pubmed" not in chosen:
        return
    pubmed = load_planetoid("pubmed")  # (the graph only: random features and labels, as for the others)
    n = pubmed.num_nodes
    yield (f"PubMed ({pubmed.edge_index.shape[1] / 1e3:.0f}k edges)", pubmed.edge_index, n,
           jnp.asarray(rng.standard_normal((n, 128)).astype(np.float32)), jnp.asarray(rng.integers(0, 3, n)))


def compiled_step(model, x, y, graph, deterministic: bool = False) -> Callable[[], object]:
    """A training step of `model` compiled (Adam, learning rate 0.01), as a function of no arguments."""
    step, state = train_step(model, 0.01)
    with jinsum.deterministic(deterministic):  # (the mode is read while tracing: the executable keeps it)
        compiled = jax.jit(step).lower(state, x, y, graph).compile()
    return lambda: compiled(state, x, y, graph)


def device_note(run: Callable[[], object], ours: bool) -> dict:
    """The device time of `run` as a note, with jinsum's kernels' share of it where the system is `ours` (nothing
    without a GPU trace). Wall time minus this is what the host adds to a step."""
    times = kernel_times(run, calls=10)
    if not times:
        return {}
    if BREAKDOWN:
        print(f"    device time by kernel (top {BREAKDOWN} of {len(times)}):")
        for name, t in sorted(times.items(), key=lambda item: -item[1])[:BREAKDOWN]:
            print(f"      {1e3 * t:8.3f} ms  {name[:100]}")
    note = f"device {1e3 * sum(times.values()):.3f} ms"
    if ours:
        note += f", of which jinsum kernels {1e3 * sum(t for n, t in times.items() if n.startswith('jinsum')):.3f}"
    return {"note": note}


def time_jax_systems(workload: str, systems: dict[str, tuple[Callable[[], Callable], bool]], calls: int) -> None:
    """The rows of `systems` (name -> (make its compiled step, whether it is jinsum's)): every step compiled and run
    once first, then all timed together in interleaved rounds (`jinsum.timing.time_interleaved`: small steps are the
    host's, whose speed drifts), then each one's device time noted; a system that failed is its row's note
    (`Results.attempt`)."""
    ready = {}
    for system, (make, _) in systems.items():
        try:
            ready[system] = make()
            jax.block_until_ready(ready[system]())  # (a step that fails when it runs fails here, alone)
        except Exception as error:  # noqa: BLE001 (its row reports it)
            ready[system] = error
    seconds = time_interleaved({s: run for s, run in ready.items() if not isinstance(run, Exception)}, calls=calls)

    def measured(system: str, kernels: bool) -> dict:
        if isinstance(ready[system], Exception):
            raise ready[system]
        return {"ms": 1e3 * seconds[system], **device_note(ready[system], ours=kernels)}

    for system, (_, kernels) in systems.items():
        RESULTS.attempt(workload, system, lambda system=system, kernels=kernels: measured(system, kernels))


def without_column_order(A: jinsum.GroupCOO) -> jinsum.GroupCOO:
    """`A` without the entries in column order that `jg.adjacency` builds: its transpose adds atomically."""
    Ai, Ak, Av, _, overflow = A.tree_flatten()[0]
    return type(A).tree_unflatten(A.tree_flatten()[1], (Ai, Ak, Av, None, overflow))


def model(conv, x, classes):
    """128 -> 256 -> classes, ReLU and dropout 0.5 between (examples/gcn's two-layer model)."""
    return GCN(conv, x.shape[1], 256, classes, dropout=0.5, rngs=nnx.Rngs(0))


def run_graph(name, edge_index, nodes, x, y, calls: int, models: list[str], dtype: str = "float32") -> None:
    classes = int(y.max()) + 1
    adjacency = jg.adjacency(edge_index, nodes)
    SegmentGCNConv, SegmentSAGEConv = segment_convs()
    if dtype != "float32":  # mixed precision: the jinsum and plain JAX layers compute in dtype (float32 parameters)
        run_mixed_precision(name, x, y, calls, models, adjacency, dtype, SegmentGCNConv, SegmentSAGEConv,
                            segment_graph(edge_index, nodes, self_loops=True),
                            segment_graph(edge_index, nodes, self_loops=False))
        return
    with_loops, without_loops = (segment_graph(edge_index, nodes, self_loops=s) for s in (True, False))
    for model_name, jinsum_conv, segment_conv, segment_edges in (("GCN", jnn.GCNConv, SegmentGCNConv, with_loops),
                                                                  ("GraphSAGE", jnn.SAGEConv, SegmentSAGEConv,
                                                                   without_loops)):
        if model_name not in models:
            continue
        workload = f"{model_name} step, {name}"
        print(f"\n{workload}")

        unordered = without_column_order(adjacency)
        systems = {"jinsum": (jinsum_conv, adjacency, True),
                   "jinsum, no column order (atomic transpose)": (jinsum_conv, unordered, True),
                   "jinsum, deterministic": (jinsum_conv, adjacency, True, True),
                   "jinsum, deterministic, no column order (sorted scatter)": (jinsum_conv, unordered, True, True),
                   "gathers + segment_sum": (segment_conv, segment_edges, False)}
        if model_name == "GCN":
            from jax.experimental import sparse  # noqa: PLC0415

            # (the normalisation summed once on the host, as plain JAX's weights and PyG's cached=True are)
            systems["jinsum, gcn_norm once"] = (functools.partial(jnn.GCNConv, normalize=False, add_self_loops=False),
                                                jg.gcn_norm(edge_index, nodes), True)
            src, dst, weight = with_loops
            systems["BCOO"] = (BCOOGCNConv, sparse.BCOO((weight, jnp.stack([dst, src], 1)), shape=(nodes, nodes)),
                               False)
        time_jax_systems(workload, {system: (lambda conv=conv, graph=graph, d=deterministic: compiled_step(
            model(conv, x, classes), x, y, graph, *d), kernels)
            for system, (conv, graph, kernels, *deterministic) in systems.items()}, calls)
        if torch is not None:
            RESULTS.attempt(workload, f"PyG {model_name} (CSR adj_t)",
                            lambda m=model_name: pyg_step(m, edge_index, nodes, x, y, classes, calls))
    run_max_models(name, edge_index, nodes, x, y, calls, models, adjacency, without_loops)


def run_mixed_precision(name, x, y, calls, models, adjacency, dtype, SegmentGCNConv, SegmentSAGEConv, with_loops,
                        without_loops) -> None:
    """GCN and GraphSAGE steps with `dtype=` layers: jinsum (default and deterministic) and the segment ops."""
    classes = int(y.max()) + 1
    for model_name, jinsum_conv, segment_conv, edges in (("GCN", jnn.GCNConv, SegmentGCNConv, with_loops),
                                                         ("GraphSAGE", jnn.SAGEConv, SegmentSAGEConv, without_loops)):
        if model_name not in models:
            continue
        workload = f"{model_name} step {dtype}, {name}"
        print(f"\n{workload}")
        ours, theirs = (functools.partial(conv, dtype=dtype) for conv in (jinsum_conv, segment_conv))
        time_jax_systems(workload, {
            "jinsum": (lambda: compiled_step(model(ours, x, classes), x, y, adjacency), True),
            "jinsum, deterministic": (lambda: compiled_step(model(ours, x, classes), x, y, adjacency, True), True),
            "gathers + segment_sum": (lambda: compiled_step(model(theirs, x, classes), x, y, edges), False)}, calls)


def run_max_models(name, edge_index, nodes, x, y, calls, models, adjacency, edges) -> None:
    """SAGE with max aggregation and EdgeConv: jinsum's `max=` against `jax.ops.segment_max` and PyG."""
    classes = int(y.max()) + 1
    SegmentSAGEMaxConv, SegmentEdgeConv = segment_max_convs()
    sage_max = lambda i, o, rngs: jnn.SAGEConv(i, o, aggr="max", rngs=rngs)  # noqa: E731
    for model_name, jinsum_conv, segment_conv in (("SAGE-max", sage_max, SegmentSAGEMaxConv),
                                                  ("EdgeConv", jnn.EdgeConv, SegmentEdgeConv)):
        if model_name not in models:
            continue
        workload = f"{model_name} step, {name}"
        print(f"\n{workload}")
        time_jax_systems(workload, {
            "jinsum": (lambda c=jinsum_conv: compiled_step(model(c, x, classes), x, y, adjacency), True),
            "jinsum, deterministic": (lambda c=jinsum_conv: compiled_step(model(c, x, classes), x, y, adjacency, True),
                                      True),
            "gathers + segment_max": (lambda c=segment_conv: compiled_step(model(c, x, classes), x, y, edges), False)},
            calls)
        if torch is not None:
            for layout in ("CSR adj_t", "edge_index"):
                RESULTS.attempt(workload, f"PyG {model_name} ({layout})", lambda m=model_name, layout=layout: pyg_step(
                    m, edge_index, nodes, x, y, classes, calls, layout))


def pyg_step(model_name, edge_index, nodes, x, y, classes, calls, layout="CSR adj_t") -> dict:
    """The row's columns of a training step of the same model in PyG."""
    from torch_geometric.nn import EdgeConv, GCNConv, SAGEConv  # noqa: PLC0415

    conv = {"GCN": lambda i, o: GCNConv(i, o, cached=True), "GraphSAGE": SAGEConv,
            "SAGE-max": lambda i, o: SAGEConv(i, o, aggr="max"),
            "EdgeConv": lambda i, o: EdgeConv(torch.nn.Linear(2 * i, o))}[model_name]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = conv(x.shape[1], 256), conv(256, classes)

        def forward(self, x, adj_t):
            x = torch.nn.functional.dropout(x, 0.5, self.training)
            x = torch.relu(self.conv1(x, adj_t))
            x = torch.nn.functional.dropout(x, 0.5, self.training)
            return self.conv2(x, adj_t)

    model = Model().cuda().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    src, dst = (torch.from_numpy(np.asarray(e, np.int64)) for e in edge_index)
    if layout == "edge_index":
        adj_t = torch.stack([src, dst]).cuda()
    else:
        adj_t = torch.sparse_coo_tensor(torch.stack([dst, src]), torch.ones(src.numel()), (nodes, nodes)).coalesce()
        adj_t = adj_t.to_sparse_csr().cuda()
    xt, yt = torch.from_numpy(np.asarray(x)).cuda(), torch.from_numpy(np.asarray(y)).long().cuda()

    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xt, adj_t), yt)
        loss.backward()
        optimizer.step()
        return loss

    return {"ms": 1e3 * time_calls(step, calls=calls, sync=sync_torch)}


def write_results(out: pathlib.Path, started: float, tag: str = "") -> None:
    rows = RESULTS.rows
    for row in rows:
        row["vs_jinsum"] = ratio(row["ms"], baseline(rows, row, lambda r: r["system"] == "jinsum"))
    preamble = (f"{versions_text()}; `{command(__file__)}` ({time.time() - started:.0f} s). ms: median over rounds "
                "of back-to-back steps, a workload's JAX systems in interleaved rounds "
                "(`jinsum.timing.time_interleaved`); x jinsum: the system's time over jinsum's (above 1: jinsum is "
                "faster).")
    write(out / f"training{'_' + tag if tag else ''}_{device_file_name()}", f"GNN training steps on {device_name()}",
          [preamble], COLUMNS, rows, csv_fields=[c.key for c in COLUMNS])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=17)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--graphs", nargs="*", choices=["rmat", "uniform", "pubmed"], default=["rmat", "uniform", "pubmed"])
    p.add_argument("--models", nargs="*", choices=MODELS, default=MODELS)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the layers' computation dtype (bfloat16: GCN and GraphSAGE, jinsum and segment ops only)")
    p.add_argument("--breakdown", type=int, default=0, metavar="N", help="print each jinsum step's N longest kernels")
    p.add_argument("--tag", default="", help="names the results training_<tag>_<device> (a run of some models)")
    args = p.parse_args()
    global BREAKDOWN
    BREAKDOWN = args.breakdown
    started = time.time()
    for graph in graphs(args.scale, args.graphs):
        run_graph(*graph, args.calls, args.models, args.dtype)
        write_results(args.out, started, args.tag)  # (after each graph: a run cut short keeps what it measured)


if __name__ == "__main__":
    main()

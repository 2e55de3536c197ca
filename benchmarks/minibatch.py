"""Mini-batch GraphSAGE with neighbor sampling, end to end (sampling included), and device-built formats.

    python benchmarks/minibatch.py [--scale 20] [--batch 1024] [--fanouts 15 10] [--calls 20] [--out benchmarks/results]

Graph: R-MAT (`jinsum.datasets.rmat`, made undirected; scale 20: 1.05M nodes, 31.4M edges), random 128 features,
40 random classes. Model: GraphSAGE (mean) 128 -> 256 -> 40, ReLU, Adam; one step samples a batch of seeds' 2-hop
neighbourhood and runs forward, backward and the update. Systems, every one timed the same way
(`jinsum.timing.time_calls`: back-to-back steps, one sync per round, median of rounds):

- jinsum: `jinsum.sampling.sample_neighbors` on the device inside the jitted step, `jinsum.nn.SAGEConv` on the
  sampled bipartite `GroupCOO`s (fixed-fanout tables carrying their column order);
- plain JAX: the identical on-device sampler, then gathers + a sorted `jax.ops.segment_sum` per layer;
- PyG (where torch_geometric and CUDA torch are present): a vectorised NumPy sampler on the host (with
  replacement, the cheapest one to write) and PyG's `SAGEConv` on the sampled `edge_index`.
Also timed: `GroupCOO.from_edge_index(..., capacity=E)` from E random edges on the device, with its column order
(`--build-edges`, 1M by default), against a plain `jnp.argsort` of the same edges. Results go to `--out` as
`minibatch_<device>.{md,csv}`; each jitted step's compile count is checked (one).
"""

from __future__ import annotations

import argparse
import csv
import os
import pathlib
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jinsum  # noqa: E402
import jinsum.nn as jnn  # noqa: E402
from jinsum.datasets import rmat  # noqa: E402
from jinsum.sampling import CSRGraph, sample_neighbors  # noqa: E402
from jinsum.timing import time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _training import package_versions  # noqa: E402

ROWS: list[dict] = []


def record(workload: str, system: str, ms: float | None, note: str = "") -> None:
    ROWS.append({"workload": workload, "system": system, "ms": ms, "note": note})
    print(f"{workload:40s} {system:28s} {'failed' if ms is None else f'{ms:9.3f} ms'}  {note}", flush=True)


def attempt(workload: str, system: str, run) -> None:
    try:
        ms, note = run()
        record(workload, system, ms, note)
    except Exception as error:  # a peer that fails is a row, not the end of the run
        traceback.print_exc()
        record(workload, system, None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")


# --- models --------------------------------------------------------------------------------------------------------

class JinsumSAGE(nnx.Module):
    """SAGE mean over the sampled bipartite adjacencies (outermost first)."""

    def __init__(self, sizes, *, rngs):
        self.convs = nnx.List([jnn.SAGEConv(i, o, rngs=rngs) for i, o in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x, adjacencies):
        for i, (conv, A) in enumerate(zip(self.convs, adjacencies)):
            x = conv((x, x[: A.shape[0]]), A)
            x = jax.nn.relu(x) if i < len(self.convs) - 1 else x
        return x


class SegmentSAGE(nnx.Module):
    """The same model as a JAX user writes it without jinsum: per layer, the sampled neighbor table as edges,
    a gather of the sources and a sorted `jax.ops.segment_sum` (sum and in-degree)."""

    def __init__(self, sizes, *, rngs):
        self.neighbors = nnx.List([nnx.Linear(i, o, use_bias=False, rngs=rngs) for i, o in zip(sizes[:-1], sizes[1:])])
        self.roots = nnx.List([nnx.Linear(i, o, rngs=rngs) for i, o in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x, tables):
        for i, (lin, root, (src, valid, n_dst)) in enumerate(zip(self.neighbors, self.roots, tables)):
            dst = jnp.repeat(jnp.arange(n_dst), src.shape[0] // n_dst)
            messages = jnp.where(valid[:, None], x[src], 0)
            total = jax.ops.segment_sum(messages, dst, n_dst, indices_are_sorted=True)
            degree = jax.ops.segment_sum(valid.astype(x.dtype), dst, n_dst, indices_are_sorted=True)
            x = lin(total / jnp.maximum(degree, 1)[:, None]) + root(x[:n_dst])
            x = jax.nn.relu(x) if i < len(self.neighbors) - 1 else x
        return x


def sampled_step(model, graph_input):
    """A jitted step: sample around `seeds`, gather features, forward, backward, Adam. `graph_input(sample)` is what
    the model reads of the sample."""
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, graph, features, labels, seeds, key, fanouts=None):
        model, optimizer = nnx.merge(graphdef, state)
        sample = sample_neighbors(graph, seeds, FANOUTS, key)
        x = features[jnp.maximum(sample.node_ids, 0)]
        y = labels[jnp.maximum(seeds, 0)]

        def loss_fn(model):
            logits = model(x, graph_input(sample))[: seeds.shape[0]]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, state


def tables_of(sample):
    """Each layer's neighbor table as (source rows, valid, destination count), outermost first."""
    return [(A.Ak.reshape(-1), (A.Av != 0).reshape(-1), A.shape[0]) for A in sample.adjacencies]


def time_step(step, state, graph, features, labels, seed_batches, calls):
    """ms per step over distinct batches (a new sample each call), and the step's compile count."""
    keys = jax.random.split(jax.random.key(1), len(seed_batches))
    position = [0]

    def one():
        i = position[0] % len(seed_batches)
        position[0] += 1
        return step(state, graph, features, labels, seed_batches[i], keys[i])[1]

    ms = time_calls(one, calls=calls) * 1e3
    assert step._cache_size() == 1, f"the step compiled {step._cache_size()} times"
    return ms


# --- PyG with a host sampler ----------------------------------------------------------------------------------------

def host_sample(indptr, indices, seeds, fanouts, rng):
    """Vectorised NumPy neighbour sampling with replacement: (node ids, edge_index per layer (outermost first),
    destination counts)."""
    nodes, layers = seeds, []
    for k in fanouts:
        degree = indptr[nodes + 1] - indptr[nodes]
        pick = (rng.random((nodes.size, k)) * degree[:, None]).astype(np.int64)
        has = np.repeat(degree > 0, k)
        src = indices[(indptr[nodes][:, None] + pick).reshape(-1)[has]]
        dst = np.repeat(np.arange(nodes.size), k)[has]
        unique, inverse = np.unique(np.concatenate([nodes, src]), return_inverse=True)
        # relabel: the destinations first, then the new nodes
        local = np.full(unique.size, -1)
        local[inverse[: nodes.size]] = np.arange(nodes.size)
        new = local < 0
        local[new] = nodes.size + np.arange(new.sum())
        layers.append((np.stack([local[inverse[nodes.size:]], dst]), nodes.size))
        nodes = np.concatenate([nodes, unique[new]])
    return nodes, layers[::-1]


def pyg_step_time(indptr, indices, features, labels, seed_batches, calls):
    import torch  # noqa: PLC0415
    from torch_geometric.nn import SAGEConv  # noqa: PLC0415

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList([SAGEConv(i, o) for i, o in zip(SIZES[:-1], SIZES[1:])])

        def forward(self, x, layers):
            for i, (conv, (edge_index, n_dst)) in enumerate(zip(self.convs, layers)):
                x = conv((x, x[:n_dst]), edge_index)
                x = torch.relu(x) if i < len(self.convs) - 1 else x
            return x

    model = Model().cuda().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x_all, y_all = torch.from_numpy(features).cuda(), torch.from_numpy(labels).long().cuda()
    rng, position = np.random.default_rng(0), [0]

    def step():
        seeds = seed_batches[position[0] % len(seed_batches)]
        position[0] += 1
        nodes, layers = host_sample(indptr, indices, seeds, FANOUTS, rng)
        x = x_all[torch.from_numpy(nodes).cuda()]
        layers = [(torch.from_numpy(e).cuda(), n) for e, n in layers]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x, layers)[: seeds.size], y_all[torch.from_numpy(seeds).cuda()])
        loss.backward()
        optimizer.step()
        return loss

    ms = time_calls(step, calls=calls, sync=lambda _: torch.cuda.synchronize()) * 1e3
    return ms, f"host sampler alone {time_calls(lambda: host_sample(indptr, indices, seed_batches[0], FANOUTS, rng), calls=calls, sync=lambda _: None) * 1e3:.2f} ms"


# --- building formats on the device ---------------------------------------------------------------------------------

def build_times(num_edges: int, num_nodes: int, calls: int):
    rng = np.random.default_rng(0)
    edges = jnp.asarray(rng.integers(0, num_nodes, (2, num_edges)), jnp.int32)
    build = jax.jit(lambda e: jinsum.GroupCOO.from_edge_index(e, num_nodes=num_nodes, capacity=num_edges))
    workload = f"GroupCOO + column order, {num_edges:,} edges"
    attempt(workload, "jinsum (device)", lambda: (time_calls(build, edges, calls=calls) * 1e3, ""))
    attempt(workload, "jnp.argsort of the edges", lambda: (
        time_calls(jax.jit(lambda e: jnp.argsort(e[1] * num_nodes + e[0])), edges, calls=calls) * 1e3,
        "one sort, for scale"))
    host = np.asarray(edges)
    attempt(workload, "jinsum (host, NumPy)", lambda: (time_calls(
        lambda: jinsum.GroupCOO.from_edge_index(host, num_nodes=num_nodes).with_transpose(), calls=2, rounds=3,
        sync=lambda _: None) * 1e3, "today's converter, for scale"))


def write(out: pathlib.Path, started: float) -> None:
    device = jax.devices()[0].device_kind
    versions = package_versions()
    stem = out / f"minibatch_{device.replace(' ', '_')}"
    out.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["workload", "system", "ms", "note"])
        writer.writeheader()
        writer.writerows(ROWS)
    lines = [f"# Mini-batch training and device-built formats on {device}", "",
             f"{', '.join(f'{k} {v}' for k, v in versions.items())}; `python benchmarks/minibatch.py "
             f"{' '.join(sys.argv[1:])}` ({time.time() - started:.0f} s). ms: median over rounds of back-to-back "
             "calls (`jinsum.timing.time_calls`), each step on a new batch.", "",
             "| workload | system | ms | note |", "|---|---|---:|---|"]
    for row in ROWS:
        ms = f"{row['ms']:.3f}" if row["ms"] is not None else "failed"
        lines.append(f"| {row['workload']} | {row['system']} | {ms} | {row['note']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


FANOUTS: tuple[int, ...] = (15, 10)
SIZES: tuple[int, ...] = (128, 256, 40)


def main() -> None:
    global FANOUTS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=20)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--build-edges", type=int, default=1 << 20)
    p.add_argument("--skip", nargs="*", default=[], choices=["jinsum", "plain JAX", "PyG", "build"])
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    FANOUTS = tuple(args.fanouts)
    started = time.time()

    edge_index = rmat(args.scale, undirected=True)
    nodes = 1 << args.scale
    rng = np.random.default_rng(0)
    features = rng.normal(size=(nodes, SIZES[0])).astype(np.float32)
    labels = rng.integers(0, SIZES[-1], nodes).astype(np.int32)
    graph = CSRGraph.from_edge_index(edge_index, nodes)
    order = rng.permutation(nodes)
    seed_batches = [order[i * args.batch:(i + 1) * args.batch].astype(np.int32) for i in range(8)]
    workload = (f"SAGE step, R-MAT {args.scale} ({edge_index.shape[1]:,} edges), batch {args.batch}, "
                f"fanouts {FANOUTS}")
    print(workload, flush=True)
    x, y = jnp.asarray(features), jnp.asarray(labels)
    batches = [jnp.asarray(s) for s in seed_batches]

    if "jinsum" not in args.skip:
        step, state = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), lambda s: s.adjacencies)
        attempt(workload, "jinsum", lambda: (time_step(step, state, graph, x, y, batches, args.calls), "1 compile"))
    if "plain JAX" not in args.skip:
        step, state = sampled_step(SegmentSAGE(SIZES, rngs=nnx.Rngs(0)), tables_of)
        attempt(workload, "plain JAX (same sampler)",
                lambda: (time_step(step, state, graph, x, y, batches, args.calls), "1 compile; gathers + segment_sum"))
    sampler = jax.jit(lambda g, s, k: sample_neighbors(g, s, FANOUTS, k).node_ids)
    attempt(workload, "the device sampler alone", lambda: (time_calls(
        sampler, graph, batches[0], jax.random.key(0), calls=args.calls) * 1e3, ""))
    if "PyG" not in args.skip:
        indptr, indices = np.asarray(graph.indptr).astype(np.int64), np.asarray(graph.indices)
        attempt(workload, "PyG (host sampler)",
                lambda: pyg_step_time(indptr, indices, features, labels, seed_batches, args.calls))
    if "build" not in args.skip:
        build_times(args.build_edges, nodes, args.calls)
    write(args.out, started)


if __name__ == "__main__":
    main()

"""GraphSAGE (mean and max aggregation) and GIN on PubMed's graph and an R-MAT graph, SYNTHETIC features and labels.

The graphs are real or standard: PubMed's citation graph (19,717 nodes, 88,648 directed edges) and an R-MAT graph
(`jinsum.datasets.rmat`, Graph500 parameters, `2**scale` nodes, skewed degrees). The features and labels are NOT
real: features are i.i.d. standard normal, and the labels of each model's task come from a random teacher of the
same architecture (the model initialised with seed + 1): a node's label is the argmax of the teacher's class
scores, each class's scores standardised over the nodes so that no class dominates by scale. Labels thus depend
on two-hop neighbourhoods, and the student can represent them exactly. Nodes are split at random 60% / 20% / 20%
into train / validation / test; the largest class's share is printed as the accuracy of a constant guess.

Each model is trained twice from the same initial parameters, full batch with Adam:

- jinsum: `jinsum.nn.SAGEConv` (mean aggregation, and `aggr="max"`) and `jinsum.nn.GINConv` (sum aggregation,
  2-layer MLPs) on `jinsum.graphs.adjacency`: one SpMM, or one `max=` statement, per aggregation;
- segment ops: the same layers written with gathers `x[src]` and `jax.ops.segment_sum` / `jax.ops.segment_max`
  over edges sorted by destination.

Reported per system: time of one training step (`jinsum.timing.time_calls`), the step's peak memory, and the
final training accuracy (plus the test accuracy at the best validation epoch). Peak memory is XLA's buffer plan
for the compiled step (`memory_analysis()`: arguments + outputs + temporaries), available on every backend; the
device's `memory_stats()` is None on CPU, and on a GPU its `peak_bytes_in_use` (over the whole process, so over
all systems run so far) is printed after the table.

    python examples/graphsage_gin/main.py [--scale 15] [--epochs 200] [--features 128] [--seed 0] [--smoke]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jinsum.graphs
import jinsum.nn
from jinsum.datasets import load_planetoid, rmat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402


def teacher_task(teacher: nnx.Module, graph, x: jax.Array, seed: int) -> _common.NodeTask:
    """SYNTHETIC labels for features `x`: the argmax of a random teacher's class scores, standardised per class."""
    scores = nnx.jit(lambda teacher, x, graph: teacher(x, graph))(teacher, x, graph)  # (one program, not op by op)
    y = ((scores - scores.mean(0)) / scores.std(0)).argmax(1)
    train, val, test = map(jnp.asarray, _common.random_split(x.shape[0], (0.6, 0.2), seed))
    return _common.NodeTask(x=x, y=y, train_idx=train, val_idx=val, test_idx=test, num_classes=scores.shape[1])


def segment_aggregate(x: jax.Array, edges: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Sum of the sources' rows into each destination: a gather and a sorted `jax.ops.segment_sum`."""
    src, dst = edges
    return jax.ops.segment_sum(x[src], dst, num_segments=x.shape[0], indices_are_sorted=True)


class SegmentSAGEConv(nnx.Module):
    """`jinsum.nn.SAGEConv` with segment ops: same parameters, initialisers and order of operations."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        self.lin_neighbors = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
        self.lin_root = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,)))

    def __call__(self, x: jax.Array, edges: tuple[jax.Array, jax.Array]) -> jax.Array:
        deg = segment_aggregate(jnp.ones((x.shape[0], 1), x.dtype), edges)
        inv_deg = 1 / jnp.where(deg != 0, deg, 1)
        # As in SAGEConv: aggregate whichever of x and x W is narrower (the mean commutes with W).
        if self.lin_neighbors.out_features < self.lin_neighbors.in_features:
            out = segment_aggregate(self.lin_neighbors(x), edges) * inv_deg
        else:
            out = self.lin_neighbors(segment_aggregate(x, edges) * inv_deg)
        return out + self.lin_root(x) + self.bias[...]


class SegmentSAGEMaxConv(nnx.Module):
    """`jinsum.nn.SAGEConv(aggr="max")` with segment ops: the sources' elementwise maximum, 0 without in-edges."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        self.lin_neighbors = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
        self.lin_root = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,)))

    def __call__(self, x: jax.Array, edges: tuple[jax.Array, jax.Array]) -> jax.Array:
        src, dst = edges
        largest = jax.ops.segment_max(x[src], dst, num_segments=x.shape[0], indices_are_sorted=True)
        largest = jnp.where(jnp.isneginf(largest), 0, largest)
        return self.lin_neighbors(largest) + self.lin_root(x) + self.bias[...]


class SegmentGINConv(nnx.Module):
    """`jinsum.nn.GINConv` with segment ops: `mlp((1 + eps) x + sum_in(x))`, eps learned."""

    def __init__(self, mlp: nnx.Module):
        self.mlp = mlp
        self.eps = nnx.Param(jnp.zeros(()))

    def __call__(self, x: jax.Array, edges: tuple[jax.Array, jax.Array]) -> jax.Array:
        return self.mlp((1 + self.eps[...]) * x + segment_aggregate(x, edges))


class SAGE(nnx.Module):
    """SAGEConv -> ReLU -> SAGEConv."""

    def __init__(self, conv, features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
        self.conv1 = conv(features, hidden, rngs=rngs)
        self.conv2 = conv(hidden, classes, rngs=rngs)

    def __call__(self, x: jax.Array, graph) -> jax.Array:
        return self.conv2(nnx.relu(self.conv1(x, graph)), graph)


class GIN(nnx.Module):
    """GINConv -> ReLU -> GINConv, each with a 2-layer MLP."""

    def __init__(self, conv, features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
        def mlp(a, b, c):
            return nnx.Sequential(nnx.Linear(a, b, rngs=rngs), nnx.relu, nnx.Linear(b, c, rngs=rngs))

        self.conv1 = conv(mlp(features, hidden, hidden))
        self.conv2 = conv(mlp(hidden, hidden, classes))

    def __call__(self, x: jax.Array, graph) -> jax.Array:
        return self.conv2(nnx.relu(self.conv1(x, graph)), graph)


MODELS = {"GraphSAGE": (SAGE, jinsum.nn.SAGEConv, SegmentSAGEConv),
          "GraphSAGE-max": (SAGE, functools.partial(jinsum.nn.SAGEConv, aggr="max"), SegmentSAGEMaxConv),
          "GIN": (GIN, jinsum.nn.GINConv, SegmentGINConv)}


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--scale", type=int, default=15, help="R-MAT graph with 2**scale nodes, 16 draws per node")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--features", type=int, default=128, help="width of the synthetic features")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    args = p.parse_args(argv)
    epochs, scale = (2, 8) if args.smoke else (args.epochs, args.scale)

    pubmed = load_planetoid("pubmed")
    graphs = {"pubmed": (pubmed.edge_index, pubmed.num_nodes), f"rmat{scale}": (rmat(scale, seed=args.seed), 2**scale)}
    print(f"device: {_common.device_name()}")
    print("features and labels are SYNTHETIC (random features, labels of a random teacher GNN); graphs are real "
          "(PubMed) or R-MAT")
    rows = []
    for graph_name, (edge_index, num_nodes) in graphs.items():
        order = np.lexsort(edge_index)  # by destination, then source: segment_sum wants destinations sorted
        edges = (jnp.asarray(edge_index[0, order]), jnp.asarray(edge_index[1, order]))
        adjacency = jinsum.graphs.adjacency(edge_index, num_nodes)
        x = jax.random.normal(jax.random.key(args.seed), (num_nodes, args.features))
        print(f"{graph_name}: {num_nodes} nodes, {edge_index.shape[1]} edges, jinsum {adjacency}")
        for model_name, (model_cls, jinsum_conv, segment_conv) in MODELS.items():
            sizes = (args.features, args.hidden, args.classes)
            task = teacher_task(model_cls(jinsum_conv, *sizes, rngs=nnx.Rngs(args.seed + 1)), adjacency, x, args.seed)
            majority = np.bincount(np.asarray(task.y)).max() / num_nodes
            print(f"  {model_name}: SYNTHETIC labels of a random {model_name} teacher, largest class "
                  f"{100 * majority:.1f}% of the nodes")
            fits = {}
            for system, (conv, graph) in {"jinsum": (jinsum_conv, adjacency),
                                          "segment ops": (segment_conv, edges)}.items():
                name = f"{graph_name} {model_name} {system}"
                fits[name] = _common.fit(model_cls(conv, *sizes, rngs=nnx.Rngs(args.seed)), optax.adam(0.01), task,
                                         graph, epochs=epochs, desc=name, smoke=args.smoke)
            rows += _common.fit_rows(fits)
    _common.print_table(f"GraphSAGE (mean, max) and GIN, SYNTHETIC features ({args.features}) and labels "
                        f"({args.classes} classes), hidden {args.hidden}, {epochs} epochs, seed {args.seed}",
                        _common.FIT_HEADER, rows)
    stats = jax.devices()[0].memory_stats()
    print("device memory_stats: " + ("unavailable on this backend" if stats is None else
                                     f"peak_bytes_in_use {stats['peak_bytes_in_use'] / 2**20:.1f} MiB (whole run)"))


if __name__ == "__main__":
    main()

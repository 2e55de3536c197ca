"""Graph classification on a batch of small GENERATED graphs: GIN layers and global pooling, all graphs at once.

The data are generated, with a known signal: each graph has 12-30 nodes and is drawn from one of two random graph
families with the same numbers of nodes and edges: preferential attachment (Barabasi-Albert, each new node linked to
2 existing nodes chosen in proportion to their degree: a few hubs) or uniform random edges (Erdos-Renyi: no hubs).
The class is the family. Every node's feature is the constant 1, so the model must read the structure: degree and
neighbourhood statistics (counts of walks, which GIN's sums compute), pooled per graph. Graphs are split at random
60% / 20% / 20% into train / validation / test.

Both systems train the same model from the same initial parameters, full batch with Adam: three GIN layers (2-layer
MLPs), the mean and the maximum of each graph's node states, and a 2-layer classifier.

- jinsum: `jinsum.nn.batch_graphs` (one block-diagonal adjacency and the node -> graph vector), `jinsum.nn.GINConv`
  (one SpMM per layer), `jinsum.nn.global_mean_pool` (`P[b[i],n] += X[i,n]` over a count) and
  `jinsum.nn.global_max_pool` (`P[b[i],n] max= X[i,n]`);
- segment ops: the same model with gathers and `jax.ops.segment_sum` over edges sorted by destination, and
  `jax.ops.segment_sum` / `jax.ops.segment_max` over the sorted batch vector.

    python examples/graph_classification/main.py [--graphs 1000] [--epochs 300] [--hidden 32] [--seed 0] [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jinsum.nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402
from graphsage_gin.main import SegmentGINConv  # noqa: E402


def preferential_attachment(n: int, rng: np.random.Generator) -> np.ndarray:
    """Undirected edges `(2, m)` of a Barabasi-Albert graph: nodes 0-1 linked, then each node to 2 earlier ones."""
    edges, ends = [(0, 1)], [0, 1]  # `ends`: every edge's endpoints, so a uniform draw is degree-proportional
    for v in range(2, n):
        targets = set()
        while len(targets) < min(2, v):
            targets.add(ends[rng.integers(len(ends))])
        for u in targets:
            edges.append((u, v))
            ends += [u, v]
    return np.array(edges).T


def uniform_edges(n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """Undirected edges `(2, m)`: `m` distinct pairs of distinct nodes, uniformly."""
    pairs = np.array([(u, v) for u in range(n) for v in range(u + 1, n)])
    return pairs[rng.choice(len(pairs), m, replace=False)].T


def generate(count: int, seed: int):
    """`count` graphs, half of each family, shuffled: (directed edge indices, node counts, labels, features)."""
    rng = np.random.default_rng(seed)
    edge_indices, sizes, labels = [], [], rng.permutation(np.arange(count) % 2)
    for label in labels:
        n = int(rng.integers(12, 31))
        hubs = preferential_attachment(n, rng)
        edges = hubs if label else uniform_edges(n, hubs.shape[1], rng)
        edge_indices.append(np.concatenate([edges, edges[::-1]], axis=1))  # both directions
        sizes.append(n)
    return edge_indices, sizes, jnp.asarray(labels), jnp.ones((sum(sizes), 1))


class GraphClassifier(nnx.Module):
    """Three GIN layers, then `[mean, max]` of each graph's node states, then Linear -> ReLU -> Linear."""

    def __init__(self, conv, pools, features: int, hidden: int, classes: int, num_graphs: int, *, rngs: nnx.Rngs):
        def mlp(a, b):
            return nnx.Sequential(nnx.Linear(a, b, rngs=rngs), nnx.relu, nnx.Linear(b, b, rngs=rngs))

        self.convs = nnx.List([conv(mlp(features, hidden)), conv(mlp(hidden, hidden)), conv(mlp(hidden, hidden))])
        self.pools, self.num_graphs = pools, num_graphs
        self.hidden = nnx.Linear(len(pools) * hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x: jax.Array, graph) -> jax.Array:
        adjacency, batch = graph
        for conv in self.convs:
            x = nnx.relu(conv(x, adjacency))
        pooled = jnp.concatenate([pool(x, batch, self.num_graphs) for pool in self.pools], axis=-1)
        return self.out(nnx.relu(self.hidden(pooled)))


def segment_mean_pool(x, batch, num_graphs):
    total = jax.ops.segment_sum(x, batch, num_segments=num_graphs, indices_are_sorted=True)
    count = jax.ops.segment_sum(jnp.ones_like(batch, x.dtype), batch, num_graphs, indices_are_sorted=True)
    return total / jnp.maximum(count, 1)[:, None]


def segment_max_pool(x, batch, num_graphs):
    out = jax.ops.segment_max(x, batch, num_segments=num_graphs, indices_are_sorted=True)
    return jnp.where(jnp.isneginf(out), 0, out)


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--graphs", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--hidden", type=int, default=32)
    args = p.parse_args(argv)
    count, epochs = (40, 3) if args.smoke else (args.graphs, args.epochs)

    edge_indices, sizes, labels, x = generate(count, args.seed)
    adjacency, batch = jinsum.nn.batch_graphs(edge_indices, sizes)
    edge_index = np.concatenate([e + o for e, o in zip(edge_indices, np.cumsum([0, *sizes[:-1]]))], axis=1)
    order = np.lexsort(edge_index)  # by destination: segment_sum wants destinations sorted
    edges = (jnp.asarray(edge_index[0, order]), jnp.asarray(edge_index[1, order]))
    train, val, test = map(jnp.asarray, _common.random_split(count, (0.6, 0.2), args.seed))
    task = _common.NodeTask(x=x, y=labels, train_idx=train, val_idx=val, test_idx=test, num_classes=2)
    print(f"device: {_common.device_name()}")
    print(f"{count} GENERATED graphs (preferential attachment vs uniform random edges, same sizes), {sum(sizes)} "
          f"nodes, {edge_index.shape[1]} directed edges; constant node features; jinsum {adjacency}")

    systems = {"jinsum GINConv + global pools": (jinsum.nn.GINConv, (jinsum.nn.global_mean_pool,
                                                                      jinsum.nn.global_max_pool), adjacency),
               "segment ops GIN + segment pools": (SegmentGINConv, (segment_mean_pool, segment_max_pool), edges)}
    fits = {}
    for name, (conv, pools, graph) in systems.items():
        model = GraphClassifier(conv, pools, 1, args.hidden, 2, count, rngs=nnx.Rngs(args.seed))
        fits[name] = _common.fit(model, optax.adam(0.003), task, (graph, batch), epochs=epochs, desc=name,
                                 smoke=args.smoke)
    _common.print_table(f"Graph classification, {count} GENERATED graphs, 2 classes (chance 50%), {epochs} epochs, "
                        f"seed {args.seed}", _common.FIT_HEADER, _common.fit_rows(fits))


if __name__ == "__main__":
    main()

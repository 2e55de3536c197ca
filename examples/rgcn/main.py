"""Node classification with a 2-layer RGCN (Schlichtkrull et al., 2018) on a GENERATED multi-relational graph.

No knowledge graph ships offline with the package, so the graph comes from a documented recipe, a stochastic
block model with typed edges in which only the relation types tell the communities apart:

- `N` nodes fall uniformly at random into `K` communities; a node's label is its community.
- There are `R = K` relations. Every node sends `degree` edges of each relation `r`; an edge of relation `r` from
  a node of community `c` goes to a uniformly drawn node of community `(c + r) mod K` with probability `purity`,
  else to a uniformly drawn node of any community. So relation `r`'s community-mixing matrix is
  `M_r = purity * P^r + (1 - purity) / K`, with `P` the cyclic shift, and `sum_r M_r` is uniform: with the edge
  types ignored, a node's neighbours say nothing about its community.
- Features are weak: `x = signal * onehot(community) Q + noise` with `Q` a random `K x F` projection with
  orthonormal rows and standard normal noise, so a node's own features alone classify it poorly.

Nodes are split at random 10% / 10% / 80% into train / validation / test. The same architecture (RGCNConv ->
ReLU -> RGCNConv, per-relation weights or `--bases` basis matrices, Adam, best-validation model selection) is
trained on the typed graph and on the same edges with one relation type only: the gap is what the relations
carry. Each `jinsum.nn.RGCNConv` layer is one indirect Einsum over the typed edges, `O[dst[e],f] += norm[e] *
X[src[e],c] * W[rel[e],c,f]`; on the typed graph the same model is also trained with a segment-op layer (every
node times every relation's weight, then a gather per edge and `jax.ops.segment_sum`), from the same initial
parameters. Train steps are timed with `jinsum.timing.time_calls`.

    python examples/rgcn/main.py [--nodes 10000] [--communities 6] [--degree 2] [--bases 0] [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jinsum.graphs
import jinsum.nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402


def typed_block_model(num_nodes: int, communities: int, *, degree: int, purity: float, features: int,
                      signal: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The generated graph of the module docstring: (edges (2, E), relations (E,), features (N, F), labels (N,))."""
    rng = np.random.default_rng(seed)
    label = rng.integers(communities, size=num_nodes)
    members = np.argsort(label, kind="stable")  # node ids grouped by community
    start = np.searchsorted(label[members], np.arange(communities))
    size = np.bincount(label, minlength=communities)

    src = np.repeat(np.arange(num_nodes), communities * degree)
    rel = np.tile(np.repeat(np.arange(communities), degree), num_nodes)
    target = np.where(rng.random(src.size) < purity, (label[src] + rel) % communities,
                      rng.integers(communities, size=src.size))
    dst = members[start[target] + (rng.random(src.size) * size[target]).astype(int)]

    projection = np.linalg.qr(rng.standard_normal((features, communities)))[0].T  # orthonormal rows
    x = signal * projection[label] + rng.standard_normal((num_nodes, features))
    return np.stack([src, dst]), rel, x.astype(np.float32), label


class SegmentRGCNConv(nnx.Module):
    """`jinsum.nn.RGCNConv` in the usual segment-op form (same parameters, initialisers and result).

    Every node is transformed by every relation's weight first (`N x R x F`, one dense einsum); each edge then
    gathers the row of its (source, relation), scaled by `norm`, and a sorted `jax.ops.segment_sum` adds the
    messages into their destinations.
    """

    def __init__(self, in_features: int, out_features: int, *, num_relations: int, num_bases: int | None,
                 rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.weight = nnx.Param(init(rngs.params(), (num_bases or num_relations, in_features, out_features)))
        self.comp = (nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (num_relations, num_bases)))
                     if num_bases else None)
        self.root = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,)))

    def __call__(self, x: jax.Array, graph: jinsum.graphs.RelationalGraph) -> jax.Array:
        weight = self.weight[...]
        if self.comp is not None:
            weight = jnp.einsum("rb,bcf->rcf", self.comp[...], weight)
        transformed = jnp.einsum("nc,rcf->nrf", x, weight)
        messages = graph.norm[:, None] * transformed[graph.src, graph.rel]
        out = jax.ops.segment_sum(messages, graph.dst, num_segments=x.shape[0], indices_are_sorted=True)
        return out + self.root(x) + self.bias[...]


class RGCN(nnx.Module):
    """conv -> ReLU -> conv: logits of every node."""

    def __init__(self, conv, features: int, hidden: int, classes: int, *, relations: int, bases: int | None,
                 rngs: nnx.Rngs):
        self.conv1 = conv(features, hidden, num_relations=relations, num_bases=bases, rngs=rngs)
        self.conv2 = conv(hidden, classes, num_relations=relations, num_bases=bases, rngs=rngs)

    def __call__(self, x: jax.Array, graph: jinsum.graphs.RelationalGraph) -> jax.Array:
        return self.conv2(nnx.relu(self.conv1(x, graph)), graph)


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--nodes", type=int, default=10000)
    p.add_argument("--communities", type=int, default=6, help="K classes, and as many relation types")
    p.add_argument("--degree", type=int, default=2, help="edges each node sends per relation")
    p.add_argument("--purity", type=float, default=0.8, help="fraction of edges that follow the relation's rule")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--signal", type=float, default=1.0, help="strength of the community in the features")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--bases", type=int, default=0, help="basis matrices shared by the relations (0: none)")
    p.add_argument("--epochs", type=int, default=200)
    args = p.parse_args(argv)
    epochs, nodes = (3, 300) if args.smoke else (args.epochs, args.nodes)
    k = args.communities

    edge_index, rel, x, label = typed_block_model(nodes, k, degree=args.degree, purity=args.purity,
                                                  features=args.features, signal=args.signal, seed=args.seed)
    splits = _common.random_split(nodes, (0.1, 0.1), args.seed)
    task = _common.NodeTask(jnp.asarray(x), jnp.asarray(label, jnp.int32), *map(jnp.asarray, splits),
                            num_classes=k)
    print(f"GENERATED typed block model: {nodes} nodes, {k} communities, {k} relations, {edge_index.shape[1]} edges, "
          f"purity {args.purity}, feature signal {args.signal}")
    print(f"device: {_common.device_name()}")
    merged = np.zeros_like(rel)
    variants = {  # name: (layer, relation of each edge, number of relations)
        f"jinsum RGCNConv, {k} relations": (jinsum.nn.RGCNConv, rel, k),
        f"segment_sum RGCN, {k} relations": (SegmentRGCNConv, rel, k),
        "jinsum RGCNConv, relations merged": (jinsum.nn.RGCNConv, merged, 1),
    }
    fits = {}
    for name, (conv, relations, num_relations) in variants.items():
        graph = jinsum.graphs.relational_graph(*edge_index, relations, nodes, num_relations)
        model = RGCN(conv, args.features, args.hidden, k, relations=num_relations, bases=args.bases or None,
                     rngs=nnx.Rngs(args.seed))
        fits[name] = _common.fit(model, optax.adam(0.01), task, graph, epochs=epochs, desc=name, smoke=args.smoke)
    bases = f"{args.bases} bases" if args.bases else "a weight per relation"
    _common.print_table(f"RGCN on the generated graph, hidden {args.hidden}, {bases}, {epochs} epochs, seed "
                        f"{args.seed} (chance: {100 / k:.1f}%)", _common.FIT_HEADER, _common.fit_rows(fits))


if __name__ == "__main__":
    main()

"""Semi-supervised node classification with a 2-layer GAT (Velickovic et al., ICLR 2018) on Cora.

The real Planetoid data with the standard split, features row-normalised, and the paper's transductive model:
8 attention heads of 8 features (concatenated, ELU), an output layer of 1 head, dropout 0.6 on both layers'
inputs and on the attention coefficients, Adam with learning rate 0.005 and an L2 penalty of 5e-4 on all
parameters (PyG's example: torch's Adam weight_decay). The reported test accuracy is that of the epoch with the
best validation accuracy (the paper reports 83.0% on Cora).

The same run trains the same model twice from the same initial parameters:

- jinsum: `jinsum.nn.GATConv` on `jinsum.graphs.adjacency`: scores, edge softmax, attention dropout and aggregation
  are one fused `jinsum.attention` chain (one generated kernel on a GPU, the unfused statements elsewhere);
- segment ops: the same layer on edge arrays (self loops added, sorted by destination): scores and messages
  by gathers, the softmax by `jax.ops.segment_max` / `segment_sum`, the aggregation by `jax.ops.segment_sum`.
  jax.experimental.sparse has no per-row softmax over a BCOO's entries, hence the edge arrays.

Dropout masks differ between the two (the layers draw them over differently laid out edges), so the two runs
agree in distribution, not bit for bit. Both train steps are timed with `jinsum.timing.time_calls`.

    python examples/gat/main.py [--epochs 300] [--seed 0] [--smoke]
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

PAPER_ACCURACY = 0.830


class SegmentGATConv(nnx.Module):
    """The segment-op baseline of `jinsum.nn.GATConv` (same parameters, initialisers and semantics).

    Called with ``edges = (src, dst)``: every edge once, self loops included, sorted by destination.
    """

    def __init__(self, in_features: int, out_features: int, *, heads: int, concat: bool, dropout: float,
                 rngs: nnx.Rngs, negative_slope: float = 0.2):
        self.heads, self.out_features, self.concat, self.negative_slope = heads, out_features, concat, negative_slope
        self.linear = nnx.Linear(in_features, heads * out_features, use_bias=False, rngs=rngs)
        init = nnx.initializers.glorot_uniform()
        self.att_src = nnx.Param(init(rngs.params(), (heads, out_features)))
        self.att_dst = nnx.Param(init(rngs.params(), (heads, out_features)))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((heads * out_features if concat else out_features,)))

    def __call__(self, x: jax.Array, edges: tuple[jax.Array, jax.Array]) -> jax.Array:
        src, dst = edges
        n = x.shape[0]
        h = self.linear(x).reshape(n, self.heads, self.out_features)
        s_src = jnp.einsum("nhf,hf->nh", h, self.att_src[...])
        s_dst = jnp.einsum("nhf,hf->nh", h, self.att_dst[...])
        scores = jax.nn.leaky_relu(s_src[src] + s_dst[dst], self.negative_slope)  # (E, H)
        segment = dict(num_segments=n, indices_are_sorted=True)
        row_max = jax.lax.stop_gradient(jax.ops.segment_max(scores, dst, **segment))
        weights = jnp.exp(scores - row_max[dst])
        alpha = weights / jax.ops.segment_sum(weights, dst, **segment)[dst]
        out = jax.ops.segment_sum(self.dropout(alpha)[..., None] * h[src], dst, **segment)
        out = out.reshape(n, -1) if self.concat else out.mean(axis=1)
        return out + self.bias[...]


class GAT(nnx.Module):
    """dropout -> 8-head attention (concat) -> ELU -> dropout -> 1-head attention: logits of every node."""

    def __init__(self, conv, in_features: int, classes: int, *, heads: int, hidden: int, dropout: float,
                 rngs: nnx.Rngs):
        self.conv1 = conv(in_features, hidden, heads=heads, concat=True, dropout=dropout, rngs=rngs)
        self.conv2 = conv(heads * hidden, classes, heads=1, concat=False, dropout=dropout, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, graph) -> jax.Array:
        x = nnx.elu(self.conv1(self.dropout(x), graph))
        return self.conv2(self.dropout(x), graph)


def edges_with_self_loops(edge_index: np.ndarray, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """(src, dst) of every edge plus one self loop per node, sorted by destination (for sorted segment ops)."""
    loops = np.arange(num_nodes, dtype=edge_index.dtype)
    src, dst = np.concatenate([edge_index[:, edge_index[0] != edge_index[1]], np.stack([loops, loops])], axis=1)
    order = np.lexsort((src, dst))
    return jnp.asarray(src[order]), jnp.asarray(dst[order])


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=8, help="features per head of the first layer")
    args = p.parse_args(argv)
    epochs = 2 if args.smoke else args.epochs

    task, edge_index, num_nodes = _common.citation_task("cora", features=128 if args.smoke else None)
    print(f"cora: {num_nodes} nodes, {edge_index.shape[1]} directed edges (+ {num_nodes} self loops), "
          f"{task.x.shape[1]} features, {task.num_classes} classes")
    print(f"device: {_common.device_name()}")
    systems = {
        "jinsum GATConv": (jinsum.nn.GATConv, jinsum.graphs.adjacency(edge_index, num_nodes)),
        "gathers + jax.ops.segment_*": (SegmentGATConv, edges_with_self_loops(edge_index, num_nodes)),
    }
    fits = {}
    for name, (conv, graph) in systems.items():
        model = GAT(conv, task.x.shape[1], task.num_classes, heads=args.heads, hidden=args.hidden, dropout=0.6,
                    rngs=nnx.Rngs(args.seed))
        fits[name] = _common.fit(model, optax.adam(0.005), task, graph, epochs=epochs, desc=name, smoke=args.smoke,
                                 penalty=lambda m: 5e-4 * _common.l2(m))
    _common.print_table(
        f"GAT on cora, {args.heads} heads x {args.hidden}, {epochs} epochs, seed {args.seed} "
        f"(paper: {100 * PAPER_ACCURACY:.1f}% test accuracy)", _common.FIT_HEADER, _common.fit_rows(fits))


if __name__ == "__main__":
    main()

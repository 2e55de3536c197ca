"""Semi-supervised node classification with a 2-layer GCN (Kipf & Welling, ICLR 2017) on Cora or Citeseer.

The real Planetoid data with the standard split (20 labelled nodes per class, 500 validation, 1000 test nodes),
features row-normalised, and the paper's hyperparameters: 16 hidden units, ReLU, dropout 0.5, Adam with learning
rate 0.01, L2 penalty 5e-4 on the first layer, 200 epochs. The reported test accuracy is that of the epoch with
the best validation accuracy (the paper reports 81.5% on Cora and 70.3% on Citeseer).

The same run trains the same model twice from the same initial parameters and dropout seed:

- jinsum: `jinsum.nn.GCNConv` on the raw adjacency (`jinsum.graphs.adjacency`); the layer adds the self loops and
  the symmetric normalisation itself, with one SpMM `C[Ai[g],n] += Av[g,p] * H[Ak[g,p],n]` per layer;
- jax.experimental.sparse: the normalised adjacency D^-1/2 (A + I) D^-1/2 precomputed on the host as a BCOO
  matrix, multiplied by the dense `X W` (`BCOO @ dense`).

Both train steps (forward, backward and Adam update of one full-batch epoch) are jitted once and timed the same
way, with `jinsum.timing.time_calls`.

    python examples/gcn/main.py [--dataset cora|citeseer] [--epochs 200] [--seed 0] [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import sparse

import jinsum.graphs
import jinsum.nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402

PAPER_ACCURACY = {"cora": 0.815, "citeseer": 0.703}


class BCOOGCNConv(nnx.Module):
    """The jax.experimental.sparse baseline of `GCNConv`: `Â (x W) + b`, with `Â` the normalised BCOO adjacency
    (`(Â x) W + b` where `W` widens, as `GCNConv` orders it).

    Its parameters have the names, shapes and initialisers of `jinsum.nn.GCNConv`'s, so that equal seeds give
    equal initial models.
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,)))

    def __call__(self, x: jax.Array, A_hat: sparse.BCOO) -> jax.Array:
        if self.linear.out_features < self.linear.in_features:
            return A_hat @ self.linear(x) + self.bias[...]
        return self.linear(A_hat @ x) + self.bias[...]


class GCN(nnx.Module):
    """dropout -> conv -> ReLU -> dropout -> conv: logits of every node."""

    def __init__(self, conv, in_features: int, hidden: int, classes: int, *, dropout: float, rngs: nnx.Rngs):
        self.conv1 = conv(in_features, hidden, rngs=rngs)
        self.conv2 = conv(hidden, classes, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, graph) -> jax.Array:
        x = nnx.relu(self.conv1(self.dropout(x), graph))
        return self.conv2(self.dropout(x), graph)


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--dataset", choices=sorted(PAPER_ACCURACY), default="cora")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--hidden", type=int, default=16)
    args = p.parse_args(argv)
    epochs = 2 if args.smoke else args.epochs

    task, edge_index, num_nodes = _common.citation_task(args.dataset, features=128 if args.smoke else None)
    print(f"{args.dataset}: {num_nodes} nodes, {edge_index.shape[1]} directed edges, {task.x.shape[1]} features, "
          f"{task.num_classes} classes; split {len(task.train_idx)} / {len(task.val_idx)} / {len(task.test_idx)}")
    print(f"device: {_common.device_name()}")
    n = num_nodes
    edges, weights = map(jnp.asarray, _common.normalized_adjacency(edge_index, n))  # BCOO entry [dst, src]
    systems = {
        "jinsum GCNConv": (jinsum.nn.GCNConv, jinsum.graphs.adjacency(edge_index, n)),
        "jax.experimental.sparse BCOO": (BCOOGCNConv, sparse.BCOO((weights, edges[::-1].T), shape=(n, n))),
    }
    fits = {}
    for name, (conv, graph) in systems.items():
        model = GCN(conv, task.x.shape[1], args.hidden, task.num_classes, dropout=0.5, rngs=nnx.Rngs(args.seed))
        fits[name] = _common.fit(model, optax.adam(0.01), task, graph, epochs=epochs, desc=name, smoke=args.smoke,
                                 penalty=lambda m: 5e-4 * _common.l2(m.conv1))
    _common.print_table(
        f"GCN on {args.dataset}, {epochs} epochs, seed {args.seed} (paper: {100 * PAPER_ACCURACY[args.dataset]:.1f}%"
        " test accuracy)", _common.FIT_HEADER, _common.fit_rows(fits))


if __name__ == "__main__":
    main()

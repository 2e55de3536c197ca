"""A pruned MLP: `jinsum.nn.SparseLinear` layers (a fixed sparse pattern, learned values) against the same MLP
with dense `nnx.Linear` layers, classifying Cora's papers from their words alone (no graph).

The real Cora features (1,433 words per paper, row-normalised) and labels (7 classes), a random split of 60% / 20%
/ 20% of the 2,708 papers. The model is 1433 -> H -> H -> 7 with ReLU and dropout 0.5 between (H = 256 by
default); the sparse model keeps 10% of each hidden weight: an element pattern in the first layer, 32 x 32
blocks in the second (the kind that runs on tensor cores), and a dense output layer. Both train with Adam from the
same seed; the table gives the accuracies, the step time and the number of weights each stores.

    python examples/sparse_mlp/main.py [--hidden 256] [--density 0.1] [--epochs 200] [--seed 0] [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jinsum.nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402


class MLP(nnx.Module):
    """in -> hidden -> hidden -> classes, ReLU and dropout between; `hidden_layer(i, o, index)` builds layer 1 and 2."""

    def __init__(self, hidden_layer, in_features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
        self.layer1 = hidden_layer(in_features, hidden, 0, rngs)
        self.layer2 = hidden_layer(hidden, hidden, 1, rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array, graph=None) -> jax.Array:  # (`_common.fit` passes a graph; there is none)
        x = self.dropout(nnx.relu(self.layer1(x)))
        return self.out(self.dropout(nnx.relu(self.layer2(x))))


def sparse_layer(density: float, seed: int):
    """Layer 1: elements at `density`; layer 2: 32 x 32 blocks at `density`."""

    def make(in_features: int, out_features: int, index: int, rngs: nnx.Rngs) -> jinsum.nn.SparseLinear:
        block = None if index == 0 else (32, 32)
        pattern = jinsum.nn.random_pattern(in_features, out_features, density, block_shape=block, seed=seed + index)
        # flax's LeCun normal over the stored fan-in (density x in_features), so activations keep their variance
        init = nnx.initializers.variance_scaling(1 / density, "fan_in", "truncated_normal")
        return jinsum.nn.SparseLinear(in_features, out_features, pattern, block_shape=block, kernel_init=init,
                                      rngs=rngs)

    return make


def dense_layer(in_features: int, out_features: int, index: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, rngs=rngs)


def stored_weights(model: MLP) -> int:
    """Weights (not biases) of the two hidden layers: the pattern's entries, or the dense matrices'."""
    return sum(int(layer.kernel[...].size) for layer in (model.layer1, model.layer2))


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--hidden", type=int, default=256, help="hidden width (a multiple of 32)")
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=200)
    args = p.parse_args(argv)
    if args.hidden % 32:
        p.error(f"--hidden must be a multiple of 32 (the blocks of the second layer), got {args.hidden}")
    epochs = 3 if args.smoke else args.epochs

    task, _, num_nodes = _common.citation_task("cora", features=128 if args.smoke else None)
    train, val, test = (jnp.asarray(s) for s in _common.random_split(num_nodes, (0.6, 0.2), args.seed))
    task = _common.NodeTask(task.x, task.y, train, val, test, task.num_classes)
    print(f"Cora: {num_nodes} papers, {task.x.shape[1]} word features, {task.num_classes} classes; "
          f"split {len(train)} / {len(val)} / {len(test)}")
    print(f"device: {_common.device_name()}")
    systems = {f"jinsum SparseLinear, {100 * args.density:g}% of the weights": sparse_layer(args.density, args.seed),
               "dense nnx.Linear": dense_layer}
    fits, weights = {}, {}
    for name, layer in systems.items():
        model = MLP(layer, task.x.shape[1], args.hidden, task.num_classes, rngs=nnx.Rngs(args.seed))
        weights[name] = stored_weights(model)
        fits[name] = _common.fit(model, optax.adam(0.005), task, None, epochs=epochs, desc=name, smoke=args.smoke)
    rows = [row + [f"{weights[name]:,}"] for row, name in zip(_common.fit_rows(fits), fits)]
    _common.print_table(f"MLP {task.x.shape[1]} -> {args.hidden} -> {args.hidden} -> {task.num_classes} on Cora's "
                        f"words, {epochs} epochs, seed {args.seed}", _common.FIT_HEADER + ["hidden weights"], rows)


if __name__ == "__main__":
    main()

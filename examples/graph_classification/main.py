"""Graph classification over padded mini-batches of GENERATED molecule-like graphs: GIN and sum pooling, one compile.

The data are generated (`jinsum.datasets.molecules`): graphs of 10-50 atoms, each a random tree plus 0-3 ring
bonds that close rings of 5-8 atoms, every bond an edge both ways, atom types one-hot in 32 features. The class is
the number of rings (4 classes, balanced): a model that counts nodes and edges finds it, which sum pooling allows
and mean pooling does not. Graphs are split 80% / 10% / 10% into train / validation / test.

`jinsum.graphs.GraphLoader` pads every batch of up to 128 graphs to the same budgets of nodes and edges (chosen from
the dataset's statistics), so the jitted step compiles once for the whole run. The host only gathers and pads
arrays; the step builds the block-diagonal adjacency on the device (`batch.adjacency()`). Systems, the same model
(5 GIN layers of 300, each a 2-layer MLP, then a sum over each graph's nodes and a linear classifier), the same
batches, Adam:

- jinsum: `jinsum.nn.GINConv` on `batch.adjacency()` (one SpMM per layer), `jinsum.nn.global_add_pool` (a sorted
  segment reduction that leaves padding nodes out);
- plain JAX, as a jraph user writes it: the same padded batches, a gather of the sources and `jax.ops.segment_sum`
  over the destinations (padding edges dropped), `jax.ops.segment_sum` over the node -> graph vector;
- PyG, where torch_geometric is installed: its `DataLoader` (a new `Batch` every step, no padding), `GINConv` and
  `global_add_pool`, on CUDA when torch has it.
Losses and accuracies leave padding graphs out (`batch.graph_mask`). Reported per system: test accuracy, steps per
second over the training run (host batching included), and the jitted step's compile count.

    python examples/graph_classification/main.py [--graphs 4096] [--epochs 20] [--batch 128] [--hidden 300] [--smoke]
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jinsum.graphs
import jinsum.nn
from jinsum.datasets import molecules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402


class SegmentGINConv(nnx.Module):
    """`jinsum.nn.GINConv` with a gather and `jax.ops.segment_sum` over an edge index padded with -1."""

    def __init__(self, mlp: nnx.Module):
        self.mlp = mlp
        self.eps = nnx.Param(jnp.zeros(()))

    def __call__(self, x: jax.Array, edge_index: jax.Array) -> jax.Array:
        src, dst = edge_index
        summed = jax.ops.segment_sum(x[src], dst, num_segments=x.shape[0])  # (dst = -1: dropped)
        return self.mlp((1 + self.eps[...]) * x + summed)


def segment_add_pool(x: jax.Array, batch: jax.Array, num_graphs: int) -> jax.Array:
    """`jinsum.nn.global_add_pool` with `jax.ops.segment_sum` (padding nodes, numbered `num_graphs`, dropped)."""
    return jax.ops.segment_sum(x, batch, num_segments=num_graphs, indices_are_sorted=True)


SYSTEMS = {  # name -> (convolution, pool, the graph the convolution reads from a GraphBatch)
    "jinsum GINConv + global_add_pool": (jinsum.nn.GINConv, jinsum.nn.global_add_pool,
                                         lambda batch: batch.adjacency()),
    "plain JAX segment_sum (padded)": (SegmentGINConv, segment_add_pool, lambda batch: batch.edges()),
}


TORCH_INIT = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")  # torch.nn.Linear's weights


def _torch_bias(fan_in: int):
    """torch.nn.Linear's bias: uniform in +-1/sqrt(fan_in)."""
    bound = fan_in ** -0.5
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class GIN(nnx.Module):
    """`layers` GIN layers (Linear -> ReLU -> Linear, then ReLU), a sum over each graph's nodes, a linear head."""

    def __init__(self, system: str, features: int, hidden: int, layers: int, classes: int, *, rngs: nnx.Rngs):
        conv, self.pool, self.graph_of = SYSTEMS[system]
        sizes = [features] + [hidden] * layers

        def linear(a, b):  # torch's initialisation, as PyG's model has it: sums over neighbours and over a graph's
            # nodes grow with flax's (variance 1 / fan_in, three times torch's), and training stalled with it
            return nnx.Linear(a, b, kernel_init=TORCH_INIT, bias_init=_torch_bias(a), rngs=rngs)

        self.convs = nnx.List([conv(nnx.Sequential(linear(a, b), nnx.relu, linear(b, b)))
                               for a, b in zip(sizes[:-1], sizes[1:])])
        self.head = linear(hidden, classes)

    def __call__(self, batch: jinsum.graphs.GraphBatch) -> jax.Array:
        graph, x = self.graph_of(batch), batch.x
        for conv in self.convs:
            x = nnx.relu(conv(x, graph))
        return self.head(self.pool(x, batch.node_graph(), batch.budget.graphs))


def train_step(model: nnx.Module, learning_rate: float):
    """`(step, evaluate, state)`: `step(state, batch) -> (state, loss)` with Adam (`state` donated: pass each step
    the last one's), and `evaluate(state, batch) -> (correct, count)`, both jitted, over the batch's graphs only
    (padding graphs masked out).

    `state` is the model's and Adam's variables as a flat list of arrays, the cheapest pytree for `jit` to pass."""
    # Adam over one flat vector (`optax.flatten`): one fused update instead of one per parameter array (dispatch,
    # not the GPU, bounds this step: 1.2 instead of 1.6 ms of host time per step on an H100 host).
    optimizer = nnx.Optimizer(model, optax.flatten(optax.adam(learning_rate)), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)

    def merge(leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    @functools.partial(jax.jit, donate_argnums=0)  # (the new state takes the old one's buffers)
    def step(leaves, batch):
        model, optimizer = merge(leaves)

        def loss_fn(model):
            losses = optax.softmax_cross_entropy_with_integer_labels(model(batch), batch.y)
            return jnp.sum(jnp.where(batch.graph_mask, losses, 0)) / jnp.maximum(jnp.sum(batch.graph_mask), 1)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return jax.tree.leaves(nnx.state((model, optimizer))), loss

    @jax.jit
    def evaluate(leaves, batch):
        model, _ = merge(leaves)
        right = (jnp.argmax(model(batch), -1) == batch.y) & batch.graph_mask
        return jnp.sum(right), jnp.sum(batch.graph_mask)

    return step, evaluate, leaves


def run_jax(name, model, loaders, epochs: int, learning_rate: float, smoke: bool):
    """Trains `model` and returns (steps/s over the run, test accuracy, compiles of the step)."""
    step, evaluate, state = train_step(model, learning_rate)
    train, val, test = loaders
    clock = _StepClock()
    for _ in (bar := tqdm(range(epochs), desc=name, disable=smoke)):
        for batch in train:
            state, loss = step(state, batch)
            clock.tick(loss)
        clock.pause(loss)
        bar.set_postfix(loss=f"{float(loss):.3f}", val=f"{_accuracy(evaluate, state, val):.3f}")
    return clock.rate(), _accuracy(evaluate, state, test), step._cache_size()


class _StepClock:
    """Steps per second over the training steps only: from the end of the first step (its compile left out) to the
    end of the last, without the evaluations between epochs. `sync(output)` waits for the device."""

    def __init__(self, sync=jax.block_until_ready):
        self.sync, self.steps, self.seconds, self.start = sync, -1, 0.0, None

    def tick(self, output) -> None:
        if self.steps < 0:
            self.sync(output)
        if self.start is None:
            self.start = time.perf_counter()
        self.steps += 1

    def pause(self, output) -> None:
        self.sync(output)
        self.seconds += time.perf_counter() - self.start
        self.start = None

    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds else float("nan")


def _accuracy(evaluate, state, loader) -> float:
    right, count = np.sum([np.asarray(evaluate(state, batch)) for batch in loader], axis=0)
    return right / count


def pyg_trainer(features: int, hidden: int, layers: int, classes: int, learning_rate: float, seed: int):
    """PyG's reading of the same model: `(to_data, train, predict, sync)`, where `to_data(graph)` makes a `Data`,
    `train(batch) -> loss` runs one Adam step on a `Batch`, `predict(batch)` gives its classes, and `sync(_)` waits
    for the device."""
    import torch  # noqa: PLC0415
    from torch_geometric.data import Data  # noqa: PLC0415
    from torch_geometric.nn import GINConv, global_add_pool  # noqa: PLC0415

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            sizes = [features] + [hidden] * layers
            self.convs = torch.nn.ModuleList([GINConv(torch.nn.Sequential(
                torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, b)), train_eps=True)
                for a, b in zip(sizes[:-1], sizes[1:])])
            self.head = torch.nn.Linear(hidden, classes)

        def forward(self, batch):
            x = batch.x
            for conv in self.convs:
                x = torch.relu(conv(x, batch.edge_index))
            return self.head(global_add_pool(x, batch.batch, batch.num_graphs))

    model = Model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)

    def to_data(graph):
        return Data(x=torch.from_numpy(graph["x"]), edge_index=torch.from_numpy(graph["edge_index"]).long(),
                    y=torch.tensor([int(graph["y"])]))

    def train(batch):
        batch = batch.to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch), batch.y)
        loss.backward()
        optimizer.step()
        return loss

    def predict(batch):
        with torch.no_grad():
            return model(batch.to(device)).argmax(-1).cpu()

    def sync(_):
        if device == "cuda":
            torch.cuda.synchronize()

    return to_data, train, predict, sync


def run_pyg(graphs, splits, batch_size: int, epochs: int, trainer):
    """Trains PyG's model over its `DataLoader`: (steps/s, test accuracy)."""
    from torch_geometric.loader import DataLoader  # noqa: PLC0415

    to_data, train, predict, sync = trainer
    train_set, _, test_set = ([to_data(graphs[i]) for i in split] for split in splits)
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    clock = _StepClock(sync=sync)
    for _ in range(epochs):
        for batch in loader:
            clock.tick(train(batch))
        clock.pause(None)
    right = sum(int((predict(b) == b.y.cpu()).sum()) for b in DataLoader(test_set, batch_size))
    return clock.rate(), right / len(test_set)


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--graphs", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", type=int, default=300)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    if args.smoke:
        args.graphs, args.epochs, args.batch, args.hidden, args.layers = 96, 2, 16, 16, 2

    graphs = molecules(args.graphs, seed=args.seed)
    splits = _common.random_split(len(graphs), (0.8, 0.1), args.seed)
    budget = jinsum.graphs.GraphBudget.for_dataset([graphs[i] for i in splits[0]], args.batch)
    loaders = [jinsum.graphs.GraphLoader([graphs[i] for i in split], args.batch, budget=budget, shuffle=not k,
                                     seed=args.seed) for k, split in enumerate(splits)]
    features, classes = graphs[0]["x"].shape[1], 4
    print(f"{len(graphs)} GENERATED molecule-like graphs (classes: 0-3 rings), "
          f"{np.mean([g['x'].shape[0] for g in graphs]):.1f} nodes and "
          f"{np.mean([g['edge_index'].shape[1] for g in graphs]):.1f} directed edges on average; {budget}; "
          f"{_common.device_name()}")

    rows = []
    for name in SYSTEMS:
        model = GIN(name, features, args.hidden, args.layers, classes, rngs=nnx.Rngs(args.seed))
        rate, accuracy, compiles = run_jax(name, model, loaders, args.epochs, args.lr, args.smoke)
        rows.append([name, f"{accuracy:.3f}", f"{rate:.1f}", str(compiles)])
    try:
        import torch_geometric  # noqa: F401, PLC0415
    except ImportError:
        rows.append(["PyG DataLoader + GINConv", "-", "-", "torch_geometric not installed"])
    else:
        trainer = pyg_trainer(features, args.hidden, args.layers, classes, args.lr, args.seed)
        rate, accuracy = run_pyg(graphs, splits, args.batch, args.epochs, trainer)
        rows.append(["PyG DataLoader + GINConv", f"{accuracy:.3f}", f"{rate:.1f}", "-"])
    _common.print_table(f"GIN {args.layers} x {args.hidden}, batches of {args.batch} graphs, {args.epochs} epochs, "
                        f"seed {args.seed} (chance 25%)", ["system", "test accuracy", "steps/s", "compiles"], rows)


if __name__ == "__main__":
    main()

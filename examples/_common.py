"""What the examples share: command-line flags, data preparation, the training loop, timing and the summary table.

Each example puts this folder on ``sys.path`` and imports this module as ``_common``; it is not part of the
``jinsum`` package. Every system in a comparison goes through :func:`fit`, so jinsum models and their baselines
are trained, evaluated, timed and measured by the same code.
"""

from __future__ import annotations

import argparse
import socket
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.sparse as sp
from flax import nnx
from tqdm import tqdm

from jinsum.datasets import load_planetoid
from jinsum.timing import time_calls


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser showing the example's docstring, with the flags every example has."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes and a few epochs: checks that it runs")
    p.add_argument("--seed", type=int, default=0)
    return p


def free_port() -> int:
    """A free port on this machine, for the coordinator of several processes started here."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def join_processes(coordinator: str, count: int, index: int) -> None:
    """Makes this process one of `count` running the same program (`jax.distributed`; Gloo between CPU devices of
    several processes, NCCL between GPUs). Call it before anything starts JAX's backends."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, count, index)


def timing_options(smoke: bool) -> dict:
    """Arguments of jinsum.timing.time_calls: its defaults for real runs, as few calls as possible for smoke runs
    (one timed call, no warm-up: what is timed is compiled already, and a smoke run's time is not read)."""
    return dict(calls=1, rounds=1, warmup=0) if smoke else {}


def measure(compiled: jax.stages.Compiled, *args, timing: dict) -> tuple[float, int]:
    """Seconds per call of a compiled function (`jinsum.timing.time_calls` with `timing`) and its peak memory.

    The peak is XLA's buffer plan for the program: arguments + outputs + temporaries - aliased buffers, from
    `memory_analysis()`, which every backend reports (the device's `memory_stats()` is None on CPU, and
    `peak_memory_in_bytes` leaves the temporaries out there).
    """
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return time_calls(compiled, *args, **timing), peak


def device_name() -> str:
    device = jax.devices()[0]
    return f"{device.platform.upper()} ({device.device_kind}), jax {jax.__version__}"


@dataclasses.dataclass(frozen=True)
class NodeTask:
    """Full-batch node classification: features, labels and the node indices of the three splits."""

    x: jax.Array
    y: jax.Array
    train_idx: jax.Array
    val_idx: jax.Array
    test_idx: jax.Array
    num_classes: int


def citation_task(name: str, features: int | None = None) -> tuple[NodeTask, np.ndarray, int]:
    """A Planetoid graph with its standard split: (task, edge_index, num_nodes).

    Features are row-normalised (each row sums to one, rows without words stay zero) and stored dense: the
    feature transforms are dense matmuls in every model, only the aggregation over edges is sparse. `features`
    keeps only the first words (smoke runs: at Cora's 1,433 words, the first layer and a dropout on the input,
    which draws a random number per entry, make most of a step's time on a CPU).
    """
    data = load_planetoid(name)
    words = data.x if features is None else data.x[:, :features]
    row_sums = np.asarray(words.sum(axis=1)).ravel()
    x = sp.diags(np.divide(1.0, row_sums, out=np.zeros_like(row_sums), where=row_sums > 0)) @ words
    task = NodeTask(
        x=jnp.asarray(x.toarray(), jnp.float32),
        y=jnp.asarray(data.y),
        train_idx=jnp.asarray(data.train_idx),
        val_idx=jnp.asarray(data.val_idx),
        test_idx=jnp.asarray(data.test_idx),
        num_classes=data.num_classes,
    )
    return task, data.edge_index, data.num_nodes


def normalized_adjacency(edge_index: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Edges of A + I and their GCN weights 1 / sqrt(deg(src) deg(dst)): Kipf & Welling's D^-1/2 (A + I) D^-1/2."""
    loops = np.arange(num_nodes, dtype=edge_index.dtype)
    edges = np.concatenate([edge_index, np.stack([loops, loops])], axis=1)
    degree = np.bincount(edges[1], minlength=num_nodes).astype(np.float32)
    return edges, (degree[edges[0]] * degree[edges[1]]) ** -0.5


def random_split(num_nodes: int, fractions: tuple[float, float], seed: int) -> tuple[np.ndarray, ...]:
    """Train, validation and test node indices: a random permutation cut at the given train/validation fractions."""
    order = np.random.default_rng(seed).permutation(num_nodes).astype(np.int32)
    cuts = (np.cumsum(fractions) * num_nodes).astype(int)
    return tuple(np.sort(part) for part in np.split(order, cuts))


def l2(module: nnx.Module) -> jax.Array:
    """Half the squared norm of a module's parameters: the L2 penalty of Kipf & Welling and Velickovic et al."""
    return 0.5 * sum(jnp.sum(p**2) for p in jax.tree.leaves(nnx.state(module, nnx.Param)))


@dataclasses.dataclass(frozen=True)
class Fit:
    """The outcome of :func:`fit`.

    ``test_acc`` and ``val_acc`` are those of the epoch with the best validation accuracy (ties: lower validation
    loss); ``train_acc`` is the final epoch's. ``step_s`` is the time of one training step (forward, backward
    and the optimiser update: one full-batch epoch), ``peak_bytes`` the peak memory of that step as XLA plans
    it (arguments, outputs and temporaries).
    """

    test_acc: float
    val_acc: float
    best_epoch: int
    train_acc: float
    step_s: float
    peak_bytes: int


def fit(model: nnx.Module, tx: optax.GradientTransformation, task: NodeTask, graph, *, epochs: int,
        desc: str, smoke: bool, penalty: Callable[[nnx.Module], jax.Array] | None = None) -> Fit:
    """Trains ``model(x, graph) -> logits`` full-batch with softmax cross-entropy on the training nodes.

    The train step is one jitted pure function of the model and optimiser state (``nnx.split`` / ``nnx.merge``),
    compiled once; ``graph`` (any pytree: a jinsum format, a BCOO, edge arrays) is one of its arguments rather
    than a constant baked into the program. After training, the same compiled step is measured by
    :func:`measure`: ``jinsum.timing.time_calls`` (warm-up, back-to-back calls, ``block_until_ready``, median of
    rounds) and XLA's peak memory.
    ``penalty(model)`` is added to the loss (weight decay as an L2 term, as in the GCN and GAT papers).
    """
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    model.train()
    train_def, state = nnx.split((model, optimizer))
    model.eval()
    eval_def = nnx.graphdef((model, optimizer))
    inputs = (task.x, task.y, task.train_idx, task.val_idx, task.test_idx)

    def step(state, inputs, graph):
        model, optimizer = nnx.merge(train_def, state)
        x, y, train_idx, *_ = inputs

        def loss_fn(model):
            logits = model(x, graph)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits[train_idx], y[train_idx]).mean()
            return loss if penalty is None else loss + penalty(model)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    @jax.jit
    def evaluate(state, inputs, graph):
        model, _ = nnx.merge(eval_def, state)
        x, y, *splits = inputs
        logits = model(x, graph)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        accuracy = logits.argmax(-1) == y
        return [(losses[idx].mean(), accuracy[idx].mean()) for idx in splits]

    compiled = jax.jit(step).lower(state, inputs, graph).compile()
    best = (-1.0, 0.0, 0.0, 0)  # (val acc, -val loss, test acc, epoch): the best epoch is the largest tuple
    with tqdm(range(1, epochs + 1), desc=desc, leave=False) as bar:
        for epoch in bar:
            state, loss = compiled(state, inputs, graph)
            (_, train_acc), (val_loss, val_acc), (_, test_acc) = jax.device_get(evaluate(state, inputs, graph))
            best = max(best, (float(val_acc), -float(val_loss), float(test_acc), epoch))
            bar.set_postfix(loss=f"{float(loss):.3f}", val=f"{float(val_acc):.3f}")
    step_s, peak_bytes = measure(compiled, state, inputs, graph, timing=timing_options(smoke))
    return Fit(test_acc=best[2], val_acc=best[0], best_epoch=best[3], train_acc=float(train_acc), step_s=step_s,
               peak_bytes=peak_bytes)


FIT_HEADER = ["system", "test acc", "val acc", "best epoch", "train acc", "ms / epoch", "time vs 1st",
              "peak MiB (XLA)"]


def fit_rows(fits: dict[str, Fit]) -> list[list[str]]:
    """Rows under :data:`FIT_HEADER` for systems trained on one task, times relative to the first system's."""
    first = next(iter(fits.values())).step_s
    return [[name, f"{100 * f.test_acc:.1f}%", f"{100 * f.val_acc:.1f}%", str(f.best_epoch),
             f"{100 * f.train_acc:.1f}%", f"{1e3 * f.step_s:.2f}", f"{f.step_s / first:.2f}x",
             f"{f.peak_bytes / 2**20:.1f}"] for name, f in fits.items()]


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "-" * len(line(header))
    print(f"\n{title}\n{rule}\n{line(header)}\n{rule}")
    for row in rows:
        print(line(row))
    print(rule)

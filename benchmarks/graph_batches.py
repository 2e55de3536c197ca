"""Training on mini-batches of small graphs: padded budgets and device-built adjacencies against PyG's `DataLoader`.

    python benchmarks/graph_batches.py [--graphs 4096] [--batch 128] [--hidden 300] [--layers 5] [--epochs 3]

Data: `jinsum.datasets.molecules` (10-50 atoms, a random tree plus 0-3 rings, about 2 directed edges per node,
32 features). Model (the example `examples/graph_classification`): GIN with `--layers` layers of `--hidden`, sum
pooling, a linear head, Adam. Systems:

- jinsum: `jinsum.graphs.GraphLoader` (every batch padded to one budget), `GINConv` on `batch.adjacency()` (built on the
  device inside the step), `global_add_pool`;
- plain JAX, jraph's reading: the same padded batches, a gather and `jax.ops.segment_sum` per layer;
- PyG: `torch_geometric.loader.DataLoader` (a new `Batch` per step), `GINConv`, `global_add_pool`, on CUDA.
Timed the same way for all: one epoch to warm up (compiles), then `--epochs` epochs of training steps, host batching
and the transfer included, closed by one synchronisation: ms per step. Also: the host's time per batch alone (the
loader iterated without training), and for the JAX systems the step on one batch already on the device
(`jinsum.timing.time_calls`) and the device's own time for it (`jinsum.timing.device_time`). Each jitted step's
compile count is checked (one over all epochs); the first step's loss of jinsum and plain JAX (same parameters,
same batch) must agree.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jinsum.nn  # noqa: E402
from jinsum.datasets import molecules  # noqa: E402
from jinsum.timing import device_time, time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from _harness import SYSTEM, Column, command, device_file_name, device_name, versions_text, write  # noqa: E402
from graph_classification.main import GIN, SYSTEMS, pyg_trainer, train_step  # noqa: E402


COLUMNS = (SYSTEM, Column("ms / step", "ms", "{:.3f}"), Column("vs jinsum", "vs_jinsum", "{:.2f}x"),
           Column("host ms / batch", "host_ms", "{:.3f}"), Column("step on device ms", "on_device_ms", "{:.3f}"),
           Column("device ms", "device_ms", "{:.3f}"), Column("compiles", "compiles"))


def epochs_ms(run_epoch, epochs: int, sync) -> float:
    """ms per step over `epochs` epochs after one to warm up, one synchronisation at the end."""
    sync(run_epoch()[0])
    steps, start = 0, time.perf_counter()
    for _ in range(epochs):
        out, count = run_epoch()
        steps += count
    sync(out)
    return 1e3 * (time.perf_counter() - start) / steps


def host_ms(loader, sync) -> float:
    """ms per batch to make the batches of one epoch and move them to the device, without training."""
    start, count = time.perf_counter(), 0
    for batch in loader:
        count += 1
    sync(batch)
    return 1e3 * (time.perf_counter() - start) / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", type=int, default=4096)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", type=int, default=300)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    started = time.time()
    graphs = molecules(args.graphs, seed=0)
    features, classes = graphs[0]["x"].shape[1], 4
    loader = jinsum.graphs.GraphLoader(graphs, args.batch, shuffle=True)
    steps_per_epoch = len(loader)
    print(f"{args.graphs} molecule-like graphs, {steps_per_epoch} batches of {args.batch}: {loader.budget}")
    rows, losses = [], {}  # (a row: `system`, `ms` a step and the columns of COLUMNS)

    for name in SYSTEMS:
        step, _, state = train_step(GIN(name, features, args.hidden, args.layers, classes, rngs=nnx.Rngs(0)), 1e-3)
        first = next(iter(jinsum.graphs.GraphLoader(graphs[: args.batch], args.batch, budget=loader.budget)))
        losses[name] = float(step(jax.tree.map(jnp.copy, state), first)[1])  # (the step donates its state)
        box = [state]

        def run_epoch():
            count = 0
            for batch in loader:
                box[0], loss = step(box[0], batch)
                count += 1
            return loss, count

        def on_one_batch(batch):
            box[0], loss = step(box[0], batch)
            return loss

        ms = epochs_ms(run_epoch, args.epochs, jax.block_until_ready)
        compiles = step._cache_size()
        assert compiles == 1, f"{name}: {compiles} compiles"
        on_device = 1e3 * time_calls(on_one_batch, first, calls=args.calls)
        device = device_time(on_one_batch, first, calls=args.calls)
        rows.append(dict(system=name, ms=ms, host_ms=host_ms(loader, jax.block_until_ready), on_device_ms=on_device,
                         device_ms=None if device is None else 1e3 * device, compiles=compiles))
    names = list(SYSTEMS)
    assert np.isclose(losses[names[0]], losses[names[1]], rtol=2e-3), losses

    try:
        import torch  # noqa: PLC0415
        from torch_geometric.loader import DataLoader  # noqa: PLC0415
    except ImportError as error:
        print(f"PyG skipped: {error}")
    else:
        to_data, train, _, sync = pyg_trainer(features, args.hidden, args.layers, classes, 1e-3, 0)
        pyg_loader = DataLoader([to_data(g) for g in graphs], batch_size=args.batch, shuffle=True)

        def run_pyg_epoch():
            count = 0
            for batch in pyg_loader:
                loss = train(batch)
                count += 1
            return loss, count

        torch_device = "cuda" if torch.cuda.is_available() else "cpu"
        rows.append(dict(system="PyG DataLoader + GINConv", ms=epochs_ms(run_pyg_epoch, args.epochs, sync),
                         host_ms=host_ms((b.to(torch_device) for b in pyg_loader), sync)))

    write_results(args, rows, steps_per_epoch, loader.budget, started)


def write_results(args, rows, steps_per_epoch, budget, started) -> None:
    jinsum_ms = rows[0]["ms"]
    for row in rows:
        row["vs_jinsum"] = row["ms"] / jinsum_ms
    best_peer = min(row["ms"] for row in rows[1:])
    preamble = (f"{versions_text()}; `{command(__file__)}` ({time.time() - started:.0f} s). {args.graphs} "
                f"molecule-like graphs (`jinsum.datasets.molecules`), batches of {args.batch} ({steps_per_epoch} a "
                f"epoch), {budget}; GIN {args.layers} x {args.hidden}, sum pooling, Adam. ms / step: {args.epochs} "
                "epochs after one to warm up, host batching included, one synchronisation. host ms / batch: the loader "
                "alone (with the transfer). step on device: one batch already there, `time_calls`; device ms: the "
                "GPU's own time.")
    write(args.out / f"graph_batches_{device_file_name()}", f"Mini-batches of small graphs on {device_name()}",
          [preamble], COLUMNS, rows, after=["", f"jinsum against the best peer: {best_peer / jinsum_ms:.2f}x."])


if __name__ == "__main__":
    main()

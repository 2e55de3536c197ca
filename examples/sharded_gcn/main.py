"""Train a GCN on an R-MAT graph split over every visible device (`jinsum.shard`), beside the same model on one.

    python examples/sharded_gcn/main.py [--scale 16] [--features 128] [--steps 30] [--chunks 1] [--smoke]

No GPUs? Pretend: `XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/sharded_gcn/main.py`.

Several processes (hosts) run the same program over all their devices: start one per host with its id,

    python examples/sharded_gcn/main.py --coordinator host0:1234 --num-processes 2 --process-id 0   # on host 0
    python examples/sharded_gcn/main.py --coordinator host0:1234 --num-processes 2 --process-id 1   # on host 1

(`jax.distributed.initialize`; NCCL between GPUs, Gloo between CPU processes, so two processes of one machine with
`XLA_FLAGS=--xla_force_host_platform_device_count=2` each try it out). Each process prints its own devices' lines.

The graph is split by rows over a mesh axis of all devices (`jinsum.shard.partition`, balanced by edges + nodes),
node features and labels are laid out on the same split (`P.shard_rows`), and the jitted training step runs each
layer's SpMM per device on its part, exchanging only the rows its part reads; the weights are replicated and XLA
adds the all-reduce of their gradients. Labels are planted (the argmax of a random linear map of the propagated
features), so the loss has somewhere to go. Printed for both runs: the step time, each device's memory for the
compiled step (arguments + outputs + temporaries), the bytes each device receives per step, and the losses, which
agree between the runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jinsum
import jinsum.graphs
import jinsum.nn as jnn
import jinsum.shard
from jinsum.datasets import rmat
from jinsum.timing import kernel_times, time_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402


class GCN(nnx.Module):
    """conv -> ReLU -> conv: logits of every node (no dropout: the two runs then take the same steps)."""

    def __init__(self, in_features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
        self.conv1 = jnn.GCNConv(in_features, hidden, rngs=rngs)
        self.conv2 = jnn.GCNConv(hidden, classes, rngs=rngs)

    def __call__(self, x, graph):
        return self.conv2(nnx.relu(self.conv1(x, graph)), graph)


def train_step(model: nnx.Module, learning_rate: float = 0.01):
    """`(step, state)`: `step(state, x, y, mask, graph) -> (state, loss)`, Adam on the masked mean cross-entropy
    (the mask leaves out the padding rows of a partitioned layout)."""
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x, y, mask, graph):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            losses = optax.softmax_cross_entropy_with_integer_labels(model(x, graph), y)
            return jnp.sum(jnp.where(mask, losses, 0)) / jnp.sum(mask)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, state


def planted_task(scale: int, features: int, classes: int, seed: int = 0, planted: bool = True):
    """The adjacency of an R-MAT graph (directed), random features, and labels planted by the graph (or random)."""
    rng = np.random.default_rng(seed)
    edges, nodes = rmat(scale, seed=seed), 1 << scale
    A = jinsum.graphs.adjacency(edges, nodes)
    x = rng.standard_normal((nodes, features)).astype(np.float32)
    if not planted:
        return A, x, rng.integers(0, classes, nodes).astype(np.int32)
    propagated = np.asarray(A.to_scipy() @ x)
    y = np.argmax(propagated @ rng.standard_normal((features, classes)).astype(np.float32), axis=1).astype(np.int32)
    return A, x, y


def memory_per_device(compiled) -> int:
    """Bytes one device holds for a compiled call: its arguments, outputs and temporaries (XLA's analysis)."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def run(name: str, model_fn, graph, x, y, mask, replicated, steps: int, calls: int,
        compiler_options: dict | None = None) -> dict:
    """Trains `steps` steps and times `calls` more; returns what the table prints."""
    step, state = train_step(model_fn())
    state = jax.device_put(state, replicated)
    started = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(state, x, y, mask, graph).compile(compiler_options)
    compile_s = time.perf_counter() - started
    bytes_received = jinsum.shard.communication(step, state, x, y, mask, graph)
    losses = []
    for _ in range(steps):
        state, loss = compiled(state, x, y, mask, graph)
        losses.append(float(loss))

    def one_step():
        nonlocal state
        state, loss = compiled(state, x, y, mask, graph)
        return loss

    seconds = time_calls(one_step, calls=calls, rounds=3, warmup=1)
    kernels = kernel_times(one_step, calls=3, warmup=0)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:6]
    kernels = (f"{1e3 * sum(kernels.values()):.2f} ms: " + "; ".join(f"{k[:36]} {1e3 * t:.2f}" for k, t in top)
               if kernels else "")
    print(f"{name}: step {1e3 * seconds:.2f} ms, memory per device {memory_per_device(compiled) / 2**20:.1f} MiB, "
          f"received per device per step {sum(bytes_received.values()) / 2**20:.2f} MiB {bytes_received or ''}, "
          f"compiled in {compile_s:.1f} s", flush=True)
    print(f"  losses: {' '.join(f'{v:.4f}' for v in losses[:: max(1, steps // 8)])} ... {losses[-1]:.4f}")
    return dict(seconds=seconds, memory=memory_per_device(compiled), received=sum(bytes_received.values()),
                losses=losses, kernels=kernels)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=16, help="R-MAT scale: 2**scale nodes, ~16 edges per node")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=40)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--chunks", type=int, default=1,
                   help="move each exchange in this many chunks (less overlap; less memory in flight for a "
                        "product, but not for this training step: 2 H200s measured more, benchmarks/README.md)")
    p.add_argument("--smoke", action="store_true", help="a tiny graph and 3 steps (CI)")
    p.add_argument("--coordinator", help="host:port of process 0, to run as one of several processes")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.scale, args.steps, args.features, args.hidden = 9, 3, 16, 32
    if args.coordinator:
        _common.join_processes(args.coordinator, args.num_processes, args.process_id)
    devices = jax.devices()  # (every process's: the mesh spans them all)
    mesh = Mesh(np.array(devices), ("x",))
    started = time.perf_counter()
    A, x, y = planted_task(args.scale, args.features, args.classes)
    where = f"; process {jax.process_index()} of {jax.process_count()}" if jax.process_count() > 1 else ""
    print(f"R-MAT {args.scale}: {A.shape[0]} nodes, {A.nnz} edges; {len(devices)} x {devices[0].device_kind}{where} "
          f"({time.perf_counter() - started:.1f} s to build)")
    started = time.perf_counter()
    P = jinsum.shard.partition(A, mesh, chunks=args.chunks)
    print(f"{P}\n  rows per device {P.layout.rows_per_device(P.num_parts)}, remote rows read per device "
          f"{list(P.plan.needed)} ({time.perf_counter() - started:.1f} s to partition)")

    def model_fn():
        return GCN(args.features, args.hidden, args.classes, rngs=nnx.Rngs(0))

    calls = 3 if args.smoke else 10
    device = jax.local_devices()[0]  # (one of this process's own)
    single_device = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    one = run("1 device", model_fn, jax.device_put(A, device), *jax.device_put((x, y), device),
              jax.device_put(np.ones(len(y), bool), device), single_device, args.steps, calls)
    many = run(f"{len(devices)} devices", model_fn, P, P.shard_rows(x), P.shard_rows(y), P.row_mask,
               NamedSharding(mesh, PartitionSpec()), args.steps, calls)
    gap = np.max(np.abs(np.array(one["losses"]) - np.array(many["losses"])))
    print(f"speed-up {one['seconds'] / many['seconds']:.2f}x, memory per device {many['memory'] / one['memory']:.2f}x "
          f"of one device's; largest loss difference {gap:.2e}")
    if gap > 1e-3:
        sys.exit(f"the sharded run's losses differ from the single device's by {gap:.2e}")


if __name__ == "__main__":
    main()

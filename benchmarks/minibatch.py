"""Mini-batch GraphSAGE with neighbor sampling, end to end (sampling included), and device-built formats.

    python benchmarks/minibatch.py [--scale 20] [--batch 1024] [--fanouts 15 10] [--calls 20] [--steps-per-call 8]
                                   [--processes N] [--out benchmarks/results]

Graph: R-MAT (`jinsum.datasets.rmat`, made undirected; scale 20: 1.05M nodes, 31.4M edges), random 128 features,
40 random classes. Model: GraphSAGE (mean) 128 -> 256 -> 40, ReLU, Adam; one step samples a batch of seeds' 2-hop
neighbourhood and runs forward, backward and the update. Systems, every one timed the same way
(`jinsum.timing.time_calls`: back-to-back steps, one sync per round, median of rounds):

- jinsum: `jinsum.sampling.sample_neighbors` on the device inside the jitted step, `jinsum.nn.SAGEConv` on the
  sampled bipartite `GroupCOO`s (fixed-fanout tables);
- plain JAX: the identical on-device sampler, then gathers + a sorted `jax.ops.segment_sum` per layer;
  each in two readings of the sample: PyG's (`x[node_ids]` gathered for the first layer) and "in place"
  (`outer_sources="graph"`: the first layer reads the feature table through the graph's ids);
- PyG (where torch_geometric and CUDA torch are present): a vectorised NumPy sampler on the host (with
  replacement, the cheapest one to write) and PyG's `SAGEConv` on the sampled `edge_index`.
jinsum also runs `--steps-per-call K` steps in one call (`sampled_step(steps=K)`, a `lax.scan`: one dispatch for K
steps). Where there are several devices, jinsum also runs data parallel (`sampled_step(..., mesh=...)`: the seeds
split over the devices, each sampling its share from the replicated graph, the gradients summed over them), with
the same batch split over the devices and with a batch per device, each at one step a call and at K, against one
device at as many steps a call; with `--processes N`, the same again as N processes of this
script (`jax.distributed`, one GPU visible to each), each dispatching its own device.
Also timed: `GroupCOO.from_edge_index(..., capacity=E)` from E random edges on the device, with its column order
(`--build-edges`, 1M by default), against a plain `jnp.argsort` of the same edges. Results go to `--out` as
`minibatch_<device>.{md,csv}` (`minibatch_<N>x_<device>` on N devices); each jitted step's compile count is checked
(one).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jinsum  # noqa: E402
from jinsum.datasets import rmat  # noqa: E402
from jinsum.sampling import CSRGraph, sample_neighbors  # noqa: E402
from jinsum.timing import kernel_times, time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, command, device_file_name, device_name, versions_text, write)
from minibatch_sage.main import (  # noqa: E402
    JinsumSAGE, SegmentSAGE, host_sample, on_mesh, pyg_trainer, replicated_keys, sampled_step)
from _common import free_port, join_processes  # noqa: E402  (examples/_common.py)

RESULTS = Results()
COLUMNS = (WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}", "failed"), NOTE)


# --- the systems (the example's models, step and PyG trainer) ---------------------------------------------------------

def time_step(train, state, graph, features, labels, seed_batches, mesh=None, *, calls):
    """(ms per step over distinct batches (a new sample each call), the GPU's own ms per step or None); checks the
    step compiled once. With a `mesh` (data parallel), the keys are placed on it; over several processes the device
    time is not read (None). Batches of shape `(K, B)` are `K` steps a call (`sampled_step(steps=K)`): the times
    are per step."""
    steps = seed_batches[0].shape[0] if seed_batches[0].ndim == 2 else 1
    keys = jax.random.split(jax.random.key(1), (len(seed_batches), steps) if steps > 1 else len(seed_batches))
    keys = list(keys if mesh is None else replicated_keys(mesh, keys))  # (indexing an array per call dispatches)
    position = [0]

    def one():
        i = position[0] % len(seed_batches)
        position[0] += 1
        return train(state, graph, features, labels, seed_batches[i], keys[i])[1]

    ms = time_calls(one, calls=calls, rounds=10) * 1e3 / steps
    assert train._cache_size() == 1, f"the step compiled {train._cache_size()} times"
    if jax.process_count() > 1:
        return ms, None
    kernels = kernel_times(one, calls=calls)
    if KERNELS:
        print(f"  device time {sum(kernels.values()) * 1e3 / steps:.3f} ms a step in {len(kernels)} kernels; the "
              "largest:")
        for name, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[:KERNELS]:
            print(f"    {seconds * 1e6 / steps:8.1f} us  {name[:110]}")
    return ms, (sum(kernels.values()) * 1e3 / steps if kernels else None)


def pyg_step_time(indptr, indices, features, labels, seed_batches, calls) -> dict:
    """The row's columns of PyG's step with its host sampler."""
    train, _, sync = pyg_trainer(SIZES, indptr, indices, features, labels, FANOUTS, 0)
    position = [0]

    def one():
        position[0] += 1
        return train(seed_batches[position[0] % len(seed_batches)])

    ms = time_calls(one, calls=calls, sync=sync) * 1e3
    rng = np.random.default_rng(0)
    host = time_calls(lambda: host_sample(indptr, indices, seed_batches[0], FANOUTS, rng), calls=calls,
                      sync=lambda _: None) * 1e3
    return {"ms": ms, "note": f"host sampler alone {host:.2f} ms"}


# --- building formats on the device ---------------------------------------------------------------------------------

def build_times(num_edges: int, num_nodes: int, calls: int):
    rng = np.random.default_rng(0)
    edges = jnp.asarray(rng.integers(0, num_nodes, (2, num_edges)), jnp.int32)
    build = jax.jit(lambda e: jinsum.GroupCOO.from_edge_index(e, num_nodes=num_nodes, capacity=num_edges))
    workload = f"GroupCOO + column order, {num_edges:,} edges"
    RESULTS.attempt(workload, "jinsum (device)", lambda: {"ms": time_calls(build, edges, calls=calls) * 1e3})
    RESULTS.attempt(workload, "jnp.argsort of the edges", lambda: {"ms": time_calls(
        jax.jit(lambda e: jnp.argsort(e[1] * num_nodes + e[0])), edges, calls=calls) * 1e3}, note="one sort, for scale")
    host = np.asarray(edges)
    RESULTS.attempt(workload, "jinsum (host, NumPy)", lambda: {"ms": time_calls(
        lambda: jinsum.GroupCOO.from_edge_index(host, num_nodes=num_nodes).with_transpose(), calls=2, rounds=3,
        sync=lambda _: None) * 1e3}, note="today's converter, for scale")


def write_results(out: pathlib.Path, started: float, devices: int) -> None:
    preamble = (f"{versions_text()}; `{command(__file__)}` ({time.time() - started:.0f} s). ms: median over rounds of "
                "back-to-back calls (`jinsum.timing.time_calls`), each step on a new batch.")
    count = f"{devices}x_" if devices > 1 else ""  # (a run on several devices keeps its own file beside one device's)
    write(out / f"minibatch_{count}{device_file_name()}",
          f"Mini-batch training and device-built formats on {device_name()}",
          [preamble], COLUMNS, RESULTS.rows, csv_fields=[c.key for c in COLUMNS])


FANOUTS: tuple[int, ...] = (15, 10)
KERNELS = 0  # --kernels N: print each jitted step's N largest kernels
SIZES: tuple[int, ...] = (128, 256, 40)


def stacked_batches(order: np.ndarray, batch: int, steps: int, calls: int) -> list[np.ndarray]:
    """`calls` arrays of seeds from the shuffled nodes `order` (wrapping round on a small graph): `(batch,)`, or
    `(steps, batch)` for `steps` a call."""
    size = steps * batch
    return [np.take(order, np.arange(i * size, (i + 1) * size), mode="wrap").reshape(
        (steps, batch) if steps > 1 else (batch,)).astype(np.int32) for i in range(calls)]


def one_device_many_steps(graph, x, y, order, batch, steps, sampling) -> list:
    """jinsum on one device, `steps` steps a call (`sampled_step(steps=...)`): the baseline of the data-parallel rows
    of as many steps a call."""
    train, _, state = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), FANOUTS, steps=steps, **sampling)
    seeds = [jnp.asarray(s) for s in stacked_batches(order, batch, steps, 4)]
    return [(f"jinsum, in place, {steps} steps a call", "1 compile; one lax.scan over the steps", train, state,
             (graph, x, y, seeds))]


def data_parallel_steps(graph, x, y, order, batch, steps, sampling) -> list:
    """jinsum data parallel over every device (of every process): the batch split over them, and a batch per
    device, one step a call and `steps` a call; the inputs placed on the mesh once."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    D, processes = len(devices), jax.process_count()
    by = f"{processes} processes x {D // processes} device(s)" if processes > 1 else f"{D} devices"
    runs = []  # (label, steps a call, the calls' seeds)
    for k in sorted({1, steps}):
        for label, size in ((f"batch {batch} split over them", batch), (f"batch {D} x {batch}", D * batch)):
            runs.append((label + ("" if k == 1 else f", {k} steps a call"), k,
                         stacked_batches(order, size, k, 8 if k == 1 else 4)))  # (as the one-device rows)
    systems = []
    for label, k, seeds in runs:
        train, _, state = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), FANOUTS, mesh=mesh, steps=k, **sampling)
        systems.append((f"jinsum, in place, {by} data parallel, {label}",
                        "1 compile; gradients summed over the devices",
                        train, state, (*on_mesh(mesh, graph, x, y, [np.asarray(s) for s in seeds]), mesh)))
    return systems


def time_passes(steps, calls) -> dict:
    """Each step timed in three passes over the systems, the first discarded: on a GPU whichever system ran first
    measured 0.2-0.4 ms a step slower (clocks and first-launch work). The steps are bound by the host's dispatch (XLA
    updating its command buffers with each call's new buffers), which drifts by up to 0.2 ms between passes: a row is
    the mean of the two timed passes' medians, and its note gives the device's own time, which does not drift."""
    timed = {}
    for _ in range(3):
        for system, _note, train, state, inputs in steps:
            try:
                timed.setdefault(system, []).append(time_step(train, state, *inputs, calls=calls))
            except Exception:  # noqa: BLE001 (a system that fails is a row, not the end of the run)
                traceback.print_exc()
    return timed


def in_processes(count: int) -> dict:
    """The data-parallel steps timed as `count` processes of this script, one device each (one GPU visible to each
    on a GPU machine): `{system: [(ms, None), ...]}` as process 0 measured them."""
    port = free_port()
    argv = sys.argv[1:]
    children = []
    for i in range(count):
        env = dict(os.environ)
        if jax.default_backend() == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        children.append(subprocess.Popen(
            [sys.executable, __file__, *argv, "--processes", "1", "--coordinator", f"localhost:{port}",
             "--num-processes", str(count), "--process-id", str(i)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [child.communicate()[0] for child in children]
    for i, (child, out) in enumerate(zip(children, outputs)):
        if child.returncode:
            print(f"process {i} of {count} failed:\n{out}", flush=True)
            return {}
    rows = [json.loads(line[len(RESULT):]) for line in outputs[0].splitlines() if line.startswith(RESULT)]
    return {row["system"]: [tuple(run) for run in row["runs"]] for row in rows}


RESULT = "data-parallel result: "  # (how a child process reports a row to the parent)


def main() -> None:
    global FANOUTS, KERNELS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=20)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--build-edges", type=int, default=1 << 20)
    p.add_argument("--skip", nargs="*", default=[], choices=["jinsum", "plain JAX", "PyG", "build"])
    p.add_argument("--kernels", type=int, default=0, help="print each jitted step's N largest GPU kernels")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    p.add_argument("--steps-per-call", type=int, default=8,
                   help="also time jinsum (one device and data parallel) with this many steps a call (1: not)")
    p.add_argument("--processes", type=int, default=1,
                   help="also time jinsum data parallel as this many processes, one device (GPU) each")
    p.add_argument("--coordinator", help=argparse.SUPPRESS)  # (the child processes of --processes)
    p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    FANOUTS, KERNELS = tuple(args.fanouts), args.kernels
    if args.coordinator:  # a child: its devices in the mesh of every process's, the data-parallel rows only
        join_processes(args.coordinator, args.num_processes, args.process_id)
    started = time.time()

    edge_index = rmat(args.scale, undirected=True)
    nodes = 1 << args.scale
    rng = np.random.default_rng(0)
    features = rng.normal(size=(nodes, SIZES[0])).astype(np.float32)
    labels = rng.integers(0, SIZES[-1], nodes).astype(np.int32)
    graph = CSRGraph.from_edge_index(edge_index, nodes)
    order = rng.permutation(nodes)
    seed_batches = stacked_batches(order, args.batch, 1, 8)
    workload = (f"SAGE step, R-MAT {args.scale} ({edge_index.shape[1]:,} edges), batch {args.batch}, "
                f"fanouts {FANOUTS}")
    print(workload, flush=True)
    x, y = jnp.asarray(features), jnp.asarray(labels)
    batches = [jnp.asarray(s) for s in seed_batches]

    # Each system in both readings of the sample: PyG's (the first layer gathers `x[node_ids]`) and the fast one
    # (the first layer reads the feature table in place). Every backward adds into its sources atomically.
    readings = {"PyG reading": dict(), "in place": dict(outer_sources="graph")}
    if args.coordinator:  # a child of --processes: the data-parallel rows, reported by process 0 to the parent
        for system, runs in time_passes(data_parallel_steps(graph, x, y, order, args.batch,
                                                            args.steps_per_call, readings["in place"]),
                                        args.calls).items():
            if jax.process_index() == 0:
                print(RESULT + json.dumps({"system": system, "runs": runs}), flush=True)
        return
    steps = []
    for system, model, note in [("jinsum", JinsumSAGE, "1 compile"),
                                ("plain JAX (same sampler)", SegmentSAGE, "1 compile; gathers + segment_sum")]:
        for reading, sampling in readings.items():
            if system.split(" (")[0] in args.skip:
                continue
            train, _, state = sampled_step(model(SIZES, rngs=nnx.Rngs(0)), FANOUTS, **sampling)
            steps.append((f"{system}, {reading}", note, train, state, (graph, x, y, batches)))
    if args.steps_per_call > 1 and "jinsum" not in args.skip:
        steps += one_device_many_steps(graph, x, y, order, args.batch, args.steps_per_call, readings["in place"])
    if len(jax.devices()) > 1 and "jinsum" not in args.skip:
        steps += data_parallel_steps(graph, x, y, order, args.batch, args.steps_per_call,
                                     readings["in place"])
    timed = time_passes(steps, args.calls)
    notes = {system: note for system, note, *_ in steps}
    if args.processes > 1 and "jinsum" not in args.skip:
        for system, runs in in_processes(args.processes).items():
            timed[system], notes[system] = runs, ("1 compile; gradients summed over the devices; each process "
                                                  "dispatches its own devices")
    for system, note in notes.items():
        runs = timed.get(system, [])[1:]
        if not runs:
            RESULTS.record(workload, system, None, "failed")
            continue
        device, ms = runs[-1][1], float(np.mean([ms for ms, _ in runs]))
        # (a data-parallel row's baseline: the same step on one device, as many steps a call)
        many = re.search(r", (\d+) steps a call", system)
        one_device = "jinsum, in place" + (f", {many.group(1)} steps a call" if many else "")
        if "data parallel" in system and timed.get(one_device, [])[1:]:
            baseline = float(np.mean([ms for ms, _ in timed[one_device][1:]]))
            per_device = re.search(r"batch (\d+) x \d+", system)  # (else the batch is split over the devices)
            seeds = args.batch * (int(per_device.group(1)) if per_device else 1)  # (a step's, all devices')
            note += (f"; {baseline / ms:.2f}x the steps/s and {baseline * seeds / (ms * args.batch):.2f}x the "
                     f"seeds/s of one device")
        RESULTS.record(workload, system, ms, note + ("" if device is None else f"; device {device:.3f} ms") +
                       f"; passes {', '.join(f'{ms:.3f}' for ms, _ in runs)}")
    for reading, sampling in readings.items():
        sampler = jax.jit(lambda g, s, k, sampling=sampling: sample_neighbors(g, s, FANOUTS, k, **sampling))
        RESULTS.attempt(workload, f"the device sampler alone, {reading}", lambda: {"ms": time_calls(
            sampler, graph, batches[0], jax.random.key(0), calls=args.calls) * 1e3}, note="with the formats")
    if "PyG" not in args.skip:
        indptr, indices = np.asarray(graph.indptr).astype(np.int64), np.asarray(graph.indices)
        RESULTS.attempt(workload, "PyG (host sampler)",
                lambda: pyg_step_time(indptr, indices, features, labels, seed_batches, args.calls))
    if "build" not in args.skip:
        build_times(args.build_edges, nodes, args.calls)
    write_results(args.out, started, max(len(jax.devices()), args.processes))


if __name__ == "__main__":
    main()

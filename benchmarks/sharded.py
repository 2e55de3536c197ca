"""Scaling over the GPUs of one host (`jinsum.shard`): SpMM and GCN training steps on 1 GPU and on all visible GPUs,
same run, same timing method, and a model too wide for one GPU.

    python benchmarks/sharded.py [--scale 22] [--features 128] [--wide 8192] [--chunks 3] [--out benchmarks/results]

Graph: R-MAT (directed, Graph500 parameters; scale 22: 4.2M nodes, ~64M edges), `jinsum.graphs.adjacency`.
- SpMM `A @ X`, X float32 `(N, features)`: one GPU on the whole matrix, against `P @ X` on the partition over all
  GPUs (`jinsum.shard.partition`), its exchange in one piece and in `--chunks` chunks (less memory, less overlap).
  Timing: `jinsum.timing.time_calls` for both; memory per device: XLA's analysis
  of the compiled call (arguments + outputs + temporaries); the bytes each device receives per call, read off the
  program (`jinsum.shard.communication`); the device time by kernel of the sharded call.
- GCN training step (features -> 256 -> 40, Adam, masked cross-entropy; examples/sharded_gcn): the same.
- A wide model: `--wide` input features (generated on the devices), the same GCN; tried on one GPU first (expected
  to run out of memory), then on all; compiled without XLA's autotuning of matmuls (it would copy the features).
Results: `--out`/sharded_<D>x_<device>_rmat<scale>.{md,csv}.

    python benchmarks/sharded.py --compile-only 2 4 8 [--scale 22] [--wide 7168]

Memory per device on D GPUs of this machine's kind without having them: each workload compiled (never run) for a
compile-only topology of D GPUs (`jax.experimental.topologies`), the partition built on as many host devices; XLA's
memory analysis of that program is the one a real run of D GPUs allocates. Nothing but Triton's compile needs a GPU
(one, of the kind). Beside it, the SpMM of device 0's part run alone on this GPU, its exchange replaced by a copy of
the rows it sends: the per-device work without NCCL, a bound on what D GPUs can reach. Results:
`--out`/sharded_compiled_<device>.{md,csv}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

if "--compile-only" in sys.argv:  # (the host devices that hold the partition; XLA reads this once, at start)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=64".strip()

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jinsum
import jinsum.shard
from jinsum.timing import kernel_times, time_calls

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from _harness import (  # noqa: E402
    NOTE, SYSTEM, WORKLOAD, Column, Results, command, device_file_name, device_name, failure, versions_text, write)
from sharded_gcn.main import GCN, memory_per_device, planted_task, run, train_step  # noqa: E402

RESULTS = Results()
COLUMNS = (WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}"), Column("memory per device (GiB)", "memory_gib", "{:.2f}"),
           Column("received per device per call (MiB)", "received_mib", "{:.1f}"), NOTE)
# XLA tries matmul configurations on copies of the operands: tens of GiB for the wide model's features.
NO_AUTOTUNING = {"xla_gpu_autotune_level": 0}


def record(workload: str, system: str, ms: float | str | None, memory: int | None, received: int | None,
           note: str = ""):
    """A row of the results: `ms` None where nothing was timed (a compile only), "failed" where the run failed;
    `memory` per device and `received` per device and call in bytes."""
    RESULTS.record(workload, system, ms, note, memory_gib=None if memory is None else memory / 2**30,
                   received_mib=None if received is None else received / 2**20)


def top_kernels(fn, *args, count: int = 6) -> str:
    kernels = kernel_times(fn, *args, calls=5)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:count]
    return f"total {1e3 * sum(kernels.values()):.2f} ms: " + "; ".join(f"{name[:40]} {1e3 * t:.2f}" for name, t in top)


def spmm(A, partitions, x_np, devices) -> None:
    """The SpMM on one GPU, then over each partition (the exchange in one piece, then in chunks)."""
    workload = f"SpMM F={x_np.shape[1]} fp32"
    x1 = jax.device_put(x_np, devices[0])
    A1 = jax.device_put(A, devices[0])
    f1 = jax.jit(lambda A, x: A @ x).lower(A1, x1).compile()
    t1 = time_calls(f1, A1, x1, calls=20)
    m1 = memory_per_device(f1)
    record(workload, "1 GPU", 1e3 * t1, m1, 0)
    reference = np.asarray(f1(A1, x1)[:4096])
    del x1, A1
    for P in partitions:
        xs = P.shard_rows(x_np)
        fs = jax.jit(lambda P, x: P @ x).lower(P, xs).compile()
        ts = time_calls(fs, P, xs, calls=20)
        received = sum(jinsum.shard.communication(lambda P, x: P @ x, P, xs).values())
        chunks = "" if P.plan.chunks == 1 else f", {P.plan.chunks} chunks"
        record(workload, f"{len(devices)} GPUs{chunks}", 1e3 * ts, memory_per_device(fs), received,
               f"{t1 / ts:.2f}x, memory {memory_per_device(fs) / m1:.3f}x; device time (all GPUs) by kernel: "
               f"{top_kernels(fs, P, xs)}")
        check = np.asarray(P.unshard_rows(fs(P, xs))[:4096]) - reference
        print(f"  max |sharded - single| over the first 4096 rows: {np.abs(check).max():.2e}")


def exchanges(P: jinsum.shard.Partitioned, x_np: np.ndarray) -> None:
    """The halo exchange alone (the rows gathered and moved, no product), two ways: a `ppermute` per shift (what
    `P @ x` runs, one piece after another), and one `all_to_all` of the same rows, each destination's slot padded to
    the largest shift (one NCCL call to every peer at once, but every row in before any remote product starts)."""
    parts, pieces = P.num_parts, P.plan.pieces  # (one a shift: P has one chunk)
    xs = P.shard_rows(x_np)
    spec = PartitionSpec(P.axis)
    slot = max(P.plan.columns)
    send = np.asarray(P.send)
    slots = np.zeros((parts, parts * slot), np.int32)  # device s's rows for device j at slots[s, j * slot:]
    for s in range(parts):
        for k, start, count in pieces:
            j = (s + k) % parts
            slots[s, j * slot:j * slot + count] = send[s, start:start + count]
    slots = jax.device_put(slots, P.sharding)

    def per_shift(send, x):
        return tuple(jax.lax.ppermute(jnp.take(x, send[0, start:start + count], axis=0), P.axis,
                                      [(s, (s + k) % parts) for s in range(parts)])
                     for k, start, count in pieces)

    def at_once(slots, x):
        return jax.lax.all_to_all(jnp.take(x, slots[0], axis=0), P.axis, 0, 0, tiled=True)

    for name, fn, indices in (("a ppermute per shift", per_shift, P.send), ("one all_to_all", at_once, slots)):
        exchange = jax.shard_map(fn, mesh=P.mesh, in_specs=(spec, spec), out_specs=spec)
        compiled = jax.jit(exchange).lower(indices, xs).compile()
        record(f"exchange alone F={x_np.shape[1]} fp32", f"{parts} GPUs", 1e3 * time_calls(compiled, indices, xs),
               memory_per_device(compiled), sum(jinsum.shard.communication(exchange, indices, xs).values()), name)


def gcn(A, partitions, x_np, y_np, devices, mesh) -> None:
    """The GCN training step on one GPU, then over each partition (the exchange in one piece, then in chunks)."""
    workload = f"GCN step {x_np.shape[1]}->256->40"

    def model_fn():
        return GCN(x_np.shape[1], 256, 40, rngs=nnx.Rngs(0))

    one_mesh = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    one = run("1 GPU", model_fn, jax.device_put(A, devices[0]), *jax.device_put((x_np, y_np), devices[0]),
              jax.device_put(np.ones(len(y_np), bool), devices[0]), one_mesh, 3, 10)
    record(workload, "1 GPU", 1e3 * one["seconds"], one["memory"], 0)
    for P in partitions:
        system = f"{len(devices)} GPUs" + ("" if P.plan.chunks == 1 else f", {P.plan.chunks} chunks")
        many = run(system, model_fn, P, P.shard_rows(x_np), P.shard_rows(y_np), P.row_mask,
                   NamedSharding(mesh, PartitionSpec()), 3, 10)
        gap = np.max(np.abs(np.array(one["losses"]) - np.array(many["losses"])))
        record(workload, system, 1e3 * many["seconds"], many["memory"], many["received"],
               f"{one['seconds'] / many['seconds']:.2f}x, memory {many['memory'] / one['memory']:.3f}x; loss gap "
               f"{gap:.1e}; device time (all GPUs) by kernel: {many['kernels']}")


def wide(A, P, width: int, devices, mesh) -> None:
    workload = f"GCN step {width}->256->40 (wide)"
    n = A.shape[0]

    def model_fn():
        return GCN(width, 256, 40, rngs=nnx.Rngs(0))

    def features(sharding, rows):
        make = jax.jit(lambda key: jax.random.normal(key, (rows, width), jnp.float32), out_shardings=sharding)
        return make(jax.random.key(0))

    y = np.random.default_rng(0).integers(0, 40, n).astype(np.int32)
    try:
        one_mesh = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
        x1 = features(jax.sharding.SingleDeviceSharding(devices[0]), n)
        one = run("1 GPU", model_fn, jax.device_put(A, devices[0]), x1, jax.device_put(y, devices[0]),
                  jax.device_put(np.ones(n, bool), devices[0]), one_mesh, 2, 3, NO_AUTOTUNING)
        record(workload, "1 GPU", 1e3 * one["seconds"], one["memory"], 0)
    except Exception as error:  # noqa: BLE001 (running out of memory is the expected outcome)
        record(workload, "1 GPU", "failed", None, None, failure(error))
    x1 = None  # (free the single GPU's features before the sharded run)
    try:
        xs = features(P.sharding, P.padded_rows)
        many = run(f"{len(devices)} GPUs", model_fn, P, xs, P.shard_rows(y), P.row_mask,
                   NamedSharding(mesh, PartitionSpec()), 2, 3, NO_AUTOTUNING)
        record(workload, f"{len(devices)} GPUs", 1e3 * many["seconds"], many["memory"], many["received"],
               f"losses {many['losses'][0]:.3f} -> {many['losses'][-1]:.3f}")
    except Exception as error:  # noqa: BLE001
        record(workload, f"{len(devices)} GPUs", "failed", None, None, failure(error))


def on_mesh(P: jinsum.shard.Partitioned, mesh: Mesh) -> jinsum.shard.Partitioned:
    """`P`'s structure over another mesh of as many devices, its arrays as shapes (a compile-only mesh holds no
    data)."""
    sharding = NamedSharding(mesh, PartitionSpec(P.axis))
    arrays = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          (P.local, P.remote, P.send))
    return jinsum.shard.Partitioned(*arrays, mesh, P.axis, P.shape, P.layout, P.plan)


def device_alone(P: jinsum.shard.Partitioned, x_np: np.ndarray) -> tuple[float, str]:
    """Seconds per SpMM of device 0's part alone on this GPU, the rows it would receive replaced by a copy of those
    it sends (same count, no NCCL), and its kernels."""
    from jinsum.shard._ops import spmm  # noqa: PLC0415 (the product P @ x runs on each part)

    gpu = jax.devices()[0]
    local, remote, send = jax.tree.map(lambda a: jax.device_put(np.asarray(a)[0], gpu), (P.local, P.remote, P.send))
    x = jax.device_put(np.asarray(P.shard_rows(x_np))[: P.layout.rows_per_part], gpu)
    plan = P.plan if P.plan.exchange == "halo" else None

    def part(local, remote, send, x):
        out = spmm(local, x)
        for piece, matrix in enumerate(remote):
            if plan is None:  # all_gather: every block received; here D copies of its own
                received = jnp.tile(x, (P.num_parts, 1))
            else:
                _, start, count = plan.pieces[piece]
                received = jnp.take(x, send[start:start + count], axis=0) if count else x[:1] * 0
            out = spmm(matrix, received, out=out)
        return out

    compiled = jax.jit(part).lower(local, remote, send, x).compile()
    return time_calls(compiled, local, remote, send, x, calls=20), top_kernels(compiled, local, remote, send, x)


def compile_only(A, x_np, counts: list[int], split: str, width: int) -> list[str]:
    """Memory per device of the SpMM, the GCN step and (`width`) the wide GCN step on 1 GPU and on each of `counts`,
    from compiles for compile-only topologies; the lines of the results' header."""
    from jax.experimental import topologies  # noqa: PLC0415

    gpu = jax.devices()[0]
    n, features = x_np.shape
    capacity = gpu.memory_stats().get("bytes_limit") if gpu.memory_stats() else None

    def gcn_memory(graph, width, sharding, replicated, rows):
        step, state = train_step(GCN(width, 256, 40, rngs=nnx.Rngs(0)))
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state)
        x, y, mask = (jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in
                      (((rows, width), np.float32), ((rows,), np.int32), ((rows,), np.bool_)))
        compiled = jax.jit(step, donate_argnums=0).lower(state, x, y, mask, graph).compile(NO_AUTOTUNING)
        return memory_per_device(compiled), sum(jinsum.shard.communication(step, state, x, y, mask, graph).values())

    def note(memory):
        if capacity is None or memory <= capacity:
            return "compiled"
        return f"compiled; over the {capacity / 2**30:.0f} GiB JAX's allocator has of one {gpu.device_kind}"

    one = jax.sharding.SingleDeviceSharding(gpu)
    A1, x1 = jax.device_put((A, x_np), gpu)
    compiled = jax.jit(lambda A, x: A @ x).lower(A1, x1).compile()
    record(f"SpMM F={features} fp32", "1 GPU", 1e3 * time_calls(compiled, A1, x1, calls=20),
           memory_per_device(compiled), 0, f"run; {top_kernels(compiled, A1, x1)}")
    del x1
    workloads = [("GCN step", features)] + ([("GCN step (wide)", width)] if width else [])
    for name, w in workloads:
        memory, _ = gcn_memory(A1, w, one, one, n)
        record(f"{name} {w}->256->40", "1 GPU", None, memory, 0, note(memory))
    del A1
    header = []
    for parts in counts:
        mesh = topologies.make_mesh(topologies.get_topology_desc(platform="cuda", topology=f"1x1x{parts}"),
                                    (parts,), ("x",))
        started = time.perf_counter()
        host = jinsum.shard.partition(A, Mesh(np.array(jax.devices("cpu")[:parts]), ("x",)), split=split)
        header.append(f"{parts} GPUs: {host!r}, {time.perf_counter() - started:.0f} s to partition.")
        print(header[-1], flush=True)
        P = on_mesh(host, mesh)
        sharding, replicated = P.sharding, NamedSharding(mesh, PartitionSpec())
        xs = jax.ShapeDtypeStruct((P.padded_rows, features), np.float32, sharding=sharding)
        compiled = jax.jit(lambda P, x: P @ x).lower(P, xs).compile()
        received = sum(jinsum.shard.communication(lambda P, x: P @ x, P, xs).values())
        seconds, kernels = device_alone(host, x_np)
        record(f"SpMM F={features} fp32", f"{parts} GPUs", None, memory_per_device(compiled), received,
               f"compiled; device 0's part alone on one GPU (no NCCL): {1e3 * seconds:.3f} ms, {kernels}")
        for name, w in workloads:
            memory, received = gcn_memory(P, w, sharding, replicated, P.padded_rows)
            record(f"{name} {w}->256->40", f"{parts} GPUs", None, memory, received, note(memory))
    return header


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=22)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--wide", type=int, default=7168, help="input width of the wide model (0: skip)")
    p.add_argument("--split", default="auto", choices=jinsum.shard.SPLITS)
    p.add_argument("--chunks", type=int, default=3,
                   help="also the SpMM and GCN step with the exchange in this many chunks (1: not)")
    p.add_argument("--compile-only", type=int, nargs="+", metavar="D",
                   help="compile for D GPUs of this kind (each D given) instead of running on the visible ones")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    devices = jax.devices()
    started = time.perf_counter()
    A, x, y = planted_task(args.scale, args.features, 40, planted=False)
    print(f"R-MAT {args.scale}: {A.shape[0]} nodes, {A.nnz} edges ({time.perf_counter() - started:.1f} s)", flush=True)
    if args.compile_only:
        header = compile_only(A, x, args.compile_only, args.split, args.wide)
        stem, title = f"sharded_compiled_{device_file_name()}", f"Memory per device, compiled for D x {device_name()}"
    else:
        mesh = Mesh(np.array(devices), ("x",))
        started = time.perf_counter()
        P = jinsum.shard.partition(A, mesh, split=args.split)
        header = [f"{P!r}; rows per device {P.layout.rows_per_device(P.num_parts)}, distinct remote rows read per "
                  f"device {list(P.plan.needed)} ({time.perf_counter() - started:.1f} s to partition)."]
        print(header[0], flush=True)
        partitions = [P]
        if args.chunks > 1:
            partitions.append(jinsum.shard.partition(A, mesh, split=args.split, chunks=args.chunks))
        spmm(A, partitions, x, devices)
        if len(devices) > 2:
            exchanges(P, x)
        gcn(A, partitions, x, y, devices, mesh)
        del partitions[1:]
        if args.wide:
            wide(A, P, args.wide, devices, mesh)
        stem = f"sharded_{len(devices)}x_{device_file_name()}_rmat{args.scale}"
        title = f"Sharded SpMM and GCN steps: {len(devices)} x {device_name()}"
    preamble = [f"`{command(__file__)}`; {versions_text()}.", "",
                f"R-MAT {args.scale}: {A.shape[0]} nodes, {A.nnz} edges.", *header]
    write(pathlib.Path(args.out) / stem, title, preamble, COLUMNS, RESULTS.rows, csv_fields=[c.key for c in COLUMNS])


if __name__ == "__main__":
    main()

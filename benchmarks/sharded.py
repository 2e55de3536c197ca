"""Scaling over the GPUs of one host (`jinsum.shard`): SpMM and GCN training steps on 1 GPU and on all visible GPUs,
same run, same timing method, and a model too wide for one GPU.

    python benchmarks/sharded.py [--scale 22] [--features 128] [--wide 8192] [--out benchmarks/results]

Graph: R-MAT (directed, Graph500 parameters; scale 22: 4.2M nodes, ~64M edges), `jinsum.nn.adjacency`.
- SpMM `A @ X`, X float32 `(N, features)`: one GPU on the whole matrix, against `P @ X` on the partition over all
  GPUs (`jinsum.shard.partition`). Timing: `jinsum.timing.time_calls` for both; memory per device: XLA's analysis
  of the compiled call (arguments + outputs + temporaries); the bytes each device receives per call, read off the
  program (`jinsum.shard.communication`); the device time by kernel of the sharded call.
- GCN training step (features -> 256 -> 40, Adam, masked cross-entropy; examples/sharded_gcn): the same.
- A wide model: `--wide` input features (generated on the devices), the same GCN; tried on one GPU first (expected
  to run out of memory), then on all; compiled without XLA's autotuning of matmuls (it would copy the features).
Results: `--out`/sharded_<device>.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import time

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
from _training import package_versions  # noqa: E402
from sharded_gcn.main import GCN, memory_per_device, planted_task, run  # noqa: E402

ROWS: list[dict] = []
# XLA tries matmul configurations on copies of the operands: tens of GiB for the wide model's features.
NO_AUTOTUNING = {"xla_gpu_autotune_level": 0}


def record(workload: str, system: str, ms: float | None, memory: int | None, received: int | None, note: str = ""):
    ROWS.append(dict(workload=workload, system=system, ms=ms, memory_gib=None if memory is None else memory / 2**30,
                     received_mib=None if received is None else received / 2**20, note=note))
    shown = "failed" if ms is None else f"{ms:.3f} ms"
    mem = "" if memory is None else f"{memory / 2**30:.2f} GiB/device"
    print(f"  {workload:<34} {system:<12} {shown:>12} {mem:>16}  {note}", flush=True)


def top_kernels(fn, *args, count: int = 6) -> str:
    kernels = kernel_times(fn, *args, calls=5)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:count]
    return f"total {1e3 * sum(kernels.values()):.2f} ms: " + "; ".join(f"{name[:40]} {1e3 * t:.2f}" for name, t in top)


def spmm(A, P, x_np, devices) -> None:
    workload = f"SpMM F={x_np.shape[1]} fp32"
    x1 = jax.device_put(x_np, devices[0])
    A1 = jax.device_put(A, devices[0])
    f1 = jax.jit(lambda A, x: A @ x).lower(A1, x1).compile()
    t1 = time_calls(f1, A1, x1, calls=20)
    record(workload, "1 GPU", 1e3 * t1, memory_per_device(f1), 0)
    xs = P.shard_rows(x_np)
    fn = jax.jit(lambda P, x: P @ x)
    fs = fn.lower(P, xs).compile()
    ts = time_calls(fs, P, xs, calls=20)
    received = sum(jinsum.shard.communication(lambda P, x: P @ x, P, xs).values())
    record(workload, f"{len(devices)} GPUs", 1e3 * ts, memory_per_device(fs), received,
           f"{t1 / ts:.2f}x; device time (both GPUs) by kernel: {top_kernels(fs, P, xs)}")
    check = np.asarray(P.unshard_rows(fs(P, xs))[:4096]) - np.asarray(f1(A1, x1)[:4096])
    print(f"  max |sharded - single| over the first 4096 rows: {np.abs(check).max():.2e}")


def gcn(A, P, x_np, y_np, devices, mesh) -> None:
    workload = f"GCN step {x_np.shape[1]}->256->40"

    def model_fn():
        return GCN(x_np.shape[1], 256, 40, rngs=nnx.Rngs(0))

    one_mesh = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    one = run("1 GPU", model_fn, jax.device_put(A, devices[0]), *jax.device_put((x_np, y_np), devices[0]),
              jax.device_put(np.ones(len(y_np), bool), devices[0]), one_mesh, 3, 10)
    record(workload, "1 GPU", 1e3 * one["seconds"], one["memory"], 0)
    many = run(f"{len(devices)} GPUs", model_fn, P, P.shard_rows(x_np), P.shard_rows(y_np), P.row_mask,
               NamedSharding(mesh, PartitionSpec()), 3, 10)
    gap = np.max(np.abs(np.array(one["losses"]) - np.array(many["losses"])))
    record(workload, f"{len(devices)} GPUs", 1e3 * many["seconds"], many["memory"], many["received"],
           f"{one['seconds'] / many['seconds']:.2f}x; loss gap {gap:.1e}; device time (both GPUs) by kernel: "
           f"{many['kernels']}")


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
        record(workload, "1 GPU", None, None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")
    x1 = None  # (free the single GPU's features before the sharded run)
    try:
        xs = features(P.sharding, P.padded_rows)
        many = run(f"{len(devices)} GPUs", model_fn, P, xs, P.shard_rows(y), P.row_mask,
                   NamedSharding(mesh, PartitionSpec()), 2, 3, NO_AUTOTUNING)
        record(workload, f"{len(devices)} GPUs", 1e3 * many["seconds"], many["memory"], many["received"],
               f"losses {many['losses'][0]:.3f} -> {many['losses'][-1]:.3f}")
    except Exception as error:  # noqa: BLE001
        record(workload, f"{len(devices)} GPUs", None, None, None,
               f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=22)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--wide", type=int, default=7168, help="input width of the wide model (0: skip)")
    p.add_argument("--split", default="auto", choices=jinsum.shard.SPLITS)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    started = time.perf_counter()
    A, x, y = planted_task(args.scale, args.features, 40, planted=False)
    print(f"R-MAT {args.scale}: {A.shape[0]} nodes, {A.nnz} edges ({time.perf_counter() - started:.1f} s)", flush=True)
    started = time.perf_counter()
    P = jinsum.shard.partition(A, mesh, split=args.split)
    print(f"{P}\n  rows per device {P.layout.rows_per_device(P.num_parts)}, remote rows read {list(P.plan.needed)} "
          f"({time.perf_counter() - started:.1f} s to partition)", flush=True)
    spmm(A, P, x, devices)
    gcn(A, P, x, y, devices, mesh)
    if args.wide:
        wide(A, P, args.wide, devices, mesh)

    name = devices[0].device_kind.replace(" ", "_")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"sharded_{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    versions = ", ".join(f"{k} {v}" for k, v in package_versions().items())
    lines = [f"# Sharded SpMM and GCN steps: {len(devices)} x {devices[0].device_kind}", "",
             f"`python benchmarks/sharded.py {' '.join(sys.argv[1:])}`; {versions}.", "",
             f"R-MAT {args.scale}: {A.shape[0]} nodes, {A.nnz} edges. {P!r}; rows per device "
             f"{P.layout.rows_per_device(P.num_parts)}, distinct remote rows read per device {list(P.plan.needed)}.",
             "", "| workload | system | ms | memory per device (GiB) | received per device per call (MiB) | note |",
             "|---|---|---:|---:|---:|---|"]
    for r in ROWS:
        ms = "failed" if r["ms"] is None else f"{r['ms']:.3f}"
        mem = "" if r["memory_gib"] is None else f"{r['memory_gib']:.2f}"
        rec = "" if r["received_mib"] is None else f"{r['received_mib']:.1f}"
        lines.append(f"| {r['workload']} | {r['system']} | {ms} | {mem} | {rec} | {r['note']} |")
    (out / f"sharded_{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

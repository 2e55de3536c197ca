"""Graphs computed on the device from points (`jinsum.graphs.knn`, `radius_graph`) and a DGCNN training step, against
plain JAX and torch.

    python benchmarks/point_graphs.py [--clouds 16] [--points 1024] [--k 20] [--dims 3 64] [--radius 0.5]
                                      [--max-neighbors 32] [--calls 20] [--out benchmarks/results]
                                      [--knn-configs CONFIG ...] [--knn-large N ...]

Clouds of random points (standard normal). Systems, every one timed the same way (`jinsum.timing.time_calls`;
torch's with `torch.cuda.synchronize` as the sync), torch's only where torch has CUDA (torch_cluster does not
install from the index):

- kNN, the k nearest neighbours of every point within its cloud, for each of `--dims`: `jinsum.graphs.knn` with PyG's
  `batch` vector over all the points and vmapped over the clouds (on CUDA both are one Triton kernel, each row
  block scanning its own cloud's points), its tiled XLA path with the batch vector (`JINSUM_TRITON=0`, GPU only:
  it tiles every pair of clouds), plain JAX (a dense `(P, P)` distance matrix per cloud and `lax.top_k`), and
  torch `cdist` + `topk`. `--knn-configs` adds a batch-vector row per kernel configuration (`JINSUM_KNN_CONFIG`
  strings, e.g. `block_m=32,block_n=32,num_warps=1`); `--knn-large N ...` times `N` points (D = 3) as one cloud
  and as clouds of `--points`, one call each;
- radius graphs over 3-D positions, the first `--max-neighbors` points within `--radius` of each point in index
  order (torch_cluster's rule on CUDA): `jinsum.graphs.radius_graph` with the batch vector and vmapped, plain JAX (a
  dense distance matrix per cloud, the first points within reach by `lax.top_k` over their ids), and torch `cdist`
  + `topk` over the ids;
- a DGCNN training step on all the clouds (3-D; the model of `examples/point_cloud`: three dynamic edge
  convolutions of k = `--k` neighbours, max pool, MLP head; forward, backward and Adam): jinsum's
  `DynamicEdgeConv` on the batch vector, and PyG's `EdgeConv` on a torch `cdist` + `topk` kNN graph (the example's
  `pyg_trainer`; `DynamicEdgeConv` needs torch_cluster or pyg-lib).
Results go to `--out` as `point_graphs_<device>.md`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jinsum  # noqa: E402
import jinsum.graphs as jg  # noqa: E402
from jinsum.timing import time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from _harness import (  # noqa: E402
    SYSTEM, Column, command, device_file_name, device_name, sync_torch, text, torch_on_cuda, versions_text, write)
from point_cloud.main import DGCNN, SHAPES, pyg_trainer, train_step  # noqa: E402


COLUMNS = (text("graph", "workload"), Column("D", "D"), SYSTEM, Column("ms", "ms", "{:.3f}"))


def dense_knn(pos, k):
    """One cloud: squared distances `(P, P)`, itself excluded, the k smallest."""
    d = jnp.sum((pos[:, None, :] - pos[None, :, :]) ** 2, -1) + jnp.diag(jnp.full(pos.shape[0], jnp.inf))
    return jax.lax.top_k(-d, k)[1]


def dense_radius(pos, r, width):
    """One cloud: squared distances `(P, P)`, the first `width` other points within `r` by index, -1 padded."""
    d = jnp.sum((pos[:, None, :] - pos[None, :, :]) ** 2, -1)
    ids = jnp.arange(pos.shape[0])
    keys = jnp.where((d < r * r) & (ids[:, None] != ids[None, :]), ids, pos.shape[0])
    first = -jax.lax.top_k(-keys, width)[0]
    return jnp.where(first < pos.shape[0], first, -1)


def compiled_with(env: dict[str, str], fn, *inputs):
    """`jax.jit(fn)` compiled for `inputs` with the environment variables `env` set while it is traced (where
    `jinsum.graphs.knn` reads `JINSUM_KNN_CONFIG`, a sweep's override that JAX's caches do not see: a fresh
    function)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return jax.jit(lambda *a: fn(*a)).lower(*inputs).compile()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def without_kernel(fn, *inputs):
    """`jax.jit(fn)` compiled for `inputs` under `jinsum.triton(False)`: kNN's tiled XLA path on a GPU."""
    with jinsum.triton(False):
        return jax.jit(fn).lower(*inputs).compile()


def knn_rows(args, pos: np.ndarray, torch) -> list[tuple]:
    """`(graph, D, system, ms)` of the kNN systems on `pos` `(clouds, points, D)`."""
    dim, graph = pos.shape[2], f"kNN, k = {args.k}"
    flat, batch = jnp.asarray(pos.reshape(-1, dim)), jnp.repeat(jnp.arange(args.clouds), args.points)
    clouds = jnp.asarray(pos)
    systems = {
        "jinsum knn, batch vector": (jax.jit(lambda x, b: jg.knn(x, args.k, b)), (flat, batch)),
        "jinsum knn, vmapped over clouds": (jax.jit(jax.vmap(lambda x: jg.knn(x, args.k))), (clouds,)),
        "plain JAX dense + top_k, vmapped": (jax.jit(jax.vmap(lambda x: dense_knn(x, args.k))), (clouds,)),
    }
    if jax.default_backend() == "gpu":
        systems["jinsum knn, batch vector, tiled XLA path"] = (
            without_kernel(lambda x, b: jg.knn(x, args.k, b), flat, batch), (flat, batch))
    for config in args.knn_configs:
        try:
            systems[f"jinsum knn, batch vector, {config}"] = (
                compiled_with({"JINSUM_KNN_CONFIG": config}, lambda x, b: jg.knn(x, args.k, b), flat, batch),
                (flat, batch))
        except ValueError as error:  # (a shape the kernel cannot take at this D, e.g. tl.dot under 16 rows)
            print(f"D = {dim}, {config}: {error}", file=sys.stderr)
    rows = [(graph, dim, name, time_calls(fn, *inputs, calls=args.calls) * 1e3)
            for name, (fn, inputs) in systems.items()]
    if torch is not None:
        tp = torch.from_numpy(pos).cuda()

        def torch_knn():
            d = torch.cdist(tp, tp)
            d.diagonal(dim1=1, dim2=2).fill_(float("inf"))
            return d.topk(args.k, largest=False).indices

        rows.append((graph, dim, "torch cdist + topk", time_calls(torch_knn, calls=args.calls, sync=sync_torch) * 1e3))
    return rows


def large_knn_rows(args) -> list[tuple]:
    """`(graph, D, system, ms)` of `jinsum.graphs.knn` on `--knn-large` points (D = 3): one cloud, and clouds of
    `--points` with the batch vector; one call each (the one-cloud case is quadratic)."""
    rows = []
    rng = np.random.default_rng(2)
    for n in args.knn_large:
        pos = jnp.asarray(rng.standard_normal((n, 3)).astype(np.float32))
        batch = jnp.arange(n, dtype=jnp.int32) // args.points
        graph = f"kNN, k = {args.k}, {n:,} points"
        one = jax.jit(lambda x: jg.knn(x, args.k))
        many = jax.jit(lambda x, b: jg.knn(x, args.k, b))
        rows.append((graph, 3, "jinsum knn, one cloud", time_calls(one, pos, calls=1, rounds=1, warmup=1) * 1e3))
        rows.append((graph, 3, f"jinsum knn, clouds of {args.points}, batch vector",
                     time_calls(many, pos, batch, calls=1, rounds=3, warmup=1) * 1e3))
    return rows


def radius_rows(args, pos: np.ndarray, torch) -> list[tuple]:
    """`(graph, D, system, ms)` of the radius-graph systems on `pos` `(clouds, points, 3)`."""
    r, width = args.radius, args.max_neighbors
    graph = f"radius graph, r = {r}, at most {width}"
    flat, batch = jnp.asarray(pos.reshape(-1, 3)), jnp.repeat(jnp.arange(args.clouds), args.points)
    clouds = jnp.asarray(pos)
    systems = {
        "jinsum radius_graph, batch vector": (
            jax.jit(lambda x, b: jg.radius_graph(x, r, b, max_num_neighbors=width)), (flat, batch)),
        "jinsum radius_graph, vmapped over clouds": (
            jax.jit(jax.vmap(lambda x: jg.radius_graph(x, r, max_num_neighbors=width))), (clouds,)),
        "plain JAX dense + top_k over ids, vmapped": (jax.jit(jax.vmap(lambda x: dense_radius(x, r, width))),
                                                      (clouds,)),
    }
    rows = [(graph, 3, name, time_calls(fn, *inputs, calls=args.calls) * 1e3) for name, (fn, inputs) in systems.items()]
    if torch is not None:
        tp = torch.from_numpy(pos).cuda()
        ids = torch.arange(args.points, device="cuda")

        def torch_radius():
            within = torch.cdist(tp, tp) < r
            within.diagonal(dim1=1, dim2=2).fill_(False)
            first = torch.where(within, ids, args.points).topk(width, largest=False).values
            return torch.where(first < args.points, first, -1)

        rows.append((graph, 3, "torch cdist + topk over ids", time_calls(torch_radius, calls=args.calls,
                                                                          sync=sync_torch) * 1e3))
    return rows


def dgcnn_rows(args, pos: np.ndarray, torch) -> list[tuple]:
    """`(graph, D, system, ms)` of a DGCNN training step on `pos` `(clouds, points, 3)`, random labels."""
    graph = f"DGCNN step, k = {args.k}"
    labels = np.random.default_rng(1).integers(0, len(SHAPES), args.clouds).astype(np.int32)
    step, _, state = train_step(DGCNN(args.k, len(SHAPES), rngs=nnx.Rngs(0)), learning_rate=1e-3)
    inputs = (state, jnp.asarray(pos), jnp.asarray(labels), jnp.ones(args.clouds, bool))
    rows = [(graph, 3, "jinsum DynamicEdgeConv", time_calls(jax.jit(step), *inputs, calls=args.calls) * 1e3)]
    try:
        import torch_geometric  # noqa: F401, PLC0415
    except ImportError:
        return rows
    if torch is not None:
        train, _, sync = pyg_trainer(args.k, len(SHAPES), 1e-3, seed=0)
        rows.append((graph, 3, "PyG EdgeConv + cdist kNN", time_calls(train, pos, labels, calls=args.calls,
                                                                       sync=sync) * 1e3))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clouds", type=int, default=16)
    p.add_argument("--points", type=int, default=1024)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    p.add_argument("--radius", type=float, default=0.5)
    p.add_argument("--max-neighbors", type=int, default=32)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    p.add_argument("--knn-configs", nargs="*", default=[], help="JINSUM_KNN_CONFIG strings to time (kNN kernel)")
    p.add_argument("--knn-large", type=int, nargs="*", default=[], help="points of the large kNN rows")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    torch = torch_on_cuda()
    rows = []
    for dim in args.dims:
        rows += knn_rows(args, rng.standard_normal((args.clouds, args.points, dim)).astype(np.float32), torch)
    rows += large_knn_rows(args)
    pos = rng.standard_normal((args.clouds, args.points, 3)).astype(np.float32)
    rows += radius_rows(args, pos, torch)
    rows += dgcnn_rows(args, pos, torch)
    _, count = jg.radius(pos.reshape(-1, 3), args.radius, jnp.repeat(jnp.arange(args.clouds), args.points),
                          args.max_neighbors)
    preamble = (f"{versions_text()}; `{command(__file__)}`: {args.clouds} clouds of {args.points} points (standard "
                f"normal); {100 * np.mean(np.asarray(count) > args.max_neighbors):.1f}% of the points have more than "
                f"{args.max_neighbors} within r = {args.radius}; ms per call, median of rounds of back-to-back calls.")
    write(args.out / f"point_graphs_{device_file_name()}", f"Graphs from points on the device on {device_name()}",
          [preamble], COLUMNS, [dict(workload=graph, D=d, system=name, ms=ms) for graph, d, name, ms in rows])


if __name__ == "__main__":
    main()

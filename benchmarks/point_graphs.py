"""kNN graphs computed on the device (`jinsum.nn.knn`), against a dense distance matrix + `top_k` and torch.

    python benchmarks/point_graphs.py [--clouds 16] [--points 1024] [--k 20] [--dims 3 64] [--out benchmarks/results]

Clouds of random points, the k nearest neighbours of every point within its cloud. Systems, timed the same way
(`jinsum.timing.time_calls`): `jinsum.nn.knn` with PyG's `batch` vector over all the points (tiles over every pair
of clouds, masked), the same vmapped over the clouds, plain JAX (a dense `(P, P)` distance matrix per cloud and
`lax.top_k`), and torch `cdist` + `topk` where torch has CUDA (torch_cluster does not install from the index).
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

import jinsum.nn as jnn  # noqa: E402
from jinsum.timing import time_calls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _training import package_versions  # noqa: E402


def dense_knn(pos, k):
    """One cloud: squared distances `(P, P)`, itself excluded, the k smallest."""
    d = jnp.sum((pos[:, None, :] - pos[None, :, :]) ** 2, -1) + jnp.diag(jnp.full(pos.shape[0], jnp.inf))
    return jax.lax.top_k(-d, k)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clouds", type=int, default=16)
    p.add_argument("--points", type=int, default=1024)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for dim in args.dims:
        pos = rng.standard_normal((args.clouds, args.points, dim)).astype(np.float32)
        flat, batch = jnp.asarray(pos.reshape(-1, dim)), jnp.repeat(jnp.arange(args.clouds), args.points)
        clouds = jnp.asarray(pos)
        systems = {
            "jinsum knn, batch vector": (jax.jit(lambda x, b: jnn.knn(x, args.k, b)), (flat, batch)),
            "jinsum knn, vmapped over clouds": (jax.jit(jax.vmap(lambda x: jnn.knn(x, args.k))), (clouds,)),
            "plain JAX dense + top_k, vmapped": (jax.jit(jax.vmap(lambda x: dense_knn(x, args.k))), (clouds,)),
        }
        for name, (fn, inputs) in systems.items():
            rows.append((dim, name, time_calls(fn, *inputs, calls=args.calls) * 1e3))
        try:
            import torch  # noqa: PLC0415
            if not torch.cuda.is_available():
                raise ImportError("no CUDA")
        except ImportError:
            continue
        tp = torch.from_numpy(pos).cuda()

        def torch_knn():
            d = torch.cdist(tp, tp)
            d.diagonal(dim1=1, dim2=2).fill_(float("inf"))
            return d.topk(args.k, largest=False).indices

        rows.append((dim, "torch cdist + topk", time_calls(torch_knn, calls=args.calls,
                                                            sync=lambda _: torch.cuda.synchronize()) * 1e3))
    device = jax.devices()[0].device_kind
    lines = [f"# kNN graphs on the device on {device}", "",
             f"{', '.join(f'{k} {v}' for k, v in package_versions().items())}; `python benchmarks/point_graphs.py "
             f"{' '.join(sys.argv[1:])}`: {args.clouds} clouds of {args.points} points, k = {args.k}; ms per call, "
             "median of rounds of back-to-back calls.", "", "| D | system | ms |", "|---:|---|---:|"]
    lines += [f"| {d} | {name} | {ms:.3f} |" for d, name, ms in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"point_graphs_{device.replace(' ', '_')}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

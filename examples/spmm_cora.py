"""GCN aggregation on the real Cora graph: `Â @ H` with jinsum, checked and timed against its peers.

Â = D^-1/2 (A + I) D^-1/2 is the normalised adjacency of Kipf & Welling's GCN (2,708 nodes, 13,264 entries with
self loops). Each system computes Â @ H for feature widths F; results are checked against SciPy in float64 and
timed the same way (jinsum.timing.time_calls: back-to-back calls, one synchronisation, median of rounds).

    python examples/spmm_cora.py [--features 16 64 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.experimental import sparse

import jinsum
from jinsum.datasets import load_planetoid
from jinsum.timing import time_calls

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples' shared helpers
from _common import normalized_adjacency  # noqa: E402


def main(features: list[int]) -> None:
    cora = load_planetoid("cora")
    edges, weights = normalized_adjacency(cora.edge_index, cora.num_nodes)
    n = cora.num_nodes
    A = jinsum.GroupCOO.from_edge_index(edges, weights, num_nodes=n)
    A_scipy = sp.csr_matrix((weights.astype(np.float64), (edges[1], edges[0])), shape=(n, n))
    A_bcoo = sparse.BCOO.from_scipy_sparse(A_scipy.astype(np.float32))
    src, dst, w = jnp.asarray(edges[0]), jnp.asarray(edges[1]), jnp.asarray(weights)
    order = np.lexsort((edges[0], edges[1]))  # segment_sum wants destinations sorted
    src_s, dst_s, w_s = src[order], dst[order], w[order]
    print(f"Cora: {n} nodes, {edges.shape[1]} entries of Â; jinsum format {A}")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}\n")

    systems = {
        "jinsum (A @ H)": jax.jit(lambda H: A @ H),
        "jax.experimental.sparse BCOO": jax.jit(lambda H: A_bcoo @ H),
        "segment_sum (sorted)": jax.jit(lambda H: jax.ops.segment_sum(
            w_s[:, None] * H[src_s], dst_s, num_segments=n, indices_are_sorted=True)),
        "dense matmul": jax.jit(lambda H, D=jnp.asarray(A_scipy.toarray(), jnp.float32): D @ H),
    }
    print(f"{'F':>5}  {'system':<30} {'max rel. error':>15} {'ms / call':>10} {'vs jinsum':>10}")
    for f in features:
        H = np.random.default_rng(f).standard_normal((n, f)).astype(np.float32)
        expected = A_scipy @ H.astype(np.float64)
        times = {}
        for name, fn in systems.items():
            error = np.abs(np.asarray(fn(H), np.float64) - expected).max() / np.abs(expected).max()
            if error > 1e-5:
                raise SystemExit(f"{name} disagrees with SciPy at F={f}: relative error {error:.2e}")
            times[name] = time_calls(fn, H)
            ratio = times[name] / times["jinsum (A @ H)"]
            print(f"{f:>5}  {name:<30} {error:>15.2e} {1e3 * times[name]:>10.3f} {ratio:>9.2f}x")
    grad = jax.grad(lambda H: (A @ H).sum())(jnp.ones((n, 4)))
    np.testing.assert_allclose(grad[:, 0], np.asarray(A_scipy.sum(axis=0)).ravel(), rtol=1e-5)
    print("\ngrad of sum(A @ H) with respect to H equals the column sums of Â: ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=int, nargs="+", default=[16, 64, 256])
    main(parser.parse_args().features)

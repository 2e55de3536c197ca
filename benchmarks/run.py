"""jinsum GPU benchmarks: SpMM, block SpMM and SDDMM against their peers, every system timed the same way.

    python benchmarks/run.py [--quick] [--out benchmarks/results]

Workloads: SpMM fp32 and its transpose (A^T dC, the gradient with respect to the dense operand), each with jinsum
also in deterministic mode (`jinsum.deterministic`), and SDDMM fp32 on PubMed (real, shipped), R-MAT graphs (a=0.57,
b=c=0.19, edge factor 16, scales 17 and 20, deduplicated) and a uniform random graph of R-MAT 17's size (no hubs),
for F = 32, 128 and 256 (--quick: 32 and 128, no R-MAT 20);
block SpMM fp16 with M=K=N=4096, 32x32 blocks at 5% and 20% block density. Peers in the same run:
jax.experimental.sparse (BCOO), the sorted segment_sum idiom (gather idiom for SDDMM), dense matmul where it fits,
and, where PyTorch is installed, cuSPARSE CSR (torch.sparse), torch.sparse._triton_ops.bsr_dense_mm and
torch.sparse.sampled_addmm.

Timing (jinsum.timing.time_calls): warm-up, then R back-to-back calls closed by one synchronisation, divided by R;
the median of 5 rounds (a system whose first call takes over 0.5 s: R = 1, median of 3). Small workloads (PubMed)
are bound by the host's dispatch that way, so the device time is reported too (jinsum.timing.device_time: the GPU's
kernel and copy time per call, from a profiler trace of R calls). Every result is checked against the first peer
before it is timed. Bandwidth is the
compulsory traffic (each input read once, the output written once) over the time, and its fraction of the device
copy bandwidth measured in the same run; block SpMM also reports TFLOP/s against a dense fp16 matmul's rate.
Writes a long-format CSV and a markdown table (with the device name) to --out (`_harness.write`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for the torch peers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402
from jax.experimental import sparse  # noqa: E402

import jinsum  # noqa: E402
from jinsum.datasets import load_planetoid, rmat  # noqa: E402
from jinsum.timing import device_time, time_calls  # noqa: E402

from _harness import (  # noqa: E402 (benchmarks/, this script's folder)
    SYSTEM, WORKLOAD, Column, Results, device_file_name, device_name, ratio, relative_error, sync_torch, versions_text,
    write)

try:
    import torch
except ImportError:  # the torch peers are skipped
    torch = None


# The results' columns: the CSV's (device_ms: kernels and copies only, None where the trace has none), the table's.
CSV_FIELDS = ("workload", "system", "ms", "device_ms", "gb_per_s", "hbm_fraction", "tflops", "vs_jinsum",
              "vs_jinsum_device", "max_rel_error")
COLUMNS = (WORKLOAD, SYSTEM, Column("ms", "ms", "{:.3f}"), Column("device ms", "device_ms", "{:.3f}", "n/a"),
           Column("GB/s", "gb_per_s", "{:.0f}"), Column("of HBM", "hbm_fraction", "{:.0%}"),
           Column("TFLOP/s", "tflops", "{:.1f}"), Column("x jinsum", "vs_jinsum", "{:.2f}"),
           Column("x jinsum (device)", "vs_jinsum_device", "{:.2f}", "n/a"),
           Column("max rel. error", "max_rel_error", "{:.1e}"))


def _to_numpy(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return (x.to_dense() if x.is_sparse or x.layout != torch.strided else x).float().cpu().numpy()
    return np.asarray(x)


class Suite:
    def __init__(self, calls: int):
        self.calls = calls
        self.results = Results()
        self.device = device_name()
        self.copy_gbps = self._copy_bandwidth()
        self.matmul_tflops = self._fp16_matmul_rate()

    def _copy_bandwidth(self) -> float:
        x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
        seconds = time_calls(jax.jit(lambda x: x * 1.0001), x, calls=self.calls)
        return 2 * x.nbytes / seconds / 1e9

    def _fp16_matmul_rate(self) -> float:
        keys = jax.random.split(jax.random.key(0))
        a, b = (jax.random.normal(k, (8192, 8192), jnp.float16) for k in keys)
        seconds = time_calls(jax.jit(jnp.matmul), a, b, calls=self.calls)
        return 2 * 8192**3 / seconds / 1e12

    def run(self, workload: str, systems: dict, bytes_moved: float, flops: float | None = None) -> None:
        """Checks every system against the first peer, times each, records rows relative to jinsum.

        `systems`: name -> (fn, args, sync) or (fn, args, sync, to_host), `to_host` mapping the output to the
        peers' layout for the check (it is not timed).
        """
        reference = None
        results = {}
        for name, (fn, args, sync, *to_host) in systems.items():
            sync(fn(*args))  # compiles
            start = time.perf_counter()
            out = fn(*args)
            sync(out)
            slow = time.perf_counter() - start > 0.5  # e.g. BCOO on block SpMM: ~1 s a call; time 3 single calls
            value = to_host[0](out) if to_host else _to_numpy(out)
            if reference is None and name != "jinsum":
                reference = value
            calls, rounds = (1, 3) if slow else (self.calls, 5)
            seconds = time_calls(fn, *args, calls=calls, rounds=rounds, warmup=1, sync=sync)
            results[name] = (value, seconds, device_time(fn, *args, calls=calls, warmup=0, sync=sync))
        reference = reference if reference is not None else results["jinsum"][0]
        _, base, base_device = results["jinsum"]
        for name, (value, seconds, device) in results.items():
            gbps = bytes_moved / seconds / 1e9
            self.results.record(workload, name, 1e3 * seconds, device_ms=device and 1e3 * device, gb_per_s=gbps,
                                hbm_fraction=gbps / self.copy_gbps, tflops=flops / seconds / 1e12 if flops else None,
                                vs_jinsum=seconds / base, vs_jinsum_device=ratio(device, base_device),
                                max_rel_error=relative_error(value, reference))


def _graph(name: str) -> tuple[np.ndarray, int]:
    if name == "pubmed":
        data = load_planetoid("pubmed")
        return data.edge_index, data.num_nodes
    if name.startswith("uniform"):  # the R-MAT graph's size, its edges spread evenly: no hubs
        edges, n = _graph(name.replace("uniform", "rmat"))
        return np.random.default_rng(2).integers(0, n, edges.shape, dtype=np.int32), n
    scale = int(name.removeprefix("rmat"))
    return rmat(scale, 16), 1 << scale


def deterministic(fn):
    """`fn` called in jinsum's deterministic mode (traced in it, and looked up in jit's cache under it)."""
    def call(*args):
        with jinsum.deterministic(True):
            return fn(*args)
    return call


def spmm_and_sddmm(suite: Suite, graph: str, features: list[int]) -> None:
    edges, n = _graph(graph)
    rng = np.random.default_rng(0)
    values = rng.random(edges.shape[1], dtype=np.float32)
    A = jinsum.GroupCOO.from_edge_index(edges, values, num_nodes=n)
    A_transposed = A.with_transpose()
    csr = sp.csr_matrix((values, (edges[1], edges[0])), shape=(n, n))
    csr.sum_duplicates()
    csr.sort_indices()
    nnz = csr.nnz
    bcoo = sparse.BCOO.from_scipy_sparse(csr)
    rows = jnp.asarray(np.repeat(np.arange(n, dtype=np.int32), np.diff(csr.indptr)))
    cols, vals = jnp.asarray(csr.indices), jnp.asarray(csr.data)
    stored = _stored_slots(A, csr)
    print(f"{graph}: {n} nodes, {nnz} nonzeros, {A}", flush=True)
    torch_csr = None
    if torch is not None:
        torch_csr = torch.sparse_csr_tensor(torch.from_numpy(csr.indptr.astype(np.int64)),
                                            torch.from_numpy(csr.indices.astype(np.int64)),
                                            torch.from_numpy(csr.data), size=(n, n), device="cuda")
    for f in features:
        B = jnp.asarray(rng.standard_normal((n, f), dtype=np.float32))
        systems = {
            # Every system takes its sparse operand as an argument (closed-over arrays would be constant-folded).
            "segment_sum (sorted)": (jax.jit(lambda vals, cols, rows, B: jax.ops.segment_sum(
                vals[:, None] * B[cols], rows, num_segments=n, indices_are_sorted=True)), (vals, cols, rows, B),
                jax.block_until_ready),
            "jinsum": (jax.jit(lambda A, B: A @ B), (A, B), jax.block_until_ready),
            "jinsum, deterministic": (deterministic(jax.jit(lambda A, B: A @ B)), (A, B), jax.block_until_ready),
            "jax.experimental.sparse BCOO": (jax.jit(lambda M, B: M @ B), (bcoo, B), jax.block_until_ready),
        }
        if n * n * 4 < 8e9:
            dense = jnp.asarray(csr.toarray())
            systems["dense matmul (XLA)"] = (jax.jit(jnp.matmul), (dense, B), jax.block_until_ready)
        if torch_csr is not None:
            tB = torch.from_numpy(np.asarray(B)).cuda()
            systems["cuSPARSE CSR (torch.sparse)"] = (lambda B: torch_csr @ B, (tB,), sync_torch)
        compulsory = nnz * 8 + (n + 1) * 4 + 2 * n * f * 4
        print(f" SpMM fp32 {graph} F={f}", flush=True)
        suite.run(f"SpMM fp32 {graph} F={f}", systems, compulsory)
        del systems

        # The SpMM's gradient with respect to B: dB = A^T dC. jinsum's transpose rule runs it over the entries in
        # column order when the format carries them (`with_transpose`), else as an atomic scatter; the peer is a
        # sorted segment_sum over the transpose's arrays, sorted on the host as well.
        csc = csr.tocsc()
        t_rows = jnp.asarray(np.repeat(np.arange(n, dtype=np.int32), np.diff(csc.indptr)))
        t_cols, t_vals = jnp.asarray(csc.indices), jnp.asarray(csc.data)

        def transpose(A, C, f=f):
            return jax.linear_transpose(lambda B: A @ B, jax.ShapeDtypeStruct((n, f), jnp.float32))(C)[0]

        systems = {
            "segment_sum over A^T (sorted)": (jax.jit(lambda vals, cols, rows, C: jax.ops.segment_sum(
                vals[:, None] * C[cols], rows, num_segments=n, indices_are_sorted=True)), (t_vals, t_cols, t_rows, B),
                jax.block_until_ready),
            "jinsum": (jax.jit(transpose), (A_transposed, B), jax.block_until_ready),
            "jinsum, atomic scatter (no column order)": (jax.jit(transpose), (A, B), jax.block_until_ready),
            "jinsum, deterministic": (deterministic(jax.jit(transpose)), (A_transposed, B), jax.block_until_ready),
            "jinsum, deterministic, sorted scatter (no column order)": (deterministic(jax.jit(transpose)), (A, B),
                                                                         jax.block_until_ready),
        }
        if torch_csr is not None:
            torch_csr_t = torch_csr.t().to_sparse_csr()
            systems["cuSPARSE CSR of A^T (torch.sparse)"] = (lambda C: torch_csr_t @ C, (tB,), sync_torch)
        print(f" SpMM transpose fp32 {graph} F={f}", flush=True)
        suite.run(f"SpMM transpose (A^T dC) fp32 {graph} F={f}", systems, compulsory)
        del systems

        X = jnp.asarray(rng.standard_normal((n, f), dtype=np.float32))
        Y = jnp.asarray(rng.standard_normal((n, f), dtype=np.float32))
        pattern = A.with_values(jnp.ones_like(A.Av))
        indices = jnp.stack([rows, cols], axis=1)
        systems = {
            "gather idiom": (jax.jit(lambda rows, cols, X, Y: jnp.sum(X[rows] * Y[cols], axis=1)), (rows, cols, X, Y),
                             jax.block_until_ready),
            "jinsum": (jax.jit(lambda A, X, Y: jinsum.einsum("ij,ik,jk->ij", A, X, Y).Av), (pattern, X, Y),
                       jax.block_until_ready, lambda Sv: np.asarray(Sv).reshape(-1)[stored]),
            "jax.experimental.sparse bcoo_dot_general_sampled": (jax.jit(
                lambda indices, X, Y: sparse.bcoo_dot_general_sampled(X, Y, indices,
                                                                      dimension_numbers=(([1], [1]), ([], [])))),
                (indices, X, Y), jax.block_until_ready),
        }
        if torch_csr is not None:
            mask = torch.sparse_csr_tensor(torch_csr.crow_indices(), torch_csr.col_indices(),
                                           torch.ones_like(torch_csr.values()), size=(n, n))
            tX, tY = (torch.from_numpy(np.asarray(a)).cuda() for a in (X, Y))
            systems["torch.sparse.sampled_addmm"] = (
                lambda X, Y: torch.sparse.sampled_addmm(mask, X, Y.T, beta=0.0).values(), (tX, tY), sync_torch)
        print(f" SDDMM fp32 {graph} F={f}", flush=True)
        suite.run(f"SDDMM fp32 {graph} F={f}", systems, nnz * 12 + 2 * n * f * 4)
        del systems


def _stored_slots(A: jinsum.GroupCOO, csr: sp.csr_matrix) -> np.ndarray:
    """Which of the format's G*P slots hold a stored entry (not group padding), in CSR order: a row's entries fill
    its groups in column order, then the last group is padded."""
    lengths = np.diff(csr.indptr)
    rows = np.asarray(A.Ai)
    first_group = np.searchsorted(rows, rows, side="left")
    position = (np.arange(len(rows)) - first_group)[:, None] * A.group_size + np.arange(A.group_size)
    return (position < lengths[rows][:, None]).reshape(-1)


def block_spmm(suite: Suite, densities: list[float], size: int = 4096, block: int = 32) -> None:
    rng = np.random.default_rng(1)
    grid = size // block
    for density in densities:
        mask = rng.random((grid, grid)) < density
        block_rows, block_cols = np.nonzero(mask)
        data = rng.standard_normal((len(block_rows), block, block)).astype(np.float16).astype(np.float32)
        bsr = sp.bsr_matrix((data, block_cols, np.searchsorted(block_rows, np.arange(grid + 1))),
                            shape=(size, size))  # SciPy has no float16: values are float16-exact float32
        A = jinsum.BlockGroupCOO.from_scipy(bsr, block_shape=(block, block), dtype=jnp.float16)
        B = jnp.asarray(rng.standard_normal((size, size)).astype(np.float16))
        dense = jnp.asarray(bsr.toarray(), jnp.float16)
        systems = {
            "dense matmul fp16 (cuBLAS)": (jax.jit(jnp.matmul), (dense, B), jax.block_until_ready),
            "jinsum": (jax.jit(lambda A, B: A @ B), (A, B), jax.block_until_ready),
            "jax.experimental.sparse BCOO": (jax.jit(lambda M, B: M @ B), (sparse.BCOO.fromdense(dense), B),
                                             jax.block_until_ready),
        }
        if torch is not None:
            from torch.sparse._triton_ops import bsr_dense_mm  # noqa: PLC0415

            t_bsr = torch.from_numpy(bsr.toarray()).cuda().half().to_sparse_bsr((block, block))
            systems["torch bsr_dense_mm (Triton)"] = (bsr_dense_mm, (t_bsr, torch.from_numpy(np.asarray(B)).cuda()),
                                                      sync_torch)
        stored = len(block_rows) * block * block
        print(f" Block SpMM fp16 {size}^3 {block}x{block} density {density:.0%} ({A})", flush=True)
        suite.run(f"Block SpMM fp16 {size}^3 {block}x{block} {density:.0%}", systems,
                  stored * 2 + 2 * size * size * 2, flops=2 * stored * size)


def write_results(suite: Suite, out: pathlib.Path, started: float) -> None:
    preamble = (f"{versions_text(('jinsum', 'torch'))}; measured copy bandwidth {suite.copy_gbps:.0f} GB/s, dense fp16 "
                f"matmul {suite.matmul_tflops:.0f} TFLOP/s; {time.time() - started:.0f} s. ms: median of 5 rounds of "
                "back-to-back calls, one sync per round (host dispatch included: it bounds the small workloads). "
                "device ms: the GPU's kernel and copy time per call, from a profiler trace. GB/s: compulsory bytes / "
                "ms. x jinsum: time / jinsum's time (above 1: jinsum faster).")
    write(out / device_file_name(), f"jinsum benchmarks on {suite.device}", [preamble], COLUMNS, suite.results.rows,
          csv_fields=CSV_FIELDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="PubMed and R-MAT 17 only, one block density")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    started = time.time()
    suite = Suite(args.calls)
    print(f"{suite.device}: copy {suite.copy_gbps:.0f} GB/s, fp16 matmul {suite.matmul_tflops:.0f} TFLOP/s")
    for graph in ["pubmed", "rmat17", "uniform17"] + ([] if args.quick else ["rmat20"]):
        spmm_and_sddmm(suite, graph, [32, 128] if args.quick else [32, 128, 256])
    block_spmm(suite, [0.05] if args.quick else [0.05, 0.20])
    write_results(suite, args.out, started)


if __name__ == "__main__":
    main()

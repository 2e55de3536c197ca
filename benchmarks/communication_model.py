"""How far the row split scales: bytes each device receives per GCN training step on 2 to 512 GPUs, from the graph.

    python benchmarks/communication_model.py [--scale 22] [--step-ms 50.5]

With rows dealt to D devices at random (what `jinsum.shard.partition(split="dealt")` does to a graph without
locality), a node whose features go to `k` distinct destinations is needed by a given other device with
probability `1 - (1 - 1/D)^k`; the expected rows a device receives per product are the sum over the other devices'
nodes. A 2-layer GCN step (widths 256 and 40, float32) exchanges each such row once per layer forward and once
backward: 2 * (256 + 40) * 4 bytes. Against it: the compute of one device, the single-GPU step (measured: 50.5 ms
on an H200 at scale 22, benchmarks/results/sharded_2x_NVIDIA_H200_rmat22.md) over D, and the link: NVLink within a
node of 8 (~450 GB/s per GPU and direction), InfiniBand between nodes (~50 GB/s per GPU, 400 Gb/s NICs).
"""

from __future__ import annotations

import argparse

import numpy as np

from jinsum.datasets import rmat

from _harness import Column, markdown_table, text  # (benchmarks/, this script's folder)

BYTES_PER_ROW = 2 * (256 + 40) * 4
COLUMNS = (Column("GPUs", "devices"), Column("rows received per device", "rows", "{:,.0f}"),
           Column("of its own rows", "of_own", "{:.2f}x"), Column("MB per device per step", "megabytes", "{:,.0f}"),
           text("link"), Column("exchange ms", "exchange_ms", "{:.2f}"), Column("compute ms", "compute_ms", "{:.2f}"),
           Column("exchange / compute", "exchange_over_compute", "{:.2f}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=22)
    p.add_argument("--step-ms", type=float, default=50.5, help="the single-GPU step this compute model divides")
    args = p.parse_args()
    edges = rmat(args.scale)
    nodes = 1 << args.scale
    out_degree = np.bincount(edges[0], minlength=nodes)  # distinct destinations of each source (no duplicates)
    print(f"R-MAT {args.scale}: {nodes} nodes, {edges.shape[1]} edges; 2-layer GCN 128 -> 256 -> 40, float32\n")
    rows = []
    for D in (2, 8, 64, 512):
        needed = (D - 1) / D * np.sum(1 - (1 - 1 / D) ** out_degree)
        link, bandwidth = ("NVLink", 450e9) if D <= 8 else ("InfiniBand", 50e9)
        exchange_ms = 1e3 * needed * BYTES_PER_ROW / bandwidth
        compute_ms = args.step_ms / D
        rows.append(dict(devices=D, rows=needed, of_own=needed / (nodes / D), megabytes=needed * BYTES_PER_ROW / 1e6,
                         link=link, exchange_ms=exchange_ms, compute_ms=compute_ms,
                         exchange_over_compute=exchange_ms / compute_ms))
    print("\n".join(markdown_table(COLUMNS, rows)))


if __name__ == "__main__":
    main()

"""Every example runs end to end in its smoke mode (tiny sizes, a few epochs) and prints its summary.

The examples run in this process (their `main(argv)`), which saves a Python and JAX start-up per example; together
they take about half a minute on two CPU cores.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from _common import free_port  # noqa: E402  (examples/_common.py)

# example -> (the argument of its main(), the systems it compares: each must have a line in the summary)
RUNS = {
    "gcn/main.py": (["--smoke"], ["jinsum GCNConv", "jax.experimental.sparse BCOO"]),
    "gat/main.py": (["--smoke"], ["jinsum GATConv", "gathers + jax.ops.segment_*"]),
    "graphsage_gin/main.py": (["--smoke", "--features", "16", "--hidden", "16"],
                              ["pubmed GraphSAGE jinsum", "pubmed GIN segment ops", "rmat8 GraphSAGE segment ops",
                               "rmat8 GIN jinsum", "pubmed GraphSAGE-max jinsum", "rmat8 GraphSAGE-max segment ops"]),
    "graph_classification/main.py": (["--smoke"], ["jinsum GINConv + global_add_pool", "plain JAX segment_sum (padded)",
                                                  "PyG DataLoader + GINConv"]),
    "rgcn/main.py": (["--smoke"], ["jinsum RGCNConv, 6 relations", "segment_sum RGCN, 6 relations",
                                   "jinsum RGCNConv, relations merged"]),
    # (run by test_minibatch_sage_in_one_process_and_in_two, beside its two-process run; fanouts (4, 3), not the
    # default (15, 10): the sampler unrolls a step per neighbour drawn, which XLA compiles three times over)
    "minibatch_sage/main.py": (["--smoke", "--steps-per-call", "2", "--fanouts", "4", "3"],
                               ["jinsum SAGEConv", "plain JAX segment_sum",
                                                                      "PyG SAGEConv (host sampler)",
                                                                      "jinsum SAGEConv, 4 devices (data parallel)"]),
    "block_sparse_attention/main.py": (["--smoke"], ["jinsum attention", "dense dot_product_attention"]),
    "sharded_gcn/main.py": (["--smoke", "--chunks", "2"], ["1 device:", "4 devices:", "speed-up"]),
    "spmm_cora.py": ([16], ["jinsum (A @ H)", "jax.experimental.sparse BCOO"]),
    "point_cloud/main.py": (["--smoke"], ["jinsum DynamicEdgeConv", "PyG EdgeConv + cdist kNN"]),
    "dlrm/main.py": (["--smoke"], ["jinsum EmbeddingBag, sparse rows", "jinsum EmbeddingBag, dense gradient",
                                   "plain JAX gather + segment_sum"]),
    "packed_lm/main.py": (["--smoke"], ["dense causal + document mask", "sliding window + document mask",
                                        "BigBird + document mask", "dense causal + document mask, MoE FFN"]),
    "sparse_mlp/main.py": (["--smoke", "--hidden", "32"],
                           ["jinsum SparseLinear, 10% of the weights", "dense nnx.Linear"]),
    # (run by test_serve_lm_caches_agree, which also checks the two caches' outputs)
    "serve_lm/main.py": (["--smoke"], ["paged KV cache", "dense KV cache"]),
}


def test_every_example_is_run():
    scripts = [*EXAMPLES.glob("*/main.py"), *(p for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))]
    assert {p.relative_to(EXAMPLES).as_posix() for p in scripts} == set(RUNS)


def _run_example(path: str, capsys) -> str:
    """`path`'s `main(RUNS[path][0])` in this process; checks its summary and returns what it printed."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(path).parent.name or Path(path).stem}",
                                                  EXAMPLES / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argument, systems = RUNS[path]
    module.main(argument)
    out = capsys.readouterr().out
    for system in systems:
        assert any(system in line for line in out.splitlines()), f"{path}: no summary line for {system!r}:\n{out}"
    assert not re.search(r"\bnan\b", out, re.IGNORECASE), out
    return out


@pytest.mark.parametrize("path", [path for path in RUNS if path not in ("minibatch_sage/main.py", "serve_lm/main.py")])
def test_example_smoke(path, capsys):
    _run_example(path, capsys)


def test_serve_lm_caches_agree(capsys):
    """Greedy decoding over the paged cache and the dense one gives the same bytes for every request, or differs
    first where the two largest logits tie within rounding (the example reports the gap)."""
    out = _run_example("serve_lm/main.py", capsys)
    tie = re.search(r"the two largest logits were (\S+) apart", out)
    assert "(same bytes, request by request)" in out or (tie and float(tie.group(1)) < 1e-4), out


def test_sharded_gcn_runs_as_two_processes():
    """The multi-host recipe of the README, on one machine: two processes of two CPU devices each (Gloo between
    them) train on one mesh of four, and each reports losses equal to its single-device run (else it exits 1)."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    processes = [subprocess.Popen([sys.executable, str(EXAMPLES / "sharded_gcn/main.py"), "--smoke", "--coordinator",
                                   f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    for i, (p, out) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, f"process {i}:\n{out}"
        assert f"process {i} of 2" in out and "4 devices:" in out and "largest loss difference" in out, out


def _last_loss(output: str, system: str) -> str:
    """The 'last loss' column of the example table's row for `system` (not its progress bar's lines)."""
    [row] = [line for line in output.splitlines() if line.startswith(system) and line.split()[-1].isdigit()]
    return row.split()[-2]


def test_minibatch_sage_in_one_process_and_in_two(capsys):
    """The example's smoke run in this process (every system; the data-parallel one over 4 CPU devices, two steps a
    call), and beside it the recipe for one process per device group: two processes of two CPU devices each (Gloo)
    train the data-parallel step over one mesh of four and end with the same loss."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    processes = [subprocess.Popen([sys.executable, str(EXAMPLES / "minibatch_sage/main.py"),
                                   *RUNS["minibatch_sage/main.py"][0], "--coordinator", f"localhost:{port}",
                                   "--num-processes", "2", "--process-id", str(i)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
    try:
        expected = _last_loss(_run_example("minibatch_sage/main.py", capsys),
                              "jinsum SAGEConv, 4 devices (data parallel)")
    except BaseException:
        for p in processes:
            p.kill()
        raise
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    for i, (p, out) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, f"process {i}:\n{out}"
        assert f"process {i} of 2" in out and "jinsum SAGEConv, 4 devices, 2 processes" in out, out
        assert abs(float(_last_loss(out, "jinsum SAGEConv, 4 devices, 2 processes")) - float(expected)) < 1e-5, out

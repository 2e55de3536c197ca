"""First calls: how long a new process takes to run its first jitted training step, cold and with a warm cache.

    python benchmarks/first_call.py [--scale 17] [--out benchmarks/results]

Models: GCN (128 -> 256 -> 40) and GAT (4 heads x 64, then 1 head) on an R-MAT graph made undirected (scale 17:
131k nodes, 3.7M edges), a full-batch training step (forward, backward, Adam). Systems: jinsum's layers, and the
same models on gathers + `jax.ops.segment_sum` (GCN, GAT: `examples/gat`) or a `jax.experimental.sparse` BCOO
(GCN). Each run is a new Python process that reports wall-clock seconds for:

- `import`: jax, flax, optax and jinsum; `context`: the first GPU array (CUDA context);
- `lower`: tracing and lowering, where jax-triton compiles every generated kernel (Triton's front end, then
  Triton's compiler down to PTX: both also reported on their own, by wrapping jax-triton's functions);
- `compile`: XLA; `first run`: the first call, where jaxlib assembles each new kernel's PTX (ptxas);
- `first step` = lower + compile + first run (the issue's measure; the graph is built on the host before it);
- `new statement`: one more SpMM with a feature width the step did not use (lower, compile, first run).

jinsum runs with one `JINSUM_CACHE_DIR` that starts empty: `cold`, then `second process`, which loads the
compiled kernels from jinsum's persistent cache; then twice more with JAX's persistent compilation cache as well
(`JAX_COMPILATION_CACHE_DIR`, empty at first): the second of those is a rerun that finds both caches warm. The
segment-op model runs the same way with JAX's cache. Kernels compiled and loaded, and front ends parsed, are
counted (`jinsum.kernel_cache_info()`). Results go to `--out` as `first_call_<device>.{md,csv}`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
STAGES = ("import", "context", "lower", "front end", "Triton compiler", "compile", "first run", "first step",
          "new statement")


def child(model_name: str, system: str, scale: int) -> dict:
    """One measurement, in this (new) process."""
    started = time.perf_counter()
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: F401, PLC0415 (timed with the other imports)
    from flax import nnx  # noqa: PLC0415
    from _training import train_step  # noqa: PLC0415 (benchmarks/, this script's folder)

    import jinsum  # noqa: PLC0415
    import jinsum.nn as jnn  # noqa: PLC0415
    from jinsum.datasets import rmat  # noqa: PLC0415

    times = {"import": time.perf_counter() - started}
    clock = time.perf_counter()
    jnp.zeros(1).block_until_ready()
    times["context"] = time.perf_counter() - clock

    nodes = 1 << scale
    edge_index = rmat(scale, seed=0, undirected=True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((nodes, 128)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 40, nodes).astype(np.int32))
    model, graph = _model(model_name, system, edge_index, nodes, nnx, jnp, jnn)

    front, back = _instrument() if system == "jinsum" and jax.devices()[0].platform == "gpu" else ({}, {})
    step, state = train_step(model, 0.01)

    clock = time.perf_counter()
    lowered = jax.jit(step).lower(state, x, y, graph)
    times["lower"] = time.perf_counter() - clock
    times["front end"], times["Triton compiler"] = front.get("seconds"), back.get("seconds")
    clock = time.perf_counter()
    compiled = lowered.compile()
    times["compile"] = time.perf_counter() - clock
    clock = time.perf_counter()
    jax.block_until_ready(compiled(state, x, y, graph))
    times["first run"] = time.perf_counter() - clock
    times["first step"] = times["lower"] + times["compile"] + times["first run"]
    clock = time.perf_counter()
    jax.block_until_ready(compiled(state, x, y, graph))
    second = time.perf_counter() - clock
    result = dict(times=times, second_run=second)
    if system == "jinsum":
        result["kernels"] = {k: v for k, v in jinsum.kernel_cache_info().items()
                             if k in ("compiled", "loaded", "parsed")}
        features = jnp.ones((nodes, 48), jnp.float32)
        clock = time.perf_counter()
        jax.block_until_ready(jax.jit(lambda A, B: A @ B)(graph, features))
        times["new statement"] = time.perf_counter() - clock
    return result


def _model(model_name, system, edge_index, nodes, nnx, jnp, jnn):
    import jinsum.graphs as jg  # noqa: PLC0415 (imported in the timed child, as jnn)

    sys.path.insert(0, str(HERE.parent / "examples"))
    if model_name == "GAT":
        import importlib.util  # noqa: PLC0415

        spec = importlib.util.spec_from_file_location("gat_example", HERE.parent / "examples" / "gat" / "main.py")
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        conv = jnn.GATConv if system == "jinsum" else example.SegmentGATConv
        graph = (jg.adjacency(edge_index, nodes) if system == "jinsum"
                 else example.edges_with_self_loops(edge_index, nodes))
        return example.GAT(conv, 128, 40, heads=4, hidden=64, dropout=0.6, rngs=nnx.Rngs(0)), graph
    from gcn.main import GCN, BCOOGCNConv  # noqa: PLC0415

    if system == "jinsum":
        return GCN(jnn.GCNConv, 128, 256, 40, dropout=0.5, rngs=nnx.Rngs(0)), jg.adjacency(edge_index, nodes)
    from _training import segment_convs, segment_graph  # noqa: PLC0415

    graph = segment_graph(edge_index, nodes, self_loops=True)
    if system == "BCOO":
        from jax.experimental import sparse  # noqa: PLC0415

        src, dst, weight = graph
        A_hat = sparse.BCOO((weight, jnp.stack([dst, src], 1)), shape=(nodes, nodes))
        return GCN(BCOOGCNConv, 128, 256, 40, dropout=0.5, rngs=nnx.Rngs(0)), A_hat
    SegmentGCNConv, _ = segment_convs()
    return GCN(SegmentGCNConv, 128, 256, 40, dropout=0.5, rngs=nnx.Rngs(0)), graph


def _instrument():
    """Seconds in Triton's front end and in Triton's compiler (or jinsum's cache in front of it), by wrapping
    the functions jax-triton calls."""
    from jinsum._lowering._launch import jax_triton  # noqa: PLC0415

    triton_lib = jax_triton().triton_lib
    totals = ({"seconds": 0.0}, {"seconds": 0.0})
    for owner, name, total in ((triton_lib.code_gen, "ast_to_ttir", totals[0]),
                               (triton_lib, "compile_ttir_inplace", totals[1])):
        original = getattr(owner, name)

        def timed(*args, original=original, total=total, **kwargs):
            clock = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                total["seconds"] += time.perf_counter() - clock

        setattr(owner, name, timed)
    return totals


def run_child(model: str, system: str, scale: int, env: dict) -> dict | None:
    clock = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", model, system, "--scale", str(scale)],
                          env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - clock
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
        return None
    return {**json.loads(lines[-1]), "process": wall}


def runs(model: str) -> list[tuple[str, str, bool]]:
    """(system, when, with JAX's compilation cache) in order. Each cache starts empty for each model; a process
    that only fills JAX's cache for the next one is a row too (`filling JAX's cache`)."""
    peers = ("segment ops", "BCOO") if model == "GCN" else ("segment ops",)
    rows = [("jinsum", "cold", False), ("jinsum", "second process", False),
            ("jinsum", "filling JAX's cache", True), ("jinsum", "second process, JAX's cache too", True)]
    for peer in peers:
        rows += [(peer, "", False)]
    rows += [("segment ops", "filling JAX's cache", True), ("segment ops", "second process, JAX's cache", True)]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=17)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "SYSTEM"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.scale)))
        return
    rows = []
    for model in ("GCN", "GAT"):
        with tempfile.TemporaryDirectory() as kernels, tempfile.TemporaryDirectory() as xla:
            for system, when, jax_cache in runs(model):
                env = {"JINSUM_CACHE_DIR": kernels}
                if jax_cache:  # JAX's persistent compilation cache, for every executable however quick to compile
                    env.update(JAX_COMPILATION_CACHE_DIR=xla, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
                result = run_child(model, system, args.scale, env)
                row = dict(model=model, system=f"{system} ({when})" if when else system)
                if result:
                    row.update(result["times"], process=result["process"], second_run=result["second_run"],
                               **{f"kernels {k}": v for k, v in result.get("kernels", {}).items()})
                rows.append(row)
                print(row, flush=True)
    write_results(rows, args.out, args.scale)


def write_results(rows: list[dict], out: pathlib.Path, scale: int) -> None:
    # (imported here, not above: a child process of this script times its own import of jax and NumPy)
    from _harness import Column, device_file_name, device_name, text, versions_text, write  # noqa: PLC0415

    seconds = [Column(stage, stage, "{:.2f}") for stage in ("process", *STAGES, "second_run")]
    kernels = [Column(f"kernels {count}", f"kernels {count}") for count in ("compiled", "loaded", "parsed")]
    columns = [text("model"), text("system"), *seconds, *kernels]
    preamble = (f"{versions_text(('jaxlib', 'triton', 'jax_triton'))}; R-MAT scale {scale} made undirected; "
                "`python benchmarks/first_call.py`. Seconds of wall clock, each row a new process (see the script's "
                "docstring).")
    write(out / f"first_call_{device_file_name()}", f"First calls on {device_name()}", [preamble], columns, rows,
          csv_fields=[c.key for c in columns])


if __name__ == "__main__":
    main()

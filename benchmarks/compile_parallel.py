"""Compile time of generated kernels, one after another against several at once: threads, then processes. No GPU
needed: the kernels (grouped products in the Hopper form, Gluon) are compiled for sm_90a, as on an H100 or H200.

    python benchmarks/compile_parallel.py [--kernels 24] [--workers 2]

Each kernel is a new source (a comment of its own in its body), compiled into a fresh Triton cache, so every
compile is cold. A failed compile is reported, not hidden: Triton's front end is not safe to run from threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("serial", "threads", "processes")


def _payloads(count: int) -> list[tuple[str, dict, dict]]:
    """`count` distinct kernels (source, signature, constants): the Hopper forms of four grouped products."""
    import jinsum  # noqa: PLC0415
    from jinsum._frontend import _einsum  # noqa: PLC0415
    from jinsum._lowering._route import route  # noqa: PLC0415
    from jinsum._rules import _primitive  # noqa: PLC0415
    from jinsum.kernels import KernelConfig, generate, kernel_inputs  # noqa: PLC0415

    types = {"bfloat16": "*bf16", "float16": "*fp16", "int32": "*i32"}
    found = []
    shapes = ((jnp.bfloat16, 128, 256, 384), (jnp.float16, 64, 128, 128), (jnp.bfloat16, 64, 512, 256))
    for dtype, rows, k, n in shapes:
        operands = dict(Ak=np.zeros((6, rows), np.int32), Ai=np.arange(6, dtype=np.int32) // 2,
                        X=jnp.zeros((500, k), dtype), W=jnp.zeros((3, k, n), dtype),
                        H=jax.ShapeDtypeStruct((6, rows, n), dtype))
        statement, arrays, flags = _einsum.prepare("H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]", operands,
                                                   sorted_indices=("Ai",), allow_tf32=None)
        with jinsum.small_terms(0):
            plan = route(_primitive.make_spec(statement, arrays, **flags), config=KernelConfig(hopper=True)).plan
        signature = {f"p_{name}": types[str(plan.spec.operand[name].dtype)] for name in kernel_inputs(plan)}
        signature |= {"p_out": types[str(plan.spec.lhs.dtype)], "scratch": "*u8"}
        constants = dict(BLOCK_M=plan.config.block_m, BLOCK_N=plan.config.block_n, BLOCK_K=64, WINDOW=1,
                         NUM_STAGES=plan.config.num_stages) | plan.sizes
        found.append((generate(plan), signature, constants))
    marked = []
    for i in range(count):  # (a comment in the kernel's body changes its hash: a new kernel to Triton)
        source, signature, constants = found[i % len(found)]
        marked.append((source.replace('):\n    """', f'):\n    # copy {i}\n    """', 1), signature, constants))
    return marked


def compile_one(payload: tuple[str, dict, dict]) -> int:
    """Compiles one kernel for sm_90a; returns its PTX's length."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415

    from jinsum.kernels import load_kernel  # noqa: PLC0415

    source, signature, constants = payload
    kernel = load_kernel(source)
    signature = signature | {name: "constexpr" for name in constants}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
             if kind.startswith("*")}
    compiled = triton.compile(GluonASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return len(compiled.asm["ptx"])


def run(kind: str, payloads, workers: int) -> tuple[float, int]:
    """Seconds to compile `payloads` the `kind` way, and how many compiles failed."""
    start = time.perf_counter()
    if kind == "serial":
        results = []
        for payload in payloads:
            try:
                results.append(compile_one(payload))
            except Exception:  # noqa: BLE001 (counted)
                results.append(None)
    else:
        pool = (concurrent.futures.ThreadPoolExecutor(workers) if kind == "threads" else
                concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")))
        with pool:
            futures = [pool.submit(compile_one, payload) for payload in payloads]
            results = [None if f.exception() else f.result() for f in futures]
    return time.perf_counter() - start, sum(r is None for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    for kind in KINDS:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TRITON_CACHE_DIR"] = cache  # (cold compiles; spawned workers inherit it)
            payloads = [(s.replace("# copy", f"# {kind} copy"), sig, c) for s, sig, c in _payloads(args.kernels)]
            seconds, failed = run(kind, payloads, args.workers)
        print(f"{kind:10s} {args.kernels} kernels, {args.workers if kind != 'serial' else 1} at once: "
              f"{seconds:5.1f} s" + (f", {failed} failed" if failed else ""), flush=True)


if __name__ == "__main__":
    main()

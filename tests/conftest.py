import gc
import importlib.metadata
import os
import zlib

# The sharding tests (tests/test_shard.py) split work over 4 devices: on a CPU, XLA pretends to have them. This must
# be set before JAX starts its backends; other tests run on the first device as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# Two test workers on two cores: a worker's torch (Triton's interpreter, the PyG references) and NumPy's BLAS take one
# thread each, as do the examples' subprocesses. With a thread per core, each operation waited at its threads' barrier
# for a core the other worker held (a PyG step of point_cloud's smoke run 30x slower than on one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CPU runs spend most of their time compiling small programs: XLA's older elemental emitter compiles them in ~30% less
# time than its MLIR fusion emitters (test_shard.py's layer tests: 31 -> 22 s of CPU). jaxlib 0.11's XLA no longer
# has the flag and refuses to start with it, on any platform.
if (tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) < (0, 11)
        and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

import jax  # noqa: E402
import numpy as np
import pytest
from hypothesis import settings

# CI draws the same property-based examples every run (a red CI then means a change broke something, not that a
# new example was drawn); elsewhere each run draws new ones, and a failure prints the seed to reproduce it.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Without a GPU, generated Triton kernels run in Triton's interpreter (on torch CPU tensors). This must be set
# before any @triton.jit function is defined, hence here, before the test modules import jinsum's kernels.
ON_GPU = any(d.platform == "gpu" for d in jax.devices())
# On a GPU, statements too small for a kernel to pay run on XLA's lowering (`jinsum.small_terms`, read from this
# variable when jinsum is imported); the tests' inputs are all small, and they are there to test the kernels.
os.environ.setdefault("JINSUM_SMALL_TERMS", "0")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_the_language_once_per_kernel():
    """Triton's interpreter patches `triton.language` for the interpreter when a kernel starts (undone when it ends),
    and again at every call of a `@triton.jit` helper inside it: each call walked the language's members anew, ~20%
    of the interpreter's time (tests/test_reductions.py: 50 -> 41 s). Within one kernel's run, a helper whose globals
    name the language modules already patched in that run finds nothing to change, so that walk is skipped; a helper
    naming another (`triton.language.core`) still patches it the first time. Triton's own code otherwise unchanged."""
    import threading  # noqa: PLC0415  (only here)

    import triton.language as tl  # noqa: PLC0415  (after TRITON_INTERPRET: @triton.jit reads it at definition)
    from triton.runtime import interpreter  # noqa: PLC0415

    patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    run = threading.local()  # (the language modules patched in the kernel this thread is running)

    class Unchanged:
        def restore(self):
            pass

    def patch_lang_once(fn):
        languages = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        patched = getattr(run, "patched", None)
        if patched is not None and languages in patched:
            return Unchanged()
        scope = patch_lang(fn)
        if patched is not None:
            patched.add(languages)
        return scope

    def run_grid_patching_once(self, *args, **kwargs):
        run.patched = set()
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            run.patched = None

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = run_grid_patching_once


if not ON_GPU:
    _patch_the_language_once_per_kernel()


def pytest_configure(config):
    """CPU runs (CI's) are mostly XLA compiling small programs that then run for microseconds: compile them fast.

    No JAX compilation cache is shared between the workers: at these compile times reading an entry costs about
    what compiling it does, and writing every program cost more than the hits saved (the whole suite 508 -> 493 s
    on 2 cores without it)."""
    if ON_GPU:
        return
    # LLVM's -O0 (JAX's `jax_disable_most_optimizations`) compiles them in about half the time (test_shard.py: 197 ->
    # 161 s on 2 cores). Set in the environment too, for the examples' subprocesses (tests/test_examples.py).
    if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
        jax.config.update("jax_disable_most_optimizations", True)


def pytest_collection_finish(session):
    """Python's cyclic garbage collector less often (every 20,000 allocations, not 700), and never over the
    modules and test items collected by now: tracing, lowering and Triton's interpreter allocate millions of
    short-lived objects, and the default thresholds spent ~6% of a run collecting (memory unchanged)."""
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


@pytest.fixture(autouse=True)
def float32_products():
    """On GPUs, float32 products in float32's accuracy, as the tests' tolerances and float64 references assume:
    jinsum (as `jnp.dot`) follows `jax.default_matmul_precision`, which is TensorFloat-32 by default there. The
    TensorFloat-32 default itself is tested on its own (`test_gpu.py`). (CPUs multiply float32 exactly either way.)"""
    if not ON_GPU:
        yield
        return
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture
def rng(request):
    """A generator seeded per test, so every test draws fresh but reproducible inputs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

import os
import zlib

# The sharding tests (tests/test_shard.py) split work over 4 devices: on a CPU, XLA pretends to have them. This must
# be set before JAX starts its backends; other tests run on the first device as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

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
# On a GPU, statements too small for a kernel to pay run on XLA's lowering (`jinsum._lowering._route.SMALL_TERMS`);
# the tests' inputs are all small, and they are there to test the kernels.
os.environ.setdefault("JINSUM_SMALL_TERMS", "0")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


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

import os
import zlib

import jax
import numpy as np
import pytest

# Without a GPU, generated Triton kernels run in Triton's interpreter (on torch CPU tensors). This must be set
# before any @triton.jit function is defined, hence here, before the test modules import jinsum's kernels.
ON_GPU = any(d.platform == "gpu" for d in jax.devices())
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def rng(request):
    """A generator seeded per test, so every test draws fresh but reproducible inputs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

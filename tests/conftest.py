import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A generator seeded per test, so every test draws fresh but reproducible inputs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

"""jinsum.timing: the device time read from a profiler trace is the kernels' time, not the host's."""

import jax
import jax.numpy as jnp
import pytest

from jinsum.timing import device_time, time_calls


def test_device_time_is_none_without_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert device_time(jax.jit(lambda x: 2 * x), jnp.ones(1000)) is None


@pytest.mark.gpu
def test_device_time_of_a_copy_is_bound_by_memory_bandwidth():
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB read, 1 GiB written: about 0.7 ms at 3 TB/s
    double = jax.jit(lambda x: 2 * x)
    device, host = device_time(double, x), time_calls(double, x)
    # No faster than HBM allows (5 TB/s: above an H200's 4.8), no slower than the host sees.
    assert 2 * x.nbytes / 5e12 < device <= host * 1.05
    small = jnp.ones(1000)
    assert device_time(double, small) < 0.2 * time_calls(double, small)  # tiny: dispatch-bound on the host

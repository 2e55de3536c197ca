"""jinsum.timing: the device time read from a profiler trace is the kernels' time, not the host's."""

import time

import jax
import jax.numpy as jnp
import pytest

from jinsum.timing import device_time, time_calls, time_interleaved


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


def test_interleaved_rounds_take_the_systems_in_turn():
    """Each system warms up, then every round runs each one's `calls` calls in a block, starting one later each
    round; the medians are per system (a slow system stays slow however the rounds fall)."""
    order = []

    def system(name, seconds):
        def run():
            order.append(name)
            time.sleep(seconds)
            return name
        return run

    times = time_interleaved({"a": system("a", 0.0), "b": system("b", 0.004), "c": system("c", 0.0)}, calls=2,
                             rounds=3, warmup=1, sync=lambda out: out)
    assert order[:3] == ["a", "b", "c"]  # warm-up
    blocks = ["".join(order[3 + 2 * i: 5 + 2 * i]) for i in range(9)]
    assert blocks == ["aa", "bb", "cc", "bb", "cc", "aa", "cc", "aa", "bb"]
    assert times["b"] >= 0.004 > max(times["a"], times["c"])

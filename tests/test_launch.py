"""The one launcher (`jinsum._lowering._launch`): a kernel that makes TMA descriptors on the device runs with the
scratch memory the launch provides, in Triton's interpreter here and through XLA's kernel node on a GPU (`pytest -m
gpu`), and its PTX is redirected to that scratch, or refused with the fix where the launch gave none."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinsum._lowering import _launch

from conftest import ON_GPU

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _double_by_descriptors(x_ptr, M, N, y_ptr, scratch, BM: tl.constexpr, BN: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    x = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    y = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    y.store([pid_m * BM, pid_n * BN], x.load([pid_m * BM, pid_n * BN]) * 2)


def _double(launcher, x, block=16):
    m, n = x.shape
    return launcher.call(_double_by_descriptors, x, m, n, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(-(-m // block), -(-n // block)), num_warps=4, num_stages=1, name="double",
                         global_scratch=256, BM=block, BN=block)


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")
def test_descriptors_in_the_interpreter(rng):
    """NumPy arrays, and traced ones through a host callback; edges past the blocks (50 x 40 by 16) are masked."""
    pytest.importorskip("torch")
    x = rng.standard_normal((50, 40)).astype(np.float32)
    np.testing.assert_array_equal(_double(_launch.INTERPRETER, x), 2 * x)
    np.testing.assert_array_equal(jax.jit(lambda x: _double(_launch.INTERPRETER, x))(x), 2 * x)


PTX = """.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u64 .ptr .global .align 1 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2,
\t.param .u64 .ptr .global .align 1 k_param_3
)
{
\tld.param.u64 %rd1, [k_param_0];
\tld.param.u64 %rd2, [k_param_2];
}"""


def test_unread_parameters_go_where_the_launch_passes_their_operands():
    """A launch through XLA's kernel node passes every operand, zeros that an output is aliased to included, so the
    PTX declares a parameter for each where it is passed (after the inputs); the code still reads its own by name."""
    ptx = _launch.with_unread_parameters(PTX, 1, 2)
    declared = re.findall(r"\.param \.u64 \.ptr \.global \.align 1 (\w+)", ptx)
    assert declared == ["k_param_0", "k_param_unread_0", "k_param_unread_1", "k_param_1", "k_param_2", "k_param_3"]
    assert ptx.split("{", 1)[1] == PTX.split("{", 1)[1]
    assert _launch.with_unread_parameters(PTX, 1, 0) is PTX


def test_the_ptx_reads_the_launch_s_scratch():
    """Parameters: x, the explicit scratch, then Triton's hidden global and profile scratch. The hidden global
    scratch's reads move to the explicit one; a kernel that reads none is left alone; one that reads it without a
    scratch operand is refused with the fix."""
    redirected = _launch.redirect_global_scratch(PTX, has_scratch=True)
    assert "[k_param_1]" in redirected and "[k_param_2]" not in redirected and "[k_param_0]" in redirected
    untouched = PTX.replace("[k_param_2]", "[k_param_0]")
    assert _launch.redirect_global_scratch(untouched, has_scratch=False) is untouched
    with pytest.raises(ValueError, match=r"kernel k makes TMA descriptors on the device.*global_scratch="):
        _launch.redirect_global_scratch(PTX, has_scratch=False)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_descriptors_through_the_kernel_node(rng):
    """On a GPU the kernel runs from the launch's scratch (jaxlib alone passes a null pointer: an illegal
    address), in bfloat16 tiles of 64 over an array that is not a multiple of them."""
    x = jnp.asarray(rng.standard_normal((1000, 520)), jnp.bfloat16)
    y = jax.jit(lambda x: _double(_launch.XLA_KERNEL, x, block=64))(x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), 2 * np.asarray(x, np.float32))


@triton.jit
def _copy_without_scratch(x_ptr, n, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def test_a_scratch_launch_needs_its_parameter_and_a_name_of_its_own():
    """Refused before anything compiles: a scratch launch of a kernel whose last parameter is not `scratch`, and
    one name launched both with and without scratch (the redirect would not know which PTX is which)."""
    x = jnp.zeros(8)

    def launch(kernel, **scratch):
        return _launch.XLA_KERNEL.call(kernel, x, 8, out_shape=jax.ShapeDtypeStruct((8,), x.dtype), grid=(1,),
                                       num_warps=1, num_stages=1, name="copy", BLOCK=8, **scratch)

    with pytest.raises(ValueError, match=r"_copy_without_scratch is launched with global_scratch but its last "
                                         r"parameter is 'y_ptr'"):
        launch(_copy_without_scratch, global_scratch=128)
    _launch._register(_double_by_descriptors, scratch=True)
    with pytest.raises(ValueError, match=r"two kernels named _double_by_descriptors"):
        _launch._register(_double_by_descriptors, scratch=False)

"""The one place a compiled Triton kernel is launched, for statements, attention chains and the kNN kernel.

`Launcher.call` has jax-triton's signature (`triton_call`: the kernel's array and scalar arguments, then one buffer
per output; aliased outputs are their input's buffer), with two targets:
- `JAX_TRITON`: in a lowering, traced arrays, a CUDA custom call (jax-triton, with jinsum's persistent cache of
  compiled kernels in front of its compiler, `_kernel_cache`);
- `INTERPRETER`: Triton's interpreter on CPU (tests: needs `TRITON_INTERPRET=1` set before Triton kernels are
  first defined, and torch). NumPy arrays in and out; traced arrays through a host callback. Outputs that the
  kernel must write start as NaN (-7 for integers), so an element it leaves unwritten shows.
`interpreted()` makes `target()` the interpreter within a block (tests of a kernel path traced for CPU).

Kernels that make TMA descriptors on the device (`tl.make_tensor_descriptor`) need Triton's global scratch memory,
a hidden last-but-one kernel parameter that jaxlib's Triton custom call passes as a null pointer (jax-triton
0.3.1, jaxlib 0.11: the kernel dies with an illegal address). Such a kernel takes an explicit last parameter,
`scratch`, and is launched with `global_scratch=` its bytes per program: the launch adds that operand (programs x
bytes, uint8), and `redirect_global_scratch` rewrites the kernel's PTX, before jaxlib assembles it, to read the
scratch pointer from that parameter instead of the hidden one. A kernel whose PTX reads the hidden pointer without
such a launch is refused when it is compiled, with the fix, instead of crashing on the GPU. (A workaround for
jaxlib's launch: once jaxlib passes global scratch itself, the redirect goes.)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from jinsum._lowering import _kernel_cache


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How kernels run: `call(kernel, *args, out_shape, grid, num_warps, num_stages, name, input_output_aliases,
    zeroed_outputs, **constexprs)`, and the array module `xp` their launchers compute with."""

    name: str
    xp: ModuleType
    call: Callable


def _jax_triton_call(kernel, *args, out_shape, grid, num_warps: int, num_stages: int, name: str,
                     input_output_aliases: dict[int, int] | None = None, zeroed_outputs: Sequence[int] = (),
                     global_scratch: int = 0, **constexprs):
    single = not isinstance(out_shape, (list, tuple))
    structs = [out_shape] if single else list(out_shape)
    _register(kernel, bool(global_scratch))
    if global_scratch:  # the kernel's last parameter: its global scratch memory (see the module docstring)
        structs.append(jax.ShapeDtypeStruct((math.prod(grid) * global_scratch,), jnp.uint8))
    results = jax_triton().triton_call(*args, kernel=kernel, out_shape=structs, grid=grid, num_warps=num_warps,
                                       num_stages=num_stages, name=name,
                                       input_output_aliases=input_output_aliases or {},
                                       zeroed_outputs=tuple(zeroed_outputs), **constexprs)
    results = list(results)[:len(results) - bool(global_scratch)]
    return results[0] if single else results


def _interpreter_call(kernel, *args, out_shape, grid, num_warps: int, num_stages: int, name: str,
                      input_output_aliases: dict[int, int] | None = None, zeroed_outputs: Sequence[int] = (),
                      global_scratch: int = 0, **constexprs):
    del num_stages, name  # (no meaning in the interpreter)
    single = not isinstance(out_shape, (list, tuple))
    structs = [out_shape] if single else list(out_shape)
    if global_scratch:  # (the interpreter keeps descriptors on the host: the parameter is there, unread)
        structs.append(jax.ShapeDtypeStruct((1,), jnp.uint8))
    arrays = [k for k, a in enumerate(args) if isinstance(a, (jax.Array, np.ndarray))]
    if any(isinstance(args[k], jax.Array) for k in arrays):  # traced (or on a device): the same launch on the host

        def host(*values):
            host_args = list(args)  # (scalar arguments stay Python numbers)
            for k, value in zip(arrays, values):
                host_args[k] = np.asarray(value)
            return _interpreter_call(kernel, *host_args, out_shape=out_shape, grid=grid, num_warps=num_warps,
                                     num_stages=0, name="", input_output_aliases=input_output_aliases,
                                     zeroed_outputs=zeroed_outputs, global_scratch=global_scratch,
                                     **constexprs)

        return jax.pure_callback(host, out_shape, *(args[k] for k in arrays))
    inputs = [to_torch(np.asarray(a)) if isinstance(a, np.ndarray) else a for a in args]
    aliased = {o: i for i, o in (input_output_aliases or {}).items()}
    outputs = []
    for k, struct in enumerate(structs):
        if k in aliased:  # the kernel reads and writes the input's buffer (a copy: inputs are never changed)
            inputs[aliased[k]] = inputs[aliased[k]].clone()
            outputs.append(inputs[aliased[k]])
            continue
        buffer = to_torch(np.zeros(struct.shape, struct.dtype))
        if k not in zeroed_outputs:
            buffer.fill_(float("nan") if buffer.is_floating_point() else -7)
        outputs.append(buffer)
    kernel[grid](*inputs, *outputs, num_warps=num_warps, **constexprs)
    results = [from_torch(t) for t in outputs[:len(outputs) - bool(global_scratch)]]
    return results[0] if single else results


JAX_TRITON = Launcher("jax-triton", jnp, _jax_triton_call)
INTERPRETER = Launcher("interpreter", np, _interpreter_call)

_TARGET: contextvars.ContextVar[Launcher] = contextvars.ContextVar("jinsum_launch_target", default=JAX_TRITON)


def target() -> Launcher:
    """Where kernels launched from lowerings run: jax-triton, or the interpreter within `interpreted()`."""
    return _TARGET.get()


@contextlib.contextmanager
def interpreted():
    """Within: kernel paths that ask `target()` (the kNN kernel's) launch in Triton's interpreter, so that a
    function traced for CPU takes them (tests). Functions traced inside keep the choice, as jit caches them."""
    token = _TARGET.set(INTERPRETER)
    try:
        yield
    finally:
        _TARGET.reset(token)


def available(launcher: Launcher) -> bool:
    """Whether `launcher` can run kernels here (jax-triton imports: the CPU build of jaxlib cannot import it)."""
    return launcher is not JAX_TRITON or _jax_triton_imports()


@functools.cache
def _jax_triton_imports() -> bool:
    try:
        jax_triton()
    except ImportError:
        return False
    return True


def jax_triton():
    """jax_triton, imported on first use, with jinsum's persistent cache of compiled kernels in front of its
    compiler (`jinsum._lowering._kernel_cache`)."""
    previous = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton as module  # noqa: PLC0415

    # jax-triton 0.3.1 sets TRITON_CACHE_DIR="" on import, which disables Triton's on-disk cache in this process.
    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
    _kernel_cache.install(module.triton_lib)
    _install_scratch_redirect(module.triton_lib)
    _start_triton_specializer_without_torch()
    return module


# The kernels this launcher launched, by name (the PTX entry is the `@triton.jit` function's name): with and without
# `global_scratch`. A name in both would make the PTX redirect ambiguous, and is refused at launch.
_LAUNCHED: dict[str, bool] = {}


def _register(kernel, scratch: bool) -> None:
    name = kernel.__name__
    # The last parameter that is not a constexpr (those are no parameters of the compiled kernel).
    last = [n for n, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" not in str(p.annotation)][-1]
    if scratch and last != "scratch":
        raise ValueError(f"jinsum: kernel {name} is launched with global_scratch but its last parameter is "
                         f"{last!r}: declare a last (non-constexpr) parameter `scratch` for the launch's operand")
    if _LAUNCHED.setdefault(name, scratch) != scratch:
        raise ValueError(f"jinsum: two kernels named {name}, one launched with global_scratch and one without: "
                         "the PTX of one of them could read the other's scratch; give them distinct names")


def redirect_global_scratch(ptx: str, has_scratch: bool) -> str:
    """The kernel's PTX reading its global-scratch pointer from its last explicit parameter (the launch's scratch
    operand) instead of the hidden one jaxlib passes as null; unchanged if the kernel reads no global scratch.
    Triton (3.3 on) appends two hidden pointers to every kernel's parameters, global then profile scratch."""
    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx, re.S)
    if entry is None:
        return ptx
    name, count = entry.group(1), len(re.findall(r"\.param\b", entry.group(2)))
    hidden = rf"\[{name}_param_{count - 2}\]"
    if count < 3 or not re.search(hidden, ptx):
        return ptx
    if not has_scratch:
        raise ValueError(f"jinsum: kernel {name} makes TMA descriptors on the device, which need Triton's global "
                         "scratch memory, and jaxlib passes none: give the kernel a last parameter `scratch` and "
                         "launch it with global_scratch= its bytes per program (jinsum._lowering._launch)")
    return re.sub(hidden, f"[{name}_param_{count - 3}]", ptx)


def _install_scratch_redirect(triton_lib) -> None:
    """Puts `redirect_global_scratch` after jax-triton's compiler (and jinsum's cache in front of it), once."""
    if getattr(triton_lib, "_jinsum_scratch_redirect", False):
        return
    compile_ttir = triton_lib.compile_ttir_inplace

    @functools.wraps(compile_ttir)
    def compile_with_scratch(ttir, backend, options, compute_capability, platform):
        result = compile_ttir(ttir, backend, options, compute_capability, platform)
        if platform != "cuda":
            return result
        if result.name not in _LAUNCHED:  # (not jinsum's: left as jax-triton made it)
            return result
        binary = redirect_global_scratch(result.binary, _LAUNCHED[result.name])
        return result if binary is result.binary else dataclasses.replace(result, binary=binary)

    triton_lib.compile_ttir_inplace = compile_with_scratch
    triton_lib._jinsum_scratch_redirect = True


def _start_triton_specializer_without_torch() -> None:
    """Triton's argument specializer imports torch on its first call, once per process, to recognise torch
    tensors; jax-triton calls it while lowering the first kernel. Where torch is installed, that import costs
    seconds of the first lowering of every process (DESIGN.md), in processes that never touch torch. So it makes
    its first call here with torch hidden, unless torch is already imported. Torch tensors handed to Triton
    kernels later in the same process still specialise, by the path for any object with a `data_ptr`."""
    if "torch" in sys.modules:
        return
    from triton._C.libtriton import native_specialize_impl  # noqa: PLC0415
    from triton.backends.compiler import BaseBackend  # noqa: PLC0415

    sys.modules["torch"] = None  # `import torch` raises ImportError, which the specializer expects
    try:
        native_specialize_impl(BaseBackend, 1, False, True, True)
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def to_torch(x: np.ndarray):
    """A torch CPU tensor sharing `x`'s data (bfloat16 through a uint16 view: NumPy has no bfloat16)."""
    import torch  # noqa: PLC0415 (torch is only needed by the interpreter)

    x = np.ascontiguousarray(x)
    if not x.flags.writeable:  # (torch wants writable memory; the interpreter's inputs are copies anyway)
        x = x.copy()
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def from_torch(x) -> np.ndarray:
    import torch  # noqa: PLC0415

    if x.dtype == torch.bfloat16:
        return x.view(torch.uint16).numpy().view(jnp.bfloat16)
    return x.numpy()

"""The one place a compiled Triton kernel is launched, for statements, attention chains and the kNN kernel.

`Launcher.call` has jax-triton's signature (`triton_call`: the kernel's array and scalar arguments, then one buffer
per output; aliased outputs are their input's buffer), with two targets:
- `XLA_KERNEL`: in a lowering, traced arrays: the kernel compiled by jax-triton's steps of Triton's compiler (with
  jinsum's persistent cache of compiled kernels in front of them, `_kernel_cache`), or, for a Gluon kernel (the
  Hopper form, `jinsum.kernels.hopper`), by Triton's own compiler (its front end writes TTGIR, past jax-triton's
  TTIR steps), and launched as XLA's own kernel node (`KERNEL_NODE`), not as jax-triton's custom call: XLA's
  command buffers (CUDA graphs) capture a kernel node like one of its fusions, where each jax-triton call split
  them and returned to the host between the pieces (a small training step took much longer to issue:
  DESIGN.md, "Kernels are XLA kernel nodes"). A Gluon kernel's warp-specialised partitions add warps to the
  launch's: the node gets the compiled kernel's count;
- `INTERPRETER`: Triton's interpreter on CPU (tests: needs `TRITON_INTERPRET=1` set before Triton kernels are
  first defined, and torch). NumPy arrays in and out; traced arrays through a host callback. Outputs that the
  kernel must write start as NaN (-7 for integers), so an element it leaves unwritten shows.
`interpreted()` makes `target()` the interpreter within a block (tests of a kernel path traced for CPU).

Kernels that make TMA descriptors on the device (`tl.make_tensor_descriptor`) need Triton's global scratch memory,
a hidden last-but-one kernel parameter. Such a kernel takes an explicit last parameter, `scratch`, and is launched
with `global_scratch=` its bytes per program: the launch adds that operand (programs x bytes, uint8), and
`redirect_global_scratch` rewrites the kernel's PTX to read the scratch pointer from that parameter instead of the
hidden one (which jaxlib's Triton custom call passed as a null pointer; the kernel node passes a byte). A kernel
whose PTX reads the hidden pointer without such a launch is refused when it is compiled, with the fix, instead of
crashing on the GPU.
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


# XLA's own kernel custom call: the kernel's PTX in the backend config, launched as a plain kernel node, which XLA's
# command buffers (CUDA graphs) capture like its own fusions. Every kernel parameter is a buffer: operands, then
# results, in order.
KERNEL_NODE = "__gpu$xla.gpu.ptx"
# Triton (3.3 on) appends two hidden pointers to every kernel's parameters (global, then profile scratch); a launch
# passes each a byte of its own.
HIDDEN_POINTERS = 2


def _kernel_node_call(kernel, *args, out_shape, grid, num_warps: int, num_stages: int, name: str,
                      input_output_aliases: dict[int, int] | None = None, zeroed_outputs: Sequence[int] = (),
                      global_scratch: int = 0, **constexprs):
    """The launch as one XLA kernel node (`KERNEL_NODE`). Scalar arguments become constexprs of the compiled kernel
    (its parameters are buffers only; a shape is static under jit anyway). An output that must start as zeros is
    aliased to a zeros operand that the kernel does not read: the PTX gets a parameter for it
    (`with_unread_parameters`), since XLA passes every operand."""
    del name  # (a profile shows the kernel's own name, its PTX entry's)
    single = not isinstance(out_shape, (list, tuple))
    structs = [out_shape] if single else list(out_shape)
    _register(kernel, bool(global_scratch))
    if global_scratch:  # the kernel's last parameter: its global scratch memory (see the module docstring)
        structs.append(jax.ShapeDtypeStruct((math.prod(grid) * global_scratch,), jnp.uint8))
    scalar = (bool, int, float, np.integer, np.floating)
    arrays = [a for a in args if not isinstance(a, scalar)]
    names = kernel.arg_names
    constants = {names[i]: a.item() if isinstance(a, np.generic) else a for i, a in enumerate(args)
                 if isinstance(a, scalar)}
    pointer_type = jax_triton().triton_lib.get_triton_type  # (Triton's names: "*bf16", as jax-triton gives them)
    pointers = {names[i]: pointer_type(jax.core.ShapedArray((), a.dtype)) for i, a in enumerate([*args, *structs])
                if not isinstance(a, scalar)}
    compile_ = _compiled_gluon if is_gluon(kernel) else _compiled
    compiled = compile_(kernel, tuple(pointers.items()), tuple({**constants, **constexprs}.items()), num_warps,
                        num_stages)
    zeros = [jnp.zeros(structs[k].shape, structs[k].dtype) for k in zeroed_outputs]
    aliases = {**(input_output_aliases or {}), **{len(arrays) + j: k for j, k in enumerate(zeroed_outputs)}}
    hidden = [jax.ShapeDtypeStruct((1,), jnp.uint8)] * HIDDEN_POINTERS
    grid = (*((grid,) if isinstance(grid, int) else tuple(grid)), 1, 1)[:3]
    call = jax.ffi.ffi_call(KERNEL_NODE, [*structs, *hidden], input_output_aliases=aliases or None)
    results = call(*arrays, *zeros, name=compiled.name, kernel_type="ptx",
                   kernel_data=with_unread_parameters(compiled.binary, len(arrays), len(zeros)),
                   grid_x=grid[0], grid_y=grid[1], grid_z=grid[2], block_x=32 * compiled.num_warps, block_y=1,
                   block_z=1, shared_mem_bytes=compiled.shared_mem_bytes)
    results = list(results)[:len(structs) - bool(global_scratch)]
    return results[0] if single else results


@functools.cache
def _compiled(kernel, pointers: tuple, constants: tuple, num_warps: int, num_stages: int):
    """What Triton's compiler makes of `kernel` with these pointer parameters (16-byte aligned, as XLA's buffers
    are) and constexprs: jax-triton's compile steps, through jinsum's cache of them (`_kernel_cache`): PTX, the
    entry's name and its shared memory."""
    triton_lib = jax_triton().triton_lib
    capability = triton_lib.triton_kernel_call_lib.get_compute_capability(0)
    backend = triton_lib.get_cuda_backend(0, capability)
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages, num_ctas=1,
                                         optimize_epilogue=False, debug=False, enable_fp_fusion=True))
    signature = {**dict(pointers), **{name: "constexpr" for name, _ in constants}}
    attrs = {(kernel.arg_names.index(name),): backend.parse_attr("D") for name, _ in pointers}
    context = triton_lib._triton.ir.context()
    triton_lib._triton.ir.load_dialects(context)
    backend.load_dialects(context)
    module = triton_lib.code_gen.ast_to_ttir(
        kernel, triton_lib.tc.ASTSource(kernel, constexprs=dict(constants), signature=signature, attrs=attrs),
        options=options, codegen_fns=backend.get_codegen_implementation(options), context=context,
        module_map=backend.get_module_map())
    result = triton_lib.compile_ttir_inplace(module, backend, options, capability, "cuda")
    return Compiled(result.binary, result.name, result.shared_mem_bytes, num_warps)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A kernel as the kernel node launches it: its PTX, entry name, dynamic shared memory and warps (a Gluon
    kernel's warp-specialised partitions add warps to those it was launched with)."""

    binary: str
    name: str
    shared_mem_bytes: int
    num_warps: int


def is_gluon(kernel) -> bool:
    """A kernel written in Gluon (`triton.experimental.gluon`), which Triton's own compiler compiles."""
    return getattr(kernel, "is_gluon", lambda: False)()


@functools.cache
def _compiled_gluon(kernel, pointers: tuple, constants: tuple, num_warps: int, num_stages: int) -> Compiled:
    """A Gluon kernel compiled by Triton's compiler (which caches on disk), for this GPU: jax-triton's compile
    steps start from TTIR, which Gluon skips (its front end writes TTGIR)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415

    del num_stages  # (a Gluon kernel's pipeline is written out)
    capability = int(round(10 * float(jax.devices()[0].compute_capability)))
    names = kernel.arg_names
    signature = {**dict(pointers), **{name: "constexpr" for name, _ in constants}}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, _ in pointers}  # (XLA's buffers: aligned)
    source = GluonASTSource(kernel, signature=signature, constexprs=dict(constants), attrs=attrs)
    result = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
    binary = redirect_global_scratch(result.asm["ptx"], _LAUNCHED[kernel.__name__])
    return Compiled(binary, result.metadata.name, result.metadata.shared, result.metadata.num_warps)


def with_unread_parameters(ptx: str, position: int, count: int) -> str:
    """`ptx` with `count` more pointer parameters at `position` of its entry's list, which its code never reads
    (they take the operands a launch passes without the kernel's asking: zeros that an output is aliased to).
    PTX reads its parameters by name, so the others are unchanged."""
    if not count:
        return ptx
    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx, re.S)
    if entry is None:
        raise ValueError("jinsum: no .entry in the kernel's PTX")
    name, body = entry.group(1), entry.group(2)
    declared = [line.rstrip(",") for line in body.strip().splitlines()]
    unread = [f"\t.param .u64 .ptr .global .align 1 {name}_param_unread_{k}" for k in range(count)]
    params = declared[:position] + unread + declared[position:]
    return ptx[:entry.start(2)] + "\n" + ",\n".join(params) + "\n" + ptx[entry.end(2):]


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


XLA_KERNEL = Launcher("xla-kernel-node", jnp, _kernel_node_call)
INTERPRETER = Launcher("interpreter", np, _interpreter_call)

_TARGET: contextvars.ContextVar[Launcher] = contextvars.ContextVar("jinsum_launch_target", default=XLA_KERNEL)


def target() -> Launcher:
    """Where kernels launched from lowerings run: XLA kernel nodes, or the interpreter within `interpreted()`."""
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
    return launcher is not XLA_KERNEL or _jax_triton_imports()


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

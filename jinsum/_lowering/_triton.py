"""The CUDA lowering: a generated Triton kernel per statement, launched through `jax_triton.triton_call`.

Also the same launch through Triton's interpreter on torch CPU tensors (`interpret`), which is how CI runs every
generated kernel without a GPU. Statements the code generator does not take stay on the XLA lowering, with a
`FallbackWarning` that says why.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jinsum._lowering import _kernel_cache, _xla
from jinsum._rules._primitive import split_epilogue
from jinsum._lang import Spec
from jinsum.kernels import (Fallback, KernelConfig, KernelPlan, canonical, generate, kernel_inputs,
                            load_kernel, make_plan, tuned_config)


class FallbackWarning(UserWarning):
    """A statement runs on the XLA lowering instead of a generated Triton kernel."""


def plan_for(spec: Spec, config: KernelConfig | None = None) -> KernelPlan | Fallback:
    """The plan the CUDA lowering uses for `spec`: of its canonical form (so statements that differ in names share
    a kernel; `plan.spec` names the operands `T0, T1, ...` in `spec.names` order), with `config`, else the tuned
    configuration if `jinsum.autotune` stored one, else the defaults."""
    return make_plan(canonical(spec), config or tuned_config(spec) or KernelConfig())


def _metaparameters(plan: KernelPlan) -> dict[str, int]:
    config = plan.config
    tiles = dict(BLOCK_ROWS=config.block_rows, BLOCK=config.block) if plan.template == "lanes" else \
        dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k)
    return dict(**tiles, WINDOW=config.window, NUM_STAGES=config.num_stages)


def _has_work(plan: KernelPlan) -> bool:
    return 0 not in plan.grid_shape and all(plan.spec.extent[v] for v in plan.spec.loop_variables)


# Below this many terms (the product of every variable's extent: rows x slots x features for an SpMM) a statement
# runs on XLA's lowering on CUDA too: its fused gathers run inside the step's CUDA graph, while a generated kernel
# is a custom call launched on its own, and the launch costs more than the kernel saves. Measured on an H100 over
# fixed-fanout tables (`benchmarks/crossover.py`): XLA takes 0.3-0.9x of Triton's time below 2**24 terms, the two
# are even at 2**24-2**25, and kernels win from there (1.15-1.3x at 2**27 terms and 256 features).
# Derivatives in column order keep their kernel at any size: XLA's scatter adds a hub column's entries atomically
# one after another (R-MAT 20, a sampled layer's backward, 15,360 x 256 terms with 11,176 on one column: 115 us,
# sorted or not, against 16 us for uniform columns), where the kernel sums them in registers (17 us).
# `JINSUM_SMALL_TERMS=0` sends every statement to a kernel (the GPU tests do, to test the kernels).
SMALL_TERMS = 1 << 24


def _small(spec: Spec) -> bool:
    """Whether `spec` is too small for a launched kernel to pay. Deterministic mode keeps its kernels (XLA's
    scatter-add on a GPU adds atomically), and so do derivatives in column order."""
    limit = int(os.environ.get("JINSUM_SMALL_TERMS", SMALL_TERMS))
    return not (spec.deterministic or spec.by_columns) and math.prod(spec.extent.values()) < limit


def fuses_epilogue(spec: Spec) -> bool:
    """Whether the kernel for `spec` applies its epilogue (else the lowering applies it after the statement)."""
    if os.environ.get("JINSUM_TRITON", "1") == "0" or _small(spec):
        return False
    plan = plan_for(spec)
    return not isinstance(plan, Fallback) and plan.fuses_epilogue and _has_work(plan)


def adds_in_order(spec: Spec) -> bool:
    """Whether the kernel for `spec` adds each output element's terms in a fixed order as it stands (a carried
    `split` schedule, `KernelPlan.carries`), so that deterministic mode runs it without the rewrite into sorted
    segment reductions."""
    if os.environ.get("JINSUM_TRITON", "1") == "0":
        return False
    plan = plan_for(spec)
    return not isinstance(plan, Fallback) and plan.carries


def evaluate(*arrays: jax.Array, spec: Spec) -> jax.Array:
    """The statement on CUDA arrays: one generated kernel (the body of the primitive's cuda lowering), or XLA's
    lowering where the statement is too small for a kernel to pay (`SMALL_TERMS`)."""
    if os.environ.get("JINSUM_TRITON", "1") == "0":
        plan = Fallback("JINSUM_TRITON=0")
    elif _small(spec):
        plan = Fallback("small")
    else:
        plan = plan_for(spec)
    if isinstance(plan, Fallback):
        if plan.reason not in ("JINSUM_TRITON=0", "small"):
            warnings.warn(f"jinsum: {spec.statement} runs on the XLA lowering: {plan.reason}", FallbackWarning,
                          stacklevel=2)
        return _xla.evaluate(*arrays, spec=spec)
    if spec.deterministic and plan.adds_atomically:
        raise NotImplementedError(
            f"jinsum: deterministic mode: {spec.statement} would add into its left-hand side atomically. "
            "The primitive's lowering rewrites such statements into sorted segment reductions (`jinsum._deterministic`) "
            "before they get here")
    kernel_spec = plan.spec
    env = dict(zip(kernel_spec.names, arrays))
    env.update(zip(kernel_spec.epilogue_names, split_epilogue(arrays, kernel_spec)[1]))
    lhs = env[kernel_spec.lhs.name]
    if not _has_work(plan):
        return lhs if not spec.winners else jnp.zeros(lhs.shape, spec.out_dtype)
    if plan.reads_lhs:
        env[kernel_spec.lhs.name] = lhs.astype(plan.out_dtype)
    inputs = [env[n] for n in kernel_inputs(plan)]
    if plan.row_programs:
        inputs.append(row_starts(env[kernel_spec.lhs_sorted_index], plan.row_count, jnp))
    source, out_shape = generate(plan), jax.ShapeDtypeStruct(lhs.shape, plan.out_dtype)
    launch = functools.partial(_jax_triton().triton_call, grid=plan.grid_shape, num_warps=plan.config.num_warps,
                               num_stages=plan.config.num_stages, name="jinsum", **_metaparameters(plan))
    if plan.carries:  # the rows that windows share: partial sums, then the fixup kernel adds them up
        out, partials = launch(*inputs, *plan.sizes.values(), kernel=load_kernel(source),
                               out_shape=(out_shape, jax.ShapeDtypeStruct(_partials_shape(plan), plan.acc_dtype)))
        rows = env[kernel_spec.lhs_sorted_index]
        out = launch(rows, partials, out, *plan.fixup_sizes.values(), out_shape=out_shape,
                     kernel=load_kernel(source, f"jinsum_{plan.template}_fixup"), input_output_aliases={2: 0})
        return out.astype(spec.out_dtype)
    out = launch(*inputs, *plan.sizes.values(), kernel=load_kernel(source), out_shape=out_shape,
                 input_output_aliases={0: 0} if plan.reads_lhs else {},
                 zeroed_outputs=(0,) if plan.zeroes_output and not plan.covers_output else ())
    return out.astype(spec.out_dtype)


def _partials_shape(plan: KernelPlan) -> tuple[int, int, int]:
    """The scratch array of a carried split schedule: two rows of partial sums per window (`KernelPlan.carries`)."""
    return plan.windows, 2, plan.spec.extent[plan.lanes]


def row_starts(rows, count: int, xp):
    """Entry r: the first group whose (sorted) row is >= r, for r in 0..count. Rows out of range are skipped."""
    return count_below(rows, count + 1, xp)


def count_below(values, n: int, xp):
    """`searchsorted(values, arange(n), side="left")` for sorted integer `values`: how many are below each `i`.

    Traced, it is a histogram and a cumulative sum: `jnp.searchsorted`'s default is a while loop of
    `log2(len(values))` steps, each a few kernels and copies on a GPU (some 0.2 ms a call on a graph of a
    million entries, paid in every step that takes the pattern as an argument).
    """
    if xp is np:
        return np.searchsorted(values, np.arange(n), side="left").astype(np.int32)
    # Value v counts for every i > v: bin v + 1, the bins summed up to i (bins past n are dropped).
    bins = jnp.zeros(n, jnp.int32).at[jnp.maximum(values.astype(jnp.int32) + 1, 0)].add(1, mode="drop")
    return jnp.cumsum(bins, dtype=jnp.int32)


def _jax_triton():
    """jax_triton, imported on first use (the CPU build of jaxlib cannot import it), with jinsum's persistent
    cache of compiled kernels in front of its compiler (`jinsum._kernel_cache`)."""
    previous = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton  # noqa: PLC0415

    # jax-triton 0.3.1 sets TRITON_CACHE_DIR="" on import, which disables Triton's on-disk cache in this process.
    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
    _kernel_cache.install(jax_triton.triton_lib)
    _start_triton_specializer_without_torch()
    return jax_triton


def _start_triton_specializer_without_torch() -> None:
    """Triton's argument specializer imports torch on its first call, once per process, to recognise torch
    tensors; jax-triton calls it while lowering the first kernel. Where torch is installed, that import cost
    3.6 s of the first lowering of every process (H100 host, torch 2.11), in processes that never touch torch.
    So it makes its first call here with torch hidden, unless torch is already imported. Torch tensors handed to
    Triton kernels later in the same process still specialise, by the path for any object with a `data_ptr`."""
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


def interpret(spec: Spec, arrays: dict[str, np.ndarray], config: KernelConfig = KernelConfig()) -> np.ndarray:
    """Runs the generated kernel for `spec` in Triton's interpreter on CPU (needs `TRITON_INTERPRET=1` set before
    Triton kernels are first defined, and torch). For tests: the same plan, source and arguments as on a GPU."""
    plan = plan_for(spec, config)
    if isinstance(plan, Fallback):
        raise ValueError(f"jinsum: no kernel for {spec.statement}: {plan.reason}")
    if spec.epilogue is not None and not plan.fuses_epilogue:
        raise ValueError(f"jinsum: the kernel for {spec.statement} ({plan.write} write) does not apply the epilogue")
    arrays = {kernel_name: arrays[name] for kernel_name, name in zip(plan.spec.names + plan.spec.epilogue_names,
                                                                      spec.names + spec.epilogue_names)}
    lhs = np.asarray(arrays[plan.spec.lhs.name])
    if not _has_work(plan):
        return lhs if not spec.winners else np.zeros(lhs.shape, spec.out_dtype)
    aliased = plan.spec.lhs.name if plan.reads_lhs else None
    inputs = [to_torch(np.asarray(arrays[n])) for n in kernel_inputs(plan) if n != aliased]
    if plan.row_programs:
        inputs.append(to_torch(row_starts(np.asarray(arrays[plan.spec.lhs_sorted_index]), plan.row_count, np)))
    out = to_torch(np.zeros(lhs.shape, plan.out_dtype) if spec.winners else lhs.astype(plan.out_dtype)).clone()
    if plan.covers_output:
        out.fill_(float("nan") if out.is_floating_point() else -1)  # as the launcher's unfilled output
    elif plan.zeroes_output:
        out.zero_()  # as the launcher's zeroed output: the kernel must not rely on the left-hand side's values
    if plan.reads_lhs:
        inputs.insert(0, out)  # aliased: the kernel reads and writes the output buffer only
    source, launch = generate(plan), dict(num_warps=plan.config.num_warps, **_metaparameters(plan))
    if plan.carries:
        import torch  # noqa: PLC0415

        partials = torch.full(_partials_shape(plan), float("nan"), dtype=getattr(torch, plan.acc_dtype.name))
        load_kernel(source)[plan.grid_shape](*inputs, *plan.sizes.values(), out, partials, **launch)
        rows = to_torch(np.asarray(arrays[plan.spec.lhs_sorted_index]))
        load_kernel(source, f"jinsum_{plan.template}_fixup")[plan.grid_shape](
            rows, partials, out, *plan.fixup_sizes.values(), out, **launch)
    else:
        load_kernel(source)[plan.grid_shape](*inputs, *plan.sizes.values(), out, **launch)
    return from_torch(out).astype(spec.out_dtype)


def to_torch(x: np.ndarray):
    """A torch CPU tensor sharing `x`'s data (bfloat16 through a uint16 view: NumPy has no bfloat16)."""
    import torch  # noqa: PLC0415 (torch is only needed by the interpreter)

    x = np.ascontiguousarray(x)
    if not x.flags.writeable:  # (torch wants writable memory; the interpreter's inputs are copies anyway)
        x = x.copy()
    if x.dtype == jax.numpy.bfloat16:
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def from_torch(x) -> np.ndarray:
    import torch  # noqa: PLC0415

    if x.dtype == torch.bfloat16:
        return x.view(torch.uint16).numpy().view(jax.numpy.bfloat16)
    return x.numpy()

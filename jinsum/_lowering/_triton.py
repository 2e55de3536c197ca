"""Generated kernels run: a statement's kernel plan (its `route`) launched, on CUDA arrays as XLA kernel nodes in the
primitive's CUDA lowering, or in Triton's interpreter on NumPy arrays (`interpret`), which is how CI runs every
generated kernel without a GPU. Both go through the one launcher (`_launch`) and the same launch sequence (`run`).
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from jinsum._lang import Spec
from jinsum._lowering import _launch, _xla
from jinsum._lowering._route import Route, follow, has_work, route
from jinsum._rules._primitive import split_epilogue
from jinsum.formats._row_starts import row_starts
from jinsum.kernels import (KernelConfig, KernelPlan, generate, kernel_inputs, kernel_name, kernel_scratch,
                            load_kernel)


class FallbackWarning(UserWarning):
    """A statement runs on the XLA lowering instead of a generated Triton kernel."""


def _metaparameters(plan: KernelPlan) -> dict[str, int]:
    config = plan.config
    tiles = dict(BLOCK_ROWS=config.block_rows, BLOCK=config.block) if plan.template == "lanes" else \
        dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k)
    return dict(**tiles, WINDOW=config.window, NUM_STAGES=config.num_stages)


def evaluate(found: Route, arrays) -> jax.Array:
    """The statement of route `found` (a whole one: a kernel, or XLA's lowering) on its operands, CUDA arrays (the
    leaves of the primitive's CUDA lowering)."""
    spec = found.spec
    if not found.kernel:
        if found.warns:
            warnings.warn(f"jinsum: {spec.statement} runs on the XLA lowering: {found.reason}", FallbackWarning,
                          stacklevel=2)
        return _xla.evaluate(*arrays, spec=spec)
    statement_arrays, captures = split_epilogue(arrays, spec)
    kernel_spec = found.plan.spec
    env = dict(zip(kernel_spec.names, statement_arrays)) | dict(zip(kernel_spec.epilogue_names, captures))
    return run(found, env, _launch.XLA_KERNEL)


def run(found: Route, env: dict, launcher: _launch.Launcher):
    """The kernel of route `found` on `env` (its arrays by the kernel's names, `found.plan.spec`), launched by
    `launcher`: the result, in the statement's dtype."""
    plan, spec, xp = found.plan, found.spec, launcher.xp
    if spec.deterministic and plan.adds_atomically:
        raise NotImplementedError(
            f"jinsum: deterministic mode: {spec.statement} would add into its left-hand side atomically. The "
            "primitive's lowering rewrites such statements into sorted segment reductions (`jinsum._deterministic`) "
            "before they get here")
    kernel_spec = plan.spec
    lhs = env[kernel_spec.lhs.name]
    if not has_work(plan):
        return lhs if not spec.winners else xp.zeros(lhs.shape, spec.out_dtype)
    if plan.reads_lhs:
        env = {**env, kernel_spec.lhs.name: lhs.astype(plan.out_dtype)}
    inputs = [env[n] for n in kernel_inputs(plan)]
    if plan.row_pointers:
        inputs.append(row_starts(env[kernel_spec.lhs_sorted_index], plan.row_count, xp))
    source, out_shape = generate(plan), jax.ShapeDtypeStruct(lhs.shape, plan.out_dtype)

    def launch(kernel, *args, name="jinsum", **options):
        return launcher.call(load_kernel(source, kernel), *args, grid=plan.grid_shape,
                             num_warps=plan.config.num_warps, num_stages=plan.config.num_stages, name=name,
                             **options, **_metaparameters(plan))

    if plan.carries:  # the rows that windows share: partial sums, then the fixup kernel adds them up
        out, partials = launch(None, *inputs, *plan.sizes.values(),
                               out_shape=(out_shape, jax.ShapeDtypeStruct(_partials_shape(plan), plan.acc_dtype)))
        rows = env[kernel_spec.lhs_sorted_index]
        out = launch(f"jinsum_{plan.template}_fixup", rows, partials, out, *plan.fixup_sizes.values(),
                     out_shape=out_shape, input_output_aliases={2: 0})
        return out.astype(spec.out_dtype)
    # A kernel reading tiles through TMA descriptors has its own name and the global scratch they live in
    # (`jinsum._lowering._launch`); a carried split schedule (a lanes plan) has none.
    scratch = kernel_scratch(plan)
    out = launch(None, *inputs, *plan.sizes.values(), out_shape=out_shape,
                 input_output_aliases={0: 0} if plan.reads_lhs else {},
                 zeroed_outputs=(0,) if plan.zeroes_output and not plan.covers_output else (),
                 **(dict(name=kernel_name(plan), global_scratch=scratch) if scratch else {}))
    return out.astype(spec.out_dtype)


def _partials_shape(plan: KernelPlan) -> tuple[int, int, int]:
    """The scratch array of a carried split schedule: two rows of partial sums per window (`KernelPlan.carries`)."""
    return plan.windows, 2, plan.spec.extent[plan.lanes]


def interpret(spec: Spec, arrays: dict[str, np.ndarray], config: KernelConfig | None = None) -> np.ndarray:
    """Runs the generated kernel for `spec` in Triton's interpreter on CPU (needs `TRITON_INTERPRET=1` set before
    Triton kernels are first defined, and torch). For tests: the route, plan, source, arguments and launch sequence
    the CUDA lowering takes, with the configuration `config` (a statement contracted pairwise: each of its two)."""
    found = route(spec, config=config, rewrite=False)
    if found.pairwise:  # two statements, each interpreted
        return np.asarray(follow(spec, [arrays[name] for name in spec.arguments],
                                 lambda part, a: interpret(part.spec, dict(zip(part.spec.arguments, a)), config),
                                 config=config))
    if found.epilogue_after:
        raise ValueError(f"jinsum: the kernel for {spec.statement} does not apply the epilogue (it runs after it)")
    if not found.kernel:
        raise ValueError(f"jinsum: no kernel for {spec.statement}: {found.reason}")
    if found.plan.config.hopper:
        raise ValueError(f"jinsum: the kernel for {spec.statement} is in the Hopper form (Gluon), which Triton's "
                         "interpreter cannot run: pass a configuration without `hopper`")
    kernel_spec = found.plan.spec
    env = {kernel_name: np.asarray(arrays[name]) for kernel_name, name in
           zip(kernel_spec.names + kernel_spec.epilogue_names, spec.names + spec.epilogue_names)}
    return np.asarray(run(found, env, _launch.INTERPRETER))

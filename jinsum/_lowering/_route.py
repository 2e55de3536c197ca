"""One route from a checked statement to what runs: XLA's lowering, or a kernel plan with everything decided about it.

`route(spec)` is read by the lowerings (`jinsum._lowering`), by Triton's interpreter path (`_triton.interpret`),
and by `jinsum.triton_source`, so that what the inspection shows is what runs. A route is one of:
- a kernel (`plan`): the generated kernel runs the statement, its epilogue included;
- XLA's lowering (`plan` None, `reason` says why: not a CUDA lowering, a switch, too small to pay for a launch, or
  what the code generator cannot do, which warns);
- a split: in deterministic mode a `+=` through index arrays whose kernel would not add in a fixed order is first
  rewritten into sorted segment reductions (`rewritten`, `jinsum._rules._deterministic`), each routed again; an
  epilogue that the route of the statement does not fuse runs as an element-wise pass after it
  (`epilogue_after`: the statement without it is routed again); a sum of three or more factors that has no Tensor
  Core plan, but two of whose factors do, contracts those two first into an intermediate (`pairwise`: the two
  statements routed again; see `contracted_first`); a weight gradient that would gather its rows in its reduction
  loop, tile after tile, gathers them once first (`pairwise` too; see `gathered_first`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jinsum import _config
from jinsum._lang import Access, Operand, Spec, Var, check, tensor_names, variables, walk
from jinsum._rules import _derive, _deterministic
from jinsum._rules._primitive import apply_epilogue, split_epilogue
from jinsum.kernels import Fallback, KernelConfig, KernelPlan, canonical, make_plan, statement_config, tuned_config

# How much cheaper a term of a Tensor Core (dot) plan is than one of a lanes plan, to order the ways of splitting a
# product of three factors (`contracted_first`): Tensor Cores' dense peak is tens of times the rate of gathered
# multiply-adds on CUDA cores (the peak: benchmarks/README.md, "Sparse weights (`benchmarks/sparse_linear.py`)"). A
# rough ratio: it only ranks splits whose costs differ by their shapes.
TENSOR_CORE_RATIO = 16
# A weight gradient's rows gathered along its reduction (`dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]`) are gathered
# once beforehand where at least this many tiles along the output's columns would each gather them again (the
# gather first pays at 56 column tiles and still at 3: DESIGN.md, "Mixtures of experts").
GATHER_FIRST_TILES = 8
TRITON_OFF = "jinsum.triton is off"
# Reasons for XLA's lowering that are choices, not shortcomings of the code generator: they do not warn.
CHOSEN = ("not CUDA", TRITON_OFF, "small")


@dataclasses.dataclass(frozen=True)
class Route:
    """What runs for `spec` (see the module docstring)."""

    spec: Spec
    plan: KernelPlan | None = None
    reason: str = ""
    rewritten: bool = False
    epilogue_after: bool = False
    pairwise: tuple[Spec, Spec] | None = None  # the pair's statement (into zeros), then the rest's

    @property
    def kernel(self) -> bool:
        """The statement, its epilogue included, is one generated kernel."""
        return self.plan is not None

    @property
    def warns(self) -> bool:
        """XLA's lowering runs where a kernel was wanted (a `FallbackWarning`)."""
        return (not self.kernel and not self.rewritten and not self.epilogue_after and not self.pairwise
                and self.reason not in CHOSEN)


def plan_for(spec: Spec, config: KernelConfig | None = None) -> KernelPlan | Fallback:
    """The kernel plan for `spec`: of its canonical form (so statements that differ in names share a kernel;
    `plan.spec` names the operands `T0, T1, ...` in `spec.names` order), with `config`, else the tuned
    configuration if `jinsum.autotune` stored one, else the defaults (`statement_config`: the Hopper form on sm_90
    where the plan has one)."""
    return make_plan(canonical(spec), config or tuned_config(spec) or statement_config())


def has_work(plan: KernelPlan) -> bool:
    """Whether the kernel has programs to launch and terms to add (else the left-hand side is the result)."""
    return 0 not in plan.grid_shape and all(plan.spec.extent[v] for v in plan.spec.loop_variables)


def small(spec: Spec) -> bool:
    """Whether `spec` is too small for a launched kernel to pay (`jinsum.small_terms`). Deterministic mode keeps
    its kernels (XLA's scatter-add on a GPU adds atomically), and so do derivatives in column order (XLA's scatter
    adds a hub column's entries atomically one after another, where the kernel sums them in registers)."""
    return not (spec.deterministic or spec.by_columns) and math.prod(spec.extent.values()) < _config.small_terms.value


def route(spec: Spec, *, kernels: bool = True, config: KernelConfig | None = None, rewrite: bool = True) -> Route:
    """What runs for `spec` in a lowering that may launch generated kernels (`kernels`: the CUDA one), with the
    kernel configuration `config` (else the tuned or default one). `rewrite=False`: deterministic mode runs the
    statement as written (one that its rewrite derived: sorted, and never split again)."""
    if not kernels:
        plan = Fallback("not CUDA")
    elif not _config.triton.value:
        plan = Fallback(TRITON_OFF)
    elif small(spec):  # (never a deterministic statement)
        plan = Fallback("small")
    else:
        plan = plan_for(spec, config)
    kernel = not isinstance(plan, Fallback)
    # (Not a statement that a deterministic rewrite derived, `rewrite=False`: it runs as written.)
    if (kernel and plan.template == "lanes" and (rewrite or not spec.deterministic)
            and (split := contracted_first(spec)) is not None):
        return Route(spec, pairwise=split)
    if kernel and (split := gathered_first(spec, plan, config)) is not None:
        return Route(spec, pairwise=split)
    if kernel and (split := scattered_after(spec, plan, config)) is not None:
        return Route(spec, pairwise=split)
    # A carried `split` schedule adds each element's terms in a fixed order as it stands: no rewrite needed.
    rewritten = rewrite and _deterministic.rewritten(spec) and not (kernel and plan.carries)
    if spec.epilogue is not None and (rewritten or not (kernel and plan.fuses_epilogue and has_work(plan))):
        return Route(spec, epilogue_after=True)
    if rewritten:
        return Route(spec, rewritten=True)
    return Route(spec, plan) if kernel else Route(spec, reason=plan.reason)


def contracted_first(spec: Spec) -> tuple[Spec, Spec] | None:
    """A sum of three or more factors as two statements, a pair of its factors multiplied first into an
    intermediate (`_derive.contracted_first`), where one of the two statements has a Tensor Core plan and the
    statement as written has none: `Y[Ak[g,p],n] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,n]` runs `T[g,p,n] +=
    X[Ak[g,p],c] * W[Ai[g],c,n]` on Tensor Cores, then `Y[Ak[g,p],n] += Av[g,p] * T[g,p,n]`; its weight gradient
    `dW[Ai[g],c,n] += Av[g,p] * X[Ak[g,p],c] * dY[Ak[g,p],n]` first scales the rows, `T[g,p,c] += Av[g,p] *
    X[Ak[g,p],c]`, then `dW[Ai[g],c,n] += dY[Ak[g,p],n] * T[g,p,c]` on Tensor Cores. Three factors at once would be a
    lanes plan doing every product on CUDA cores. The intermediate takes the result type of the pair.

    Where the pair's product depends on the entries only through one index array, it is multiplied over that
    index's range instead (`_derive.contracted_at_index`): an SpMM by a dense weight, `H[Ai[g],o] += Av[g,p] *
    X[Ak[g,p],c] * W[c,o]`, runs `T[j,o] += X[j,c] * W[c,o]` (a row of `X W` per row of `X`, not per entry), then
    `H[Ai[g],o] += Av[g,p] * T[Ak[g,p],o]` (`A (X W)`); or summed over the entries first into the rows the
    left-hand side writes (`_derive.contracted_into_rows`): `T[Ai[g],c] += Av[g,p] * X[Ak[g,p],c]`, then `H[i,o] +=
    W[c,o] * T[i,c]` (`(A X) W`). Among the splits with a Tensor Core statement, the one of least cost: its
    statements' terms, those on Tensor Cores counted `TENSOR_CORE_RATIO` times cheaper (so an SpMM by a weight
    contracts first whichever of c and o is narrower, and a grouped product scales the narrower rows). None where
    none qualifies."""
    statement = spec.statement
    if len(statement.factors) < 3 or statement.reduction != "sum" or spec.winners:
        return None
    name = _derive.fresh_name("pair", set(tensor_names(statement)))
    best, best_cost = None, None
    factors = range(len(statement.factors))
    splits = []
    for pair in ((i, j) for i in factors for j in factors if i < j):
        split = _derive.contracted_first(statement, pair, name)
        if split is not None and _through_one_index(split[0]):
            split = _derive.contracted_at_index(statement, pair, name)
        splits += [(split, pair), (_derive.contracted_into_rows(statement, pair, name), pair)]
    for (first, rest), pair in ((split, pair) for split, pair in splits if split is not None):
        shape = _intermediate_shape(first, spec)
        dtype = np.result_type(*(spec.operand[statement.factors[k].tensor].dtype for k in pair))
        first_spec, rest_spec = _checked_split(spec, first, rest, Operand(name, shape, np.dtype(dtype)))
        dots = [_on_tensor_cores(s) for s in (first_spec, rest_spec)]
        cost = sum(math.prod(s.extent.values()) / (TENSOR_CORE_RATIO if dot else 1)
                   for s, dot in zip((first_spec, rest_spec), dots))
        if any(dots) and (best_cost is None or cost < best_cost):
            best, best_cost = (first_spec, rest_spec), cost
    return best


def gathered_first(spec: Spec, plan: KernelPlan, config: KernelConfig | None = None) -> tuple[Spec, Spec] | None:
    """A Tensor Core plan that walks a row's entries as its reduction (`KernelPlan.window_in_k`: a weight
    gradient) and gathers one factor's rows through an index array in that loop, as two statements: the rows
    gathered first, in the entries' order (`_derive.gathered_first`), then the product on contiguous rows.
    Each k step of the loop as written loads an index tile and then the rows it names, a dependent load that
    the pipeline does not hide, and every tile along the output's columns does it again. Where those tiles are at
    least `GATHER_FIRST_TILES`, or the product on contiguous rows has the Hopper form (a grouped sum, which reads
    its rows by TMA); None elsewhere."""
    if not (plan.template == "dot" and plan.window_in_k):
        return None
    canonical, k = plan.spec.statement, plan.dot.k  # (the plan's names: `canonical(spec)`'s, same factor order)
    gathered = [f for f in (plan.dot.a, plan.dot.b) if any(
        node is not canonical.factors[f] and k in variables(node) for node in walk(canonical.factors[f]))]
    if len(gathered) != 1:
        return None
    statement = spec.statement
    name = _derive.fresh_name("rows", set(tensor_names(statement)))
    first, rest = _derive.gathered_first(statement, gathered[0], name)
    source = spec.operand[statement.factors[gathered[0]].tensor]
    split = _checked_split(spec, first, rest, Operand(name, _intermediate_shape(first, spec), source.dtype))
    if -(-plan.spec.extent[plan.dot.n] // plan.config.block_n) >= GATHER_FIRST_TILES:
        return split
    product = plan_for(split[1], config)
    return split if not isinstance(product, Fallback) and product.config.hopper else None


def scattered_after(spec: Spec, plan: KernelPlan, config: KernelConfig | None) -> tuple[Spec, Spec] | None:
    """A Tensor Core plan adding its tiles atomically into rows through an index array, as two statements where the
    products have the Hopper form (`jinsum.kernels.grouped_hopper_fallback`): each entry's row of products stored
    in grouped order, then added into its row (`_derive.scattered_after`). A mixture of experts' input gradient,
    `dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]`: `T[g,p,c] += dH[g,p,h] * W[Ai[g],c,h]` in the persistent
    warp-specialised kernel, stored once in 16 bits, then `dX[Ak[g,p],c] += T[g,p,c]`, where the plan as written
    adds every tile into float32 atomically and casts after. None elsewhere, and in deterministic mode (whose
    rewrite of the scatter keeps its order)."""
    statement = spec.statement
    if not (plan.template == "dot" and plan.write == "atomic" and statement.reduction == "sum" and not spec.winners
            and not spec.deterministic and isinstance(statement.lhs.indices[0], Access)
            and all(isinstance(i, Var) for i in statement.lhs.indices[1:])):
        return None
    name = _derive.fresh_name("products", set(tensor_names(statement)))
    first, rest = _derive.scattered_after(statement, name)
    dtype = np.result_type(*(spec.operand[f.tensor].dtype for f in statement.factors))
    split = _checked_split(spec, first, rest, Operand(name, _intermediate_shape(first, spec), np.dtype(dtype)))
    products = plan_for(split[0], config)
    return split if not isinstance(products, Fallback) and products.config.hopper else None


def _checked_split(spec: Spec, first, rest, intermediate: Operand) -> tuple[Spec, Spec]:
    """The specs of a split's two statements: the first into zeros of `intermediate`, the rest reading it (and
    writing `spec`'s left-hand side, its epilogue included), with `spec`'s flags."""
    def given(statement):
        return tuple(spec.operand[n] for n in tensor_names(statement) if n != intermediate.name)

    return (check(first, (intermediate, *given(first)), spec.sorted_indices, spec.allow_tf32, True, None,
                  spec.deterministic),
            check(rest, (*given(rest), intermediate), spec.sorted_indices, spec.allow_tf32, spec.zero_lhs, None,
                  spec.deterministic, epilogue=spec.epilogue))


def _on_tensor_cores(spec: Spec) -> bool:
    return not isinstance(plan := plan_for(spec), Fallback) and plan.template == "dot"


def _intermediate_shape(first, spec: Spec) -> tuple[int, ...]:
    """The shape of the intermediate a split's first statement writes: a variable's extent (one that
    `contracted_at_index` introduces ranges over the operand dimension it indexes), and for an index array
    (`contracted_into_rows`: the left-hand side's rows) the left-hand side's dimension it addresses."""
    ranges = {i.name: spec.operand[f.tensor].shape[d] for f in first.factors for d, i in enumerate(f.indices)
              if isinstance(i, Var)}
    lhs_rows = {str(i): spec.lhs.shape[d] for d, i in enumerate(spec.statement.lhs.indices) if isinstance(i, Access)}
    return tuple(spec.extent.get(i.name, ranges.get(i.name)) if isinstance(i, Var) else lhs_rows[str(i)]
                 for i in first.lhs.indices)


def _through_one_index(statement) -> bool:
    """Whether the factors read every left-hand side variable they do not index directly through one and the same
    index access (`T[g,p,o] += X[Ak[g,p],c] * W[c,o]`: a function of `Ak[g,p]` alone)."""
    kept = {v.name for v in statement.lhs.indices}
    direct = {i.name for f in statement.factors for i in f.indices if isinstance(i, Var)}
    indirect = kept - direct
    if not indirect:
        return False
    nodes = {str(node) for f in statement.factors for node in walk(f) if node is not f
             and indirect & {v.name for v in node.indices if isinstance(v, Var)}}
    return len(nodes) == 1


def follow(spec: Spec, arrays, run, *, kernels: bool = True, config: KernelConfig | None = None):
    """`spec` on `arrays` (its operands, `spec.arguments`, then the epilogue's captures) along its route: `run(route,
    arrays)` for each whole statement (a kernel or XLA's lowering), the splits the routes say in between. The
    lowerings evaluate a statement by it, and `jinsum.triton_source` records what would run by it."""
    found = route(spec, kernels=kernels, config=config)
    if found.epilogue_after:
        statement_arrays, captures = split_epilogue(arrays, spec)
        return apply_epilogue(spec, follow(spec.without_epilogue, statement_arrays, run, kernels=kernels,
                                           config=config), captures)
    if found.pairwise:
        first, rest = found.pairwise
        named = dict(zip(spec.arguments, arrays))
        named[first.lhs.name] = jnp.zeros(first.lhs.shape, first.lhs.dtype)
        named[first.lhs.name] = follow(first, [named[n] for n in first.arguments], run, kernels=kernels,
                                       config=config)
        return follow(rest, [named[n] for n in rest.arguments], run, kernels=kernels, config=config)
    if found.rewritten:
        return _deterministic.evaluate(spec, dict(zip(spec.arguments, arrays)), lambda s, a: run(
            route(s, kernels=kernels, config=config, rewrite=False), [a[n] for n in s.arguments]))
    return run(found, arrays)

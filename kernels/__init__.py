"""The Triton code generator: checked statement (or attention chain) -> kernel plan -> Triton source -> kernel.

Shipped inside the package as `jinsum.kernels`. What runs is decided by the routes (`jinsum._lowering._route` for
statements, `jinsum._attention._chain_route` for chains), and every kernel is launched by one launcher
(`jinsum._lowering._launch`: jax-triton, or Triton's interpreter for tests); the `@triton.jit` helpers every
generated kernel imports are in `helpers`. On sm_90, kernels that have one take the Hopper form of the tile core:
warp-specialised Gluon programs (`hopper`, the building blocks; `_chain_hopper`, the attention forward and backward
written over them; `_grouped_hopper`, grouped products). Reads only the notation (`jinsum._lang`).

Hand-written kernels sit beside the generator: `knn_kernel` (`_knn`, the k nearest neighbours of `jinsum.graphs.knn`,
launched through `jinsum._lowering._knn`), imported on first use since it imports Triton, which is optional.
"""

from jinsum.kernels._cache import cache_dir as cache_dir
from jinsum.kernels._chain_plan import ChainConfig as ChainConfig
from jinsum.kernels._chain_plan import ChainPlan as ChainPlan
from jinsum.kernels._chain_plan import chain_inputs as chain_inputs
from jinsum.kernels._chain_plan import chain_outputs as chain_outputs
from jinsum.kernels._chain_plan import chain_sizes as chain_sizes
from jinsum.kernels._chain_plan import hopper_fallback as hopper_fallback
from jinsum.kernels._chain_plan import make_chain_plan as make_chain_plan
from jinsum.kernels._chain_plan import scratch_shapes as scratch_shapes
from jinsum.kernels._chain_source import chain_kernel_name as chain_kernel_name
from jinsum.kernels._chain_source import chain_scratch as chain_scratch
from jinsum.kernels._chain_source import generate_chain as generate_chain
from jinsum.kernels._cache import load_kernel as load_kernel
from jinsum.kernels._plan import DotRoles as DotRoles
from jinsum.kernels._plan import Fallback as Fallback
from jinsum.kernels._plan import KernelConfig as KernelConfig
from jinsum.kernels._plan import KernelPlan as KernelPlan
from jinsum.kernels._plan import canonical as canonical
from jinsum.kernels._plan import grouped_hopper_fallback as grouped_hopper_fallback
from jinsum.kernels._plan import make_plan as make_plan
from jinsum.kernels._source import described as described
from jinsum.kernels._source import generate as generate
from jinsum.kernels._source import kernel_inputs as kernel_inputs
from jinsum.kernels._source import kernel_name as kernel_name
from jinsum.kernels._source import kernel_scratch as kernel_scratch
from jinsum.kernels._tuned import chain_config as chain_config
from jinsum.kernels._tuned import forced_config as forced_config
from jinsum.kernels._tuned import has_tma as has_tma
from jinsum.kernels._tuned import is_hopper as is_hopper
from jinsum.kernels._tuned import statement_config as statement_config
from jinsum.kernels._tuned import store_tuned_config as store_tuned_config
from jinsum.kernels._tuned import tuned_config as tuned_config


def __getattr__(name: str):
    if name == "knn_kernel":  # (imports triton: not at package import)
        from jinsum.kernels._knn import knn_kernel  # noqa: PLC0415

        return knn_kernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Graph convolution (Kipf & Welling, 2017) on a sparse adjacency."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.nn._graph import aggregate, expect_adjacency, row_sums


class GCNConv(nnx.Module):
    """`out = D^-1/2 (A + I) D^-1/2 x W + b`, with `D` the (weighted) degree of `A + I`.

    The self loops and the normalisation never rebuild the adjacency: with `deg = rowsum(A) + 1` (a sorted
    segment sum over the stored entries, `D[Ai[g]] += Av[g,p]`) and `h = (x W) * deg^-1/2`, the output is
    `deg^-1/2 * (A @ h + h)`, where `A @ h` is one SpMM, `C[Ai[g],n] += Av[g,p] * h[Ak[g,p],n]`. An existing
    self loop of weight `w` therefore counts `w + 1` (PyG's `add_remaining_self_loops` would replace it).
    Nodes of degree <= 0 (e.g. no self loops and no in-edges) get `deg^-1/2 = 0`, as in PyG.

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] = weight` -> `(N, out_features)`.

    Example:
      >>> A = jinsum.nn.adjacency(edge_index, num_nodes=N)           # once, on the host
      >>> conv = jinsum.nn.GCNConv(16, 32, rngs=nnx.Rngs(0))
      >>> y = nnx.jit(lambda conv, x, A: conv(x, A))(conv, x, A)     # (N, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, add_self_loops: bool = True,
                 normalize: bool = True, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features, out_features: feature sizes of the input and the output.
          use_bias: add a learned bias `b` after the aggregation.
          add_self_loops: aggregate `A + I` instead of `A`.
          normalize: apply the symmetric normalisation `D^-1/2 . D^-1/2`; without it the layer is
            `(A [+ I]) x W + b`.
          param_dtype: dtype of the parameters; the computation follows JAX's promotion of input and parameters.
          rngs: initialises the weight.
        """
        self.linear = nnx.Linear(in_features, out_features, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        self.add_self_loops = add_self_loops
        self.normalize = normalize

    def __call__(self, x: jax.Array, A: GroupCOO | BlockGroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` a `GroupCOO` or `BlockGroupCOO` `(N, N)` -> `(N, out_features)`."""
        expect_adjacency("GCNConv", A, x, (GroupCOO, BlockGroupCOO), self.linear.in_features)
        h = self.linear(x)
        if self.normalize:
            deg = row_sums(A, h.dtype) + (1 if self.add_self_loops else 0)
            # Isolated nodes have degree 0: scale them by 0 rather than inf; the inner where keeps the gradient finite.
            scale = jnp.where(deg > 0, jax.lax.rsqrt(jnp.where(deg > 0, deg, 1)), 0)[:, None]
            h = h * scale
        out = aggregate(A, h)
        if self.add_self_loops:
            out = out + h
        if self.normalize:
            out = out * scale
        return out if self.bias is None else out + self.bias[...]

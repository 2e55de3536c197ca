"""Graph isomorphism network convolution (Xu et al., 2019) on a sparse adjacency."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.nn._dtypes import check_dtypes, promote
from jinsum.nn._graph import aggregate, expect_adjacency


class GINConv(nnx.Module):
    """`out = mlp((1 + eps) x + A @ x)`: sum aggregation (one SpMM) followed by a learned MLP.

    Shapes: `x` `(N, F)`, `A` `(N, N)` with `A[dst, src] = weight` -> whatever `mlp` makes of `(N, F)`.

    Example:
      >>> rngs = nnx.Rngs(0)
      >>> mlp = nnx.Sequential(nnx.Linear(16, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 32, rngs=rngs))
      >>> gin = jinsum.nn.GINConv(mlp)
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> gin(x, jinsum.graphs.adjacency(edge_index, num_nodes=4)).shape
      (4, 32)
    """

    def __init__(self, mlp: nnx.Module, *, eps: float = 0.0, train_eps: bool = True, dtype=None,
                 param_dtype=jnp.float32):
        """Wraps `mlp` and creates `eps`.

        Args:
          mlp: applied to the aggregated features (any callable module, e.g. an `nnx.Sequential`); it computes by
            its own `dtype` (build it with the layer's for one dtype throughout).
          eps: the initial weight of a node's own features, `1 + eps`.
          train_eps: make `eps` a learned `nnx.Param`; otherwise it is a constant.
          dtype: the dtype of the aggregation `(1 + eps) x + A @ x` (features, `eps` and the adjacency's values are
            cast to it, as `nnx.Linear` casts them; the SpMM accumulates as its statement does, in float32 for
            bfloat16); None: JAX's promotion of the input and `eps` (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype (`eps`, when it is learned).
        """
        if not callable(mlp):
            raise TypeError(f"GINConv: mlp must be callable (a module such as nnx.Sequential), got "
                            f"{type(mlp).__name__}")
        check_dtypes("GINConv", dtype, param_dtype)
        self.mlp, self.dtype = mlp, dtype
        self.eps = nnx.Param(jnp.asarray(eps, param_dtype)) if train_eps else eps

    def __call__(self, x: jax.Array, A: GroupCOO | BlockGroupCOO) -> jax.Array:
        """`x` `(N, F)`, `A` a `GroupCOO` or `BlockGroupCOO` `(N, N)` -> `mlp(...)` of `(N, F)`."""
        expect_adjacency("GINConv", A, x, (GroupCOO, BlockGroupCOO))
        eps = self.eps[...] if isinstance(self.eps, nnx.Param) else self.eps
        x, eps = promote(self.dtype, x, eps)  # (a constant eps, a Python float, is weakly typed: x's dtype)
        return self.mlp((1 + eps) * x + aggregate(A, x))

"""Graph convolution (Kipf & Welling, 2017) on a sparse adjacency, and the layers that propagate with its
normalised adjacency: SGConv (Wu et al., 2019) and APPNP (Klicpera et al., 2019)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.nn._dtypes import check_dtypes, compute_dtype, promote
from jinsum.nn._graph import aggregate, expect_adjacency, row_sums, transform_first
from jinsum.nn._sizes import layer_sizes


def gcn_scale(A: GroupCOO | BlockGroupCOO, dtype, self_loops: float = 1.0) -> jax.Array:
    """`deg^-1/2` as a column `(N, 1)`, with `deg = rowsum(A) + self_loops` (a sorted segment sum over the stored
    entries), by PyG's rule: 0 where the degree is 0 (its inf -> 0), NaN where it is negative or NaN (a NaN edge
    weight), so that the rows reading such a node are NaN, as in PyG and `jinsum.graphs.gcn_norm`."""
    deg = row_sums(A, dtype) + self_loops
    # Isolated nodes have degree 0: scale them by 0 rather than inf; the inner where keeps the gradient finite.
    return jnp.where(deg == 0, 0, jax.lax.rsqrt(jnp.where(deg == 0, 1, deg)))[:, None]


def gcn_propagate(A: GroupCOO | BlockGroupCOO, h: jax.Array, scale: jax.Array, self_loops: float = 1.0,
                  bias: jax.Array | None = None) -> jax.Array:
    """`D^-1/2 (A + self_loops I) D^-1/2 h (+ bias)` with `scale = gcn_scale(A, ..., self_loops)`: one SpMM; the
    self loops and the normalisation never rebuild the adjacency.

    On a `GroupCOO` the SpMM's epilogue adds the self loops, scales and adds the bias: `C[Ai[g],n] += Av[g,p] *
    H[Ak[g,p],n]` with `epilogue(c, i, n) = S[i] * (c + self_loops * H[i,n]) + b[n]` for `H = S h`, so on a GPU
    (outside differentiation) the kernel stores the layer's output, with no pass over `(N, F)` after it. The
    statement stays the plain SpMM, whose transpose over the column order is the same kernel. (Scaling inside
    the statement, `Av[g,p] * S[Ai[g]] * S[Ak[g,p]] * H[Ak[g,p],n]`, would save the pass before it too, but its
    transpose lists the two scales in the other order: a second kernel to compile.)"""
    h = h * scale.astype(h.dtype)  # (a float32 scale of bfloat16 features: the SpMM reads bfloat16)
    if not isinstance(A, GroupCOO):
        out = (aggregate(A, h) + self_loops * h) * scale
        return (out if bias is None else out + bias).astype(h.dtype)
    s = scale[:, 0]

    def epilogue(c, row, n):
        out = s[row] * (c + self_loops * h[row, n])
        return out if bias is None else out + bias[n]

    return jinsum.einsum("C[Ai[g],n] += Av[g,p] * H[Ak[g,p],n]", A=A.astype(h.dtype), H=h,
                         C=jax.ShapeDtypeStruct(h.shape, h.dtype), epilogue=epilogue)


class GCNConv(nnx.Module):
    """`out = D^-1/2 (A + I) D^-1/2 x W + b`, with `D` the (weighted) degree of `A + I`.

    The self loops and the normalisation never rebuild the adjacency: with `deg = rowsum(A) + 1` (a sorted
    segment sum over the stored entries, `D[Ai[g]] += Av[g,p]`) and `h = (x W) * deg^-1/2`, the output is
    `deg^-1/2 * (A @ h + h)`, where `A @ h` is one SpMM, `C[Ai[g],n] += Av[g,p] * h[Ak[g,p],n]`. An existing
    self loop of weight `w` therefore counts `w + 1` (PyG's `add_remaining_self_loops` would replace it).
    The propagation commutes with `W`, so it runs on the narrower side: `(A x) W` where `in_features <
    out_features` (`transform_first`).
    Nodes of degree 0 (e.g. no self loops and no in-edges) get `deg^-1/2 = 0`, and a negative or NaN degree (a NaN
    edge weight) gives NaN to the rows that read the node, as in PyG. With `improved`, the self loops weigh 2
    (`A + 2I`). On a static graph the normalisation can be computed once instead (`jinsum.graphs.gcn_norm`, with
    `normalize=False, add_self_loops=False`: PyG's `cached=True`), which leaves one SpMM a layer and no degree
    sums in the step.

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] = weight` -> `(N, out_features)`.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)           # once, on the host
      >>> conv = jinsum.nn.GCNConv(16, 32, rngs=nnx.Rngs(0))
      >>> nnx.jit(lambda conv, x, A: conv(x, A))(conv, x, A).shape
      (4, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, add_self_loops: bool = True,
                 improved: bool = False, normalize: bool = True, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features, out_features: feature sizes of the input and the output.
          use_bias: add a learned bias `b` after the aggregation.
          add_self_loops: aggregate `A + I` instead of `A`.
          improved: self loops of weight 2, `A + 2I` (Kipf & Welling's "renormalisation trick", PyG's `improved`).
          normalize: apply the symmetric normalisation `D^-1/2 . D^-1/2`; without it the layer is
            `(A [+ I]) x W + b`.
          dtype: the computation's dtype (features, weights and the adjacency's values are cast to it, as
            `nnx.Linear` casts them; sparse products accumulate as their statements do, in float32 for bfloat16);
            None: JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the weight.
        """
        in_features, out_features = layer_sizes("GCNConv", in_features=in_features, out_features=out_features)
        check_dtypes("GCNConv", dtype, param_dtype)
        self.linear = nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        self.self_loops = (2.0 if improved else 1.0) if add_self_loops else 0.0
        self.normalize = normalize

    def __call__(self, x: jax.Array, A: GroupCOO | BlockGroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` a `GroupCOO` or `BlockGroupCOO` `(N, N)` -> `(N, out_features)`."""
        expect_adjacency("GCNConv", A, x, (GroupCOO, BlockGroupCOO), self.linear.in_features)
        bias = None if self.bias is None else self.bias[...]
        if transform_first(A, self.linear.in_features, self.linear.out_features):
            return self._propagate(A, self.linear(x), bias)
        # The propagation is linear and acts on rows, so it commutes with `W`: it runs on the narrower side.
        dtype = compute_dtype(self.linear.dtype, x, self.linear.kernel[...])
        out = self.linear(self._propagate(A, x.astype(dtype), None))
        return out if bias is None else out + bias.astype(out.dtype)

    def _propagate(self, A: GroupCOO | BlockGroupCOO, h: jax.Array, bias: jax.Array | None) -> jax.Array:
        """`D^-1/2 (A + I) D^-1/2 h (+ bias)`, or without the normalisation `(A + I) h (+ bias)`."""
        if self.normalize:  # (degrees summed in float32 at least: a hub's degree is not exact in bfloat16)
            scale = gcn_scale(A, jnp.promote_types(h.dtype, jnp.float32), self.self_loops)
            return gcn_propagate(A, h, scale, self.self_loops, bias)
        out = aggregate(A, h) + self.self_loops * h if self.self_loops else aggregate(A, h)
        return out if bias is None else out + bias.astype(out.dtype)


class SGConv(nnx.Module):
    """`out = (D^-1/2 (A + I) D^-1/2)^K x W + b` (PyG's `SGConv`): `K` propagations, then one linear layer.

    Each propagation is one SpMM (`gcn_propagate`); the degrees are summed once per call.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)
      >>> jinsum.nn.SGConv(16, 7, K=2, rngs=nnx.Rngs(0))(x, A).shape
      (4, 7)
    """

    def __init__(self, in_features: int, out_features: int, *, K: int = 1, add_self_loops: bool = True,
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the linear layer.

        Args:
          in_features, out_features: feature sizes of the input and the output.
          K: the number of propagations.
          add_self_loops: propagate with `A + I` instead of `A`.
          use_bias: the linear layer's bias.
          dtype: the computation's dtype (features, weights and the adjacency's values are cast to it, as
            `nnx.Linear` casts them; sparse products accumulate as their statements do, in float32 for bfloat16);
            None: JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the weight.
        """
        in_features, out_features = layer_sizes("SGConv", in_features=in_features, out_features=out_features)
        (K,) = layer_sizes("SGConv", 0, K=K)
        check_dtypes("SGConv", dtype, param_dtype)
        self.K, self.self_loops = K, 1.0 if add_self_loops else 0.0
        self.linear = nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)

    def __call__(self, x: jax.Array, A: GroupCOO | BlockGroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` `(N, N)` -> `(N, out_features)`."""
        expect_adjacency("SGConv", A, x, (GroupCOO, BlockGroupCOO), self.linear.in_features)
        x = promote(self.linear.dtype, x, self.linear.kernel[...])[0]
        # (degrees summed in float32 at least, as GCNConv's: a hub's degree is not exact in bfloat16)
        scale = gcn_scale(A, jnp.promote_types(x.dtype, jnp.float32), self.self_loops)
        for _ in range(self.K):
            x = gcn_propagate(A, x, scale, self.self_loops)
        return self.linear(x)


class APPNP(nnx.Module):
    """Personalised-PageRank propagation (PyG's `APPNP`, no parameters): `h_0 = x`,
    `h_{k+1} = (1 - alpha) D^-1/2 (A + I) D^-1/2 h_k + alpha x`, `K` times.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A, mlp = jinsum.graphs.adjacency(edge_index, num_nodes=4), nnx.Linear(16, 7, rngs=nnx.Rngs(0))
      >>> jinsum.nn.APPNP(K=10, alpha=0.1)(mlp(x), A).shape
      (4, 7)
    """

    def __init__(self, K: int, alpha: float, *, add_self_loops: bool = True, dtype=None):
        """Sets the propagation (no parameters).

        Args:
          K: the number of propagations.
          alpha: the teleport probability, in `[0, 1]`.
          add_self_loops: propagate with `A + I` instead of `A`.
          dtype: the computation's dtype (features and the adjacency's values are cast to it; sparse products
            accumulate as their statements do, in float32 for bfloat16); None: the features' dtype (integer
            features cast to float32, as `nnx.Linear` casts them; `jinsum.nn._dtypes`).
        """
        (K,) = layer_sizes("APPNP", 0, K=K)
        if not 0 <= alpha <= 1:
            raise ValueError(f"APPNP: alpha must be in [0, 1], got {alpha}")
        check_dtypes("APPNP", dtype)
        self.K, self.alpha, self.self_loops, self.dtype = K, alpha, 1.0 if add_self_loops else 0.0, dtype

    def __call__(self, x: jax.Array, A: GroupCOO | BlockGroupCOO) -> jax.Array:
        """`x` `(N, F)`, `A` `(N, N)` -> `(N, F)`."""
        expect_adjacency("APPNP", A, x, (GroupCOO, BlockGroupCOO))
        (x,) = promote(self.dtype, x)
        scale = gcn_scale(A, jnp.promote_types(x.dtype, jnp.float32), self.self_loops)  # (as GCNConv's degrees)
        h = x
        for _ in range(self.K):
            h = (1 - self.alpha) * gcn_propagate(A, h, scale, self.self_loops) + self.alpha * x
        return h

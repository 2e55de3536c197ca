"""A linear layer whose weight has a fixed sparse pattern and learned values (sparse autoencoders, pruned
transformers: the Scorch and SparseTIR workloads), element by element or in dense blocks.

`y = x W + b` with `W (in_features, out_features)` as in `nnx.Linear`. The layer stores `W` transposed, as torch's
`Linear` does: a `GroupCOO` / `BlockGroupCOO` `(out_features, in_features)` whose rows are outputs, so the forward

    element:  Y^T[Ai[g],n] += Wv[g,p] * X^T[Ak[g,p],n]            (NumPy subscripts "oi,in->on", an SpMM)
    block:    Y[n,Ai[g],m] += X[n,Ak[g,p],k] * Wv[g,m,k,p]       ("ni,oi->no", tensor-core dots)

writes each output row (element) or column block (block) from one program (no atomics). Its two gradients are
statements too: `dX` runs the same kernel over the pattern's entries in column order (built once, at construction),
`dW` is an SDDMM, one dot per stored block (a long batch cut into chunks, added atomically). The pattern is a
constant of the layer (`SparsityPattern`, not a `Param`: optimisers leave it alone); only the stored values are
parameters, so memory and work scale with the density.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from flax import nnx
from flax.nnx.nn.linear import default_kernel_init

import jinsum
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.formats._convert import check_block_shape
from jinsum.nn._dtypes import check_dtypes, compute_dtype
from jinsum.nn._sizes import layer_sizes


class SparsityPattern(nnx.Variable):
    """Where a sparse layer's weight is stored: index arrays, not trained (`nnx.Param` filters leave it out)."""


def random_pattern(in_features: int, out_features: int, density: float, *, block_shape: tuple[int, int] | None = None,
                   seed: int = 0) -> np.ndarray:
    """A uniformly random boolean pattern for `SparseLinear`: `(in_features, out_features)`, or with `block_shape =
    (bi, bo)` the block grid `(in_features / bi, out_features / bo)`, with `round(density * size)` entries set
    (at least one)."""
    where = "jinsum.nn.random_pattern"
    in_features, out_features = layer_sizes(where, in_features=in_features, out_features=out_features)
    (seed,) = layer_sizes(where, 0, seed=seed)
    if not 0 < density <= 1:
        raise ValueError(f"{where}: density must be in (0, 1], got {density}")
    bi, bo = (1, 1) if block_shape is None else check_block_shape(where, block_shape)
    if in_features % bi or out_features % bo:
        raise ValueError(f"{where}: block_shape {block_shape} must divide (in_features, out_features) = "
                         f"{(in_features, out_features)}")
    shape = (in_features // bi, out_features // bo)
    size = shape[0] * shape[1]
    chosen = np.random.default_rng(seed).choice(size, max(1, round(density * size)), replace=False)
    pattern = np.zeros(size, bool)
    pattern[chosen] = True
    return pattern.reshape(shape)


class SparseLinear(nnx.Module):
    """`y = x W + b` with `W (in_features, out_features)` stored only where `pattern` is set.

    Element pattern: `pattern` `(in_features, out_features)`, nonzero where `W` is stored (a `GroupCOO`).
    Block pattern: `block_shape = (bi, bo)` and `pattern` over the block grid `(in_features / bi, out_features /
    bo)`: each set block is a dense `bi x bo` block of `W` (a `BlockGroupCOO`; the kernels multiply blocks on
    tensor cores).

    The stored values are initialised as `nnx.Linear` initialises its kernel, `kernel_init` of the dense
    `(in_features, out_features)` shape, and then kept where the pattern is set (so the dense draw is made once, at
    construction). Pass a `kernel_init` with a larger scale to keep a sparse layer's output variance.

    Example:
      >>> pattern = jinsum.nn.random_pattern(256, 256, 0.1, block_shape=(32, 32))   # 6 of the 8 x 8 blocks
      >>> layer = jinsum.nn.SparseLinear(256, 256, pattern, block_shape=(32, 32), dtype=jnp.bfloat16,
      ...                                rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((4, 256))).shape                # x (..., 256) -> (..., 256)
      (4, 256)
    """

    def __init__(self, in_features: int, out_features: int, pattern, *, block_shape: tuple[int, int] | None = None,
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32, kernel_init=default_kernel_init,
                 bias_init=nnx.initializers.zeros_init(), rngs: nnx.Rngs):
        """Builds the pattern (on the host) and creates the parameters.

        Args:
          in_features, out_features: the sizes of `x`'s last axis and of the output's.
          pattern: a concrete boolean (or 0/1) array: `(in_features, out_features)`, or the block grid with
            `block_shape`.
          block_shape: `(bi, bo)` dividing `(in_features, out_features)`: dense blocks of `W`; None: elements.
          use_bias: add a learned bias `b` `(out_features,)`.
          dtype: the computation's dtype (inputs and parameters are cast to it, as `nnx.Linear` casts them;
            products accumulate as their statements do, in float32 for bfloat16); None: JAX's promotion of the
            input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          kernel_init, bias_init: initialisers, as `nnx.Linear`'s.
          rngs: draws the initial values.
        """
        in_features, out_features = layer_sizes("SparseLinear", in_features=in_features, out_features=out_features)
        block_shape = None if block_shape is None else check_block_shape("SparseLinear", block_shape)
        check_dtypes("SparseLinear", dtype, param_dtype)
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.block_shape = dtype, block_shape
        structure = _structure(pattern, in_features, out_features, block_shape)
        dense = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        # The structure's index arrays without its values (those are the kernel, below), and where they go.
        (Ai, Ak, ones, *index), aux = structure.tree_flatten()
        leaves, self._structure = jax.tree.flatten(structure.tree_unflatten(aux, (Ai, Ak, None, *index)))
        self.pattern = SparsityPattern(tuple(leaves))
        # Group padding (slots past a row's last entry) must stay zero: the values are multiplied by this mask in
        # every call, so padding gets no gradient and no optimiser moves it (None: the pattern has no padding).
        self.active = None if np.all(np.asarray(ones) != 0) else SparsityPattern(ones.astype(param_dtype))
        self.kernel = nnx.Param(jinsum.einsum("oi,io->oi", structure.astype(param_dtype), dense).Av)
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None

    @property
    def weight(self) -> GroupCOO | BlockGroupCOO:
        """The stored `W^T` `(out_features, in_features)` with the current values (a jinsum format)."""
        values = self.kernel[...]
        if self.active is not None:
            values = values * self.active[...]
        # (flax >= 0.12 reads a variable holding a pytree with get_value; older versions with .value)
        leaves = self.pattern.get_value() if hasattr(self.pattern, "get_value") else self.pattern.value
        return jax.tree.unflatten(self._structure, leaves).with_values(values)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x` `(..., in_features)` -> `(..., out_features)`."""
        if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != self.in_features:
            raise ValueError(f"SparseLinear: expected x of shape (..., {self.in_features}) (in_features), got "
                             f"{jnp.shape(x)}")
        weight, bias = self.weight, None if self.bias is None else self.bias[...]
        dtype = compute_dtype(self.dtype, x, weight.Av, bias)
        rows = x.reshape(-1, self.in_features).astype(dtype)
        if self.block_shape is None:
            # Elements: `Y^T = W^T X^T`, the SpMM over features-major operands, whose lanes (the batch) read
            # contiguous rows of X^T; row-major, each stored entry would read a strided column of X, an order of
            # magnitude slower than the transposes this costs (benchmarks/README.md, "Sparse weights
            # (`benchmarks/sparse_linear.py`)").
            y = jinsum.einsum("oi,in->on", weight.astype(dtype), rows.T).T
        else:
            # Blocks: row-major; each block reads a (batch tile, 32) slab of X and multiplies on tensor cores.
            y = jinsum.einsum("ni,oi->no", rows, weight.astype(dtype))
        if bias is not None:
            y = y + bias.astype(dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def _structure(pattern, in_features: int, out_features: int, block_shape) -> GroupCOO | BlockGroupCOO:
    """`W^T` `(out_features, in_features)` with ones where `pattern` is set, carrying its entries in column order."""
    where = "SparseLinear"
    if isinstance(pattern, jax.core.Tracer):
        raise TypeError(f"{where}: the pattern must be concrete (NumPy or a concrete jax array): it fixes the "
                        "layer's structure; build the layer outside jit")
    mask = np.asarray(pattern) != 0
    bi, bo = (1, 1) if block_shape is None else block_shape
    if in_features % bi or out_features % bo:
        raise ValueError(f"{where}: block_shape (bi, bo) = {(bi, bo)} must divide (in_features, out_features) = "
                         f"{(in_features, out_features)}")
    grid = (in_features // bi, out_features // bo)
    if mask.shape != grid:
        what = "the block grid (in_features / bi, out_features / bo)" if block_shape else "(in_features, out_features)"
        raise ValueError(f"{where}: expected a pattern of shape {what} = {grid}, got {mask.shape}")
    if not mask.any():
        raise ValueError(f"{where}: the pattern stores no entry; a layer with no weights is a bias alone")
    if block_shape is None:
        return GroupCOO.from_scipy(sp.csr_matrix(mask.T.astype(np.float32))).with_transpose()
    return BlockGroupCOO.from_block_mask(mask.T, block_shape=(bo, bi)).with_transpose()

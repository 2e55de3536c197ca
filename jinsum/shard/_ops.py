"""Products over a `Partitioned`: each device runs the ordinary statements (and so the generated kernels) on
its part, inside one `jax.shard_map`.

A device's result is its local matrix's product with its own rows, into which each remote matrix's product with
the rows of its piece of the exchange is then added (or maximised) in place, piece after piece. Reverse mode
transposes the exchange too (a `ppermute` runs backwards, the gather of the rows each piece sends becomes a
scatter-add of their cotangents, every piece into one array (`_send`), an `all_gather` becomes a `psum_scatter`),
so the gradient with respect to the dense operand comes back row-sharded on the same split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import jinsum
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.shard._partition import Partitioned
from jinsum.shard._send import send_rows

KINDS = ("rows", "columns", "replicated")


def _check_partitioned(where: str, A, single: str | None = None) -> None:
    """That `A` is a `Partitioned`, else a `TypeError` from `where` (the function the user called), naming what
    does the same on one device (`single`), if anything."""
    if not isinstance(A, Partitioned):
        instead = f"; for a {type(A).__name__} on one device use {single}" if single else ""
        raise TypeError(f"{where}: expected a jinsum.shard.Partitioned (jinsum.shard.partition(A, mesh)), got "
                        f"{type(A).__name__}{instead}")


def _exchange(A: Partitioned, send: jax.Array, x: jax.Array, piece: int) -> tuple[jax.Array, jax.Array]:
    """The rows of `x` (this device's rows) that this device's remote matrix `piece` reads, received from the
    others, and `x` for the next piece to gather its rows from (`send_rows`: in reverse mode every piece's
    cotangents go into one array)."""
    if A.plan.exchange == "all_gather":
        return jax.lax.all_gather(x, A.axis, tiled=True), x
    block = A.layout.block
    k, start, count = A.plan.pieces[piece]
    if not count:  # (a piece of a shift with fewer rows than chunks: nothing to send)
        return jnp.zeros((block, *x.shape[1:]), x.dtype), x
    rows, blocks = send_rows(x.reshape(x.shape[0] // block, block, *x.shape[1:]), send, start, count)
    parts = A.num_parts
    received = jax.lax.ppermute(rows, A.axis, perm=[(s, (s + k) % parts) for s in range(parts)])
    return received.reshape(-1, *x.shape[1:]), blocks.reshape(x.shape)


@jax.custom_jvp
def _after(x: jax.Array, token) -> jax.Array:
    """`x`, once `token` has been computed: XLA may not start what reads the result before then."""
    return jax.lax.optimization_barrier((x, token))[0]


@functools.partial(_after.defjvp, symbolic_zeros=True)
def _after_jvp(primals, tangents):
    # The order is the primal computation's. The tangent passes through, so reverse mode sees an identity: the
    # barrier's own transpose would tie each cotangent to an array of zeros the token's size, built, then added.
    return _after(*primals), tangents[0]


def per_part(fn: Callable, A: Partitioned, *, rows: Sequence[jax.Array] = (),
             columns: Sequence[jax.Array] = (), replicated: Sequence = ()):
    """`fn` on every device: over its local matrix, then over its remote matrices (one per piece of the exchange)
    into that result.

    `fn(part, *rows, *columns, *replicated, out=None)` takes a `GroupCOO` over the device's rows (local: `(R, R)`;
    remote: `(R, rows received)`) and arrays, and returns an array `(R, ...)`; called again with `out=` the result so
    far, it combines its own into it (`C[Ai[g],n] += ...` with `C=out` writes into the buffer in place: no
    second output, no addition after). A `fn` that returns a `GroupCOO` (new values at the entries, an SDDMM) is
    called once per matrix without `out`.

    Args:
      fn: as above.
      A: the partitioned matrix.
      rows: row-sharded arrays `(D * R, ...)` read at the part's own rows (the destinations).
      columns: row-sharded arrays `(D * R, ...)` read at the part's columns: the local matrix sees the device's
        block, the remote one the rows received by the plan's exchange.
      replicated: pytrees the same on every device (weights).

    Returns:
      A row-sharded `(D * R, ...)` array, or, if `fn` returned formats, `A` with their values.
    """
    if not callable(fn):
        raise TypeError(f"jinsum.shard.per_part: fn must be callable (fn(part, *arrays, out=None)), got "
                        f"{type(fn).__name__}")
    _check_partitioned("jinsum.shard.per_part", A)
    for name, group in (("rows", rows), ("columns", columns)):
        for x in group:
            if x.ndim < 1 or x.shape[0] != A.padded_rows:
                raise ValueError(f"jinsum.shard: expected {name} operands laid out by the partition, "
                                 f"({A.padded_rows}, ...) = {A.num_parts} devices x {A.padded_rows // A.num_parts} "
                                 f"rows (Partitioned.shard_rows), got shape {tuple(x.shape)}")
    sddmm_traced = []  # (set while tracing: whether fn returned formats)

    def body(local, remote, send, rows, columns, replicated):
        local, remote, send = jax.tree.map(lambda a: a[0], (local, remote, send))
        # The exchange does not wait for the local product: XLA runs the two at once.
        mine = fn(local, *rows, *columns, *replicated)
        sddmm = isinstance(mine, (GroupCOO, BlockGroupCOO))  # (new values at the entries: one result a matrix)
        sddmm_traced.append(sddmm)
        results = [mine]  # (the result after the local matrix, then after each piece; an SDDMM's of each)
        sources = list(columns)  # (what each piece's rows are gathered from: passed on from piece to piece)
        for m, part in enumerate(remote):
            if m >= 1 and not sddmm:
                # Piece m's rows leave once the product before last has run (piece m - 2's; the local one for
                # piece 1), so each piece moves while one product runs and at most three pieces are in flight.
                # Left free, XLA starts every transfer as early as it can and, one collective in flight at a
                # time, waits for all but the last before any product (it sees no cost in the kernels).
                sources = [_after(x, results[m - 1]) for x in sources]
            received = []
            for j, x in enumerate(sources):
                rows_received, sources[j] = _exchange(A, send, x, m)
                received.append(rows_received)
            results.append(fn(part, *rows, *received, *replicated, **({} if sddmm else {"out": results[-1]})))
        if sddmm:
            return results[0].Av[None], tuple(result.Av[None] for result in results[1:])
        return results[-1]

    spec = PartitionSpec(A.axis)
    in_specs = (spec, spec, spec, spec, spec, PartitionSpec())
    # Under jit even when called eagerly: an eager shard_map would dispatch every statement of the body alone.
    sharded = jax.jit(jax.shard_map(body, mesh=A.mesh, in_specs=in_specs, out_specs=spec))
    out = sharded(A.local, A.remote, A.send, tuple(rows), tuple(columns), tuple(replicated))
    return A.with_values(*out) if sddmm_traced[0] else out


def spmm(part: GroupCOO | BlockGroupCOO, x: jax.Array, out: jax.Array | None = None) -> jax.Array:
    """`part @ x` (`x` `(K, F)`), added into `out` in place when given: one statement,
    `C[Ai[g],n] += Av[g,p] * X[Ak[g,p],n]` (blocks: `C[Ai[g],m,n] += Av[g,m,k,p] * X[Ak[g,p],k,n]`)."""
    if isinstance(part, GroupCOO):
        C = jax.ShapeDtypeStruct((part.shape[0], x.shape[1]), x.dtype) if out is None else out
        return jinsum.einsum("C[Ai[g],n] += Av[g,p] * X[Ak[g,p],n]", C=C, A=part.astype(x.dtype), X=x)
    (bm, bk), width = part.block_shape, x.shape[1]
    C = (jax.ShapeDtypeStruct((part.shape[0] // bm, bm, width), x.dtype) if out is None
         else out.reshape(-1, bm, width))
    out = jinsum.einsum("C[Ai[g],m,n] += Av[g,m,k,p] * X[Ak[g,p],k,n]", C=C, A=part.astype(x.dtype),
                        X=x.reshape(-1, bk, width))
    return out.reshape(-1, width)


def matmul(A: Partitioned, x: jax.Array) -> jax.Array:
    """`A @ x` for row-sharded `x` `(D * R, F)`: `(D * R, F)`, row-sharded on the same split. Integer and boolean
    `x` join the product in its type, as in `A @ x` on one device."""
    _check_partitioned("jinsum.shard.matmul", A, "A @ x")
    if jnp.ndim(x) != 2:
        raise ValueError(f"jinsum.shard.matmul: expected x of shape (rows, F), got {tuple(jnp.shape(x))}; use "
                         "jinsum.shard.einsum for more axes")
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        x = jnp.asarray(x).astype(jnp.result_type(A.dtype, jnp.result_type(x)))
    return per_part(spmm, A, columns=(x,))


def row_sums(A: Partitioned, dtype=None) -> jax.Array:
    """`A.sum(axis=1)` laid out by the partition: `(D * R,)` (no exchange)."""
    _check_partitioned("jinsum.shard.row_sums", A, "jinsum.einsum('ik->i', A)")
    if A.dense_shape:
        raise ValueError(f"jinsum.shard.row_sums: expected scalar entries, got dense_shape {A.dense_shape}")
    dtype = dtype or A.dtype

    def sums(part, out=None):
        result = jinsum.einsum("ik->i", part.astype(dtype))
        return result if out is None else out + result

    return per_part(sums, A)


def einsum(subscripts: str, *operands):
    """`jinsum.einsum(subscripts, *operands)` in NumPy's notation with one `Partitioned` operand `A`
    (subscripts `rc...`): operands whose first subscript is `r` are read at the part's rows, those whose first is
    `c` at its columns (exchanged), the rest are replicated. The output's first subscript must be `r` (a
    row-sharded result), or the output must be `A`'s subscripts (an SDDMM: `A` with new values).

    Example:
      >>> edge_index = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 0]])   # a ring of 8 nodes
      >>> mesh = jax.make_mesh((jax.device_count(),), ("x",))
      >>> P = jinsum.shard.partition(jinsum.graphs.adjacency(edge_index, 8), mesh)
      >>> x = q = k = P.shard_rows(jnp.ones((8, 4)))             # laid out by P's rows
      >>> y = jinsum.shard.einsum("ik,kn->in", P, x)               # P @ x
      >>> P.unshard_rows(y).shape
      (8, 4)
      >>> scores = jinsum.shard.einsum("ik,in,kn->ik", P, q, k)    # q_i . k_k at P's entries
      >>> scores.shape
      (8, 8)
    """
    if not isinstance(subscripts, str):
        raise TypeError(f"jinsum.shard.einsum: subscripts must be a string of NumPy subscripts (e.g. 'ik,kn->in'), "
                        f"got {type(subscripts).__name__}")
    inputs_text, _, output = subscripts.replace(" ", "").partition("->")
    inputs = inputs_text.split(",")
    if len(inputs) != len(operands):
        raise ValueError(f"jinsum.shard.einsum: {subscripts!r} names {len(inputs)} operand(s) but {len(operands)} "
                         "were given")
    sparse = [k for k, x in enumerate(operands) if isinstance(x, Partitioned)]
    if len(sparse) != 1:
        raise ValueError(f"jinsum.shard.einsum: expected exactly one Partitioned operand, got {len(sparse)}")
    [s] = sparse
    A, (r, c) = operands[s], inputs[s][:2]
    if output != inputs[s] and not output.startswith(r):
        raise ValueError(f"jinsum.shard.einsum: the output {output!r} must start with the partitioned rows {r!r} "
                         f"(a row-sharded result) or equal {inputs[s]!r} (an SDDMM)")
    kinds = []
    for k, (letters, x) in enumerate(zip(inputs, operands)):
        if k == s:
            continue
        if letters[:1] in (r, c):
            kinds.append("rows" if letters[0] == r else "columns")
        elif r in letters or c in letters:
            raise ValueError(f"jinsum.shard.einsum: operand {k} ({letters!r}) uses {r!r} or {c!r} in another "
                             "place than its first axis; the rows of the split must come first")
        else:
            kinds.append("replicated")
    dense = [x for k, x in enumerate(operands) if k != s]
    # per_part passes the operands grouped by kind; `order[j]` is where the j-th of them stands among `dense`.
    order = sorted(range(len(dense)), key=lambda i: KINDS.index(kinds[i]))
    groups = {kind: [dense[i] for i in order if kinds[i] == kind] for kind in KINDS}

    def fn(part, *arrays, out=None):
        ordered = [None] * len(arrays)
        for j, array in zip(order, arrays):
            ordered[j] = array
        result = jinsum.einsum(subscripts, *ordered[:s], part, *ordered[s:])
        return result if out is None else out + result

    return per_part(fn, A, rows=groups["rows"], columns=groups["columns"], replicated=groups["replicated"])


def _merge_softmax(first, second):
    """Two softmax-weighted sums over disjoint keys, `(out, lse)` each (`lse` +inf where a query had no key), as
    the one sum over all their keys, `(out, lse)` (FlashDecoding's combine of key splits)."""
    (o1, l1), (o2, l2) = first, second
    l1, l2 = (jnp.where(jnp.isposinf(lse), -jnp.inf, lse) for lse in (l1, l2))
    shift = jnp.maximum(l1, l2)
    shift = jnp.where(jnp.isneginf(shift), 0, shift)
    w1, w2 = jnp.exp(l1 - shift), jnp.exp(l2 - shift)
    total = w1 + w2
    out = (o1 * w1[..., None].astype(o1.dtype) + o2 * w2[..., None].astype(o2.dtype))
    lse = jnp.where(total > 0, shift + jnp.log(jnp.where(total > 0, total, 1)), jnp.inf)
    return out / jnp.where(total > 0, total, 1)[..., None].astype(out.dtype), lse


def attention(q: jax.Array, k: jax.Array, v: jax.Array, A: Partitioned, *, self_loops: bool = False,
              dropout: float = 0.0, seed=None, **options) -> jax.Array:
    """`jinsum.attention(q, k, v, pattern)` over a partitioned pattern: `q` `(D * R, H, D_k)` read at the part's
    rows, `k`, `v` at its columns (exchanged), row-sharded `(D * R, H, E)` out.

    Each device attends over its local keys, then over the keys it received, and combines the two with their
    log-sum-exps (over each piece's remote matrix in turn). `self_loops` (graph attention) adds each node to its
    local keys. Dropout draws from `seed` folded with the device and the matrix (local, or a piece's remote one),
    so no two share a mask. Other keyword arguments go to `jinsum.attention` (`scale`,
    `score_mod`, ...; not `causal` or `key_padding_mask`, which read global indices).
    """
    _check_partitioned("jinsum.shard.attention", A, "jinsum.attention")
    if {"causal", "key_padding_mask"} & set(options):
        raise NotImplementedError("jinsum.shard.attention: causal and key_padding_mask read global key indices; "
                                  "not supported on a partitioned pattern")
    if dropout and seed is None:
        raise ValueError("jinsum.shard.attention: dropout needs a seed")
    seeds = () if not dropout else (jax.random.key(seed) if isinstance(seed, int) else seed,)

    matrices = 1 + len(A.remote)
    matrix = [0]  # which matrix of the device is attended: per_part calls the local one first, without `out`, then
    #               the remote ones in order

    def attend(part, q, k, v, *seed, out=None):
        remote = out is not None
        matrix[0] = matrix[0] + 1 if remote else 0
        if dropout:
            seed = jax.random.fold_in(seed[0], matrices * jax.lax.axis_index(A.axis) + matrix[0])
        result = jinsum.attention(q, k, v, part, self_loops=self_loops and not remote, dropout=dropout,
                                  seed=seed if dropout else None, return_lse=True, **options)
        return result if out is None else _merge_softmax(out, result)

    return per_part(attend, A, rows=(q,), columns=(k, v), replicated=seeds)[0]

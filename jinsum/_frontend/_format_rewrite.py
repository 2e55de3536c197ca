"""NumPy subscripts over a sparse format -> the format's indirect Einsum.

The sparse operand `A` with subscripts `rc` (row `r`, column `c`, then any dense value axes) is replaced by its
stored values, and its row and column letters by indirections wherever they occur:

    GroupCOO:       r -> Ai[g],       c -> Ak[g,p],       A[r,c,...] -> Av[g,p,...]
    BlockGroupCOO:  r -> Ai[g], m,    c -> Ak[g,p], k,    A[r,c]     -> Av[g,m,k,p]

So `"ik,kn->in"` becomes `C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]`. For the block format, dense axes labelled `r`
or `c` are split into (block, offset) axes, zero-padded to whole blocks. When the output subscripts are exactly
the sparse operand's, the output keeps its sparsity (SDDMM) and a format with the new values is returned.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import numpy as np

from jinsum._rules import _primitive
from jinsum._lang import ColumnOrder, parse
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.formats._base import PRODUCTS
from jinsum.formats._convert import check_not_overflowed


def numpy_einsum(subscripts: str, operands, *, allow_tf32: bool):
    inputs, output = _split_subscripts(subscripts, len(operands))
    sparse = [k for k, x in enumerate(operands) if isinstance(x, (GroupCOO, BlockGroupCOO))]
    operands = [x if k in sparse else jnp.asarray(x) for k, x in enumerate(operands)]  # (lists, as NumPy takes)
    if not sparse:
        precision = lax.Precision.DEFAULT if allow_tf32 else lax.Precision.HIGHEST
        return jnp.einsum(subscripts, *operands, precision=precision)
    if len(sparse) > 1:
        raise NotImplementedError(f"jinsum: {subscripts!r} multiplies {len(sparse)} sparse operands; products of "
                                  "sparse operands are not supported yet (densify all but one with .todense())")
    [s] = sparse
    if not output:
        raise NotImplementedError(f"jinsum: {subscripts!r} has a scalar output, which is not supported with a sparse "
                                  "operand; keep an index in the output and sum the result")
    A = operands[s]
    sizes = _letter_sizes(subscripts, inputs, operands)
    rows, cols, *dense = inputs[s]
    if rows == cols:
        raise NotImplementedError(f"jinsum: {subscripts!r} takes the diagonal of a sparse operand; not supported")
    block = isinstance(A, BlockGroupCOO)
    if block:
        bm, bk = A.block_shape
        replace = {rows: ["Ai[_g]", "_m"], cols: ["Ak[_g,_p]", "_k"]}
        values = "Av[_g,_m,_k,_p]"
        split = {rows: (A.shape[0], bm), cols: (A.shape[1], bk)}
    else:
        replace = {rows: ["Ai[_g]"], cols: ["Ak[_g,_p]"]}
        values = f"Av[{','.join(['_g', '_p', *dense])}]"
        split = {}

    def access(name: str, letters: str) -> str:
        return f"{name}[{','.join(part for letter in letters for part in replace.get(letter, [letter]))}]"

    factors, arrays = [], {"A": A}
    for k, (letters, x) in enumerate(zip(inputs, operands)):
        if k == s:
            factors.append(values)
            continue
        factors.append(access(f"X{k}", letters))
        arrays[f"X{k}"] = _split_axes(x, letters, split)
    dtype = jnp.result_type(A.dtype, *(arrays[f"X{k}"].dtype for k in range(len(operands)) if k != s))
    for k in range(len(operands)):  # integer and boolean operands join the product in its type, as in jnp.matmul
        if k != s and not jnp.issubdtype(arrays[f"X{k}"].dtype, jnp.inexact):
            arrays[f"X{k}"] = arrays[f"X{k}"].astype(dtype)

    if output == inputs[s]:  # the output takes the sparse operand's structure
        lhs = values.replace("Av", "Out", 1)
        arrays["Out"] = jnp.zeros(A.Av.shape, dtype)
        expanded, order = _expand(arrays)
        result = _primitive.bind(parse(f"{lhs} = {' * '.join(factors)}"), expanded, sorted_indices=frozenset({"Ai"}),
                                 allow_tf32=allow_tf32, zero_lhs=True, column_order=order)
        return A.with_values(result)

    out_shape = [d for letter in output for d in _split_shape(letter, sizes[letter], split)]
    arrays["Out"] = jnp.zeros(out_shape, dtype)
    statement = parse(f"{access('Out', output)} += {' * '.join(factors)}")
    expanded, order = _expand(arrays)
    out = _primitive.bind(statement, expanded, sorted_indices=frozenset({"Ai"}), allow_tf32=allow_tf32,
                          zero_lhs=True, column_order=order)
    return _merge_axes(out, output, split)


def _expand(arrays: dict) -> tuple[dict, ColumnOrder | None]:
    """The format `A` among `arrays` replaced by `Ai`, `Ak` and `Av` (and its entries in column order, if it
    carries them)."""
    A = arrays.pop("A")
    expanded = {**arrays, **format_arrays(A, "A")}
    order = None
    if getattr(A, "transposed", None) is not None:
        order, entries = column_order(A, "A")
        expanded.update(entries)
    return expanded, order


def format_arrays(A: GroupCOO | BlockGroupCOO, name: str) -> dict:
    """The arrays `{name}i`, `{name}k`, `{name}v` that a format operand binds: every format enters the einsum
    front end here (the indirect notation's `A=`, NumPy subscripts and `@`). Outside `jit`, a format whose
    `overflow` flag is set (built for a capacity under `jit` and returned: entries were dropped) is refused; a
    traced flag is not read, so jitted calls trace as before."""
    check_not_overflowed("jinsum", A)
    return {name + "i": A.Ai, name + "k": A.Ak, name + "v": A.Av}


def column_order(A: GroupCOO, name: str) -> tuple[ColumnOrder, dict]:
    """`A.transposed` as the primitive's column order for a statement that names `A`'s arrays `{name}i`, `{name}k`
    and `{name}v`: the order and its operands by name."""
    entries = {f"{name}_{field}": getattr(A.transposed, field) for field in ("columns", "rows", "slots")}
    order = ColumnOrder(f"{name}v", f"{name}i", f"{name}k",
                        *(_primitive.operand(n, x) for n, x in entries.items()))
    return order, entries


def _split_subscripts(subscripts: str, count: int) -> tuple[list[str], str]:
    if "." in subscripts:
        raise NotImplementedError(f"jinsum: ellipses in {subscripts!r} are not supported with sparse operands; "
                                  "name every axis")
    spec = subscripts.replace(" ", "")
    inputs_text, arrow, output = spec.partition("->")
    inputs = inputs_text.split(",")
    if len(inputs) != count:
        raise ValueError(f"jinsum: {subscripts!r} names {len(inputs)} operand(s) but {count} were given")
    if not all(s.isalpha() for s in inputs + ([output] if output else [])):
        raise ValueError(f"jinsum: {subscripts!r}: subscripts must be letters")
    letters = "".join(inputs)
    if not arrow:  # NumPy's implicit output: the letters that occur once, in alphabetical order
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    missing = [c for c in output if c not in letters]
    if missing:
        raise ValueError(f"jinsum: {subscripts!r}: output index {missing[0]!r} appears in no operand's subscripts; "
                         "every output index must name an axis of an operand")
    repeated = [c for c in output if output.count(c) > 1]
    if repeated:
        raise ValueError(f"jinsum: {subscripts!r}: output index {repeated[0]!r} appears more than once in the output "
                         "(as in NumPy, an output names each index once)")
    return inputs, output


def _letter_sizes(subscripts: str, inputs: list[str], operands) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for k, (letters, x) in enumerate(zip(inputs, operands)):
        shape = tuple(x.shape)
        if len(letters) != len(shape):
            raise ValueError(f"jinsum: {subscripts!r}: operand {k} has shape {shape} but its subscripts "
                             f"{letters!r} name {len(letters)} axes")
        for letter, size in zip(letters, shape):
            if sizes.setdefault(letter, size) != size:
                raise ValueError(f"jinsum: {subscripts!r}: '{letter}' has size {sizes[letter]} in one operand and "
                                 f"{size} in operand {k} (shape {shape})")
    return sizes


def _split_shape(letter: str, size: int, split: dict) -> list[int]:
    if letter not in split:
        return [size]
    _, block = split[letter]
    return [-(-size // block), block]


def _split_axes(x, letters: str, split: dict):
    """Pads each axis labelled with a block-split letter to whole blocks and splits it into (block, offset)."""
    for axis in reversed(range(len(letters))):
        if letters[axis] in split:
            blocks, block = _split_shape(letters[axis], x.shape[axis], split)
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, blocks * block - x.shape[axis])
            x = jnp.pad(x, pad).reshape(*x.shape[:axis], blocks, block, *x.shape[axis + 1:])
    return x


def _merge_axes(x, letters: str, split: dict):
    """Undoes `_split_axes` on the output: merges (block, offset) axes and drops the padding."""
    axis = 0
    for letter in letters:
        if letter in split:
            size, _ = split[letter]
            x = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
            x = lax.slice_in_dim(x, 0, size, axis=axis)
        axis += 1
    return x


# --- `@` on the formats ------------------------------------------------------------------------------------------

def _matmul(subscripts: dict[int, str], sparse, dense, operands):
    ndim = np.ndim(dense)
    if sparse.ndim != 2 or ndim not in subscripts:
        raise ValueError(f"jinsum: @ takes a 2-D sparse matrix and a 1-D or 2-D dense operand, got "
                         f"{type(sparse).__name__} of shape {sparse.shape} and an operand of shape {np.shape(dense)}; "
                         "use jinsum.einsum with explicit subscripts for other products")
    return numpy_einsum(subscripts[ndim], operands, allow_tf32=False)


def _format_matmul(self, other):
    """`A @ x`, `A @ B` for a dense vector or matrix: the format's SpMV / SpMM."""
    return _matmul({1: "ik,k->i", 2: "ik,kn->in"}, self, other, (self, other))


def _format_rmatmul(self, other):
    """`x @ A`, `B @ A` for a dense vector or matrix."""
    return _matmul({1: "k,ki->i", 2: "mk,ki->mi"}, self, other, (other, self))


PRODUCTS.update(matmul=_format_matmul, rmatmul=_format_rmatmul)

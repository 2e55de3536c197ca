"""The expression catalog every lowering is tested on, with random operands that exercise the awkward cases.

Operands are drawn per call: odd sizes, empty output rows, duplicate targets (several groups or edges writing the
same row), padding slots (column 0, value 0), and at least one all-empty instance per format. Index arrays are
int32, values take the requested dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

Make = Callable[[np.random.Generator, np.dtype], dict]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    expression: str
    make: Make
    differentiated: tuple[str, ...]  # value operands the tests differentiate (a sum is linear in each)

    def __repr__(self) -> str:
        return self.name


def _values(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _group_rows(rng, rows: int, groups: int) -> np.ndarray:
    """Sorted rows of `groups` groups over `rows` rows: some rows get several groups, some none."""
    return np.sort(rng.integers(0, rows, groups)).astype(np.int32)


def _padded(rng, groups: int, size: int, columns: int, dtype, dense=()):
    """Column indices and values of `groups` groups of `size` slots, some trailing slots padding (column 0, 0)."""
    Ak = rng.integers(0, columns, (groups, size)).astype(np.int32)
    Av = _values(rng, (groups, size, *dense), dtype)
    padding = rng.random((groups, size)) < 0.25
    Ak[padding] = 0
    Av[padding] = 0
    return Ak, Av


def group_spmm(rng, dtype, M=13, K=11, N=6, G=17, P=4):
    Ak, Av = _padded(rng, G, P, K, dtype)
    return dict(C=_values(rng, (M, N), dtype), Ai=_group_rows(rng, M, G), Ak=Ak, Av=Av,
                B=_values(rng, (K, N), dtype))


def _empty_group_spmm(rng, dtype):
    return group_spmm(rng, dtype, G=0)


def _coo_spmm(rng, dtype, M=10, K=7, N=5, E=23):
    return dict(C=_values(rng, (M, N), dtype), R=rng.integers(0, M, E).astype(np.int32),
                Col=rng.integers(0, K, E).astype(np.int32), V=_values(rng, (E,), dtype),
                B=_values(rng, (K, N), dtype))


def _block_spmm(rng, dtype, Mb=5, Kb=4, bm=3, bk=2, N=5, G=7, P=2):
    Ak = rng.integers(0, Kb, (G, P)).astype(np.int32)
    return dict(C=_values(rng, (Mb, bm, N), dtype), Ai=_group_rows(rng, Mb, G), Ak=Ak,
                Av=_values(rng, (G, bm, bk, P), dtype), B=_values(rng, (Kb, bk, N), dtype))


def _block_spmm_tiles(rng, dtype):
    """Blocks large enough for the Tensor Core (tl.dot) plan."""
    return _block_spmm(rng, dtype, Mb=4, Kb=3, bm=16, bk=16, N=24, G=5, P=2)


def _block_sddmm(rng, dtype, Mb=3, Kb=4, b=16, D=16, G=4, P=2):
    return dict(S=_values(rng, (G, b, b, P), dtype), Ai=_group_rows(rng, Mb, G),
                Ak=rng.integers(0, Kb, (G, P)).astype(np.int32), Q=_values(rng, (Mb, b, D), dtype),
                K=_values(rng, (Kb, b, D), dtype))


def _sddmm(rng, dtype, M=9, K=8, D=5, G=12, P=3):
    Ak, _ = _padded(rng, G, P, K, dtype)
    return dict(S=_values(rng, (G, P), dtype), Ai=_group_rows(rng, M, G), Ak=Ak,
                X=_values(rng, (M, D), dtype), Y=_values(rng, (K, D), dtype))


def _rgcn(rng, dtype, N=9, E=20, R=3, Cin=4, F=5):
    return dict(O=_values(rng, (N, F), dtype), R=rng.integers(0, N, E).astype(np.int32),
                C=rng.integers(0, N, E).astype(np.int32), T=rng.integers(0, R, E).astype(np.int32),
                X=_values(rng, (N, Cin), dtype), W=_values(rng, (R, Cin, F), dtype))


def _nested(rng, dtype):
    operands = group_spmm(rng, dtype)
    operands["P"] = rng.permutation(operands["C"].shape[0]).astype(np.int32)
    return operands


def _ell(rng, dtype, M=9, K=10, N=4, P=3):
    Ak, Av = _padded(rng, M, P, K, dtype)
    return dict(C=_values(rng, (M, N), dtype), V=Av, K=Ak, B=_values(rng, (K, N), dtype))


def _embedding_bag(rng, dtype, V=12, D=6, Bags=7, P=5):
    return dict(O=_values(rng, (Bags, D), dtype), W=_values(rng, (V, D), dtype),
                Idx=rng.integers(0, V, (Bags, P)).astype(np.int32), Wt=_values(rng, (Bags, P), dtype))


def _multihead(rng, dtype, M=8, K=9, H=3, N=4, G=11, P=2):
    Ak, Av = _padded(rng, G, P, K, dtype, dense=(H,))
    return dict(C=_values(rng, (M, H, N), dtype), Ai=_group_rows(rng, M, G), Ak=Ak, Av=Av,
                B=_values(rng, (K, H, N), dtype))


def _grouped_matmul(rng, dtype, E=3, T=29, C=16, H=24, G=5, P=16):
    """Each slot's token row by its group's expert matrix (a mixture of experts in grouped order): groups of
    Tensor Core size (the tl.dot plan, rows gathered), an expert with no group, repeated tokens, padding slots."""
    Ak, _ = _padded(rng, G, P, T, dtype)
    return dict(H=_values(rng, (G, P, H), dtype), Ai=_group_rows(rng, E - 1, G), Ak=Ak,
                X=_values(rng, (T, C), dtype), W=_values(rng, (E, C, H), dtype))


def _scatter_set(rng, dtype, M=9, I=6, N=4):  # noqa: E741 (the statement's names)
    return dict(C=_values(rng, (M, N), dtype), P=rng.permutation(M)[:I].astype(np.int32),
                X=_values(rng, (I, N), dtype))


CATALOG = [
    Case("group_spmm", "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", group_spmm, ("C", "Av", "B")),
    Case("group_spmm_empty", "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", _empty_group_spmm, ("C", "Av", "B")),
    Case("coo_spmm", "C[R[e],n] += V[e] * B[Col[e],n]", _coo_spmm, ("C", "V", "B")),
    Case("block_spmm", "C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]", _block_spmm, ("C", "Av", "B")),
    Case("block_spmm_tiles", "C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]", _block_spmm_tiles, ("C", "Av", "B")),
    Case("block_sddmm", "S[g,m,k,p] = Q[Ai[g],m,d] * K[Ak[g,p],k,d]", _block_sddmm, ("Q", "K")),
    Case("sddmm", "S[g,p] = X[Ai[g],d] * Y[Ak[g,p],d]", _sddmm, ("X", "Y")),
    Case("rgcn", "O[R[e],f] += X[C[e],c] * W[T[e],c,f]", _rgcn, ("O", "X", "W")),
    Case("nested", "C[P[Ai[g]],n] += Av[g,p] * B[Ak[g,p],n]", _nested, ("C", "Av", "B")),
    Case("ell", "C[i,n] += V[i,p] * B[K[i,p],n]", _ell, ("C", "V", "B")),
    Case("embedding_bag", "O[b,d] += W[Idx[b,p],d] * Wt[b,p]", _embedding_bag, ("O", "W", "Wt")),
    Case("multihead_spmm", "C[Ai[g],h,n] += Av[g,p,h] * B[Ak[g,p],h,n]", _multihead, ("C", "Av", "B")),
    Case("grouped_matmul", "H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]", _grouped_matmul, ("H", "X", "W")),
    Case("scatter_set", "C[P[i],n] = X[i,n]", _scatter_set, ("C", "X")),
    Case("spmm_transpose", "B[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]", group_spmm, ("B", "Av", "C")),
]


# --- max= and min= -----------------------------------------------------------------------------------------------
# Every index in range (padding would take part: a format passed as A= leaves it out, see test_reductions.py);
# float64 references by np.maximum.at. Rows without groups keep their initial value, rows with several combine.

def extreme_spmm(rng, dtype, M=13, K=11, N=6, G=17, P=4):
    return dict(C=_values(rng, (M, N), dtype), Ai=_group_rows(rng, M, G),
                Ak=rng.integers(0, K, (G, P)).astype(np.int32), Av=_values(rng, (G, P), dtype),
                B=_values(rng, (K, N), dtype))


def _extreme_gather(rng, dtype, N=6):
    operands = extreme_spmm(rng, dtype, N=N)
    del operands["Av"]
    return operands


def _extreme_wide_gather(rng, dtype, M=9, K=11, N=130, G=11, P=4):
    """Lanes wider than a program's (128), the last tile 2 wide; fewer groups than the others (the stress
    configuration's 4-lane tiles make 33 programs a window), still more than a window of 8, in a short last one;
    rows with several groups, and the last row empty."""
    return dict(C=_values(rng, (M, N), dtype), Ai=_group_rows(rng, M - 1, G),
                Ak=rng.integers(0, K, (G, P)).astype(np.int32), B=_values(rng, (K, N), dtype))


def _extreme_scatter(rng, dtype, M=13, K=11, N=6, G=17, P=4):
    return dict(C=_values(rng, (K, N), dtype), Ai=_group_rows(rng, M, G),
                Ak=rng.integers(0, K, (G, P)).astype(np.int32), Av=_values(rng, (G, P), dtype),
                B=_values(rng, (M, N), dtype))


def _extreme_scores(rng, dtype, M=13, K=11, D=5, G=17, P=4):
    return dict(S=_values(rng, (M,), dtype), Ai=_group_rows(rng, M, G),
                Ak=rng.integers(0, K, (G, P)).astype(np.int32), X=_values(rng, (M, D), dtype),
                Y=_values(rng, (K, D), dtype))


EXTREMA = [
    Case("spmm_max", "C[Ai[g],n] max= Av[g,p] * B[Ak[g,p],n]", extreme_spmm, ("C", "Av", "B")),
    Case("gather_min", "C[Ai[g],n] min= B[Ak[g,p],n]", _extreme_gather, ("C", "B")),
    Case("wide_gather_max", "C[Ai[g],n] max= B[Ak[g,p],n]", _extreme_wide_gather, ("C", "B")),
    Case("scatter_max", "C[Ak[g,p],n] max= Av[g,p] * B[Ai[g],n]", _extreme_scatter, ("C", "Av", "B")),
    Case("row_min", "C[i] min= A[i,j]",
         lambda rng, dtype: dict(C=_values(rng, (13,), dtype), A=_values(rng, (13, 37), dtype)), ("C", "A")),
    Case("dense_max", "C[i,n] max= A[i,k] * B[k,n]",
         lambda rng, dtype: dict(C=_values(rng, (13, 6), dtype), A=_values(rng, (13, 11), dtype),
                                 B=_values(rng, (11, 6), dtype)), ("C", "A", "B")),
    Case("score_max", "S[Ai[g]] max= X[Ai[g],d] * Y[Ak[g,p],d]", _extreme_scores, ("S", "X", "Y")),
    Case("elementwise_max", "C[i,n] max= A[i,n] * B[i,n]",  # no reduced variable: one term per element
         lambda rng, dtype: dict(C=_values(rng, (7, 6), dtype), A=_values(rng, (7, 6), dtype),
                                 B=_values(rng, (7, 6), dtype)), ("C", "A", "B")),
    Case("pool_max", "Out[b[i],n] max= X[i,n]",
         lambda rng, dtype: dict(Out=np.full((4, 6), -np.inf, dtype), b=_group_rows(rng, 4, 19),
                                 X=_values(rng, (19, 6), dtype)), ("X",)),
]

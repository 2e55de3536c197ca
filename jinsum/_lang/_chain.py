"""A fused chain of statements: sparse attention as scores -> transform -> softmax -> weighted sum.

    S[..., g, (m, k,) p, h] = Q[..., Ai[g], (m,) h, d] * K[..., Ak[g,p], (k,) h, d]      scores (an SDDMM)
    S' = score_mod(scale * S, b, h, q_idx, kv_idx), -inf where masked                    elementwise
    P  = softmax of S' over the entries that write one output row                        row reduction
    O[..., Ai[g], (m,) h, e] += P[..., g, (m, k,) p, h] * V[..., Ak[g,p], (k,) h, e]    aggregation (an SpMM)

over the stored entries of a pattern `(Ai, Ak, Av)`: a `GroupCOO` (one score per stored entry) or a
`BlockGroupCOO` (a `bm x bk` tile of scores per stored block, positions `q_idx = Ai[g] * bm + m`,
`kv_idx = Ak[g,p] * bk + k`). An entry attends where the pattern's value `Av` is nonzero, `mask_mod(b, h, q_idx,
kv_idx)` holds, the causal rule holds (`q_idx >= kv_idx`) and the key is not padding. For a block pattern `Av` is
either the blocks' elements `Av[g,m,k,p]` or one flag per block `Av[g,p]` (2: every element attends, 1: the
`mask_mod` decides, 0: none; `jinsum.block_mask` builds those). The row of an entry is its output row
`(..., Ai[g], (m,) h)`: its log-sum-exp `LSE` is the second result, kept for the backward.

Grouped-query attention adds a variable `r` to the queries and the output (`Q[..., Ai[g], (m,) h, r, d]`): the
`r`-th query head of key/value head `h` is head `h * R + r` for `score_mod` and `mask_mod`.

Arrays that `score_mod` and `mask_mod` capture (document ids, a bias table) are operands after the others, named
`MC0, MC1, ...` (the mask's) and `SC0, SC1, ...` (the score's); the floating ones of the score get gradients.

A `Chain` holds the two checked statements and what sits between them. It is the parameter of the attention
primitives, and the code generator plans one fused kernel from it (`jinsum.kernels.make_chain_plan`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from jinsum._lang._ast import Access, Var, variables
from jinsum._lang._check import Operand, Spec


@dataclasses.dataclass(frozen=True)
class Roles:
    """What each index variable of a chain is.

    Attributes:
      group, slot: the pattern's group and slot (`Ai[g]`, `Ak[g,p]`).
      query_offset, key_offset: the position inside a block row / block column (block patterns), else None.
      head: the head.
      contract: summed in the scores (`d`); feature: the output's last axis (`e`).
      batch: batch variables, outermost first (`vmap` adds its variables in front).
      batch_index: the batch variable that `score_mod` sees as `b` (the caller's batch axis), or None.
      head_group: grouped-query attention: the query head within its key/value head's group, or None.
    """

    group: str = "g"
    slot: str = "p"
    query_offset: str | None = None
    key_offset: str | None = None
    head: str = "h"
    contract: str = "d"
    feature: str = "e"
    batch: tuple[str, ...] = ()
    batch_index: str | None = None
    head_group: str | None = None


@dataclasses.dataclass(frozen=True)
class Chain:
    """A checked attention chain (see the module docstring).

    Attributes:
      scores: `S[...] = Q[...] * K[...]`, checked; `S` holds one score per stored entry (and block element).
      output: `O[...] += S[...] * V[...]`, checked (with the softmax weights in place of `S`).
      mask: the pattern's values as the chain reads them, `Av[g,p]`, `Av[g,p,h]` or `Av[g,m,k,p]`; nonzero attends
        (block flags `Av[g,p]` of a block pattern: see the module docstring).
      key_mask: `KM[..., Ak[g,p], (k)]` (nonzero: a real key) or None.
      extra: the operands of `mask` and `key_mask`.
      roles: the variables' roles.
      scale: multiplies the raw scores, before `score_mod`.
      score_mod: a traced `jinsum._lang._elementwise.Elementwise` of kind "score_mod", or None.
      mask_mod: a traced `Elementwise` of kind "mask_mod", or None.
      causal: an entry attends only if `q_idx >= kv_idx`.
      dropout: the rate at which attention weights are dropped (kept ones scale by `1 / (1 - rate)`): a weight is
        dropped iff the top 24 bits of its random word fall below `dropout_threshold`.
      self_loops: every row `i` also attends to key `i` (a stored entry with key `i` is masked instead); for graph
        attention with the same nodes as queries and keys.
      allow_tf32: float32 score and output products may use TensorFloat-32.
    """

    scores: Spec
    output: Spec
    mask: Access
    key_mask: Access | None
    extra: tuple[Operand, ...]
    roles: Roles
    scale: float
    score_mod: Any = None
    mask_mod: Any = None
    causal: bool = False
    dropout: float = 0.0
    self_loops: bool = False
    allow_tf32: bool = False

    def __repr__(self) -> str:  # what a printed jaxpr shows
        parts = [f"{self.scores.statement}", f"{self.output.statement.lhs} += softmax(S) * "
                 f"{self.output.statement.factors[1]}", f"mask {self.mask}"]
        if self.key_mask is not None:
            parts.append(f"keys {self.key_mask}")
        flags = [f"scale={self.scale:.4g}"] + [name for name, on in (("causal", self.causal),
                                                                      ("self_loops", self.self_loops)) if on]
        for mod in (self.score_mod, self.mask_mod):
            if mod is not None:
                flags.append(f"{mod.kind}={mod.name}" + (f" ({len(mod.captures)} captured)" if mod.captures else ""))
        if self.roles.head_group:
            flags.append(f"{self.group_size} query heads per kv head")
        if self.dropout:
            flags.append(f"dropout={self.dropout}")
        return f"Chain({'; '.join(parts)}; {', '.join(flags)})"

    @property
    def dropout_threshold(self) -> int:
        """The 24-bit integer below which a weight's random bits drop it: the rule the XLA reference
        (`jinsum._attention._random_bits`) and the generated kernels (`tl.randint`) both apply."""
        return int(round(self.dropout * 2**24))

    # --- operands --------------------------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """The attention primitive's operands, in order."""
        return (("Ai", "Ak", "Av", "seed", "Q", "K", "V") + (("KM",) if self.key_mask is not None else ())
                + self.mask_captures + self.score_captures)

    @property
    def mask_captures(self) -> tuple[str, ...]:
        """The operands `mask_mod` captures, in its order."""
        return tuple(f"MC{i}" for i in range(len(self.mask_mod.captures) if self.mask_mod else 0))

    @property
    def score_captures(self) -> tuple[str, ...]:
        """The operands `score_mod` captures, in its order."""
        return tuple(f"SC{i}" for i in range(len(self.score_mod.captures) if self.score_mod else 0))

    @property
    def differentiable(self) -> tuple[str, ...]:
        """The operands with a gradient: `Q`, `K`, `V` and the floating arrays `score_mod` captures."""
        return ("Q", "K", "V") + tuple(f"SC{i}" for i in (self.score_mod.differentiable if self.score_mod else ()))

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.scores.extent[self.roles.head_group] if self.roles.head_group else 1

    @functools.cached_property
    def operand(self) -> dict[str, Operand]:
        table = {**self.scores.operand, **self.output.operand, **{o.name: o for o in self.extra}}
        table["seed"] = Operand("seed", (), np.dtype(np.int32))
        for names, mod in ((self.mask_captures, self.mask_mod), (self.score_captures, self.score_mod)):
            for name, spec in zip(names, mod.captures if mod else ()):
                table[name] = Operand(name, tuple(spec.shape), np.dtype(spec.dtype))
        out = self.output.statement.lhs
        shape = tuple(n for i, n in zip(out.indices, self.output.lhs.shape)
                      if not (isinstance(i, Var) and i.name == self.roles.feature))
        table["LSE"] = Operand("LSE", shape, np.dtype(np.float64 if table["Q"].dtype == np.float64 else np.float32))
        return table

    @functools.cached_property
    def lse(self) -> Access:
        """`LSE[..., Ai[g], (m,) h]`: the output's access without the feature variable."""
        lhs = self.output.statement.lhs
        return Access("LSE", tuple(i for i in lhs.indices if not (isinstance(i, Var) and i.name == self.roles.feature)))

    @property
    def block(self) -> tuple[int, int] | None:
        """`(bm, bk)` for a block pattern, else None."""
        r = self.roles
        if r.query_offset is None:
            return None
        return self.scores.extent[r.query_offset], self.scores.extent[r.key_offset]

    @property
    def rows(self) -> int:
        """Output rows (block rows for a block pattern): the extent `Ai` addresses."""
        return self.operand["Q"].shape[len(self.roles.batch)]

    @property
    def keys(self) -> int:
        """Key rows (block columns): the extent `Ak` addresses."""
        return self.operand["K"].shape[len(self.roles.batch)]

    @property
    def grid(self) -> tuple[str, ...]:
        """The variables of one softmax row besides its position: batch variables, then the head (and the query
        head within its group)."""
        return (*self.roles.batch, self.roles.head) + ((self.roles.head_group,) if self.roles.head_group else ())

    @property
    def entries(self) -> int:
        """Stored entries (blocks), padding included: `G * P`; self loops number after them."""
        return self.scores.extent[self.roles.group] * self.scores.extent[self.roles.slot]

    def accesses(self) -> dict[str, Access]:
        """The chain's tensors by name: `Q`, `K` (scores), `V`, `O` (output), `Av`, `KM`, `LSE`."""
        scores, output = self.scores.statement, self.output.statement
        found = {"Q": scores.factors[0], "K": scores.factors[1], "V": output.factors[1], "O": output.lhs,
                 "Av": self.mask, "LSE": self.lse}
        if self.key_mask is not None:
            found["KM"] = self.key_mask
        return found

    def check(self) -> Chain:
        """Validates the structure the kernels rely on; returns self."""
        r, scores, output = self.roles, self.scores, self.output
        if tuple(f.tensor for f in scores.statement.factors) != ("Q", "K") or scores.statement.accumulate:
            raise ValueError(f"jinsum: a chain's scores must be `S[...] = Q[...] * K[...]`, got {scores.statement}")
        if output.statement.factors[0].tensor != scores.statement.lhs.tensor:
            raise ValueError(f"jinsum: a chain's output must read the scores, got {output.statement}")
        for mod, kind in ((self.score_mod, "score_mod"), (self.mask_mod, "mask_mod")):
            if mod is not None and mod.kind != kind:
                raise ValueError(f"jinsum: a chain's {kind} must be traced as one, got a {mod.kind}")
        if output.lhs_sorted_index != "Ai":
            raise ValueError(f"jinsum: a chain's output must be written through the sorted rows Ai, got "
                             f"{output.statement}")
        for v in variables(output.statement.lhs):
            if v not in {*r.batch, r.group, r.query_offset, r.head, r.head_group, r.feature}:
                raise ValueError(f"jinsum: unexpected variable {v!r} in a chain's output {output.statement.lhs}")
        return self

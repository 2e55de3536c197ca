"""The primitive `jinsum_p` and all its rules: shapes, JVP, transpose, batching, checked indices.

Enters: a checked `Spec` (`jinsum._lang`) and its operands. Leaves: more statements of the same primitive (the
derived ones of `_derive`: tangents, transposes, batched forms; deterministic mode's sorted segment reductions of
`_deterministic`), each still a `Spec`. Imports nothing from the lowerings. Next stage: `jinsum._lowering`.
"""

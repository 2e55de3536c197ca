"""The front end: what a user writes -> a checked statement bound to the primitive.

Enters: an expression string and named operands (arrays, formats, `ShapeDtypeStruct`s), or `A @ B` / a NumPy
subscript string over formats. Leaves: `jinsum_p.bind(*arrays, spec=...)` of `_rules`, after operand checks that
run before tracing. Next stage: `jinsum._rules` (the primitive and its rules).
"""

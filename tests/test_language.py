"""The notation: what parses, what it means structurally, and one test per rejected input with its message."""

import numpy as np
import pytest

from jinsum._lang import Access, ExpressionError, Operand, Var, check, parse, tensor_names

CATALOG = [
    "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]",
    "C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]",
    "S[g,p] = X[Ai[g],d] * Y[Ak[g,p],d]",
    "O[R[e],f] += X[C[e],c] * W[T[e],c,f]",
    "C[P[Ai[g]],n] += Av[g,p] * B[Ak[g,p],n]",
    "O[b,d] += W[Idx[b,p],d] * Wt[b,p]",
    "C[Ai[g],h,n] += Av[g,p,h] * B[Ak[g,p],h,n]",
    "out_rows[row_of[edge], feature] += weight[edge] * features[col_of[edge], feature]",
]


@pytest.mark.parametrize("text", CATALOG)
def test_catalog_round_trips_through_canonical_text(text):
    statement = parse(text)
    assert str(statement) == text.replace(", ", ",")
    assert parse(str(statement)) == statement


def test_structure_of_spmm():
    statement = parse("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]")
    assert statement.accumulate
    assert statement.lhs == Access("C", (Access("Ai", (Var("g"),)), Var("n")))
    assert [f.tensor for f in statement.factors] == ["Av", "B"]
    assert tensor_names(statement) == ("C", "Ai", "Av", "B", "Ak")
    assert not parse("S[g,p] = X[Ai[g],d] * Y[Ak[g,p],d]").accumulate


def test_whitespace_and_long_names_do_not_matter():
    assert parse("C [ Ai[ g ] , n ]+=Av[g,p]*B[Ak[g,p],n]") == parse("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]")
    assert parse("x_1[row_2] = y_[row_2]").lhs.tensor == "x_1"


def test_parse_is_cached():
    assert parse("C[i] += A[i,j]") is parse("C[i] += A[i,j]")


def _operands(**shapes):
    return tuple(Operand(n, s, np.dtype(d)) for n, (s, d) in shapes.items())


SPMM = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"
SPMM_OPERANDS = dict(C=((7, 5), "float32"), Ai=((4,), "int32"), Ak=((4, 3), "int32"), Av=((4, 3), "float32"),
                     B=((9, 5), "float32"))


def test_check_infers_extents_and_roles():
    spec = check(parse(SPMM), _operands(**SPMM_OPERANDS))
    assert spec.extent == {"g": 4, "n": 5, "p": 3}
    assert spec.names == ("C", "Ai", "Av", "B", "Ak")
    assert spec.loop_variables == ("g", "n") and spec.summed_variables == ("p",)
    assert spec.index_tensors == {"Ai", "Ak"}
    assert repr(spec) == f"Spec({SPMM!r})"
    assert check(parse(SPMM), _operands(**SPMM_OPERANDS)) is spec  # cached on (statement, shapes, dtypes)


@pytest.mark.parametrize("text, message, caret", [
    ("C[i] += A[i+1]", "arithmetic in an index is not supported", "+"),
    ("C[i] += A[i-1]", "arithmetic in an index is not supported", "-"),
    ("C[i] += 2 * A[i]", "constants are not supported", "2"),
    ("C[i] += A[i] + B[i]", r"only a product of accesses", "+"),
    ("C[i] += A[i] - B[i]", r"only a product of accesses", "-"),
    ("C[i] A[i]", "expected '=', '\\+=', 'max=' or 'min=' after the left-hand side", "A"),
    ("C[i] += A[i", "but the expression ended", ""),
    ("C[] += A[i]", r"'C\[\]' has no index", "]"),
    ("C += A[i]", "'C' must be accessed with brackets", "C"),
    ("C[i] += A", "'A' must be accessed with brackets", "A"),
    ("C[i] += A[i] *", "after '\\*', but the expression ended", ""),
    ("C[i] += A[(i)]", "arithmetic in an index", "("),
    ("C[i] += A[i] B[i]", "expected '\\*' or the end", "B"),
    ("C[i] += A[i] ; B[i]", "expected '\\*' or the end", ";"),
    ("C[i] == A[i]", "expected a tensor access", "="),
])
def test_parse_errors_point_at_the_token(text, message, caret):
    with pytest.raises(ExpressionError, match=message) as info:
        parse(text)
    lines = str(info.value).splitlines()
    assert lines[1] == "    " + text
    column = lines[2].index("^") - 4
    if caret:
        assert text[column:column + len(caret)] == caret
    else:
        assert column == len(text)


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError, match="must be a string"):
        parse(3)


@pytest.mark.parametrize("changes, message, caret", [
    (dict(B=None), r"unknown operand 'B': pass it by name", "B[Ak[g,p],n]"),
    (dict(Z=((3,), "float32")), r"operand\(s\) Z= do not appear in the expression", None),
    (dict(B=((9, 5, 2), "float32")), r"B \(shape \(9, 5, 2\), float32\) has 3 dimension\(s\) but B\[Ak\[g,p\],n\] "
     r"gives 2 index", "B[Ak[g,p],n]"),
    (dict(Ak=((4,), "int32")), r"Ak \(shape \(4,\), int32\) has 1 dimension\(s\) but Ak\[g,p\] gives 2", "Ak[g,p]"),
    (dict(Ak=((4, 3), "float32")), r"index array Ak \(shape \(4, 3\), float32\) must have an integer dtype",
     "Ak[g,p]"),
    (dict(Av=((4, 3), "int32")), r"value operand Av .* must be float16, bfloat16, float32 or float64", "Av[g,p]"),
    (dict(B=((9, 6), "float32")), r"index 'n' has extent 5 in C\[Ai\[g\],n\] \(C \(shape \(7, 5\), float32\)\) "
     r"but 6 in B\[Ak\[g,p\],n\] \(B \(shape \(9, 6\), float32\)\)", "n"),
])
def test_check_errors_name_operands_and_shapes(changes, message, caret):
    operands = {**SPMM_OPERANDS, **changes}
    operands = {k: v for k, v in operands.items() if v is not None}
    with pytest.raises(ExpressionError, match=message) as info:
        check(parse(SPMM), _operands(**operands))
    if caret:
        lines = str(info.value).splitlines()
        column = lines[2].index("^") - 4
        width = lines[2].count("^")
        assert SPMM[column:column + width] == caret


@pytest.mark.parametrize("text, operands, message", [
    ("C[i,i] += A[i]", dict(C=((3, 3), "float32"), A=((3,), "float32")), "index 'i' appears twice in C\\[i,i\\]"),
    ("C[i] += C[i] * A[i]", dict(C=((3,), "float32"), A=((3,), "float32")),
     "the left-hand side tensor 'C' is used again"),
    ("C[I[i]] += I[i]", dict(C=((3,), "float32"), I=((3,), "int32")), "used both as an index array and as a value"),
    ("C[i] += A[i] * x[i]", dict(C=((3,), "complex64"), A=((3,), "float32"), x=((3,), "float32")),
     "value operand C .* must be float16"),
])
def test_check_rejects_unsupported_constructs(text, operands, message):
    with pytest.raises(ExpressionError, match=message):
        check(parse(text), _operands(**operands))

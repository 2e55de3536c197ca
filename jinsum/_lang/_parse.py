"""Text -> `Statement`: a tokenizer and a recursive-descent parser for the indirect-Einsum notation.

Grammar (whitespace is free between tokens):

    statement := access ("=" | "+=" | "max=" | "min=") access ("*" access)*
    access    := NAME "[" index ("," index)* "]"
    index     := NAME | access          -- a bare NAME is an index variable; NAME "[" starts an indirection

Everything else is rejected here with an `ExpressionError` whose caret points at the offending token, and with a
hint for the usual mistakes (arithmetic in an index, constants, `+` between terms).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from jinsum._lang._ast import REDUCTIONS, Access, Index, Span, Statement, Var
from jinsum._lang._errors import ExpressionError

_TOKEN = re.compile(
    r"(?P<space>\s+)|(?P<op>(?:max|min)=|\+=|[\[\],*=])|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<number>\d+(\.\d*)?)"
    r"|(?P<other>.)"
)


@dataclasses.dataclass(frozen=True)
class _Token:
    kind: str  # "name", "number", "op", "other", or "end"
    text: str
    span: Span


def _tokenize(source: str) -> list[_Token]:
    tokens = []
    for match in _TOKEN.finditer(source):
        kind = match.lastgroup
        if kind != "space":
            tokens.append(_Token(kind, match.group(), Span(match.start(), match.end())))
    tokens.append(_Token("end", "", Span(len(source), len(source) + 1)))
    return tokens


class _Parser:
    def __init__(self, source: str):
        self.source = source
        self.tokens = _tokenize(source)
        self.position = 0

    @property
    def token(self) -> _Token:
        return self.tokens[self.position]

    def error(self, message: str, token: _Token | None = None) -> ExpressionError:
        return ExpressionError(f"jinsum: {message}", self.source, (token or self.token).span)

    def advance(self) -> _Token:
        token = self.token
        self.position += 1
        return token

    def expect(self, text: str, context: str) -> _Token:
        if self.token.text != text:
            raise self.unexpected(f"expected '{text}' {context}")
        return self.advance()

    def unexpected(self, expectation: str, *, in_index: bool = False) -> ExpressionError:
        token = self.token
        if token.kind == "number":
            return self.error(f"{expectation}, got the constant {token.text}: constants are not supported "
                              "(scale an operand or the result instead)")
        if in_index and token.text in {"+", "-", "*", "/", "%", "(", ")", "^"}:
            return self.error(f"{expectation}, got '{token.text}': arithmetic in an index is not supported "
                              "(an index is a variable or an access such as Ak[g,p])")
        if token.text in ("+", "-", "/"):
            return self.error(f"{expectation}, got '{token.text}': only a product of accesses may stand on the "
                              "right (for a sum of terms, call einsum once per term with '+=')")
        if token.kind == "end":
            return self.error(f"{expectation}, but the expression ended")
        return self.error(f"{expectation}, got '{token.text}'")

    def statement(self) -> Statement:
        lhs = self.access(context="at the start of the left-hand side")
        operators = {op: reduction for reduction, op in REDUCTIONS.items()}
        if self.token.text not in ("=", *operators):
            if self.token.text in ("-", "*", "/") and self.tokens[self.position + 1].text == "=":
                raise self.error(f"'{self.token.text}=' is not an operator of the notation: a statement sets ('='), "
                                 f"adds ('+='), or keeps the maximum ('max=') or minimum ('min=')")
            raise self.unexpected("expected '=', '+=', 'max=' or 'min=' after the left-hand side")
        op = self.advance().text
        accumulate, reduction = op != "=", operators.get(op, "sum")
        factors = [self.access(context="on the right-hand side")]
        while self.token.text == "*":
            self.advance()
            factors.append(self.access(context="after '*'"))
        if self.token.kind != "end":
            raise self.unexpected("expected '*' or the end of the expression")
        return Statement(lhs, accumulate, tuple(factors), source=self.source, reduction=reduction)

    def access(self, context: str) -> Access:
        if self.token.kind != "name":
            raise self.unexpected(f"expected a tensor access such as B[k,n] {context}")
        name = self.advance()
        if self.token.text != "[":
            raise self.error(f"'{name.text}' must be accessed with brackets, e.g. {name.text}[i,j] "
                             "(scalars and bare tensors are not supported)", name)
        self.advance()
        if self.token.text == "]":
            raise self.error(f"'{name.text}[]' has no index; every access names one index per dimension")
        indices = [self.index()]
        while self.token.text == ",":
            self.advance()
            indices.append(self.index())
        if self.token.text != "]":
            raise self.unexpected("expected ',' or ']'", in_index=True)
        close = self.advance()
        return Access(name.text, tuple(indices), Span(name.span.start, close.span.end))

    def index(self) -> Index:
        if self.token.kind != "name":
            raise self.unexpected("expected an index variable or an access", in_index=True)
        if self.tokens[self.position + 1].text == "[":
            return self.access(context="as an index")
        token = self.advance()
        return Var(token.text, token.span)


@functools.lru_cache(maxsize=1024)
def parse(source: str) -> Statement:
    """Parses indirect-Einsum text such as `"C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"` into a `Statement`.

    Raises:
      ExpressionError: the text is not in the notation; the message points at the offending token.
    """
    if not isinstance(source, str):
        raise TypeError(f"jinsum: the expression must be a string, got {type(source).__name__}")
    return _Parser(source).statement()

"""The one error type of the notation: the message, then the expression with a caret under the culprit."""

from __future__ import annotations

from jinsum._lang._ast import Span


class ExpressionError(ValueError):
    """An indirect-Einsum expression, or the operands bound to it, cannot be accepted.

    Raised before anything is traced. `str(error)` shows what is wrong, the expression, and a caret line under the
    offending token when there is one.
    """

    def __init__(self, message: str, source: str = "", span: Span | None = None):
        self.message = message
        self.source = source
        self.span = span
        super().__init__(_render(message, source, span))


def _render(message: str, source: str, span: Span | None) -> str:
    if not source:
        return message
    lines = [message, "    " + source]
    if span is not None:
        width = max(1, span.end - span.start)
        lines.append("    " + " " * span.start + "^" * width)
    return "\n".join(lines)

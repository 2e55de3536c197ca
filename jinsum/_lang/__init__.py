"""The indirect-Einsum notation: text -> syntax tree -> checked `Spec`."""

from jinsum._lang._ast import (
    REDUCTIONS as REDUCTIONS,
    Access as Access,
    Index as Index,
    Span as Span,
    Statement as Statement,
    Var as Var,
    index_tensor_names as index_tensor_names,
    map_accesses as map_accesses,
    map_statement as map_statement,
    statement_variables as statement_variables,
    tensor_names as tensor_names,
    variables as variables,
    walk as walk,
)
from jinsum._lang._check import (
    VALUE_DTYPES as VALUE_DTYPES,
    WINNER_NONE as WINNER_NONE,
    ColumnOrder as ColumnOrder,
    Operand as Operand,
    Spec as Spec,
    check as check,
    check_operand_names as check_operand_names,
    epilogue_names as epilogue_names,
)
from jinsum._lang._elementwise import Elementwise as Elementwise
from jinsum._lang._errors import ExpressionError as ExpressionError
from jinsum._lang._parse import parse as parse

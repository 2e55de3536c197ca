"""A traced element-wise function (a jaxpr over scalars, `jinsum._lang._elementwise`) -> Triton statements over
tiles. Attention's `score_mod` and `mask_mod` are two; statement epilogues are written the same way.

Every equation becomes one assignment; nested jaxprs (`jit`, `custom_jvp_call`) are inlined. Scalars broadcast
like tiles in Triton, so the same statements compute the transform of a whole tile of scores. A read of a
captured array (`doc[q_idx]`: a `dynamic_slice` of one element) becomes one `tl.load` at the clamped index (as
XLA clamps), so a row of query positions reads one vector of document ids. Only elementwise primitives are
translated; anything else raises `NotImplementedError` naming the primitive (the CUDA lowering then keeps the
chain on the unfused path, with a `FallbackWarning`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

_BINARY = {
    "add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "max": "tl.maximum({}, {})",
    "min": "tl.minimum({}, {})", "gt": "({} > {})", "lt": "({} < {})", "ge": "({} >= {})", "le": "({} <= {})",
    "eq": "({} == {})", "ne": "({} != {})", "and": "({} & {})", "or": "({} | {})", "xor": "({} ^ {})",
    "rem": "({} % {})",
}
_UNARY = {
    "neg": "(-{})", "exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})", "log1p": "tl.log(1.0 + {})",
    "expm1": "(tl.exp({}) - 1.0)", "abs": "tl.abs({})", "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})",
    "floor": "tl.floor({})", "ceil": "tl.ceil({})", "sin": "tl.sin({})", "cos": "tl.cos({})", "not": "(~{})",
    "logistic": "(1.0 / (1.0 + tl.exp(-{})))", "square": "({0} * {0})",
    "one_minus_square": "(1.0 - {0} * {0})", "copy": "{}", "copy_p": "{}",
    "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, 0.0))", "stop_gradient": "{}",
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no libdevice call (the interpreter has none).
    "tanh": "(1.0 - 2.0 / (tl.exp(2.0 * {}) + 1.0))",
}
_TRITON_DTYPES = {"int32": "tl.int32", "int64": "tl.int64", "bool": "tl.int1", "int8": "tl.int8",
                  "uint32": "tl.uint32"}
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "remat", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Capture:
    """A captured array as the kernel has it: its pointer argument and its shape (row-major, contiguous)."""

    pointer: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Read:
    """One read of a capture: which one (its position among the captures), the flat index expression, and the
    inputs (positions in `inputs`) that index depends on: a kernel reduces a gradient over the tile axes the
    index does not vary along before adding it at the index."""

    capture: int
    index: str
    depends: frozenset[int]


def elementwise_lines(jaxpr, inputs: list[str], prefix: str, float_type: str = "tl.float32",
                      captures: tuple[Capture, ...] = ()) -> tuple[list[str], list[str], list[Read]]:
    """Triton assignments computing `jaxpr`'s outputs from the Triton expressions `inputs` (after the captures,
    the jaxpr's first inputs).

    Returns the lines, one expression per output and the reads of captures in order. Temporaries are named
    `<prefix>0`, `<prefix>1`, ...; floating-point conversions convert to `float_type` (the kernel's accumulation
    type).
    """
    writer = _Writer(prefix, float_type, captures)
    writer.depends.update({x: frozenset({i}) for i, x in enumerate(inputs)})
    # A scalar capture is read once, first (as `jinsum._lang._elementwise` evaluates it), then used as a value.
    values = [writer.fresh(writer.load(c, [])) if not c.shape else c for c in captures]
    outputs = writer.run(jaxpr, [*values, *inputs])
    return writer.lines, outputs, writer.reads


class _Writer:
    def __init__(self, prefix: str, float_type: str, captures: tuple[Capture, ...]):
        self.prefix, self.float_type, self.lines, self.count = prefix, float_type, [], 0
        self.captures, self.reads = captures, []
        self.depends: dict[str, frozenset[int]] = {}  # expression -> the inputs it depends on

    def fresh(self, expression: str, args=()) -> str:
        name = f"{self.prefix}{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {expression}")
        self.depends[name] = frozenset().union(*(self.depends.get(a, frozenset()) for a in args
                                                 if isinstance(a, str)))
        return name

    def run(self, jaxpr, inputs: list[str]) -> list[str]:
        env = dict(zip(jaxpr.invars, inputs))

        def read(atom) -> str:
            return _literal(atom.val) if hasattr(atom, "val") else env[atom]

        for eqn in jaxpr.eqns:
            args = [read(a) for a in eqn.invars]
            name = eqn.primitive.name
            if name in _CALLS:
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                results = self.run(getattr(inner, "jaxpr", inner), args)
            elif name == "dynamic_slice" and isinstance(args[0], Capture):
                results = [self.fresh(self.load(args[0], args[1:]), args[1:])]
            elif name == "slice" and isinstance(args[0], Capture):  # a read at constant indices
                results = [self.fresh(self.load(args[0], [str(i) for i in eqn.params["start_indices"]]))]
            else:
                results = [self.fresh(self.expression(eqn, args), args)]
            for var, result in zip(eqn.outvars, results):
                env[var] = result
        return [read(a) for a in jaxpr.outvars]

    def expression(self, eqn, args: list[str]) -> str:
        name = eqn.primitive.name
        dtype = str(eqn.outvars[0].aval.dtype)
        if name == "div":
            return "({} // {})".format(*args) if "int" in str(eqn.invars[0].aval.dtype) else "({} / {})".format(*args)
        if name in _BINARY:
            return _BINARY[name].format(*args)
        if name in _UNARY:
            return _UNARY[name].format(*args)
        if name == "integer_pow":
            power = eqn.params["y"]
            product = " * ".join([args[0]] * abs(power)) or "1.0"
            return f"({product})" if power >= 0 else f"(1.0 / ({product}))"
        if name == "convert_element_type":
            constant = _constant(args[0])
            if constant is not None:  # convert it here: a Python number has no .to()
                return _literal(np.asarray(constant).astype(np.float64 if "float" in dtype else dtype))
            if "float" in dtype:
                return f"({args[0]}).to({self.float_type})"
            return f"({args[0]}).to({_TRITON_DTYPES[dtype]})" if dtype in _TRITON_DTYPES else _unsupported(eqn)
        if name == "select_n":  # select_n(which, case0, case1, ...): case[which]
            which, *cases = args
            if len(cases) == 2:
                return f"tl.where({which}, {cases[1]}, {cases[0]})"
            chosen = cases[-1]
            for k in reversed(range(len(cases) - 1)):
                chosen = f"tl.where({which} == {k}, {cases[k]}, {chosen})"
            return chosen
        if name == "clamp":
            low, x, high = args
            return f"tl.minimum(tl.maximum({x}, {low}), {high})"
        if name in ("broadcast_in_dim", "reshape", "squeeze") and math.prod(eqn.outvars[0].aval.shape) == 1:
            return args[0]  # one element: a read's (1, 1) value, or a tangent of ones
        return _unsupported(eqn)

    def load(self, capture: Capture, starts: list[str]) -> str:
        """`capture[starts]`, each start clamped into range as XLA's `dynamic_slice` clamps it."""
        flat = "0"  # (a scalar capture: its one element)
        for size, start in zip(capture.shape, starts):
            constant = _constant(start)
            clamped = (str(min(max(int(constant), 0), size - 1)) if constant is not None
                       else f"tl.minimum(tl.maximum({start}, 0), {size - 1})")
            flat = clamped if flat == "0" else f"({flat}) * {size} + {clamped}"
        index = self.fresh(flat, starts)
        self.reads.append(Read(self.captures.index(capture), index, self.depends[index]))
        return f"tl.load({capture.pointer} + {index})"


def _unsupported(eqn) -> str:
    raise NotImplementedError(f"a score_mod or mask_mod uses {eqn.primitive.name}, which has no Triton translation")


def _constant(text: str):
    """The value of a literal written by `_literal`, or None for an expression."""
    if text in ("True", "False"):
        return text == "True"
    if text.startswith('float("'):
        return float(text[7:-2])
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def _literal(value) -> str:
    value = np.asarray(value).item()
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    return str(value)

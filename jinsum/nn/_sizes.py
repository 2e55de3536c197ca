"""The sizes a layer is built with (feature widths, heads, relations, ...), checked once, in the constructor: an
error names the layer, the argument and what it got, instead of JAX's at the first parameter shape (a float width)
or an initializer's division by zero (a width of 0)."""

from __future__ import annotations

from jinsum.formats._convert import check_int


def layer_sizes(layer: str, minimum: int = 1, **sizes) -> tuple[int, ...]:
    """`sizes` (by argument name) as Python ints `>= minimum`; NumPy integers count, bools and floats do not."""
    return tuple(check_int(layer, name, size, minimum) for name, size in sizes.items())


def feature_pair(layer: str, in_features) -> tuple[int, int | None]:
    """`(F_src, F_dst)` of an `in_features` that is one size (`F_dst` None: one node set) or a pair of them, for a
    bipartite graph."""
    if isinstance(in_features, tuple):
        if len(in_features) != 2:
            raise ValueError(f"{layer}: in_features must be an int or a pair (F_src, F_dst), got {in_features!r}")
        return layer_sizes(layer, **{"in_features[0]": in_features[0], "in_features[1]": in_features[1]})
    return layer_sizes(layer, in_features=in_features)[0], None

"""Every layer of `jinsum.nn` under the one dtype policy (`jinsum.nn._dtypes`, Flax's): `dtype=` is the computation's
dtype, `param_dtype=` the parameters', and `dtype=None` JAX's promotion of the inputs and the parameters, as
`nnx.Linear` has it.

The layers are enumerated from `jinsum.nn`'s public names, so a new layer fails here until it takes the policy
(and gets a case below)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jinsum.graphs as jg

import jinsum.nn as jnn
from jinsum.testing import assert_allclose

N, F, E = 12, 6, 30
# Layers without parameters of their own take `dtype=` only (their wrapped modules, if any, carry theirs).
PARAMETERLESS = {"APPNP", "DynamicEdgeConv", "AttentionalAggregation"}


def _layers() -> dict[str, type]:
    return {name: value for name, value in vars(jnn).items()
            if not name.startswith("_") and isinstance(value, type) and issubclass(value, nnx.Module)}


def _graph():
    """A fixed edge index over N nodes: a duplicate edge, a self loop, nodes 0 and 1 without in-edges."""
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, N, E), rng.integers(2, N, E)
    src[:3], dst[:3] = [4, 4, 3], [5, 5, 3]
    return np.stack([src, dst])


def _linear(a, b, **kw):
    return nnx.Linear(a, b, rngs=nnx.Rngs(1), **kw)


def _mlp(a, b, **kw):
    return nnx.Sequential(_linear(a, 8, **kw), nnx.relu, _linear(8, b, **kw))


def _cases():
    """name -> (make(**dtypes) -> module, inputs (float32 features first, or integer ids), call(module, *inputs))."""
    edge_index = _graph()
    A, edges = jg.adjacency(edge_index, N), jg.edge_list(edge_index, N)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((N, F)), jnp.float32)
    edge_attr = jnp.asarray(rng.standard_normal((E, 3)), jnp.float32)
    rel = jg.relational_graph(edge_index[0], edge_index[1], rng.integers(0, 3, E), N, 3)
    rngs = lambda: nnx.Rngs(0)  # noqa: E731  (the same parameters for every dtype)
    on_graph = lambda m, x: m(x, A)  # noqa: E731
    return {
        "GCNConv": (lambda **kw: jnn.GCNConv(F, 8, rngs=rngs(), **kw), (x,), on_graph),  # (A x first: 6 < 8)
        "SGConv": (lambda **kw: jnn.SGConv(F, 4, K=2, rngs=rngs(), **kw), (x,), on_graph),
        "APPNP": (lambda **kw: jnn.APPNP(3, 0.1, **kw), (x,), on_graph),
        "SAGEConv": (lambda **kw: jnn.SAGEConv(F, 4, rngs=rngs(), **kw), (x,), on_graph),
        "GINConv": (lambda **kw: jnn.GINConv(_mlp(F, 4, **kw), **kw), (x,), on_graph),
        "GINEConv": (lambda **kw: jnn.GINEConv(_mlp(F, 4, **kw), train_eps=True, edge_dim=3, in_features=F,
                                               rngs=rngs(), **kw),
                     (x, edge_attr), lambda m, x, attr: m(x, edges, attr)),
        "GraphConv": (lambda **kw: jnn.GraphConv(F, 4, aggr="mean", rngs=rngs(), **kw), (x,), on_graph),
        "EdgeConv": (lambda **kw: jnn.EdgeConv(F, 4, rngs=rngs(), **kw), (x,), on_graph),
        "DynamicEdgeConv": (lambda **kw: jnn.DynamicEdgeConv(_linear(2 * F, 4, **kw), 3, aggr="mean",
                                                             dtype=kw.get("dtype")),
                            (x,), lambda m, x: m(x)),
        "GATConv": (lambda **kw: jnn.GATConv(F, 4, heads=2, rngs=rngs(), **kw), (x,), on_graph),
        "GATv2Conv": (lambda **kw: jnn.GATv2Conv(F, 4, heads=2, edge_dim=3, rngs=rngs(), **kw),
                      (x, edge_attr), lambda m, x, attr: m(x, edges, attr)),
        "TransformerConv": (lambda **kw: jnn.TransformerConv(F, 4, heads=2, beta=True, rngs=rngs(), **kw), (x,),
                            on_graph),
        "RGCNConv": (lambda **kw: jnn.RGCNConv(F, 4, num_relations=3, num_bases=2, rngs=rngs(), **kw), (x,),
                     lambda m, x: m(x, rel)),
        "HeteroLinear": (lambda **kw: jnn.HeteroLinear(F, 4, 3, rngs=rngs(), **kw), (x,),
                         lambda m, x: m(x, jnp.arange(N) % 3)),
        "SparseLinear": (lambda **kw: jnn.SparseLinear(F, 4, jnn.random_pattern(F, 4, 0.5), rngs=rngs(), **kw),
                         (x,), lambda m, x: m(x)),
        "EmbeddingBag": (lambda **kw: jnn.EmbeddingBag(20, 4, mode="mean", rngs=rngs(), **kw),
                         (jnp.asarray(rng.integers(0, 20, (5, 3))),), lambda m, ids: m(ids)),
        "MoE": (lambda **kw: jnn.MoE(F, 8, num_experts=4, top_k=2, rngs=rngs(), **kw), (x,), lambda m, x: m(x)[0]),
        "AttentionalAggregation": (
            lambda **kw: jnn.AttentionalAggregation(_linear(F, 1, **kw), _linear(F, 4, **kw), dtype=kw.get("dtype")),
            (x,), lambda m, x: m(x, jnp.asarray(np.repeat([0, 1], N // 2)), 2)),
        "BlockSparseAttention": (lambda **kw: jnn.BlockSparseAttention(F, 2, head_dim=4, block=8, causal=True,
                                                                        rngs=rngs(), **kw),
                                 (jnp.asarray(rng.standard_normal((16, F)), jnp.float32),), lambda m, x: m(x)),
    }


CASES = _cases()


def _randomized(model):
    """Every parameter drawn afresh (biases too, which start at zero), the same draw for every build."""
    rng = np.random.default_rng(2)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: (0.5 * rng.standard_normal(p.shape)).astype(p.dtype), state))
    return model


def _param_dtypes(model) -> set:
    return {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))}


def test_every_layer_has_a_case():
    """A new layer of `jinsum.nn` needs the dtype policy and a case here."""
    assert set(_layers()) == set(CASES)


@pytest.mark.parametrize("name", sorted(_layers()))
def test_signature_and_docstring(name):
    """`dtype=None` (and `param_dtype=jnp.float32` where the layer has parameters), keyword-only, before `rngs`,
    each documented in the constructor's Args."""
    init = _layers()[name].__init__
    parameters = inspect.signature(init).parameters
    names = ["dtype"] + ([] if name in PARAMETERLESS else ["param_dtype"])
    for arg in names:
        assert arg in parameters, f"{name} takes no {arg}="
        assert parameters[arg].kind is inspect.Parameter.KEYWORD_ONLY
        assert f"{arg}: " in (init.__doc__ or ""), f"{name}.__init__ does not document {arg}"
    assert parameters["dtype"].default is None
    if "param_dtype" in names:
        assert parameters["param_dtype"].default is jnp.float32
    if "rngs" in parameters:
        order = list(parameters)
        assert max(order.index(arg) for arg in names) < order.index("rngs")


def test_dtypes_are_checked_at_construction():
    with pytest.raises(TypeError, match=r"GCNConv: dtype must be a floating dtype .* got .*\(int32\)"):
        jnn.GCNConv(F, 4, dtype=jnp.int32, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"SAGEConv: param_dtype must be a floating dtype .* got None"):
        jnn.SAGEConv(F, 4, param_dtype=None, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"APPNP: dtype must be a floating dtype"):
        jnn.APPNP(2, 0.1, dtype="int8")


def test_flax_promotion_is_the_reference():
    """What the layers match: `nnx.Linear` with `dtype=None` computes in the promotion of input and parameters."""
    x = jnp.ones((2, 3), jnp.bfloat16)
    assert nnx.Linear(3, 2, rngs=nnx.Rngs(0))(x).dtype == jnp.float32
    assert nnx.Linear(3, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x).dtype == jnp.bfloat16


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_dtypes(name):
    """`dtype=bfloat16` with float32 parameters: the parameters stay float32, the output is bfloat16 and within
    bfloat16's tolerance (relative to the output's scale) of the float32 layer with the same parameters.
    `dtype=None`: bfloat16 features with float32 parameters give float32 (Flax's promotion), with bfloat16
    parameters bfloat16. (The four builds run in one jitted function: one compile per layer.)"""
    make, inputs, call = CASES[name]
    full, half = _randomized(make()), _randomized(make(dtype=jnp.bfloat16))
    low = _low_wrapped(name) if name in PARAMETERLESS else make(param_dtype=jnp.bfloat16)
    floating = tuple(a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in inputs)

    @nnx.jit
    def outputs(full, half, low, inputs, floating):
        return call(full, *inputs), call(half, *inputs), call(full, *floating), call(low, *floating)

    reference, out, promoted_out, low_out = outputs(full, half, low, inputs, floating)
    assert _param_dtypes(full) == _param_dtypes(half) <= {jnp.dtype(jnp.float32)}
    assert out.dtype == jnp.bfloat16 and reference.dtype == jnp.float32
    assert_allclose(out, reference, jnp.bfloat16, err_msg=name)
    # Flax's promotion: the features' bfloat16 with the parameters' float32 (without parameters, bfloat16; for
    # EmbeddingBag, whose inputs are ids, the table's dtype).
    params = _param_dtypes(full)
    promoted = jnp.result_type(*params) if not jnp.issubdtype(inputs[0].dtype, jnp.floating) else (
        jnp.result_type(jnp.bfloat16, *params))
    assert promoted_out.dtype == promoted
    assert _param_dtypes(low) <= {jnp.dtype(jnp.bfloat16)}
    assert low_out.dtype == jnp.bfloat16


def _low_wrapped(name):
    """A parameterless layer whose wrapped modules hold bfloat16 parameters."""
    if name == "DynamicEdgeConv":
        return jnn.DynamicEdgeConv(_linear(2 * F, 4, param_dtype=jnp.bfloat16), 3, aggr="mean")
    if name == "AttentionalAggregation":
        return jnn.AttentionalAggregation(_linear(F, 1, param_dtype=jnp.bfloat16),
                                          _linear(F, 4, param_dtype=jnp.bfloat16))
    return CASES[name][0]()


def test_wrapping_layers_apply_dtype_to_their_own_arithmetic():
    """With a wrapped function that keeps its input's dtype, a wrapping layer's output is in its `dtype`: the layer
    casts what it computes itself (GIN's sums, EdgeConv's messages, the attentional softmax), whatever the wrapped
    modules' dtypes."""
    edge_index = _graph()
    A, edges = jg.adjacency(edge_index, N), jg.edge_list(edge_index, N)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((N, F)), jnp.float32)
    same = lambda h: h  # noqa: E731
    half = jnp.bfloat16
    layers = {"GINConv": jnn.GINConv(same, dtype=half), "GINEConv": jnn.GINEConv(same, dtype=half),
              "EdgeConv": jnn.EdgeConv(F, 2 * F, nn=same, dtype=half, rngs=nnx.Rngs(0)),
              "DynamicEdgeConv": jnn.DynamicEdgeConv(same, 3, dtype=half),
              "AttentionalAggregation": jnn.AttentionalAggregation(lambda h: h[:, :1], dtype=half)}

    @nnx.jit
    def outputs(layers, x, A, edges):  # (one compiled program for the five layers, not an eager op each)
        return {"GINConv": layers["GINConv"](x, A),
                "GINEConv": layers["GINEConv"](x, edges, jnp.ones((E, F), jnp.float32)),
                "EdgeConv": layers["EdgeConv"](x, A), "DynamicEdgeConv": layers["DynamicEdgeConv"](x),
                "AttentionalAggregation": layers["AttentionalAggregation"](x, jnp.zeros(N, jnp.int32), 1)}

    out = outputs(layers, x, A, edges)
    assert {name: o.dtype for name, o in out.items()} == dict.fromkeys(layers, jnp.dtype(half))

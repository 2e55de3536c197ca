"""The full-batch training step that the benchmarks time (forward, backward and an Adam update, one function), and
the models on segment ops that jinsum's layers are compared with."""

from __future__ import annotations


def train_step(model, learning_rate: float):
    """`(step, state)` for a Flax NNX `model(x, graph) -> logits`: `step(state, x, y, graph) -> (state, loss)`
    with the softmax cross-entropy of integer labels `y`, pure (for `jax.jit`), and `state` the model's and
    Adam's variables (the model in training mode: dropout on)."""
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    model.train()
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x, y, graph):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x, graph), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, state


def segment_graph(edge_index, nodes: int, *, self_loops: bool):
    """The edges for the segment-op models, sorted by destination: `(src, dst, gcn_weight)` as jax arrays, where
    `gcn_weight` is GCN's symmetric normalisation over `A + I` (with self loops) or over `A`."""
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    src, dst = np.asarray(edge_index)
    if self_loops:
        loops = np.arange(nodes, dtype=src.dtype)
        src, dst = np.concatenate([src, loops]), np.concatenate([dst, loops])
    order = np.lexsort((src, dst))
    src, dst = src[order], dst[order]
    degree = np.bincount(dst, minlength=nodes).astype(np.float32)
    weight = (degree[src] * degree[dst]) ** -0.5
    return jnp.asarray(src), jnp.asarray(dst), jnp.asarray(weight)


def segment_convs():
    """`(SegmentGCNConv, SegmentSAGEConv)`: jinsum.nn's GCNConv and SAGEConv (mean) on edge arrays, as a JAX user
    writes them without jinsum: a gather of the sources and a sorted `jax.ops.segment_sum`."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    class SegmentGCNConv(nnx.Module):
        def __init__(self, in_features, out_features, *, dtype=None, rngs):
            self.linear = nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, rngs=rngs)
            self.bias = nnx.Param(jnp.zeros((out_features,)))

        def __call__(self, x, graph):  # graph: segment_graph(..., self_loops=True)
            src, dst, weight = graph
            first = self.linear.out_features < x.shape[1]  # (on the narrower side of W, as jinsum's layer does)
            h = self.linear(x) if first else x.astype(self.linear.dtype or x.dtype)
            h = jax.ops.segment_sum(weight[:, None].astype(h.dtype) * h[src], dst, num_segments=x.shape[0],
                                    indices_are_sorted=True)
            h = h if first else self.linear(h)
            return h + self.bias[...].astype(h.dtype)

    class SegmentSAGEConv(nnx.Module):
        def __init__(self, in_features, out_features, *, dtype=None, rngs):
            self.dtype = dtype
            self.lin_neighbors = nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, rngs=rngs)
            self.lin_root = nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, rngs=rngs)
            self.bias = nnx.Param(jnp.zeros((out_features,)))

        def __call__(self, x, graph):  # graph: segment_graph(..., self_loops=False)
            src, dst, _ = graph
            x = x if self.dtype is None else x.astype(self.dtype)
            count = jax.ops.segment_sum(jnp.ones_like(dst, x.dtype), dst, num_segments=x.shape[0],
                                        indices_are_sorted=True)[:, None]
            h = self.lin_neighbors(x) if self.lin_neighbors.out_features < x.shape[1] else x
            mean = jax.ops.segment_sum(h[src], dst, num_segments=x.shape[0], indices_are_sorted=True) / jnp.maximum(
                count, 1)
            mean = mean if h is not x else self.lin_neighbors(mean)
            return mean + self.lin_root(x) + self.bias[...].astype(x.dtype)

    return SegmentGCNConv, SegmentSAGEConv


def segment_max_convs():
    """`(SegmentSAGEMaxConv, SegmentEdgeConv)`: jinsum.nn's `SAGEConv(aggr="max")` and `EdgeConv` (linear messages)
    on edge arrays sorted by destination, as a JAX user writes them without jinsum: a gather of the sources and a
    sorted `jax.ops.segment_max` (whose gradient JAX takes by comparing every edge's value with its row's maximum,
    ties split). The EdgeConv uses the same algebra as jinsum's: `max_j W [x_i, x_j - x_i] = (W_1 - W_2) x_i +
    max_j W_2 x_j`, so the two differ only in the max aggregation."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    def segment_max(h, graph, nodes):
        src, dst, _ = graph
        out = jax.ops.segment_max(h[src], dst, num_segments=nodes, indices_are_sorted=True)
        return jnp.where(jnp.isneginf(out), 0, out)  # (nodes without in-edges: 0, as PyG)

    class SegmentSAGEMaxConv(nnx.Module):
        def __init__(self, in_features, out_features, *, rngs):
            self.lin_neighbors = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
            self.lin_root = nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs)
            self.bias = nnx.Param(jnp.zeros((out_features,)))

        def __call__(self, x, graph):  # graph: segment_graph(..., self_loops=False)
            return self.lin_neighbors(segment_max(x, graph, x.shape[0])) + self.lin_root(x) + self.bias[...]

    class SegmentEdgeConv(nnx.Module):
        def __init__(self, in_features, out_features, *, rngs):
            self.nn = nnx.Linear(2 * in_features, out_features, rngs=rngs)

        def __call__(self, x, graph):
            center, neighbor = self.nn.kernel[: x.shape[1]], self.nn.kernel[x.shape[1]:]
            degree = jax.ops.segment_sum(jnp.ones_like(graph[1]), graph[1], x.shape[0], indices_are_sorted=True)
            out = x @ (center - neighbor) + self.nn.bias[...] + segment_max(x @ neighbor, graph, x.shape[0])
            return jnp.where(degree[:, None] > 0, out, 0)

    return SegmentSAGEMaxConv, SegmentEdgeConv


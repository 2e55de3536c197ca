"""The full-batch training step that the benchmarks time: forward, backward and an Adam update, one function."""

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

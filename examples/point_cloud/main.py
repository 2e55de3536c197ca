"""Point-cloud classification of GENERATED shapes with DGCNN: kNN graphs rebuilt inside the jitted step, one compile.

The data are generated: each cloud is `--points` points on the surface of one of five shapes (sphere, cube,
cylinder, cone, torus; 5 balanced classes), stretched along each axis by a random factor in [0.7, 1.3], rotated at
random, jittered by Gaussian noise (0.02), then centred and scaled into the unit ball. Clouds are split 80% / 10% /
10% into train / validation / test.

Model (Wang et al.'s DGCNN, smaller): three dynamic edge convolutions, each the maximum over a point's `--k`
nearest neighbours (itself included, as PyG) of an MLP of `[x_i, x_j - x_i]`, the graph rebuilt from the layer's
input features (MLPs 6 -> 64 -> 64, 128 -> 64, 128 -> 128, ReLU after every layer); the three outputs concatenated
into a linear layer of 512, a maximum over each cloud's points, and an MLP head 512 -> 256 -> 5. A batch is
`--batch` clouds as one set of points with PyG's `batch` vector (point -> cloud). Systems, the same model and
batches, Adam:

- jinsum: `jinsum.nn.DynamicEdgeConv` (`jinsum.graphs.knn`, tiled, read as a fixed-fanout `GroupCOO`, then a `max=`
  over the per-edge messages) and `jinsum.nn.global_max_pool`; the jitted step sees new points every call and
  compiles once (the last batch of a split is padded with clouds left out of the loss and the accuracy);
- PyG, where torch_geometric is installed: its `EdgeConv` on the kNN graph of torch `cdist` + `topk` within each
  cloud (`DynamicEdgeConv` needs torch_cluster or pyg-lib, which do not install from the index; the graph is the
  same) and `global_max_pool`, on CUDA when torch has it.
Reported per system: test accuracy (at the end of training), and one training step's time measured after training
(`jinsum.timing.time_calls`, as steps/s) with, for jinsum, XLA's peak memory of the step.

    python examples/point_cloud/main.py [--clouds 1000] [--points 128] [--k 16] [--epochs 10] [--batch 32] [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jinsum.nn
from jinsum.timing import time_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402

SHAPES = ("sphere", "cube", "cylinder", "cone", "torus")
WIDTHS = ((6, 64, 64), (128, 64), (128, 128))  # each edge convolution's MLP: [x_i, x_j - x_i] -> features
EMBEDDING = 512


def surface_points(shape: str, count: int, points: int, rng: np.random.Generator) -> np.ndarray:
    """`(count, points, 3)` points on the surface of a unit `shape`, uniform by area (the torus, R = 1 and r = 0.4,
    uniform in its two angles). Cylinder and cone span z in [-1, 1] with radius 1 (the cone's apex at z = 1)."""
    u = rng.random((count, points, 3))
    if shape == "sphere":
        p = rng.standard_normal((count, points, 3))
        return p / np.linalg.norm(p, axis=-1, keepdims=True)
    if shape == "cube":  # a point of [-1, 1]^3 moved onto a face: a random axis set to -1 or 1
        p = 2 * u - 1
        np.put_along_axis(p, rng.integers(0, 3, (count, points, 1)), rng.choice([-1.0, 1.0], (count, points, 1)), -1)
        return p
    theta = 2 * np.pi * u[..., 0]
    if shape == "cylinder":  # the side (area 4 pi) or a cap (pi each)
        side = u[..., 2] < 2 / 3
        rho, z = np.where(side, 1, np.sqrt(u[..., 1])), np.where(side, 2 * u[..., 1] - 1, np.sign(u[..., 2] - 5 / 6))
    elif shape == "cone":  # the side (area pi sqrt(5)) at a distance from the apex whose square is uniform, or the base
        side = u[..., 2] < np.sqrt(5) / (1 + np.sqrt(5))
        t = np.sqrt(u[..., 1])
        rho, z = t, np.where(side, 1 - 2 * t, -1)
    elif shape == "torus":
        phi = 2 * np.pi * u[..., 1]
        rho, z = 1 + 0.4 * np.cos(phi), 0.4 * np.sin(phi)
    else:
        raise ValueError(f"surface_points: shape must be one of {SHAPES}, got {shape!r}")
    return np.stack([rho * np.cos(theta), rho * np.sin(theta), z], axis=-1)


def shape_clouds(count: int, points: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` clouds of `points` points: float32 positions `(count, points, 3)` in the unit ball and int32 labels
    `(count,)`, the index of the shape in `SHAPES` (balanced), each cloud stretched, rotated and jittered."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(count) % len(SHAPES)).astype(np.int32)
    pos = np.empty((count, points, 3))
    for label, shape in enumerate(SHAPES):
        pos[labels == label] = surface_points(shape, int(np.sum(labels == label)), points, rng)
    q, r = np.linalg.qr(rng.standard_normal((count, 3, 3)))
    rotations = q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]  # uniform over orthogonal matrices
    pos = (pos * rng.uniform(0.7, 1.3, (count, 1, 3))) @ rotations + 0.02 * rng.standard_normal(pos.shape)
    pos -= pos.mean(axis=1, keepdims=True)
    pos /= np.linalg.norm(pos, axis=-1).max(axis=1)[:, None, None]
    return pos.astype(np.float32), labels


def batches(pos: np.ndarray, labels: np.ndarray, size: int, rng: np.random.Generator | None = None):
    """`(clouds, labels, mask)` of `size` clouds each, in order or shuffled by `rng`; the last batch is padded with
    the split's first clouds, `mask` False on them (every batch has one shape: one compile)."""
    order = np.arange(len(labels)) if rng is None else rng.permutation(len(labels))
    order = np.resize(order, -(-len(order) // size) * size)  # (repeated from its start)
    for start in range(0, len(order), size):
        at = order[start:start + size]
        yield pos[at], labels[at], np.arange(start, start + size) < len(labels)


def mlp(sizes, *, rngs: nnx.Rngs) -> nnx.Sequential:
    """Linear layers of `sizes`, each followed by a ReLU."""
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nnx.Linear(a, b, rngs=rngs), nnx.relu]
    return nnx.Sequential(*layers)


class DGCNN(nnx.Module):
    """Three `jinsum.nn.DynamicEdgeConv` layers (max over `k` neighbours), their outputs concatenated into a linear
    layer, a maximum over each cloud's points, an MLP head: `(B, P, 3)` clouds -> `(B, classes)` logits."""

    def __init__(self, k: int, classes: int, *, rngs: nnx.Rngs):
        self.convs = nnx.List([jinsum.nn.DynamicEdgeConv(mlp(sizes, rngs=rngs), k) for sizes in WIDTHS])
        self.lin = nnx.Linear(sum(sizes[-1] for sizes in WIDTHS), EMBEDDING, rngs=rngs)
        self.head = nnx.Sequential(nnx.Linear(EMBEDDING, 256, rngs=rngs), nnx.relu, nnx.Linear(256, classes, rngs=rngs))

    def __call__(self, clouds: jax.Array) -> jax.Array:
        num_clouds, points, dims = clouds.shape
        x, batch = clouds.reshape(-1, dims), jnp.repeat(jnp.arange(num_clouds), points)
        features = []
        for conv in self.convs:
            x = conv(x, batch)
            features.append(x)
        h = nnx.relu(self.lin(jnp.concatenate(features, axis=-1)))
        return self.head(jinsum.nn.global_max_pool(h, batch, num_clouds))


def train_step(model: nnx.Module, learning_rate: float):
    """`(step, evaluate, state)`: `step(state, clouds, labels, mask) -> (state, loss)`, one Adam step on the mean
    cross-entropy of the clouds in `mask`, and `evaluate(state, clouds, labels, mask)`, their number classified
    right; both pure (for `jax.jit`), `state` the model's and Adam's variables."""
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, clouds, labels, mask):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            losses = optax.softmax_cross_entropy_with_integer_labels(model(clouds), labels)
            return jnp.sum(jnp.where(mask, losses, 0)) / jnp.maximum(jnp.sum(mask), 1)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def evaluate(state, clouds, labels, mask):
        model, _ = nnx.merge(graphdef, state)
        return jnp.sum((jnp.argmax(model(clouds), -1) == labels) & mask)

    return step, evaluate, state


def run_jinsum(model: DGCNN, splits, batch_size: int, epochs: int, learning_rate: float, seed: int, smoke: bool):
    """Trains `model`: (test accuracy, seconds per step, XLA's peak bytes of the step)."""
    step, evaluate, state = train_step(model, learning_rate)
    train, val, test = splits
    compiled = jax.jit(step).lower(state, *next(batches(*train, batch_size))).compile()  # the only compile
    evaluate = jax.jit(evaluate)
    rng = np.random.default_rng(seed)

    def accuracy(split):
        return sum(int(evaluate(state, *batch)) for batch in batches(*split, batch_size)) / len(split[1])

    for _ in (bar := tqdm(range(epochs), desc="jinsum DGCNN", disable=smoke)):
        losses = []
        for batch in batches(*train, batch_size, rng):
            state, loss = compiled(state, *batch)
            losses.append(loss)
        bar.set_postfix(loss=f"{float(np.mean(losses)):.3f}", val=f"{accuracy(val):.3f}")
    seconds, peak = _common.measure(compiled, state, *next(batches(*train, batch_size)),
                                    timing=_common.timing_options(smoke))
    return accuracy(test), seconds, peak


def pyg_trainer(k: int, classes: int, learning_rate: float, seed: int):
    """PyG's reading of the same model: `(train, predict, sync)`, where `train(clouds, labels) -> loss` runs one Adam
    step on a NumPy batch `(B, P, 3)`, `predict(clouds)` gives its classes and `sync(_)` waits for the device."""
    import torch  # noqa: PLC0415
    from torch_geometric.nn import EdgeConv, global_max_pool  # noqa: PLC0415

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def torch_mlp(sizes):
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    @torch.no_grad()
    def knn_graph(x, num_clouds):
        """The edge index (sources, targets) from each point's k nearest in its cloud, itself included."""
        clouds = x.view(num_clouds, -1, x.shape[1])
        nearest = torch.cdist(clouds, clouds).topk(k, largest=False).indices  # (B, P, k)
        offsets = torch.arange(num_clouds, device=x.device).view(-1, 1, 1) * clouds.shape[1]
        targets = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
        return torch.stack([(nearest + offsets).reshape(-1), targets])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList([EdgeConv(torch_mlp(sizes)) for sizes in WIDTHS])
            self.lin = torch.nn.Linear(sum(sizes[-1] for sizes in WIDTHS), EMBEDDING)
            self.head = torch.nn.Sequential(torch.nn.Linear(EMBEDDING, 256), torch.nn.ReLU(),
                                            torch.nn.Linear(256, classes))

        def forward(self, clouds):
            num_clouds, points, dims = clouds.shape
            x = clouds.reshape(-1, dims)
            batch = torch.arange(num_clouds, device=x.device).repeat_interleave(points)
            features = []
            for conv in self.convs:
                x = conv(x, knn_graph(x, num_clouds))
                features.append(x)
            h = torch.relu(self.lin(torch.cat(features, dim=-1)))
            return self.head(global_max_pool(h, batch, num_clouds))

    model = Model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)

    def train(clouds, labels):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.as_tensor(clouds, device=device)),
                                                 torch.as_tensor(labels, device=device).long())
        loss.backward()
        optimizer.step()
        return loss

    def predict(clouds):
        with torch.no_grad():
            return model(torch.as_tensor(clouds, device=device)).argmax(-1).cpu().numpy()

    def sync(_):
        if device == "cuda":
            torch.cuda.synchronize()

    return train, predict, sync


def run_pyg(trainer, splits, batch_size: int, epochs: int, seed: int, smoke: bool):
    """Trains PyG's model on the same batches (padding clouds left out): (test accuracy, seconds per step)."""
    step, predict, sync = trainer
    train, _, test = splits
    rng = np.random.default_rng(seed)
    for _ in tqdm(range(epochs), desc="PyG DGCNN", disable=smoke):
        for clouds, labels, mask in batches(*train, batch_size, rng):
            step(clouds[mask], labels[mask])
    right = sum(int((predict(c[m]) == y[m]).sum()) for c, y, m in batches(*test, batch_size))
    clouds, labels, _ = next(batches(*train, batch_size))
    return right / len(test[1]), time_calls(step, clouds, labels, sync=sync, **_common.timing_options(smoke))


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--clouds", type=int, default=1000)
    p.add_argument("--points", type=int, default=128)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    if args.smoke:
        args.clouds, args.points, args.k, args.epochs, args.batch = 40, 32, 4, 2, 8

    pos, labels = shape_clouds(args.clouds, args.points, args.seed)
    splits = [(pos[i], labels[i]) for i in _common.random_split(args.clouds, (0.8, 0.1), args.seed)]
    print(f"{args.clouds} GENERATED clouds of {args.points} points ({', '.join(SHAPES)}), k = {args.k}, batches of "
          f"{args.batch}; {_common.device_name()}")

    model = DGCNN(args.k, len(SHAPES), rngs=nnx.Rngs(args.seed))
    accuracy, seconds, peak = run_jinsum(model, splits, args.batch, args.epochs, args.lr, args.seed, args.smoke)
    rows = [["jinsum DynamicEdgeConv", f"{accuracy:.3f}", f"{1e3 * seconds:.1f}", f"{1 / seconds:.1f}",
             f"{peak / 2**20:.0f}"]]
    try:
        import torch_geometric  # noqa: F401, PLC0415
    except ImportError:
        rows.append(["PyG EdgeConv + cdist kNN", "-", "-", "-", "torch_geometric not installed"])
    else:
        trainer = pyg_trainer(args.k, len(SHAPES), args.lr, args.seed)
        accuracy, seconds = run_pyg(trainer, splits, args.batch, args.epochs, args.seed, args.smoke)
        rows.append(["PyG EdgeConv + cdist kNN", f"{accuracy:.3f}", f"{1e3 * seconds:.1f}", f"{1 / seconds:.1f}",
                     "-"])
    _common.print_table(f"DGCNN, {args.epochs} epochs, seed {args.seed} (chance {1 / len(SHAPES):.0%})",
                        ["system", "test accuracy", "ms / step", "steps/s", "peak MiB (XLA)"], rows)


if __name__ == "__main__":
    main()

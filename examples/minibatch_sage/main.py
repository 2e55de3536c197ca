"""Mini-batch GraphSAGE on a large generated graph, neighbours sampled on the device: one compile for the whole run.

The graph is an R-MAT graph (`jinsum.datasets.rmat`, made undirected; scale 18: 262k nodes, 7.6M edges, hubs of
10^4 neighbours). Features and labels are SYNTHETIC: features i.i.d. standard normal, and a node's label the argmax
of a random one-layer GraphSAGE teacher's class scores (mean of the in-neighbours' features and the node's own,
each class standardised over the nodes), so labels depend on the neighbourhood and a sampled two-layer model can
learn them. Nodes are split 80% / 20% into train / test; the largest class's share is printed as the accuracy of
a constant guess.

Each step draws a batch of seed nodes from a shuffled epoch, samples their two-hop neighbourhood with fanouts
(15, 10) and trains GraphSAGE (mean) features -> 256 -> classes with Adam. Systems, same data and batches:

- jinsum: `jinsum.sampling.sample_neighbors` inside the jitted step (static shapes: one compile for every batch),
  `jinsum.nn.SAGEConv((x_src, x_dst), A)` on the sampled bipartite `GroupCOO`s. The outermost adjacency maps the
  graph's own node ids (`outer_sources="graph"`), so the first layer reads the feature table in place instead of a
  gathered `(n_L, F)` copy;
- plain JAX: the same on-device sampler, then gathers + a sorted `jax.ops.segment_sum` per layer;
- PyG (where torch_geometric is installed): a vectorised NumPy sampler on the host, PyG's `SAGEConv` on the
  sampled `edge_index`, on CUDA when torch has it.
- jinsum, data parallel (where there are several devices): the seeds split over the devices, each sampling its
  share from the replicated graph, the gradients summed over the devices (`sampled_step(..., mesh=...)`).
Reported: steps per second over the training run (with a progress bar), the compile count of each jitted step, and
the test accuracy (inference on sampled neighbourhoods of the test nodes, as in training).

    python examples/minibatch_sage/main.py [--scale 18] [--epochs 2] [--batch 1024] [--fanouts 15 10] [--devices D]
                                           [--steps-per-call K] [--smoke]

A step of 1,024 seeds is less GPU work (0.42 ms on an H200) than its dispatch: `--steps-per-call 8` runs 8 steps in
one call (a `lax.scan`), and the data-parallel run goes fastest as one process per GPU (each dispatching its own
device; in one process, one host thread dispatches them all). On a machine of two GPUs (2 x H200: 1.98x one GPU's
seeds per second, `benchmarks/minibatch.py --processes 2`):

    ARGS="--steps-per-call 8 --coordinator localhost:1234 --num-processes 2"
    CUDA_VISIBLE_DEVICES=0 python examples/minibatch_sage/main.py $ARGS --process-id 0
    CUDA_VISIBLE_DEVICES=1 python examples/minibatch_sage/main.py $ARGS --process-id 1

Every process builds the same graph, features and batches (the same seed), places them on the mesh of all
processes' devices and runs the same step; each prints the table (the data-parallel run only).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.sparse as sp
from flax import nnx
from tqdm import tqdm

import jinsum.nn
from jinsum.datasets import rmat
from jinsum.sampling import CSRGraph, sample_neighbors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402


class JinsumSAGE(nnx.Module):
    """GraphSAGE (mean) over a `NeighborSample`'s bipartite adjacencies, outermost hop first."""

    def __init__(self, sizes, *, rngs):
        self.convs = nnx.List([jinsum.nn.SAGEConv(i, o, rngs=rngs) for i, o in zip(sizes[:-1], sizes[1:])])

    def __call__(self, features, sample):
        x, x_dst = sample.inputs(features)  # (x: the current hop's sources)
        for i, (conv, A) in enumerate(zip(self.convs, sample.adjacencies)):
            if i:  # a hop's destinations are the first rows of its sources
                x_dst = x[: A.shape[0]]
            x = conv((x, x_dst), A)
            x = jax.nn.relu(x) if i < len(self.convs) - 1 else x
        return x


class SegmentSAGE(nnx.Module):
    """The same model as a JAX user writes it without jinsum: per layer, the sampled neighbour table as edges, a
    gather of the sources and a sorted `jax.ops.segment_sum` (sum and in-degree)."""

    def __init__(self, sizes, *, rngs):
        pairs = list(zip(sizes[:-1], sizes[1:]))
        self.neighbors = nnx.List([nnx.Linear(i, o, use_bias=False, rngs=rngs) for i, o in pairs])
        self.roots = nnx.List([nnx.Linear(i, o, rngs=rngs) for i, o in pairs])

    def __call__(self, features, sample):
        x, x_dst = sample.inputs(features)  # (x: the current hop's sources)
        for i, (lin, root, A) in enumerate(zip(self.neighbors, self.roots, sample.adjacencies)):
            if i:
                x_dst = x[: A.shape[0]]
            n_dst, k = A.Ak.shape  # the sampled table: k neighbours per destination, value 0 where padding
            src, valid = A.Ak.reshape(-1), (A.Av != 0).reshape(-1)
            dst = jnp.repeat(jnp.arange(n_dst), k)
            messages = jnp.where(valid[:, None], x[src], 0)
            total = jax.ops.segment_sum(messages, dst, n_dst, indices_are_sorted=True)
            degree = jax.ops.segment_sum(valid.astype(x.dtype), dst, n_dst, indices_are_sorted=True)
            x = lin(total / jnp.maximum(degree, 1)[:, None]) + root(x_dst)
            x = jax.nn.relu(x) if i < len(self.neighbors) - 1 else x
        return x


def sampled_step(model, fanouts, *, tx=None, mesh=None, steps=1, **sampling):
    """`(train, predict, state)`: jitted functions of `(state, graph, features, labels, seeds, key)` that sample the
    seeds' neighbourhood on the device (`sampling`: `sample_neighbors`' keywords); `train` returns the new state
    and the loss, `predict` the seeds' classes. `model(features, sample)` gives the sample's destinations' logits;
    `tx` is the optax optimizer (Adam, learning rate 0.01, by default).

    Data parallel over a one-axis `mesh` (`jax.sharding.Mesh(jax.devices(), ("data",))`): the seeds are split into D
    equal shards, device d samples its shard's neighbourhood from the replicated graph with the key
    `jax.random.fold_in(key, d)` and takes the gradient of its share of the batch's mean loss, and the gradients
    are summed over the devices before every device applies the same update: the step of one device over the whole
    batch sampled shard by shard with those keys (`tests/test_data_parallel.py` checks it on 4 CPU devices, with
    plain SGD, which shows a gradient summed twice). `len(seeds)` must divide by D. Place the graph, features and
    labels on the mesh first (`on_mesh`): arrays left on one device are copied to the others by every step.

    With `steps > 1`, `train` runs that many steps in one call (a `jax.lax.scan`): it takes `seeds` `(steps, B)` and
    `keys` `(steps,)` and returns the state and the `(steps,)` losses. A step of this model is a few hundred
    microseconds of GPU work in ~130 kernels; dispatching them once per call, not once per step, is what lets the
    GPUs, not the host, set the pace (one host thread dispatching two GPUs took 2x one's time a step)."""
    optimizer = nnx.Optimizer(model, tx or optax.adam(0.01), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def logits(model, graph, features, seeds, key):
        sample = sample_neighbors(graph, seeds, fanouts, key, **sampling)
        return model(features, sample)[: seeds.shape[0]]

    def loss_sum(model, graph, features, labels, seeds, key):
        """The summed cross-entropy of the real seeds (a short last batch is padded with -1), and their count."""
        real = seeds >= 0
        losses = optax.softmax_cross_entropy_with_integer_labels(logits(model, graph, features, seeds, key),
                                                                 labels[jnp.maximum(seeds, 0)])
        return jnp.sum(jnp.where(real, losses, 0)), real.sum()

    def update(state, graph, features, labels, seeds, key, total=lambda x: x):
        """One update on the mean loss over the seeds of every shard (`total` sums the loss and the count over the
        shards). Inside `shard_map` the parameters are replicated (invariant over the mesh axis) and each device's
        loss is its shard's share, so reverse mode already sums the gradients over the devices (the transpose of the
        parameters' implicit `pvary` is a `psum`); a `psum` of them here would count each D times."""
        model, optimizer = nnx.merge(graphdef, state)
        count = jnp.maximum(total(jnp.sum(seeds >= 0)), 1)

        def loss_fn(model):
            return loss_sum(model, graph, features, labels, seeds, key)[0] / count

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), total(loss)

    def run(state, graph, features, labels, seeds, keys, total=lambda x: x, device=None):
        """`update`, or `steps` of them one after the other; `device` (data parallel) is folded into each key."""
        def step(state, seeds, key):
            key = key if device is None else jax.random.fold_in(key, device)
            return update(state, graph, features, labels, seeds, key, total)

        if steps == 1:
            return step(state, seeds, keys)
        return jax.lax.scan(lambda state, batch: step(state, *batch), state, (seeds, keys))

    if mesh is None:
        train = jax.jit(run)
    else:
        [axis] = mesh.axis_names
        replicated = jax.sharding.PartitionSpec()
        split = jax.sharding.PartitionSpec(axis) if steps == 1 else jax.sharding.PartitionSpec(None, axis)

        def shard(state, graph, features, labels, seeds, keys):
            return run(state, graph, features, labels, seeds, keys, lambda x: jax.lax.psum(x, axis),
                       jax.lax.axis_index(axis))

        train = jax.jit(jax.shard_map(shard, mesh=mesh, out_specs=(replicated, replicated),
                                      in_specs=(replicated, replicated, replicated, replicated, split, replicated)))
        # (placed as the steps return it: the first step's input then has the sharding of every later one's)
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, replicated))

    @jax.jit
    def predict(state, graph, features, seeds, key):
        model, _ = nnx.merge(graphdef, state)
        return logits(model, graph, features, seeds, key).argmax(-1)

    return train, predict, state


def replicated_keys(mesh, keys: jax.Array) -> jax.Array:
    """PRNG keys replicated on every device of `mesh`, of every process. They travel as their raw data: `device_put`
    refuses a key array for other processes' devices."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(keys)), replicated))


def on_mesh(mesh, graph, features, labels, batches):
    """The data-parallel step's inputs placed once: the graph, features and labels replicated on every device of
    `mesh`, each batch of seeds split over them (what the step's `shard_map` expects, so no step copies them). Over
    several processes, each passes the same values and places its own devices' copies."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    [axis] = mesh.axis_names

    def split(seeds):  # (along their last axis: a batch, or `(steps, B)` batches of several steps a call)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * (np.ndim(seeds) - 1), axis))

    return (*jax.device_put((graph, features, labels), replicated), [jax.device_put(b, split(b)) for b in batches])


def batches(nodes: np.ndarray, batch: int, rng) -> list[np.ndarray]:
    """The nodes shuffled and cut into batches of `batch`, the last padded with -1 (static shapes)."""
    order = rng.permutation(nodes)
    padded = np.full(-(-order.size // batch) * batch, -1, np.int32)
    padded[: order.size] = order
    return list(padded.reshape(-1, batch))


def teacher_labels(edge_index, x: np.ndarray, classes: int, seed: int) -> np.ndarray:
    """SYNTHETIC labels: the argmax of a random one-layer SAGE teacher (mean aggregation), classes standardised."""
    n = x.shape[0]
    A = sp.csr_matrix((np.ones(edge_index.shape[1]), (edge_index[1], edge_index[0])), shape=(n, n))
    degree = np.maximum(np.asarray(A.sum(1)).ravel(), 1)
    rng = np.random.default_rng(seed + 1)
    w_neighbors, w_root = (rng.normal(size=(x.shape[1], classes)) for _ in range(2))
    scores = (A @ x) / degree[:, None] @ w_neighbors + x @ w_root
    return ((scores - scores.mean(0)) / scores.std(0)).argmax(1).astype(np.int32)


# --- PyG with a host sampler ----------------------------------------------------------------------------------------

def host_sample(indptr, indices, seeds, fanouts, rng):
    """Vectorised NumPy neighbour sampling with replacement: the sample's node ids (seeds first) and per layer,
    outermost first, `(edge_index, destination count)` in local ids."""
    nodes, layers = seeds, []
    for k in fanouts:
        degree = indptr[nodes + 1] - indptr[nodes]
        pick = (rng.random((nodes.size, k)) * degree[:, None]).astype(np.int64)
        has = np.repeat(degree > 0, k)
        src = indices[(indptr[nodes][:, None] + pick).reshape(-1)[has]]
        dst = np.repeat(np.arange(nodes.size), k)[has]
        unique, inverse = np.unique(np.concatenate([nodes, src]), return_inverse=True)
        local = np.full(unique.size, -1)
        local[inverse[: nodes.size]] = np.arange(nodes.size)  # the destinations first, then the new nodes
        new = local < 0
        local[new] = nodes.size + np.arange(new.sum())
        layers.append((np.stack([local[inverse[nodes.size:]], dst]), nodes.size))
        nodes = np.concatenate([nodes, unique[new]])
    return nodes, layers[::-1]


def pyg_trainer(sizes, indptr, indices, features, labels, fanouts, seed):
    """`(train(seeds) -> loss, predict(seeds) -> classes, sync)` for PyG's SAGEConv fed by `host_sample`."""
    import torch  # noqa: PLC0415
    from torch_geometric.nn import SAGEConv  # noqa: PLC0415

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList([SAGEConv(i, o) for i, o in zip(sizes[:-1], sizes[1:])])

        def forward(self, x, layers):
            for i, (conv, (edge_index, n_dst)) in enumerate(zip(self.convs, layers)):
                x = conv((x, x[:n_dst]), edge_index)
                x = torch.relu(x) if i < len(self.convs) - 1 else x
            return x

    model = Model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x_all, y_all = torch.from_numpy(features).to(device), torch.from_numpy(labels).long().to(device)
    rng = np.random.default_rng(seed)

    def forward(seeds):
        seeds = seeds[seeds >= 0]
        nodes, layers = host_sample(indptr, indices, seeds, fanouts, rng)
        x = x_all[torch.from_numpy(nodes).to(device)]
        return model(x, [(torch.from_numpy(e).to(device), n) for e, n in layers])[: seeds.size], seeds

    def train(seeds):
        model.train()
        optimizer.zero_grad()
        out, seeds = forward(seeds)
        loss = torch.nn.functional.cross_entropy(out, y_all[torch.from_numpy(seeds).to(device)])
        loss.backward()
        optimizer.step()
        return loss

    def predict(seeds):
        model.eval()
        with torch.no_grad():
            return forward(seeds)[0].argmax(-1).cpu().numpy()

    def sync(_):
        if device == "cuda":
            torch.cuda.synchronize()

    return train, predict, sync


# --- the run -------------------------------------------------------------------------------------------------------

def run_jax(name, train, predict, state, graph, x, y, train_calls, test_batches, epochs, seed, mesh=None):
    """Trains over `epochs` shuffled epochs with a progress bar; returns (steps/s, test accuracy, compiles, last
    loss). `train_calls` are an epoch's seeds call by call: `(B,)` batches, or `(K, B)` stacks of K steps for a
    `train` of `steps=K`. With a `mesh`, the inputs must be placed on it (`on_mesh`); the keys and test batches are
    placed here."""
    per_call = train_calls[0].shape[0] if train_calls[0].ndim == 2 else 1
    calls = len(train_calls) * epochs
    keys = jax.random.split(jax.random.key(seed), calls * per_call + len(test_batches))
    train_keys = keys[:calls * per_call].reshape((calls, per_call) if per_call > 1 else (calls,))
    test_keys = keys[calls * per_call:]
    if mesh is not None:
        train_keys, test_keys = replicated_keys(mesh, train_keys), replicated_keys(mesh, test_keys)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        test_batches = [jax.device_put(np.asarray(b), replicated) for b in test_batches]
    train_keys, test_keys = list(train_keys), list(test_keys)  # (indexing an array per call dispatches)
    state, loss = train(state, graph, x, y, train_calls[0], train_keys[0])  # compile outside the timed loop
    jax.block_until_ready(loss)
    start = time.perf_counter()
    with tqdm(total=calls * per_call, desc=name, unit="step", leave=False) as bar:
        for call in range(calls):
            state, losses = train(state, graph, x, y, train_calls[call % len(train_calls)], train_keys[call])
            loss = losses[-1] if per_call > 1 else losses
            if call % max(1, 20 // per_call) == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}")
            bar.update(per_call)
        jax.block_until_ready(loss)
    rate = calls * per_call / (time.perf_counter() - start)
    correct = total = 0
    for seeds, key in zip(test_batches, test_keys):
        classes = np.asarray(predict(state, graph, x, seeds, key))
        real = np.asarray(seeds) >= 0
        correct += int((classes[real] == np.asarray(y)[np.asarray(seeds)[real]]).sum())
        total += int(real.sum())
    return rate, correct / total, train._cache_size(), float(loss)


def run_pyg(trainer, labels, train_batches, test_batches, epochs):
    train, predict, sync = trainer
    steps = len(train_batches) * epochs
    sync(train(train_batches[0]))
    start = time.perf_counter()
    for step in tqdm(range(steps), desc="PyG", unit="step", leave=False):
        loss = train(train_batches[step % len(train_batches)])
    sync(loss)
    rate = steps / (time.perf_counter() - start)
    correct = sum(int((predict(s) == labels[s[s >= 0]]).sum()) for s in test_batches)
    return rate, correct / sum(int((s >= 0).sum()) for s in test_batches), loss.detach().item()


def main(argv=None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--scale", type=int, default=18)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10])
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--devices", type=int, default=0,
                   help="also train data parallel on this many devices (default: all, where there are several)")
    p.add_argument("--coordinator", help="host:port of process 0: train data parallel over every process's devices")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--steps-per-call", type=int, default=1,
                   help="run K steps in one call of the JAX systems (one dispatch for K: sampled_step(steps=K)); "
                        "an epoch's last (batches mod K) batches are left out")
    args = p.parse_args(argv)
    if args.coordinator:
        _common.join_processes(args.coordinator, args.num_processes, args.process_id)
    processes = jax.process_count()
    if args.smoke:
        args.scale, args.epochs, args.batch = 9, 1, 64
    fanouts, sizes = tuple(args.fanouts), (args.features, 256, args.classes)

    edge_index = rmat(args.scale, undirected=True, seed=args.seed)
    n = 1 << args.scale
    rng = np.random.default_rng(args.seed)
    features = rng.normal(size=(n, args.features)).astype(np.float32)
    labels = teacher_labels(edge_index, features, args.classes, args.seed)
    train_nodes, test_nodes = np.split(rng.permutation(n), [int(0.8 * n)])
    train_batches, test_batches = batches(train_nodes, args.batch, rng), batches(test_nodes, args.batch, rng)
    graph = CSRGraph.from_edge_index(edge_index, n)
    x, y = jnp.asarray(features), jnp.asarray(labels)
    where = f"; process {jax.process_index()} of {processes}" if processes > 1 else ""
    print(f"R-MAT {args.scale}: {n:,} nodes, {edge_index.shape[1]:,} edges; {len(train_batches)} batches of "
          f"{args.batch} a epoch, fanouts {fanouts}; {_common.device_name()}{where}")
    print(f"constant guess: {np.bincount(labels[test_nodes]).max() / test_nodes.size:.3f} test accuracy")

    rows = []
    sampling = dict(outer_sources="graph")  # (the first layer reads the feature table in place: module docstring)
    # Several processes (one per GPU, each dispatching its own): only the data-parallel run, over all their devices.
    runs = [] if processes > 1 else [("jinsum SAGEConv", JinsumSAGE, None),
                                     ("plain JAX segment_sum", SegmentSAGE, None)]
    devices = jax.devices()[: args.devices or len(jax.devices())]
    if len(devices) > 1 and args.batch % len(devices) == 0:  # each device samples its share of the seeds
        mesh = jax.sharding.Mesh(np.array(devices), ("data",))
        by = f", {processes} processes" if processes > 1 else ""
        runs.append((f"jinsum SAGEConv, {len(devices)} devices{by} (data parallel)", JinsumSAGE, mesh))
    K = args.steps_per_call
    train_calls = train_batches if K == 1 else [np.stack(train_batches[i:i + K])
                                                for i in range(0, len(train_batches) - K + 1, K)]
    for name, model, mesh in runs:
        train, predict, state = sampled_step(model(sizes, rngs=nnx.Rngs(args.seed)), fanouts, mesh=mesh, steps=K,
                                             **sampling)
        inputs = (graph, x, y, [jnp.asarray(b) for b in train_calls])
        if mesh is not None:
            inputs = on_mesh(mesh, *inputs)
        rate, accuracy, compiles, loss = run_jax(name, train, predict, state, *inputs,
                                                 [jnp.asarray(b) for b in test_batches], args.epochs, args.seed, mesh)
        rows.append([name, f"{rate:.1f}", f"{accuracy:.3f}", f"{loss:.6f}", str(compiles)])
    if processes == 1:
        try:
            import torch_geometric  # noqa: F401, PLC0415
        except ImportError:
            rows.append(["PyG SAGEConv (host sampler)", "-", "-", "-", "torch_geometric not installed"])
        else:
            trainer = pyg_trainer(sizes, np.asarray(graph.indptr).astype(np.int64), np.asarray(graph.indices),
                                  features, labels, fanouts, args.seed)
            rate, accuracy, loss = run_pyg(trainer, labels, train_batches, test_batches, args.epochs)
            rows.append(["PyG SAGEConv (host sampler)", f"{rate:.1f}", f"{accuracy:.3f}", f"{loss:.6f}", "-"])
    _common.print_table(f"GraphSAGE, {args.epochs} epoch(s) of mini-batches",
                        ["system", "steps/s", "test accuracy", "last loss", "compiles"], rows)


if __name__ == "__main__":
    main()

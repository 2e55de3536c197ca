"""A DLRM-style click model on GENERATED data: bags of categorical ids, one embedding table each, the bags built on
the device in every step (one compile), and the tables updated on the rows each batch touches only.

The data are generated: `--samples` impressions, each with 13 dense features (standard normal) and `--tables`
categorical features, each a bag of 1-`--bag` ids of its own table of `--rows` ids, drawn with a power-law
popularity (Zipf, exponent 1.1: a few ids in most bags, most ids rare). The signal is planted: every id has a hidden
score (standard normal), and the click logit is the sum over the bags of their ids' scores, plus a linear function
of the dense features, plus a product of the two; the label is a Bernoulli draw of its sigmoid. The planted logits'
own test AUC is printed as the best a model can reach. Impressions are split 80% / 20% into train / test.

Model (Naumov et al., 2019, "Deep Learning Recommendation Model"): a bottom MLP maps the dense features to `--dim`,
each table's bag is pooled by a `jinsum.nn.EmbeddingBag` (sum) into `--dim`, the pairwise dot products of these
`tables + 1` vectors and the bottom output go through a top MLP to one logit; binary cross-entropy. The MLPs train
with Adam, the tables with row-wise Adagrad (DLRM's: one accumulator per row). Batches are flat ids with offsets per
table (torch's reading), padded with -1 to a static length. Systems, from the same initial parameters:

- jinsum, sparse rows: `emb.bags(ids, offsets, unique=True)` in the step, the gradient with respect to the rows the
  batch touches (`bags.take(table)`, `(U, dim)`), `jinsum.nn.sparse_adagrad` on those rows;
- jinsum, dense gradient: `jinsum.nn.embedding_bag(table, emb.bags(ids, offsets), "sum")`, the whole table's
  gradient (its transpose over the lookups in column order), the same Adagrad on every row;
- plain JAX: gathers `table[ids]` and a sorted `jax.ops.segment_sum`, the same dense Adagrad.
Row-wise Adagrad leaves a row without gradient as it was, so the three train the same model (their losses agree to
float32 rounding). Reported per epoch: the training loss, test AUC and accuracy and steps/s; then each system's
compile count (one).

    python examples/dlrm/main.py [--samples 200000] [--tables 4] [--rows 100000] [--bag 8] [--epochs 2] [--smoke]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.stats
from flax import nnx
from tqdm import tqdm

import jinsum.nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402

DENSE_FEATURES = 13  # (Criteo's)
MLPS = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embeddings")))  # what Adam trains; the tables have Adagrad


# --- data -----------------------------------------------------------------------------------------------------------

def generate(samples: int, tables: int, rows: int, bag: int, seed: int):
    """`(dense (n, 13), lookups, labels (n,), planted logits (n,))`, `lookups` per table a pair `(ids, lengths)`:
    each impression's bag is the next `lengths[i]` of the flat `ids`."""
    rng = np.random.default_rng(seed)
    popularity = (np.arange(rows) + 1.0) ** -1.1
    lookups, logits = [], np.zeros(samples)
    for _ in range(tables):
        lengths = rng.integers(1, bag + 1, samples)
        # The popular ids spread over the table (a permutation), as hashed categories are.
        ids = rng.permutation(rows)[rng.choice(rows, lengths.sum(), p=popularity / popularity.sum())]
        logits += np.add.reduceat(rng.standard_normal(rows)[ids], np.cumsum(lengths) - lengths) / np.sqrt(bag)
        lookups.append((ids.astype(np.int32), lengths))
    dense = rng.standard_normal((samples, DENSE_FEATURES)).astype(np.float32)
    linear = dense @ rng.standard_normal(DENSE_FEATURES) / np.sqrt(DENSE_FEATURES)
    logits = 1.5 * (logits / logits.std() + linear + 0.5 * logits / logits.std() * linear) - 1.0
    labels = (rng.random(samples) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return dense, lookups, labels, logits


def batches(dense, lookups, labels, order: np.ndarray, size: int, bag: int):
    """The impressions `order` in batches of `size` (the last one left out when short): `(dense, labels, lookups)`
    with per table the flat ids padded with -1 to `size * bag` and each bag's offset, as device arrays."""
    starts = [np.cumsum(lengths) - lengths for _, lengths in lookups]
    out = []
    for chunk in np.split(order[: len(order) // size * size], len(order) // size):
        tables = []
        for (ids, lengths), start in zip(lookups, starts):
            n = lengths[chunk]
            first = np.cumsum(n) - n
            positions = np.repeat(start[chunk] - first, n) + np.arange(n.sum())
            flat = np.full(size * bag, -1, np.int32)
            flat[: n.sum()] = ids[positions]
            tables.append((jnp.asarray(flat), jnp.asarray(first.astype(np.int32))))
        out.append((jnp.asarray(dense[chunk]), jnp.asarray(labels[chunk]), tables))
    return out


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve: the chance that a random click scores above a random non-click (ties half)."""
    ranks = scipy.stats.rankdata(scores)
    positives = labels.sum()
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * (len(labels) - positives)))


# --- the model and the three ways of pooling the bags -------------------------------------------------------------

class DLRM(nnx.Module):
    """Bottom MLP, one `EmbeddingBag` (sum) per table, pairwise dot products, top MLP: one logit per impression."""

    def __init__(self, tables: int, rows: int, dim: int, *, rngs: nnx.Rngs):
        self.embeddings = nnx.List([jinsum.nn.EmbeddingBag(rows, dim, mode="sum", rngs=rngs) for _ in range(tables)])
        self.bottom = nnx.Sequential(nnx.Linear(DENSE_FEATURES, 64, rngs=rngs), nnx.relu,
                                     nnx.Linear(64, dim, rngs=rngs), nnx.relu)
        pairs = (tables + 1) * tables // 2
        self.top = nnx.Sequential(nnx.Linear(dim + pairs, 64, rngs=rngs), nnx.relu, nnx.Linear(64, 1, rngs=rngs))

    def __call__(self, dense: jax.Array, pooled: list[jax.Array]) -> jax.Array:
        """`dense (B, 13)`, `pooled` per table `(B, dim)` -> logits `(B,)`."""
        x = self.bottom(dense)
        z = jnp.stack([x, *pooled], axis=1)
        i, j = np.triu_indices(z.shape[1], k=1)
        dots = jnp.einsum("bid,bjd->bij", z, z)[:, i, j]
        return self.top(jnp.concatenate([x, dots], axis=1))[:, 0]


def jinsum_pool(model: DLRM, tables: list[jax.Array], lookups) -> list[jax.Array]:
    """Each table's bags summed by jinsum (`EmbeddingBag.bags` on the device, `embedding_bag`)."""
    return [jinsum.nn.embedding_bag(table, emb.bags(ids, offsets), "sum")
            for emb, table, (ids, offsets) in zip(model.embeddings, tables, lookups)]


def segment_pool(model: DLRM, tables: list[jax.Array], lookups) -> list[jax.Array]:
    """The same as a JAX user writes it without jinsum: gathers and a sorted `segment_sum` (padding masked)."""
    pooled = []
    for table, (ids, offsets) in zip(tables, lookups):
        bag = jnp.cumsum(jnp.zeros(ids.shape[0], jnp.int32).at[offsets].add(1)) - 1
        rows = jnp.where((ids >= 0)[:, None], table[jnp.maximum(ids, 0)], 0)
        pooled.append(jax.ops.segment_sum(rows, bag, num_segments=offsets.shape[0], indices_are_sorted=True))
    return pooled


def rowwise_adagrad(table, accumulator, grad, learning_rate, eps=1e-10):
    """Row-wise Adagrad on a whole table: `jinsum.nn.sparse_adagrad`'s step on every row."""
    accumulator = accumulator + jnp.mean(grad**2, axis=1)
    return table - learning_rate * grad / (jnp.sqrt(accumulator)[:, None] + eps), accumulator


SPARSE = "jinsum EmbeddingBag, sparse rows"
DENSE = "jinsum EmbeddingBag, dense gradient"
SEGMENT = "plain JAX gather + segment_sum"


def make_step(system: str, model: DLRM, learning_rate: float, embedding_learning_rate: float):
    """`(step, predict, state)`: jitted `step(state, batch) -> (state, loss)` and `predict(state, batch) -> logits`,
    `state` the model's variables, Adam's for the MLPs and the tables' row-wise Adagrad accumulators."""
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=MLPS)
    graphdef, state = nnx.split((model, optimizer))
    accumulators = [jnp.zeros(emb.num_embeddings) for emb in model.embeddings]
    pool = segment_pool if system == SEGMENT else jinsum_pool

    @jax.jit
    def step(state, batch):
        (model, optimizer), accumulators = nnx.merge(graphdef, state[0]), state[1]
        dense, labels, lookups = batch
        tables = [emb.embedding[...] for emb in model.embeddings]
        if system == SPARSE:  # differentiate with respect to the rows the batch touches
            bags = [emb.bags(ids, offsets, unique=True) for emb, (ids, offsets) in zip(model.embeddings, lookups)]
            inputs = [b.take(table) for b, table in zip(bags, tables)]
        else:  # with respect to the whole tables
            inputs = tables

        def loss_fn(model, inputs):
            if system == SPARSE:
                pooled = [emb(b, rows=rows) for emb, b, rows in zip(model.embeddings, bags, inputs)]
            else:
                pooled = pool(model, inputs, lookups)
            return optax.sigmoid_binary_cross_entropy(model(dense, pooled), labels).mean()

        loss, (grads, table_grads) = nnx.value_and_grad(loss_fn, argnums=(nnx.DiffState(0, MLPS), 1))(model, inputs)
        optimizer.update(model, grads)
        for i, (emb, table, grad) in enumerate(zip(model.embeddings, tables, table_grads)):
            if system == SPARSE:
                emb.embedding[...], accumulators[i] = jinsum.nn.sparse_adagrad(
                    table, accumulators[i], bags[i], grad, embedding_learning_rate)
            else:
                emb.embedding[...], accumulators[i] = rowwise_adagrad(table, accumulators[i], grad,
                                                                      embedding_learning_rate)
        return (nnx.state((model, optimizer)), accumulators), loss

    @jax.jit
    def predict(state, batch):
        model, _ = nnx.merge(graphdef, state[0])
        dense, _, lookups = batch
        return model(dense, pool(model, [emb.embedding[...] for emb in model.embeddings], lookups))

    return step, predict, (state, accumulators)


def run(system: str, args, train_batches, test_batches, test_labels) -> list:
    """Trains one system, printing each epoch; its summary row."""
    model = DLRM(args.tables, args.rows, args.dim, rngs=nnx.Rngs(args.seed))
    step, predict, state = make_step(system, model, args.lr, args.embedding_lr)
    rates = []
    for epoch in range(1, args.epochs + 1):
        losses = []
        for i, batch in enumerate(tqdm(train_batches, desc=f"{system}, epoch {epoch}", leave=False)):
            if i == 1:  # (steps/s from the second step of each epoch: the run's first one compiles)
                jax.block_until_ready(losses)
                start = time.perf_counter()
            state, loss = step(state, batch)
            losses.append(loss)
        jax.block_until_ready(losses)
        rates.append((len(train_batches) - 1) / (time.perf_counter() - start))
        scores = np.concatenate([np.asarray(predict(state, batch)) for batch in test_batches])
        test_auc, accuracy = auc(scores, test_labels), float(np.mean((scores > 0) == test_labels))
        loss = float(np.mean(losses))
        print(f"{system}: epoch {epoch}, loss {loss:.4f}, test AUC {test_auc:.4f}, accuracy {accuracy:.4f}, "
              f"{rates[-1]:.1f} steps/s")
    return [system, f"{loss:.4f}", f"{test_auc:.4f}", f"{accuracy:.4f}", f"{np.median(rates):.1f}",
            str(step._cache_size())]


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=100_000, help="ids per table")
    p.add_argument("--bag", type=int, default=8, help="the most ids in a bag (1 to bag, uniform)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's, for the MLPs")
    p.add_argument("--embedding-lr", type=float, default=0.02, help="row-wise Adagrad's, for the tables")
    args = p.parse_args(argv)
    if args.smoke:  # (two tables, not four: the step has a lookup, a gradient and an update per table to compile)
        args.samples, args.tables, args.rows, args.batch, args.epochs = 4096, 2, 1000, 256, 2

    dense, lookups, labels, planted = generate(args.samples, args.tables, args.rows, args.bag, args.seed)
    train, test = _common.random_split(args.samples, (0.8,), args.seed)
    rng = np.random.default_rng(args.seed)
    train_batches = batches(dense, lookups, labels, rng.permutation(train), args.batch, args.bag)
    test_batches = batches(dense, lookups, labels, test, args.batch, args.bag)
    test_order = test[: len(test) // args.batch * args.batch]
    print(f"{args.samples:,} GENERATED impressions ({labels.mean():.1%} clicks), {args.tables} tables of "
          f"{args.rows:,} ids, bags of 1-{args.bag} ids (power law); {len(train_batches)} batches of {args.batch} a "
          f"epoch; {_common.device_name()}")
    print(f"planted logits: test AUC {auc(planted[test_order], labels[test_order]):.4f} (the best reachable); "
          f"constant guess accuracy {max(labels[test_order].mean(), 1 - labels[test_order].mean()):.4f}")
    rows = [run(system, args, train_batches, test_batches, labels[test_order]) for system in (SPARSE, DENSE, SEGMENT)]
    _common.print_table(f"DLRM, {args.epochs} epoch(s), seed {args.seed}",
                        ["system", "last epoch's loss", "test AUC", "test accuracy", "steps/s", "compiles"], rows)


if __name__ == "__main__":
    main()

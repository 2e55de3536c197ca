"""A byte-level causal language model on PACKED documents: masks that come from the data, built inside `jit`.

The text is the Python source that ships with Python: every `.py` file under the standard library's folder
(`sysconfig.get_paths()["stdlib"]`, its tests included, `site-packages` left out: about 1,760 files and 31 MB
for CPython 3.11) in a fixed order, each file one document, its bytes the tokens (a vocabulary of 256). Every
10th file is held out for validation. The training files, in an order shuffled by `--seed` (reshuffled each
epoch), are packed end to end into sequences of `--seq-len` bytes: a file that crosses a sequence boundary
continues in the next one, and each position carries the id of its document (restarting from 0 in each sequence)
and its position in that document's part of the sequence. `--batch` sequences make a batch.

The model predicts the next byte: byte embeddings + learned positions (within the document), `--layers` pre-norm
transformer blocks (LayerNorm, `jinsum.nn.BlockSparseAttention`, LayerNorm, a 4x GELU MLP) and an output
projection, trained with cross entropy on every position whose next byte is in the same document: the first
byte of a document is never predicted from the end of the previous one, and no position attends across
documents. Systems, the same model trained from the same seed on the same batches (only the attention differs):

- dense causal + document mask: `jinsum.sequence_mask(L, block, document_ids=doc, causal=True)`, one
  `BlockMask` per sequence built on the device in every step and shared by the layers (new document boundaries
  compile nothing); the kernels skip the blocks where no query and key share a document;
- sliding window + document mask: the same with `window=256` (`L // 4` with `--smoke`): a position sees the 255
  bytes before it in its document;
- BigBird + document mask: a fixed causal BigBird layout (`jinsum.block_pattern`: 1 local, 1 global and 1
  random block per block row), built once on the host and passed as the pattern, with the document ids masking
  inside its blocks (every stored block is computed, whatever the documents);
- dense causal + document mask, GQA: the first with half as many key/value heads as query heads;
- plain JAX dot_product_attention + document mask: the first written without jinsum, as a baseline:
  `jax.nn.dot_product_attention` with a boolean `(L, L)` mask per sequence (all `L^2` scores computed), from the
  same parameters; its losses match the first system's up to rounding;
- dense causal + document mask, MoE FFN: the first with each block's MLP a mixture of experts
  (`jinsum.nn.MoE`: `--experts` GELU MLPs of hidden width `2 * d_model`, each byte routed to 2 of them, the
  load-balancing and z losses added to the training loss): the dense MLP's active parameters and FLOPs per byte,
  `--experts / 2` times its parameters.

`--smoke` runs the first three and the MoE one unless `--systems` names others.

Printed: the training loss every few steps for each system (the mean over the steps since the previous row),
then per system the validation loss (and bits per byte), the median step time (forward, backward and Adam; each
step waited for), the compile time of the step, and the share of each sequence's `(L / block)^2` block grid that
the attention computes (for the masks built from the data, the mean over the validation batches). The parameters
stay in float32; `--dtype bfloat16` (the default on a GPU) runs the forward and backward passes in bfloat16.

    python examples/packed_lm/main.py [--seq-len 2048] [--batch 16] [--d-model 256] [--layers 4] [--heads 4]
        [--block 128] [--steps 300] [--window 256] [--dtype auto|float32|bfloat16] [--systems ...] [--smoke]
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jinsum.nn
from jinsum.formats import BlockGroupCOO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402

# name -> (attention: "mask", a BlockMask built from the data per step; "bigbird", a fixed pattern; "dense", plain
# JAX with an (L, L) mask per sequence; the query heads per key/value head; the feed-forward layer: "mlp" or "moe")
SYSTEMS = {
    "dense causal + document mask": ("mask", 1, "mlp"),
    "sliding window + document mask": ("mask", 1, "mlp"),
    "BigBird + document mask": ("bigbird", 1, "mlp"),
    "dense causal + document mask, GQA": ("mask", 2, "mlp"),
    "plain JAX dot_product_attention + document mask": ("dense", 1, "mlp"),
    "dense causal + document mask, MoE FFN": ("mask", 1, "moe"),
}
BASELINE = "plain JAX dot_product_attention + document mask"
SMOKE_SYSTEMS = ["dense causal + document mask", "sliding window + document mask", "BigBird + document mask",
                 "dense causal + document mask, MoE FFN"]
TOP_K = 2  # experts per byte in the MoE system (each of hidden width 2 * d_model: the dense MLP's active size)


# --- data --------------------------------------------------------------------------------------------------------

def stdlib_sources(limit: int | None = None) -> list[tuple[str, bytes]]:
    """The standard library's `.py` files as `(relative path, bytes)`, empty files left out, in a fixed order:
    depth first, each folder's entries sorted by name (`site-packages` skipped); the first `limit` if given."""
    root = Path(sysconfig.get_paths()["stdlib"])

    def walk(folder: Path):
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if entry.is_dir():
                if entry.name not in ("site-packages", "dist-packages", "__pycache__"):
                    yield from walk(entry)
            elif entry.suffix == ".py":
                yield entry

    sources = []
    for path in walk(root):
        if limit is not None and len(sources) == limit:
            break
        if data := path.read_bytes():
            sources.append((path.relative_to(root).as_posix(), data))
    return sources


def pack(documents: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The documents end to end: `(stream, starts)`, the bytes and each document's first offset (plus the end)."""
    stream = np.frombuffer(b"".join(documents), np.uint8)
    return stream, np.concatenate([[0], np.cumsum([len(d) for d in documents])])


def packed_batch(stream: np.ndarray, starts: np.ndarray, first: int, batch: int, length: int) -> dict[str, np.ndarray]:
    """Sequences `first, ..., first + batch - 1` of the packed stream, each `length` bytes, as arrays `(batch, length)`:

    - tokens: the bytes; targets: the byte after each (the next sequence's first byte after the last);
    - valid: the target is in the same document (False where a new document starts: nothing predicts its first
      byte from the previous document);
    - documents: the document of each position, numbered from 0 in each sequence;
    - positions: the position within that document's part of the sequence (from 0 where the document, or the
      sequence, starts).
    """
    index = (first + np.arange(batch))[:, None] * length + np.arange(length)
    document = np.searchsorted(starts, index, side="right") - 1
    valid = np.searchsorted(starts, index + 1, side="right") - 1 == document
    positions = index - np.maximum(starts[document], index[:, :1])
    return dict(tokens=stream[index].astype(np.int32), targets=stream[index + 1].astype(np.int32), valid=valid,
                documents=(document - document[:, :1]).astype(np.int32), positions=positions.astype(np.int32))


def training_batches(documents: list[bytes], batch: int, length: int, steps: int, seed: int):
    """`steps` batches of the training documents, shuffled by `seed` and packed anew in every epoch."""
    rng = np.random.default_rng(seed)
    step = 0
    while True:
        stream, starts = pack([documents[i] for i in rng.permutation(len(documents))])
        per_epoch = (len(stream) - 1) // length // batch
        if per_epoch == 0:
            raise ValueError(f"packed_lm: {len(stream)} training bytes do not fill one batch of {batch} x {length}")
        for i in range(per_epoch):
            if step == steps:
                return
            yield packed_batch(stream, starts, i * batch, batch, length)
            step += 1


def validation_batches(documents: list[bytes], batch: int, length: int, count: int) -> list[dict[str, np.ndarray]]:
    """Up to `count` batches of the validation documents, packed in their fixed order."""
    stream, starts = pack(documents)
    available = (len(stream) - 1) // length // batch
    if available == 0:
        raise ValueError(f"packed_lm: {len(stream)} validation bytes do not fill one batch of {batch} x {length}")
    return [packed_batch(stream, starts, i * batch, batch, length) for i in range(min(count, available))]


def bigbird(length: int, block: int, seed: int) -> tuple[BlockGroupCOO, float]:
    """The causal BigBird layout of one sequence (`jinsum.block_pattern`, built once on the host, shared by
    the batch) and the share of the block grid it stores. Each sequence's document ids mask inside its blocks
    (`BlockSparseAttention(x, pattern, document_ids=(B, L) ids)`: a `mask_mod` reading `doc[b, q]`)."""
    layout = jinsum.block_pattern(length, block, local_blocks=1, global_blocks=1, random_blocks=1, seed=seed,
                                     causal=True)
    return layout, layout.num_groups / (length // block) ** 2


# --- model -------------------------------------------------------------------------------------------------------

class Block(nnx.Module):
    """A pre-norm transformer block: `x + attn(ln(x))`, then `x + ffn(ln(x))`, the feed-forward layer a 4x GELU
    MLP or (`experts`) a mixture of GELU experts of width 2x with 2 per byte. Returns `(x, aux_loss)`: the MoE's
    load-balancing and z losses (0 for the MLP)."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, window: int | None, block: int,
                 experts: int | None, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = jinsum.nn.BlockSparseAttention(d_model, heads, num_kv_heads=kv_heads, causal=True, window=window,
                                                   block=block, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        if experts is None:
            self.mlp = nnx.Sequential(nnx.Linear(d_model, 4 * d_model, rngs=rngs), nnx.gelu,
                                      nnx.Linear(4 * d_model, d_model, rngs=rngs))
        else:
            self.mlp = jinsum.nn.MoE(d_model, 2 * d_model, num_experts=experts, top_k=TOP_K, activation="gelu",
                                     rngs=rngs)

    def __call__(self, x, pattern, documents):
        if isinstance(pattern, jax.Array):  # the plain JAX baseline: a boolean (B, 1, L, L) mask
            x = x + dense_attention(self.attn, self.ln1(x), pattern)
        else:
            x = x + self.attn(self.ln1(x), pattern, document_ids=documents)
        if isinstance(self.mlp, jinsum.nn.MoE):
            y, aux_loss = self.mlp(self.ln2(x))  # (its computation dtype: the input's, the parameters cast)
            return x + y, aux_loss
        return x + self.mlp(self.ln2(x)), jnp.zeros((), jnp.float32)


def dense_attention(attn: jinsum.nn.BlockSparseAttention, x: jax.Array, mask: jax.Array) -> jax.Array:
    """What `attn(x, ...)` computes, with its parameters, written with `jax.nn.dot_product_attention` and a dense
    boolean mask: every score is computed, and the masked ones dropped."""
    heads, kv_heads = attn.num_heads, attn.num_kv_heads
    qkv = attn.qkv(x).reshape(*x.shape[:-1], heads + 2 * kv_heads, attn.head_dim)
    q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=-2)
    return attn.out(jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(*x.shape[:-1], -1))


class ByteLM(nnx.Module):
    """Byte and position embeddings, `layers` blocks, a final LayerNorm and the output projection to 256 bytes."""

    def __init__(self, *, length: int, d_model: int, layers: int, heads: int, kv_heads: int, window: int | None,
                 block: int, attention: str = "mask", experts: int | None = None, rngs: nnx.Rngs):
        embedding = nnx.initializers.normal(0.02)
        self.tokens = nnx.Embed(256, d_model, embedding_init=embedding, rngs=rngs)
        self.positions = nnx.Embed(length, d_model, embedding_init=embedding, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, kv_heads, window, block, experts, rngs=rngs)
                                for _ in range(layers)])
        self.ln = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, 256, kernel_init=nnx.initializers.zeros, rngs=rngs)  # (starts at ln 256)
        self.window, self.block, self.attention = window, block, attention

    def __call__(self, batch: dict[str, jax.Array], pattern: BlockGroupCOO | None = None):
        """`(logits (B, L, 256), aux_loss)`, the blocks' auxiliary losses summed. Without `pattern`, the document
        mask (causal, and windowed if the model is) is built here on the device, one per sequence, and shared by the
        layers; with one (the BigBird layout), each sequence's document ids mask inside its blocks. The plain JAX
        baseline (`attention="dense"`) builds a boolean `(B, 1, L, L)` mask instead."""
        documents = batch["documents"]
        size, length = documents.shape
        x = self.tokens(batch["tokens"]) + self.positions(batch["positions"])
        # In the parameters' dtype (bfloat16 where the trainer casts them): nnx.Embed computes in the dtype it was
        # built with, float32, and every layer after it would too.
        x = x.astype(self.tokens.embedding[...].dtype)
        if self.attention == "dense":  # (window: not needed by the systems here)
            causal = jnp.tril(jnp.ones((length, length), bool))
            pattern = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
        elif pattern is None:
            pattern, documents = self.mask(documents), None  # (the mask carries the documents)
        aux_loss = jnp.zeros((), jnp.float32)
        for block in self.blocks:
            x, aux = block(x, pattern, documents)
            aux_loss += aux
        return self.head(self.ln(x)).reshape(size, length, -1), aux_loss

    def mask(self, documents: jax.Array) -> jinsum.BlockMask:
        """The block mask of `documents` `(B, L)` (causal, windowed if the model is), one per sequence."""
        return jinsum.sequence_mask(documents.shape[-1], self.block, document_ids=documents, causal=True,
                                       window=self.window)


# --- training ----------------------------------------------------------------------------------------------------

def trainer(model: ByteLM, tx: optax.GradientTransformation, dtype):
    """`(step, evaluate, state)`: `step(state, batch, pattern) -> (state, loss)` (jitted, `state` donated: pass
    each step the last one's; the loss it returns and minimises includes the MoE's auxiliary losses) and
    `evaluate(state, batch, pattern) -> (summed loss, targets, blocks)` (the language model's loss alone), where
    `blocks` counts the blocks the document mask of the batch computes (0 unless it is a `BlockMask`).

    The parameters stay in float32 (Adam's master copy); the forward and backward passes run in `dtype`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_sum(params, batch, pattern):
        compute = jax.tree.map(lambda p: p.astype(dtype), params)
        logits, aux_loss = nnx.merge(graphdef, compute, rest)(batch, pattern)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
        return jnp.sum(jnp.where(batch["valid"], losses, 0.0)), jnp.sum(batch["valid"]), aux_loss

    def mean_loss(params, batch, pattern):
        total, count, aux_loss = loss_sum(params, batch, pattern)
        return total / jnp.maximum(count, 1) + aux_loss

    @functools.partial(jax.jit, donate_argnums=0)  # (the new state takes the old one's buffers)
    def step(state, batch, pattern):
        params, opt_state = state
        loss, grads = jax.value_and_grad(mean_loss)(params, batch, pattern)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    @jax.jit
    def evaluate(state, batch, pattern):
        by_mask = pattern is None and model.attention == "mask"
        blocks = jnp.count_nonzero(model.mask(batch["documents"]).flags) if by_mask else 0
        return *loss_sum(state[0], batch, pattern)[:2], blocks

    return step, evaluate, (params, tx.init(params))


def run(name: str, args, train_docs, val_batches, dtype, pattern_info) -> dict:
    """Trains one system; its losses every step, validation loss, median step time, compile time."""
    kind, kv_fraction, ffn = SYSTEMS[name]
    window = args.window if name.startswith("sliding window") else None
    model = ByteLM(length=args.seq_len, d_model=args.d_model, layers=args.layers, heads=args.heads,
                   kv_heads=args.heads // kv_fraction, window=window, block=args.block, attention=kind,
                   experts=args.experts if ffn == "moe" else None, rngs=nnx.Rngs(args.seed))
    parameters = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    warmup = min(args.warmup, args.steps - 1)  # (the cosine decay needs a step)
    schedule = optax.warmup_cosine_decay_schedule(args.lr / max(warmup, 1), args.lr, warmup, args.steps,
                                                  end_value=args.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule, b2=0.95))
    step, evaluate, state = trainer(model, tx, dtype)
    pattern = pattern_info[0] if kind == "bigbird" else None

    batches = training_batches(train_docs, args.batch, args.seq_len, args.steps, args.seed)
    first = next(batches)
    start = time.perf_counter()
    compiled = step.lower(state, first, pattern).compile()
    compile_s = time.perf_counter() - start

    losses, times = [], []
    with tqdm(total=args.steps, desc=name, leave=False, disable=args.smoke) as bar:
        for batch in itertools.chain([first], batches):
            batch = jax.device_put(batch)
            start = time.perf_counter()
            state, loss = compiled(state, batch, pattern)
            losses.append(float(loss))  # (waits for the step)
            times.append(time.perf_counter() - start)
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    total, count, blocks = 0.0, 0, 0
    for batch in val_batches:
        s, c, b = jax.device_get(evaluate(state, batch, pattern))
        total, count, blocks = total + float(s), count + int(c), blocks + int(b)
    grid = len(val_batches) * args.batch * (args.seq_len // args.block) ** 2
    share = {"bigbird": pattern_info[1] if pattern_info else 0.0, "dense": 1.0}.get(kind, blocks / grid)
    return dict(losses=losses, val=total / count, step_s=float(np.median(times[1:] or times)), compile_s=compile_s,
                share=share, kv_heads=args.heads // kv_fraction, window=window, parameters=parameters)


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--window", type=int, default=256, help="the sliding window, in bytes")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (the MoE system)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=30,
                   help="steps of linear warm-up from lr / WARMUP to lr (then a cosine decay to lr / 10)")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=None, help="rows of the loss table (default: steps / 10)")
    p.add_argument("--files", type=int, default=None, help="use only the first FILES files (in their fixed order)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype (parameters stay float32); auto: bfloat16 on a GPU, float32 elsewhere")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=None,
                   help="what to train (default: all; with --smoke, the first three)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_len, args.batch, args.d_model, args.layers, args.heads, args.block = 128, 2, 32, 1, 2, 16
        args.steps, args.lr, args.warmup, args.val_batches, args.files = 6, 3e-3, 1, 1, 24
        args.window = args.seq_len // 4
    if args.systems is None:
        args.systems = SMOKE_SYSTEMS if args.smoke else list(SYSTEMS)
    gqa = any(SYSTEMS[s][1] == 2 for s in args.systems)
    if args.steps < 1 or args.seq_len % args.block or (gqa and args.heads % 2) or args.experts < TOP_K:
        p.error(f"--steps must be positive, --seq-len a multiple of --block, --heads even for the GQA system and "
                f"--experts at least {TOP_K}")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    dtype = jnp.dtype(args.dtype)
    log_every = args.log_every or max(1, args.steps // 10)

    sources = stdlib_sources(args.files)
    val_docs = [data for i, (_, data) in enumerate(sources) if i % 10 == 9]
    train_docs = [data for i, (_, data) in enumerate(sources) if i % 10 != 9]
    train_bytes = sum(map(len, train_docs))
    per_step = args.batch * args.seq_len
    print(f"{len(sources)} .py files of Python {sys.version_info.major}.{sys.version_info.minor}'s standard library "
          f"({sum(len(d) for _, d in sources) / 1e6:.1f} MB): {len(train_docs)} for training "
          f"({train_bytes / 1e6:.1f} MB, {train_bytes / per_step:,.0f} steps an epoch), {len(val_docs)} held out; "
          f"{args.batch} x {args.seq_len} bytes a step; {args.layers} layer{'s' * (args.layers > 1)} of "
          f"{args.d_model}, {args.heads} heads "
          f"of {args.d_model // args.heads}, blocks of {args.block}, {args.dtype}; {_common.device_name()}")
    val_batches = [jax.device_put(b) for b in validation_batches(val_docs, args.batch, args.seq_len,
                                                                 args.val_batches)]
    pattern_info = None
    if any(SYSTEMS[s][0] == "bigbird" for s in args.systems):
        pattern_info = bigbird(args.seq_len, args.block, args.seed)

    results = {name: run(name, args, train_docs, val_batches, dtype, pattern_info) for name in args.systems}

    logged = sorted({*range(log_every, args.steps + 1, log_every), 1, args.steps})
    spans = list(zip([0, *logged], logged))  # each row: the mean over the steps since the previous row
    _common.print_table(f"Training loss, nats per byte (chance: ln 256 = {math.log(256):.2f}), the mean over the "
                        f"steps since the previous row; seed {args.seed}", ["steps", *results],
                        [[f"{a + 1}-{b}" if b > a + 1 else str(b),
                          *(f"{np.mean(r['losses'][a:b]):.3f}" for r in results.values())] for a, b in spans])
    rows = []
    for name, r in results.items():
        attention = "causal" + (f", window {r['window']}" if r["window"] else "") + \
            {"bigbird": ", BigBird 1 local / 1 global / 1 random", "dense": ", dense (L, L) mask"}.get(
                SYSTEMS[name][0], "")
        ffn = (f"MoE, {TOP_K} of {args.experts} GELU 2x" if SYSTEMS[name][2] == "moe" else "GELU 4x")
        rows.append([name, attention, f"{args.heads}/{r['kv_heads']}", ffn, f"{r['parameters'] / 1e6:.2f}M",
                     f"{100 * r['share']:.1f}%", f"{r['losses'][-1]:.3f}", f"{r['val']:.3f}",
                     f"{r['val'] / math.log(2):.3f}", f"{1e3 * r['step_s']:.1f}",
                     f"{per_step / r['step_s'] / 1e3:.0f}", f"{r['compile_s']:.1f}"])
    _common.print_table(f"Byte-level LM on packed documents, {args.steps} steps, validation on "
                        f"{len(val_batches)} batch{'es' * (len(val_batches) > 1)} (final train loss: with the "
                        f"MoE's auxiliary losses; val: the language model's alone)",
                        ["system", "attention", "q/kv heads", "FFN", "parameters", "blocks computed",
                         "final train loss", "val loss", "val bits/byte", "ms / step", "k bytes/s", "compile s"],
                        rows)
    jinsum_run, plain = results.get("dense causal + document mask"), results.get(BASELINE)
    if jinsum_run and plain:
        difference = max(abs(a - b) for a, b in zip(jinsum_run["losses"] + [jinsum_run["val"]],
                                                    plain["losses"] + [plain["val"]]))
        print(f"largest loss difference, dense causal + document mask vs {BASELINE}: {difference:.1e}")


if __name__ == "__main__":
    main()

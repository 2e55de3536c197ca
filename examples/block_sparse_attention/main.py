"""Block-sparse attention on a long sequence: jinsum against dense masked attention, same results, timed.

A BigBird-style pattern (`jinsum.block_pattern`: each block row attends to its neighbouring blocks, to the
first `--global-blocks` blocks and to `--random-blocks` random blocks; global block rows attend everywhere) over
a sequence of `--seq-len` positions (4,096 by default; up to 16,384, where dense attention's forward+backward
needs about 17 GB: add `--passes forward` on a smaller machine). Random queries, keys and values, `--heads`
heads of `--head-dim`:

- jinsum: `jinsum.attention(q, k, v, pattern)`, one fused chain: on a GPU one
  generated kernel walks each query block's stored key blocks with an online softmax (and the backward is the
  FlashAttention-2 recomputation); elsewhere the chain's statements run unfused. Only the stored blocks are computed.
- dense: `jax.nn.dot_product_attention(q, k, v, mask=...)` with the same pattern as a boolean (L, L) mask: all L^2
  scores are computed and the masked ones dropped.

The two outputs, and their gradients with respect to q, k and v (of `sum(out * t)` for a random `t`), are compared
(max abs difference). The forward and the forward+backward passes are jitted and timed the same way
(`jinsum.timing.time_calls`), and their peak memory is XLA's plan for the compiled program.

    python examples/block_sparse_attention/main.py [--seq-len 4096] [--block 64] [--causal]
        [--passes forward forward+backward] [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jinsum.nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
import _common  # noqa: E402


def forward(attention):
    """`attention(q, k, v, mask)` -> `f(q, k, v, mask, t)`: the output (`t` is unused)."""
    return lambda q, k, v, mask, t: attention(q, k, v, mask)


def forward_backward(attention):
    """`attention(q, k, v, mask)` -> `f(q, k, v, mask, t)`: the output and the gradient of sum(out * t) by q, k, v."""
    def f(q, k, v, mask, t):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, mask), q, k, v)
        return out, pullback(t)
    return f


PASSES = {"forward": forward, "forward+backward": forward_backward}


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=1)
    p.add_argument("--global-blocks", type=int, default=1)
    p.add_argument("--random-blocks", type=int, default=2)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--passes", nargs="+", choices=list(PASSES), default=list(PASSES),
                   help="what to compare; dense forward+backward at 16,384 positions needs about 17 GB")
    args = p.parse_args(argv)
    seq_len = 512 if args.smoke else args.seq_len
    # Dense attention at 4,096 positions takes about a second per call on two CPU cores: fewer, longer rounds.
    timing = _common.timing_options(True) if args.smoke else dict(calls=2, rounds=3, warmup=1)

    pattern = jinsum.block_pattern(seq_len, args.block, local_blocks=args.local_blocks,
                                      global_blocks=args.global_blocks, random_blocks=args.random_blocks,
                                      seed=args.seed, causal=args.causal)
    mask = jnp.asarray(np.asarray(pattern.todense()) != 0)
    blocks = (seq_len // args.block) ** 2
    print(f"sequence {seq_len}, {args.heads} heads x {args.head_dim}, blocks {args.block}x{args.block}: "
          f"{pattern.num_groups} of {blocks} blocks stored ({100 * pattern.num_groups / blocks:.1f}%), "
          f"{100 * float(mask.mean()):.1f}% of the scores allowed{' (causal)' if args.causal else ''}")
    print(f"device: {_common.device_name()}")
    keys = jax.random.split(jax.random.key(args.seed), 4)
    q, k, v, t = (jax.random.normal(key, (seq_len, args.heads, args.head_dim)) for key in keys)

    systems = {  # the pattern travels as an argument: a BlockGroupCOO for jinsum, the boolean mask for dense
        "jinsum attention": (jinsum.attention, pattern),
        "dense dot_product_attention + mask": (lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m),
                                               mask),
    }
    results, measurements = {}, {}
    with tqdm(total=len(args.passes) * len(systems), desc="compile and time", leave=False) as bar:
        for pass_name in args.passes:
            for name, (attention, layout) in systems.items():
                operands = (q, k, v, layout, t)
                compiled = jax.jit(PASSES[pass_name](attention)).lower(*operands).compile()
                results[name, pass_name] = compiled(*operands)
                measurements[name, pass_name] = _common.measure(compiled, *operands, timing=timing)
                bar.update()

    reference = "dense dot_product_attention + mask"
    rows = []
    for (name, pass_name), (seconds, peak) in measurements.items():
        error = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(results[name, pass_name]),
                                                                jax.tree.leaves(results[reference, pass_name])))
        dense_seconds = measurements[reference, pass_name][0]
        rows.append([name, pass_name, f"{error:.1e}", f"{1e3 * seconds:.1f}", f"{dense_seconds / seconds:.2f}x",
                     f"{peak / 2**20:.1f}"])
    _common.print_table(f"Block-sparse attention, sequence {seq_len}, seed {args.seed} (errors: max abs difference "
                        "from dense, output and gradients)",
                        ["system", "pass", "max abs diff", "ms / call", "speed-up vs dense", "peak MiB (XLA)"], rows)


if __name__ == "__main__":
    main()

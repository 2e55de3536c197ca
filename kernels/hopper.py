"""The Hopper form of the tile core, in Gluon (`triton.experimental.gluon`): warp-specialised programs for sm_90.

What the fastest Hopper kernels share (FlashAttention-3, cuDNN, CUTLASS's grouped GEMM), written once for the
generated kernels that import it (`jinsum.kernels._chain_hopper` writes the attention chain's forward over
`attention_rows` and its backward over `attention_row_gradients` (dQ) and `attention_keys` (dK, dV);
`jinsum.kernels._grouped_hopper` grouped products over `grouped_rows` and `grouped_sums`):

- a **producer** warp issues TMA loads of the next tiles into a ring of shared-memory stages; each stage has a
  "full" mbarrier (the load landed: a transaction count) and an "empty" one (every consumer is done with it);
- two **consumer** warpgroups of 64 query rows each issue asynchronous `warpgroup_mma` (wgmma) on the stages and
  release them; they take turns issuing (ping-pong, two "turn" mbarriers), so that one's softmax runs while the
  other's products do;
- within a consumer, the scores of key tile `n` are issued together with the products of tile `n - 1`'s weights
  and values (FlashAttention-3's intra-warpgroup overlap): the softmax of tile `n` runs while that product does.

A program's work is a list of key tiles (`steps`: the entries `[begin, end)` of a block row, each `T` tiles of
`BLOCK_N` keys, at the key block `Ak[entry]`; or, for blocks narrower than a tile, `BLOCK_N / BK` entries a tile,
each block loaded into its rows of the tile), so causal, document, windowed and block-sparse patterns run the same
loop; which tiles need their mask evaluated is the generated `scores_fn`'s business (its flag). The backward over
keys walks the transposed pattern the same way, with the roles of queries and keys exchanged.

Every wgmma retires within the step that issued it: one left in flight across the loop's back edge makes ptxas
serialise every wgmma (its warning C7514). The wait for the next tile's values sits between the softmax and the wait
for the product: that branch keeps ptxas from hoisting the product's wait above the softmax, which would undo the
overlap. Gluon kernels have no interpreter: they are tested on the GPU (`pytest -m gpu`), and their compiled form
(wgmma, TMA, no spills) on any machine (`tests/test_hopper.py`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                warpgroup_mma, warpgroup_mma_wait)

# The register budgets of the partitions (`setmaxnreg`: the consumers take nearly all). Each consumer warpgroup
# owns 64 query rows (wgmma's M per warpgroup; 128 rows spill at head size 128), two consumers a program.
CONSUMER_REGISTERS = gl.constexpr(240)
PRODUCER_REGISTERS = gl.constexpr(24)


@gluon.constexpr_function
def mma_layout(n):
    """One warpgroup's wgmma accumulator of `64 x n` (m64nNk16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def weights_layout(head):
    """The weights as the register operand A of the weights-times-values wgmma (16-bit: `k_width` 2): the scores'
    accumulator layout converts to it without moving data."""
    return gl.DotOperandLayout(operand_index=0, parent=mma_layout(head), k_width=2)


@gluon.jit
def key_tile(p_Ak, begin, step, T: gl.constexpr, BK: gl.constexpr, BLOCK_N: gl.constexpr):
    """Step `step` of a work item: its entry, the entry's key block and the tile's first key position. A tile wider
    than a block (`BLOCK_N > BK`: the pages of a paged cache) holds the blocks of entries `[entry, entry +
    BLOCK_N / BK)`; the entry and block returned are its first."""
    if BLOCK_N > BK:
        entry = begin + step * (BLOCK_N // BK)
        col = gl.load(p_Ak + entry)
        return entry, col, col * BK
    else:
        entry = begin + step // T
        col = gl.load(p_Ak + entry)
        return entry, col, col * BK + (step % T) * BLOCK_N


@gluon.jit
def _load_tile(desc, p_Ak, entry, key, last, bar, tile, BK: gl.constexpr, BLOCK_N: gl.constexpr):
    """The TMA loads of one key (value) tile into `tile`, arriving on `bar`: rows `key` onwards, or for a tile of
    several blocks, each entry's block into its `BK` rows (past the item's `last` entry, that entry's block again:
    read, and masked by the scores)."""
    if BLOCK_N > BK:
        mbarrier.expect(bar, (BLOCK_N // BK) * desc.block_type.nbytes)
        for t in gl.static_range(BLOCK_N // BK):
            col = gl.load(p_Ak + gl.minimum(entry + t, last))
            tma.async_copy_global_to_shared(desc, [col * BK, 0], bar, tile.slice(t * BK, BK))
    else:
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [key, 0], bar, tile)


@gluon.jit
def _producer(descriptor_fn: gl.constexpr, smem, bars, work, q_row, context, T: gl.constexpr, BK: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GRADIENT: gl.constexpr):
    """One warp: both consumers' query tiles (and output-gradient tiles, for dQ), then the key and value tiles of
    every step into the ring."""
    q_desc = descriptor_fn("Q", context)
    k_desc = descriptor_fn("K", context)
    v_desc = descriptor_fn("V", context)
    q_smem, k_smem, v_smem = smem[0], smem[1], smem[2]
    q_bar, k_full, k_empty, v_full, v_empty, turn = bars
    p_Ak, begin, steps, last = work
    if GRADIENT:
        do_desc = descriptor_fn("dO", context)
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), (2 if GRADIENT else 1) * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + c * 64, 0], q_bar.index(c), q_smem.index(c))
        if GRADIENT:
            tma.async_copy_global_to_shared(do_desc, [q_row + c * 64, 0], q_bar.index(c), smem[3].index(c))
    for n in range(steps):
        stage = n % STAGES
        phase = (n // STAGES) & 1
        entry, col, key = key_tile(p_Ak, begin, n, T, BK, BLOCK_N)
        # (an empty barrier starts "phase 1 complete": the first pass through the ring does not wait)
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        _load_tile(k_desc, p_Ak, entry, key, last, k_full.index(stage), k_smem.index(stage), BK, BLOCK_N)
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        _load_tile(v_desc, p_Ak, entry, key, last, v_full.index(stage), v_smem.index(stage), BK, BLOCK_N)


@gluon.jit
def _softmax_step(s, m_i):
    """One step of the online softmax over base-2 scores `s` (-inf where masked): the weights, the new running
    maximum, the rescaling of what came before and the weights' row sums."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)  # a row masked so far: no shift (weights 0, not NaN)
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, alpha, gl.sum(p, axis=1)


@gluon.jit
def _take_turn(turn, c: gl.constexpr, k):
    mbarrier.wait(turn.index(c), k & 1)


@gluon.jit
def _give_turn(turn, c: gl.constexpr):
    mbarrier.arrive(turn.index(1 - c), count=1)


@gluon.jit
def _scores(q_tile, k_smem, k_full, k_empty, turn, n, c: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issues and retires step 0's scores (no product of weights before it)."""
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    stage = n % STAGES
    mbarrier.wait(k_full.index(stage), (n // STAGES) & 1)
    _take_turn(turn, c, n)
    token = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)),
                          gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    _give_turn(turn, c)
    s = warpgroup_mma_wait(0, deps=(token, ))
    mbarrier.arrive(k_empty.index(stage), count=1)
    return s


@gluon.jit
def _consumer(c: gl.constexpr, descriptor_fn: gl.constexpr, smem, bars, work, q_row, context, scores_fn: gl.constexpr,
              epilogue_fn: gl.constexpr, T: gl.constexpr, BK: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD: gl.constexpr, STAGES: gl.constexpr):
    """Consumer `c`: query rows `[q_row + 64 c, + 64)` against every step's key tile, then `epilogue_fn`."""
    q_smem, k_smem, v_smem = smem
    q_bar, k_full, k_empty, v_full, v_empty, turn = bars
    p_Ak, begin, steps, last = work
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD)
    q_tile = q_smem.index(c)
    m_i = gl.full([64], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    o_acc = gl.zeros([64, HEAD], gl.float32, o_layout)
    mbarrier.wait(q_bar.index(c), 0)
    if steps > 0:
        entry, col, key = key_tile(p_Ak, begin, 0, T, BK, BLOCK_N)
        s = _scores(q_tile, k_smem, k_full, k_empty, turn, 0, c, BLOCK_N, STAGES)
        s = scores_fn(s, c, key, entry, col, context)
        p, m_i, alpha, l_i = _softmax_step(s, m_i)
        mbarrier.wait(v_full.index(0), 0)
        p_prev = gl.convert_layout(p.to(q_tile.dtype), weights_layout(HEAD), assert_trivial=True)
        for n in range(1, steps):
            stage, previous = n % STAGES, (n - 1) % STAGES
            entry, col, key = key_tile(p_Ak, begin, n, T, BK, BLOCK_N)
            mbarrier.wait(k_full.index(stage), (n // STAGES) & 1)
            _take_turn(turn, c, n)
            s_token = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)),
                                    gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            o_token = warpgroup_mma(p_prev, v_smem.index(previous), o_acc, is_async=True)
            _give_turn(turn, c)
            s = warpgroup_mma_wait(1, deps=(s_token, ))  # (groups retire in order: the scores, not the product)
            mbarrier.arrive(k_empty.index(stage), count=1)
            s = scores_fn(s, c, key, entry, col, context)
            p, m_new, alpha, row_sum = _softmax_step(s, m_i)
            mbarrier.wait(v_full.index(stage), (n // STAGES) & 1)  # (also the branch that keeps the overlap)
            o_acc, p_prev = warpgroup_mma_wait(0, deps=(o_token, p_prev))
            mbarrier.arrive(v_empty.index(previous), count=1)
            o_acc = o_acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            l_i = l_i * alpha + row_sum
            m_i = m_new
            p_prev = gl.convert_layout(p.to(q_tile.dtype), weights_layout(HEAD), assert_trivial=True)
        last = (steps - 1) % STAGES
        _take_turn(turn, c, steps)
        o_token = warpgroup_mma(p_prev, v_smem.index(last), o_acc, is_async=True)
        _give_turn(turn, c)
        o_acc, p_prev = warpgroup_mma_wait(0, deps=(o_token, p_prev))
        mbarrier.arrive(v_empty.index(last), count=1)
    epilogue_fn(c, o_acc, m_i, l_i, q_tile, descriptor_fn("O", context), q_row + c * 64, context)


@gluon.jit
def attention_rows(descriptor_fn: gl.constexpr, work, q_row, context, scores_fn: gl.constexpr,
                   epilogue_fn: gl.constexpr, DTYPE: gl.constexpr, T: gl.constexpr, BK: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr):
    """128 query rows (`q_row` onwards in the view of `descriptor_fn("Q", context)`) attending to the key tiles of
    `work = (p_Ak, begin, steps, last)` (`last`: the item's last entry): two consumer warpgroups and a producer
    warp (the kernel is launched with `num_warps=4`, the first consumer's; the compiled kernel has 12).

    `descriptor_fn(name, context)` makes the TMA descriptor of "Q", "K", "V" or "O" (a layout of
    `NVMMASharedLayout.get_default_for` over 64-row query tiles and BLOCK_N-row key tiles of DTYPE). Each
    partition makes the descriptors it uses: a descriptor written to global memory by one warp reaches another's
    TMA only after that warp's own tensormap-proxy acquire fence, which the making warp's code holds.

    `scores_fn(s, c, key, entry, col, context)`: the raw products `q . k` of consumer `c`'s 64 x BLOCK_N tile, whose
    first key position is `key` (of entry `entry`, key block `col`) -> scores in units of log2(e), -inf where
    masked. `epilogue_fn(c, acc, m, l, q_tile, o_desc, o_row, context)`: consumer `c`'s unnormalised accumulator,
    its running maximum (base 2) and sum; `q_tile` is free shared memory of the output tile's shape. (Index vectors
    are built where they are used, from the tiles' layouts (`rows_of`, `columns_of`): held across the loop they
    would take registers the consumers do not have.)"""
    gl.static_assert(gl.num_warps() == 4, "launch with num_warps=4: the default partition is one consumer")
    smem, bars = _rows_and_ring(DTYPE, BLOCK_N, HEAD, STAGES, False)
    gl.warp_specialize([
        (_consumer, (0, descriptor_fn, smem, bars, work, q_row, context, scores_fn, epilogue_fn, T, BK, BLOCK_N,
                     HEAD, STAGES)),
        (_consumer, (1, descriptor_fn, smem, bars, work, q_row, context, scores_fn, epilogue_fn, T, BK, BLOCK_N,
                     HEAD, STAGES)),
        (_producer, (descriptor_fn, smem, bars, work, q_row, context, T, BK, BLOCK_N, STAGES, False)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


@gluon.jit
def _rows_and_ring(DTYPE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr,
                   GRADIENT: gl.constexpr):
    """A program over rows: its two consumers' query tiles (and output-gradient tiles with `GRADIENT`), the ring of
    key and value tiles, and their mbarriers."""
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD], DTYPE)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], DTYPE)
    q_smem = gl.allocate_shared_memory(DTYPE, [2, 64, HEAD], q_layout)
    k_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD], kv_layout)
    v_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.arrive(turn.index(0), count=1)  # consumer 0 takes the first turn
    bars = (q_bar, k_full, k_empty, v_full, v_empty, turn)
    if GRADIENT:
        return (q_smem, k_smem, v_smem, gl.allocate_shared_memory(DTYPE, [2, 64, HEAD], q_layout)), bars
    else:
        return (q_smem, k_smem, v_smem), bars


@gluon.jit
def _gradient_consumer(c: gl.constexpr, smem, bars, work, q_row, context, scores_fn: gl.constexpr,
                       stats_fn: gl.constexpr, epilogue_fn: gl.constexpr, T: gl.constexpr, BK: gl.constexpr,
                       BLOCK_N: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr):
    """Consumer `c` of the backward over rows: `dQ` of query rows `[q_row + 64 c, + 64)` from every step's key and
    value tiles, then `epilogue_fn`."""
    q_smem, k_smem, v_smem, do_smem = smem
    q_bar, k_full, k_empty, v_full, v_empty, turn = bars
    p_Ak, begin, steps, last = work
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    q_tile = q_smem.index(c)
    do_tile = do_smem.index(c)
    lse, drow = stats_fn(c, gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)), context)
    dq = gl.zeros([64, HEAD], gl.float32, mma_layout(HEAD))
    mbarrier.wait(q_bar.index(c), 0)
    for n in range(steps):
        stage = n % STAGES
        phase = (n // STAGES) & 1
        entry, col, key = key_tile(p_Ak, begin, n, T, BK, BLOCK_N)
        mbarrier.wait(k_full.index(stage), phase)
        s_token = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)),
                                gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        mbarrier.wait(v_full.index(stage), phase)
        dp_token = warpgroup_mma(do_tile, v_smem.index(stage).permute((1, 0)),
                                 gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_token, ))  # (groups retire in order: the scores, not dP)
        s = scores_fn(s, c, key, entry, col, context)
        p = gl.exp2(s - gl.expand_dims(lse, 1))
        dp = warpgroup_mma_wait(0, deps=(dp_token, ))
        mbarrier.arrive(v_empty.index(stage), count=1)
        ds = p * (dp - gl.expand_dims(drow, 1))
        ds_op = gl.convert_layout(ds.to(q_tile.dtype), weights_layout(HEAD), assert_trivial=True)
        dq_token = warpgroup_mma(ds_op, k_smem.index(stage), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_token, ds_op))
        mbarrier.arrive(k_empty.index(stage), count=1)
    epilogue_fn(c, dq, q_tile, q_row + c * 64, context)


@gluon.jit
def attention_row_gradients(descriptor_fn: gl.constexpr, work, q_row, context, scores_fn: gl.constexpr,
                            stats_fn: gl.constexpr, epilogue_fn: gl.constexpr, DTYPE: gl.constexpr, T: gl.constexpr,
                            BK: gl.constexpr, BLOCK_N: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr):
    """The backward over rows: `dQ = dS K` of 128 query rows, `dS = P * (dP - D)` recomputed from the key and value
    tiles of `work` as `attention_rows` walks them (three wgmma a step: the scores and `dO V^T` from shared memory,
    then `dS K` with the score gradients as the register operand). `descriptor_fn` also makes "dO" (as "Q");
    `stats_fn(c, rows, context)`: the log-sum-exp (base 2) and `D` of consumer `c`'s rows `rows` (64, from 0);
    `epilogue_fn(c, dq, q_tile, q_row, context)`: consumer `c`'s unscaled sum, its query tile free."""
    gl.static_assert(gl.num_warps() == 4, "launch with num_warps=4: the default partition is one consumer")
    smem, bars = _rows_and_ring(DTYPE, BLOCK_N, HEAD, STAGES, True)
    gl.warp_specialize([
        (_gradient_consumer, (0, smem, bars, work, q_row, context, scores_fn, stats_fn, epilogue_fn, T, BK,
                              BLOCK_N, HEAD, STAGES)),
        (_gradient_consumer, (1, smem, bars, work, q_row, context, scores_fn, stats_fn, epilogue_fn, T, BK,
                              BLOCK_N, HEAD, STAGES)),
        (_producer, (descriptor_fn, smem, bars, work, q_row, context, T, BK, BLOCK_N, STAGES, True)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


@gluon.jit
def rows_of(tile, c: gl.constexpr):
    """The rows (within the program's 128) of consumer `c`'s tile, along its first axis."""
    return c * 64 + gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, tile.type.layout))


@gluon.jit
def columns_of(tile):
    """0, 1, ... along a tile's second axis."""
    return gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, tile.type.layout))


@gluon.jit
def store_rows(acc, l_i, q_tile, o_desc, o_row):
    """`acc / l` (0 where nothing attends) into the output's rows `[o_row, + 64)` through shared memory and TMA
    (`o_desc`: boxes of 64 x 64)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout))
    store_tile(acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1), q_tile, o_desc, o_row)


@gluon.jit
def store_tile(tile, smem, desc, row):
    """A 64-row tile into rows `[row, + 64)` of `desc`'s view (boxes of 64 x 64), through `smem` (free shared
    memory of the tile's shape) and TMA."""
    smem.store(tile.to(smem.dtype))
    fence_async_shared()
    # One copy a 64-column box (`desc`'s): a copy of several boxes is split over the partition's warps, of which
    # only the first ran the descriptor's acquire fence.
    for i in gl.static_range(tile.shape[1] // 64):
        tma.async_copy_shared_to_global(desc, [row, 64 * i], smem.slice(64 * i, 64, dim=1))
    tma.store_wait(0)


# ----------------------------------------------------------------------------------------------------------------------
# The attention backward over keys: `dV = P^T dO`, `dK = dS^T Q` for 128 keys a program
# ----------------------------------------------------------------------------------------------------------------------
# The forward's partitions with the roles of the two sides exchanged: a consumer holds 64 keys (its K and V tiles in
# shared memory, its dK and dV accumulators in registers) and walks the query tiles that attend to them, which the
# producer streams (Q and dO, 64 rows a stage, of each query head of the kv head's group in turn). Per step, four
# wgmma: the transposed scores `K Q^T` and `V dO^T` from shared memory, then `P^T dO` and `dS^T Q` with the weights
# and score gradients as register operands; the two consumers' steps interleave on the Tensor Cores.
@gluon.jit
def query_tile(p_rows, begin, step, per_head, T: gl.constexpr):
    """Step `step` of a work item over keys: the query head in the group, the position `j` in the transposed
    order, its entry's query block and the tile's first row within the block (`T` tiles of 64 a block)."""
    rest = step % per_head
    j = begin + rest // T
    return step // per_head, j, gl.load(p_rows + j), (rest % T) * 64


@gluon.jit
def _key_producer(descriptor_fn: gl.constexpr, smem, bars, work, k_row, context, stats_fn: gl.constexpr,
                  BM: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr):
    """One warp: both consumers' key and value tiles, then the query and output-gradient tiles and the query rows'
    statistics of every step."""
    k_desc = descriptor_fn("K", context)
    v_desc = descriptor_fn("V", context)
    q_desc = descriptor_fn("Q", context)
    do_desc = descriptor_fn("dO", context)
    k_smem, v_smem, q_smem, do_smem, lse_smem, drow_smem = smem
    kv_bar, q_full, q_empty, do_full, do_empty = bars
    p_rows, begin, steps, per_head = work
    cols = gl.arange(0, 64, layout=gl.BlockedLayout([2], [32], [1], [0]))
    for c in gl.static_range(2):
        mbarrier.expect(kv_bar.index(c), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + c * 64, 0], kv_bar.index(c), k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [k_row + c * 64, 0], kv_bar.index(c), v_smem.index(c))
    for n in range(steps):
        stage = n % STAGES
        phase = (n // STAGES) & 1
        g, j, row, offset = query_tile(p_rows, begin, n, per_head, BM // 64)
        # (the view's columns are the group's query heads side by side: head g's features from g * HEAD)
        mbarrier.wait(q_empty.index(stage), phase ^ 1)
        mbarrier.expect(q_full.index(stage), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row * BM + offset, g * HEAD], q_full.index(stage),
                                        q_smem.index(stage))
        # The rows' statistics through shared memory too: loaded here, ahead of the consumers, their latency is
        # hidden by the ring (a consumer loading them itself waited on them every step).
        lse, drow = stats_fn(g, row, offset, cols, context)
        lse_smem.index(stage).store(lse)
        drow_smem.index(stage).store(drow)
        mbarrier.arrive(q_full.index(stage), count=1)
        mbarrier.wait(do_empty.index(stage), phase ^ 1)
        mbarrier.expect(do_full.index(stage), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row * BM + offset, g * HEAD], do_full.index(stage),
                                        do_smem.index(stage))


@gluon.jit
def _key_consumer(c: gl.constexpr, smem, bars, work, k_row, context, scores_fn: gl.constexpr,
                  epilogue_fn: gl.constexpr, BM: gl.constexpr, HEAD: gl.constexpr, STAGES: gl.constexpr):
    """Consumer `c`: keys `[k_row + 64 c, + 64)` against every step's query tile, then `epilogue_fn`."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, drow_smem = smem
    kv_bar, q_full, q_empty, do_full, do_empty = bars
    p_rows, begin, steps, per_head = work
    s_layout: gl.constexpr = mma_layout(64)
    acc_layout: gl.constexpr = mma_layout(HEAD)
    k_tile = k_smem.index(c)
    v_tile = v_smem.index(c)
    dk = gl.zeros([64, HEAD], gl.float32, acc_layout)
    dv = gl.zeros([64, HEAD], gl.float32, acc_layout)
    mbarrier.wait(kv_bar.index(c), 0)
    for n in range(steps):
        stage = n % STAGES
        phase = (n // STAGES) & 1
        g, j, row, offset = query_tile(p_rows, begin, n, per_head, BM // 64)
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        mbarrier.wait(q_full.index(stage), phase)
        s_token = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                                use_acc=False, is_async=True)
        mbarrier.wait(do_full.index(stage), phase)
        dp_token = warpgroup_mma(v_tile, do_tile.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                                 use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_token, ))  # (groups retire in order: the scores, not dP)
        s = scores_fn(s, c, g, j, row, offset, context)
        p = gl.exp2(s - gl.expand_dims(lse_smem.index(stage).load(gl.SliceLayout(0, s_layout)), 0))
        dp = warpgroup_mma_wait(0, deps=(dp_token, ))
        ds = p * (dp - gl.expand_dims(drow_smem.index(stage).load(gl.SliceLayout(0, s_layout)), 0))
        p_op = gl.convert_layout(p.to(q_tile.dtype), weights_layout(HEAD), assert_trivial=True)
        ds_op = gl.convert_layout(ds.to(q_tile.dtype), weights_layout(HEAD), assert_trivial=True)
        dv_token = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        dk_token = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_token, dk_token, p_op, ds_op))
        mbarrier.arrive(q_empty.index(stage), count=1)
        mbarrier.arrive(do_empty.index(stage), count=1)
    epilogue_fn(c, dk, dv, k_tile, v_tile, k_row + c * 64, context)


@gluon.jit
def attention_keys(descriptor_fn: gl.constexpr, work, k_row, context, scores_fn: gl.constexpr,
                   stats_fn: gl.constexpr, epilogue_fn: gl.constexpr, DTYPE: gl.constexpr, BM: gl.constexpr,
                   HEAD: gl.constexpr, STAGES: gl.constexpr):
    """The gradients of 128 keys (`k_row` onwards in the view of `descriptor_fn("K", context)`) from the query
    tiles of `work = (p_rows, begin, steps, per_head)`: step `n` is query head `n // per_head` of the group and,
    within it, tile `n % per_head % T` of the query block `p_rows[begin + n % per_head // T]` (`T = BM // 64`).
    Two consumer warpgroups of 64 keys and a producer warp (launched with `num_warps=4`; the compiled kernel has 12).

    `descriptor_fn(name, context)`: the TMA descriptors of "K", "V" (64-row boxes) and "Q", "dO" (64 x HEAD boxes
    of a view whose columns hold the group's query heads side by side), and those of the stores the epilogue
    makes. `stats_fn(g, row, offset, cols, context)`: the log-sum-exp (base 2) and `D = rowsum(dO * O)` of query
    rows `row * BM + offset + cols` of head `g`. `scores_fn(s, c, g, j, row, offset, context)`: consumer `c`'s raw
    products `k . q` (64 keys x 64 queries) -> scores in units of log2(e), -inf where masked.
    `epilogue_fn(c, dk, dv, k_tile, v_tile, k_row, context)`: consumer `c`'s sums `dS^T Q` (unscaled) and `P^T dO`,
    with its key and value tiles as free shared memory of their shape."""
    gl.static_assert(gl.num_warps() == 4, "launch with num_warps=4: the default partition is one consumer")
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD], DTYPE)
    k_smem = gl.allocate_shared_memory(DTYPE, [2, 64, HEAD], layout)
    v_smem = gl.allocate_shared_memory(DTYPE, [2, 64, HEAD], layout)
    q_smem = gl.allocate_shared_memory(DTYPE, [STAGES, 64, HEAD], layout)
    do_smem = gl.allocate_shared_memory(DTYPE, [STAGES, 64, HEAD], layout)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], rows)
    drow_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], rows)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=2)  # the query tile's bytes, and the statistics stored
        mbarrier.init(do_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(do_empty.index(i), count=2)
    smem = (k_smem, v_smem, q_smem, do_smem, lse_smem, drow_smem)
    bars = (kv_bar, q_full, q_empty, do_full, do_empty)
    gl.warp_specialize([
        (_key_consumer, (0, smem, bars, work, k_row, context, scores_fn, epilogue_fn, BM, HEAD, STAGES)),
        (_key_consumer, (1, smem, bars, work, k_row, context, scores_fn, epilogue_fn, BM, HEAD, STAGES)),
        (_key_producer, (descriptor_fn, smem, bars, work, k_row, context, stats_fn, BM, HEAD, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# ----------------------------------------------------------------------------------------------------------------------
# Grouped products: `H[g, p, n] = epilogue(sum_k X[slot (g, p), k] * W[Ai[g], k, n])`
# ----------------------------------------------------------------------------------------------------------------------
# The producer gathering rows (cp.async) holds each row's pointer and mask: four warps, and more registers than a
# TMA-only producer's 24 (24 spill).
GATHER_REGISTERS = gl.constexpr(40)
GATHER_CONSUMER_REGISTERS = gl.constexpr(232)  # (4 x 128 x 232 + 4 x 32 x 40 <= 64 K registers)
# Concurrent programs walk super-blocks of this many consecutive groups times every column tile, groups fastest:
# the groups of one expert are consecutive, so programs running at once share its weight tiles (and their rows) in L2.
GROUPS_TOGETHER = gl.constexpr(16)


@gluon.constexpr_function
def _producer_warps(gather):
    return 4 if gather else 1


@gluon.constexpr_function
def _producer_registers(gather):
    return GATHER_REGISTERS.value if gather else PRODUCER_REGISTERS.value


@gluon.constexpr_function
def _consumer_registers(gather):
    return GATHER_CONSUMER_REGISTERS.value if gather else CONSUMER_REGISTERS.value


@gluon.constexpr_function
def _gather_layout(warps):
    """cp.async of a `[rows, 64]` 16-bit tile: 16 contiguous bytes per thread, 8 threads per row."""
    return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def group_tile(item, G: gl.constexpr, TILES: gl.constexpr):
    """Work item `item` -> (group, column tile) (see `GROUPS_TOGETHER`)."""
    per = GROUPS_TOGETHER * TILES
    first = (item // per) * GROUPS_TOGETHER
    rows = gl.minimum(G - first, GROUPS_TOGETHER)
    local = item % per
    return first + local % rows, local // rows


@gluon.jit
def _group_producer(x_ptr, slots_ptr, w_ptr, experts_ptr, smem, bars, G: gl.constexpr, ROWS: gl.constexpr,
                    EXPERTS: gl.constexpr, K: gl.constexpr, N: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, GATHER: gl.constexpr, TRANSPOSED: gl.constexpr):
    """Fills the ring with each work item's k tiles: `[P, 64]` of the rows (gathered by cp.async, or one TMA box of
    rows in grouped order) and `[64, BLOCK_N]` of the group's weight matrix (TMA, in 64-column boxes)."""
    a_smem, w_smem, out_smem = smem
    full, empty, turn = bars
    # The weights seen as (EXPERTS * K, N), or (EXPERTS * N, K) stored transposed: a k tile never crosses experts
    # (K % 64 == 0), and an expert out of range (rows outside the view) is read as zeros, as jinsum reads
    # out-of-range indices. (Transposed, a column tile past N reads the next expert's rows: columns no store writes.)
    if TRANSPOSED:
        w_desc = tma.make_tensor_descriptor(w_ptr, shape=[EXPERTS * N, K], strides=[K, 1], block_shape=[BLOCK_N, 64],
                                            layout=w_smem.layout)
        W_ROWS: gl.constexpr = N
    else:
        w_desc = tma.make_tensor_descriptor(w_ptr, shape=[EXPERTS * K, N], strides=[N, 1], block_shape=[64, 64],
                                            layout=w_smem.layout)
        W_ROWS: gl.constexpr = K
    W_BYTES: gl.constexpr = 64 * BLOCK_N * w_smem.dtype.primitive_bitwidth // 8
    if not GATHER:
        a_desc = tma.make_tensor_descriptor(x_ptr, shape=[G * P, K], strides=[K, 1], block_shape=[P, 64],
                                            layout=a_smem.layout)
    TILES: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    step = 0
    for item in range(gl.program_id(0), G * TILES, gl.num_programs(0)):
        g, tile = group_tile(item, G, TILES)
        w_row = gl.load(experts_ptr + g).to(gl.int64) * W_ROWS
        w_row = gl.where((w_row >= 0) & (w_row < EXPERTS * W_ROWS), w_row, EXPERTS * W_ROWS).to(gl.int32)
        if GATHER:
            layout: gl.constexpr = _gather_layout(gl.num_warps())
            row = gl.load(slots_ptr + g * P + gl.arange(0, P, layout=gl.SliceLayout(1, layout)))
            present = gl.expand_dims((row >= 0) & (row < ROWS), 1)  # padding (-1) and rows out of range read 0
            row_ptr = gl.expand_dims(x_ptr + gl.where(row >= 0, row, 0).to(gl.int64) * K, 1)
            columns = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)), 0)
        for k in range(K // 64):
            stage = step % STAGES
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)  # (starts "phase 1 complete")
            if GATHER:
                mbarrier.expect(full.index(stage), W_BYTES)
                async_copy.async_copy_global_to_shared(a_smem.index(stage), row_ptr + (k * 64 + columns),
                                                       mask=present)
                # Every producer thread arrives once its copies land (the barrier counts them)
                async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
            else:
                mbarrier.expect(full.index(stage), W_BYTES + a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [g * P, k * 64], full.index(stage), a_smem.index(stage))
            if TRANSPOSED:
                tma.async_copy_global_to_shared(w_desc, [w_row + tile * BLOCK_N, k * 64], full.index(stage),
                                                w_smem.index(stage))
            else:
                for i in gl.static_range(BLOCK_N // 64):  # (one copy a box: see `store_rows`)
                    tma.async_copy_global_to_shared(w_desc, [w_row + k * 64, tile * BLOCK_N + 64 * i],
                                                    full.index(stage), w_smem.index(stage).slice(64 * i, 64, dim=1))
            step += 1


@gluon.jit
def _group_consumer(c: gl.constexpr, out_ptr, smem, bars, context, epilogue_fn: gl.constexpr, G: gl.constexpr,
                    K: gl.constexpr, N: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    GATHER: gl.constexpr, TRANSPOSED: gl.constexpr):
    """Consumer `c`: with 128-row groups, rows `[64 c, 64 c + 64)` of every item (both read each stage); with
    64-row groups, every other item, whole, in turns with the other consumer (whose epilogue then runs under this
    one's products)."""
    a_smem, w_smem, out_smem = smem
    full, empty, turn = bars
    TOGETHER: gl.constexpr = P == 128
    ROW0: gl.constexpr = 64 * c if TOGETHER else 0
    TILES: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    out_tile = out_smem.index(c)
    out_desc = tma.make_tensor_descriptor(out_ptr, shape=[G * P, N], strides=[N, 1], block_shape=[64, 64],
                                          layout=out_smem.layout)
    acc = gl.zeros([64, BLOCK_N], gl.float32, mma_layout(BLOCK_N))
    j = 0  # the program's items
    for item in range(gl.program_id(0), G * TILES, gl.num_programs(0)):
        if TOGETHER or j % 2 == c:
            g, tile = group_tile(item, G, TILES)
            step = j * (K // 64)
            if not TOGETHER:
                mbarrier.wait(turn.index(c), (j // 2) & 1)  # the other consumer has issued its products
            for k in range(K // 64):
                stage = step % STAGES
                mbarrier.wait(full.index(stage), (step // STAGES) & 1)
                if GATHER:
                    fence_async_shared()  # the producer's cp.async writes (generic proxy) before wgmma reads them
                a = a_smem.index(stage)
                if TOGETHER:
                    a = a.slice(ROW0, 64, dim=0)
                b = w_smem.index(stage)
                if TRANSPOSED:
                    b = b.permute((1, 0))
                token = warpgroup_mma(a, b, acc, use_acc=k > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(token, ))  # the previous step's product has retired
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=k > 0)
                step += 1
            if not TOGETHER:
                mbarrier.arrive(turn.index(1 - c), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
            value = epilogue_fn(acc, g, ROW0, tile * BLOCK_N, context)
            tma.store_wait(0)  # the previous item's store has read the tile
            out_tile.store(value.to(out_smem.dtype))
            fence_async_shared()
            for i in gl.static_range(BLOCK_N // 64):
                tma.async_copy_shared_to_global(out_desc, [g * P + ROW0, tile * BLOCK_N + 64 * i],
                                                out_tile.slice(64 * i, 64, dim=1))
        j += 1
    tma.store_wait(0)


@gluon.jit
def _output_tiles_and_ring(dtype: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FULL: gl.constexpr,
                           EMPTY: gl.constexpr):
    """The two consumers' 64 x BLOCK_N output tiles in shared memory, and the ring's `full` and `empty` mbarriers,
    `STAGES` of each, expecting `FULL` and `EMPTY` arrivals."""
    out_smem = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_N],
                                         gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=FULL)
        mbarrier.init(empty.index(i), count=EMPTY)
    return out_smem, full, empty


@gluon.jit
def grouped_rows(x_ptr, slots_ptr, w_ptr, experts_ptr, out_ptr, context, epilogue_fn: gl.constexpr, G: gl.constexpr,
                 ROWS: gl.constexpr, EXPERTS: gl.constexpr, K: gl.constexpr, N: gl.constexpr, P: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr, TRANSPOSED: gl.constexpr):
    """`out (G, P, N)`: group `g`'s `P` rows times its weight matrix `w[experts[g]]` (`w`: `(EXPERTS, K, N)`, or
    `(EXPERTS, N, K)` where `TRANSPOSED`: an input gradient's product by the transposed weights),
    then `epilogue_fn(acc, g, row0, n0, context)` on each consumer's `64 x BLOCK_N` float32 tile (rows from `row0`
    within the group, columns from `n0`). The rows are `x[slots[g, p]]` (`x`: `(ROWS, K)`; a slot out of range,
    padding's -1, reads zeros) where `GATHER`, else `x`'s own rows `g * P + p` (`(G * P, K)`, grouped order).

    A persistent program (the grid at most one per SM) walks the items (group, column tile) `group_tile` orders:
    a producer (TMA for the weights, and for the rows unless gathered: then cp.async from four warps) fills a ring
    of `STAGES` stages; two consumer warpgroups issue asynchronous wgmma, keeping one in flight, and store their
    tiles through shared memory by TMA, the store draining under the next item's products. Launched with
    `num_warps=4`: the compiled kernel has 12."""
    gl.static_assert(gl.num_warps() == 4, "launch with num_warps=4: the default partition is one consumer")
    gl.static_assert((P == 128) | (P == 64), "a group is one tile of 128 or 64 rows")
    gl.static_assert(K % 64 == 0, "k tiles of 64 (a 128-byte row of 16-bit elements) within one expert")
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, P, 64], gl.NVMMASharedLayout.get_default_for([P, 64], dtype))
    if TRANSPOSED:
        w_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 64],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dtype))
    else:
        w_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype))
    # full: the weights' expect-tx arrival, and when gathering one arrival per producer thread (4 warps); empty: one
    # arrival per consumer reading the stage
    out_smem, full, empty = _output_tiles_and_ring(dtype, BLOCK_N, STAGES, 129 if GATHER else 1, 2 if P == 128 else 1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.arrive(turn.index(0), count=1)  # (64-row groups) consumer 0 issues first
    smem = (a_smem, w_smem, out_smem)
    bars = (full, empty, turn)
    gl.warp_specialize([
        (_group_consumer, (0, out_ptr, smem, bars, context, epilogue_fn, G, K, N, P, BLOCK_N, STAGES, GATHER,
                           TRANSPOSED)),
        (_group_consumer, (1, out_ptr, smem, bars, context, epilogue_fn, G, K, N, P, BLOCK_N, STAGES, GATHER,
                           TRANSPOSED)),
        (_group_producer, (x_ptr, slots_ptr, w_ptr, experts_ptr, smem, bars, G, ROWS, EXPERTS, K, N, P, BLOCK_N,
                           STAGES, GATHER, TRANSPOSED)),
    ], [4, _producer_warps(GATHER)], [_consumer_registers(GATHER), _producer_registers(GATHER)])


# ----------------------------------------------------------------------------------------------------------------------
# Grouped sums: `W[r, m, n] = sum over the rows k of row r's groups of A[k, m] * B[k, n]` (weight gradients)
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _sum_tile(item, M_TILES: gl.constexpr, N_TILES: gl.constexpr):
    """Work item `item` -> (row, m tile, n tile), a row's tiles consecutive: programs running at once read the same
    row's groups (both factors' rows) from L2."""
    return item // (M_TILES * N_TILES), (item // N_TILES) % M_TILES, item % N_TILES


@gluon.jit
def _sum_producer(a_ptr, b_ptr, starts_ptr, smem, bars, ROWS: gl.constexpr, POSITIONS: gl.constexpr, M: gl.constexpr,
                  N: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Fills the ring with each item's k tiles: `[64, 64]` of `a` for each consumer's 64 columns of m, and `[64,
    BLOCK_N]` of `b` (TMA, 64-column boxes), at the row positions of the item's row's groups."""
    a_smem, b_smem, out_smem = smem
    full, empty = bars
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[POSITIONS, M], strides=[M, 1], block_shape=[64, 64],
                                        layout=a_smem.layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, shape=[POSITIONS, N], strides=[N, 1], block_shape=[64, 64],
                                        layout=b_smem.layout)
    BYTES: gl.constexpr = 64 * (128 + BLOCK_N) * a_smem.dtype.primitive_bitwidth // 8
    M_TILES: gl.constexpr = M // 128
    N_TILES: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    step = 0
    for item in range(gl.program_id(0), ROWS * M_TILES * N_TILES, gl.num_programs(0)):
        row, m_tile, n_tile = _sum_tile(item, M_TILES, N_TILES)
        begin = gl.load(starts_ptr + row) * P
        end = gl.load(starts_ptr + row + 1) * P
        for k in range(begin, end, 64):
            stage = step % STAGES
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)  # (starts "phase 1 complete")
            mbarrier.expect(full.index(stage), BYTES)
            for c in gl.static_range(2):
                tma.async_copy_global_to_shared(a_desc, [k, m_tile * 128 + 64 * c], full.index(stage),
                                                a_smem.index(2 * stage + c))
            for i in gl.static_range(BLOCK_N // 64):  # (one copy a box: see `store_rows`)
                tma.async_copy_global_to_shared(b_desc, [k, n_tile * BLOCK_N + 64 * i], full.index(stage),
                                                b_smem.index(stage).slice(64 * i, 64, dim=1))
            step += 1


@gluon.jit
def _sum_consumer(c: gl.constexpr, out_ptr, starts_ptr, smem, bars, ROWS: gl.constexpr, M: gl.constexpr,
                  N: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer `c`: columns `[64 c, 64 c + 64)` of every item's m tile, summed over the item's k tiles in registers
    and stored once (a row without groups stores zeros)."""
    a_smem, b_smem, out_smem = smem
    full, empty = bars
    M_TILES: gl.constexpr = M // 128
    N_TILES: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    out_tile = out_smem.index(c)
    out_desc = tma.make_tensor_descriptor(out_ptr, shape=[ROWS * M, N], strides=[N, 1], block_shape=[64, 64],
                                          layout=out_smem.layout)
    step = 0
    for item in range(gl.program_id(0), ROWS * M_TILES * N_TILES, gl.num_programs(0)):
        row, m_tile, n_tile = _sum_tile(item, M_TILES, N_TILES)
        begin = gl.load(starts_ptr + row) * P
        end = gl.load(starts_ptr + row + 1) * P
        acc = gl.zeros([64, BLOCK_N], gl.float32, mma_layout(BLOCK_N))
        first = step
        for k in range(begin, end, 64):
            stage = step % STAGES
            mbarrier.wait(full.index(stage), (step // STAGES) & 1)
            token = warpgroup_mma(a_smem.index(2 * stage + c).permute((1, 0)), b_smem.index(stage), acc,
                                  is_async=True)
            acc = warpgroup_mma_wait(1, deps=(token, ))  # the previous step's product has retired
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=step > first)
            step += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=step > first)
        tma.store_wait(0)  # the previous item's store has read the tile
        out_tile.store(acc.to(out_smem.dtype))
        fence_async_shared()
        for i in gl.static_range(BLOCK_N // 64):
            tma.async_copy_shared_to_global(out_desc, [row * M + m_tile * 128 + 64 * c, n_tile * BLOCK_N + 64 * i],
                                            out_tile.slice(64 * i, 64, dim=1))
    tma.store_wait(0)


@gluon.jit
def grouped_sums(a_ptr, b_ptr, starts_ptr, out_ptr, ROWS: gl.constexpr, POSITIONS: gl.constexpr, M: gl.constexpr,
                 N: gl.constexpr, P: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """`out (ROWS, M, N)`: row `r`'s sum of `a[k]^T b[k]` over the row positions `k` of its groups, `[starts[r] * P,
    starts[r + 1] * P)` (`a`: `(POSITIONS, M)`, `b`: `(POSITIONS, N)`, groups of `P` rows in grouped order): a
    weight gradient, each expert's matrix summed over its rows in registers and stored once, no atomics.

    Persistent programs walk the items (row, 128 columns of m, BLOCK_N of n); a producer warp fills a ring of
    `STAGES` stages by TMA; two consumer warpgroups (64 columns of m each, `a`'s tile read transposed from shared
    memory) keep one wgmma in flight and store through shared memory by TMA. Launched with `num_warps=4`."""
    gl.static_assert(gl.num_warps() == 4, "launch with num_warps=4: the default partition is one consumer")
    gl.static_assert(M % 128 == 0, "m tiles of 128 within one row (two consumers' 64)")
    gl.static_assert(P % 64 == 0, "k tiles of 64 within one group")
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    a_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, 64, 64], layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype))
    out_smem, full, empty = _output_tiles_and_ring(dtype, BLOCK_N, STAGES, 1, 2)  # (both consumers read every stage)
    smem = (a_smem, b_smem, out_smem)
    bars = (full, empty)
    gl.warp_specialize([
        (_sum_consumer, (0, out_ptr, starts_ptr, smem, bars, ROWS, M, N, P, BLOCK_N, STAGES)),
        (_sum_consumer, (1, out_ptr, starts_ptr, smem, bars, ROWS, M, N, P, BLOCK_N, STAGES)),
        (_sum_producer, (a_ptr, b_ptr, starts_ptr, smem, bars, ROWS, POSITIONS, M, N, P, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])

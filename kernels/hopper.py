"""The Hopper form of the tile core, in Gluon (`triton.experimental.gluon`): warp-specialised programs for sm_90.

What the fastest Hopper kernels share (FlashAttention-3, cuDNN), written once for the generated kernels that import
it (`jinsum.kernels._chain_hopper` writes the attention chain's forward over these):

- a **producer** warp issues TMA loads of the next tiles into a ring of shared-memory stages; each stage has a
  "full" mbarrier (the load landed: a transaction count) and an "empty" one (every consumer is done with it);
- two **consumer** warpgroups of 64 query rows each issue asynchronous `warpgroup_mma` (wgmma) on the stages and
  release them; they take turns issuing (ping-pong, two "turn" mbarriers), so that one's softmax runs while the
  other's products do;
- within a consumer, the scores of key tile `n` are issued together with the products of tile `n - 1`'s weights
  and values (FlashAttention-3's intra-warpgroup overlap): the softmax of tile `n` runs while that product does.

A program's work is a list of key tiles (`steps`: the entries `[begin, end)` of a block row, each `T` tiles of
`BLOCK_N` keys, at the key block `Ak[entry]`), so causal, document, windowed and block-sparse patterns run the same
loop; which tiles need their mask evaluated is the generated `scores_fn`'s business (its flag).

Every wgmma retires within the step that issued it: one left in flight across the loop's back edge makes ptxas
serialise every wgmma (its warning C7514). The wait for the next tile's values sits between the softmax and the wait
for the product: that branch keeps ptxas from hoisting the product's wait above the softmax, which would undo the
overlap. Gluon kernels have no interpreter: they are tested on the GPU (`pytest -m gpu`), and their compiled form
(wgmma, TMA, no spills) on any machine (`tests/test_hopper.py`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

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
    """Step `step` of a work item: its entry, the entry's key block and the tile's first key position."""
    entry = begin + step // T
    col = gl.load(p_Ak + entry)
    return entry, col, col * BK + (step % T) * BLOCK_N


@gluon.jit
def _producer(descriptor_fn: gl.constexpr, smem, bars, work, q_row, context, T: gl.constexpr, BK: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: both consumers' query tiles, then the key and value tiles of every step into the ring."""
    q_desc = descriptor_fn("Q", context)
    k_desc = descriptor_fn("K", context)
    v_desc = descriptor_fn("V", context)
    q_smem, k_smem, v_smem = smem
    q_bar, k_full, k_empty, v_full, v_empty, turn = bars
    p_Ak, begin, steps = work
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + c * 64, 0], q_bar.index(c), q_smem.index(c))
    for n in range(steps):
        stage = n % STAGES
        phase = (n // STAGES) & 1
        entry, col, key = key_tile(p_Ak, begin, n, T, BK, BLOCK_N)
        # (an empty barrier starts "phase 1 complete": the first pass through the ring does not wait)
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_full.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key, 0], k_full.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_full.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [key, 0], v_full.index(stage), v_smem.index(stage))


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
    p_Ak, begin, steps = work
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
    `work = (p_Ak, begin, steps)`: two consumer warpgroups and a producer warp (the kernel is launched with
    `num_warps=4`, the first consumer's; the compiled kernel has 12).

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
    smem = (q_smem, k_smem, v_smem)
    bars = (q_bar, k_full, k_empty, v_full, v_empty, turn)
    gl.warp_specialize([
        (_consumer, (0, descriptor_fn, smem, bars, work, q_row, context, scores_fn, epilogue_fn, T, BK, BLOCK_N,
                     HEAD, STAGES)),
        (_consumer, (1, descriptor_fn, smem, bars, work, q_row, context, scores_fn, epilogue_fn, T, BK, BLOCK_N,
                     HEAD, STAGES)),
        (_producer, (descriptor_fn, smem, bars, work, q_row, context, T, BK, BLOCK_N, STAGES)),
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
    o_layout: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)
    q_tile.store(out.to(q_tile.dtype))
    fence_async_shared()
    # One copy a 64-column box (`o_desc`'s): a copy of several boxes is split over the partition's warps, of which
    # only the first ran the descriptor's acquire fence.
    for i in gl.static_range(acc.shape[1] // 64):
        tma.async_copy_shared_to_global(o_desc, [o_row, 64 * i], q_tile.slice(64 * i, 64, dim=1))
    tma.store_wait(0)

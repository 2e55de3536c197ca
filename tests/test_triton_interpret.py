"""Every generated Triton kernel of the catalog, and of the statements its grads and vmaps derive, run in Triton's
interpreter on CPU against the float64 reference and the XLA lowering (skipped on a GPU: see test_gpu.py)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import pytest

import jinsum
from jinsum._frontend import _einsum
from jinsum._lang import parse
from jinsum._rules import _primitive
from jinsum._lowering._route import route
from jinsum._lowering._triton import interpret
from jinsum.kernels import KernelConfig, generate, make_plan
from jinsum.testing import assert_allclose, random_operands, reference, specs_in

from _catalog import CATALOG, group_spmm
from conftest import ON_GPU

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")

DTYPES = [np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)]
# Small tiles and windows so that every loop of a plan runs several times on small shapes.
STRESS = KernelConfig(block=4, block_rows=2, window=3, block_m=16, block_n=16, block_k=16, num_stages=2)


def _spec(expression, operands):
    """The checked statement, with the catalog's sorted group rows (`Ai`) declared as such."""
    sorted_rows = ("Ai",) if "Ai" in operands else ()
    statement, arrays, flags = _einsum.prepare(expression, operands, sorted_indices=sorted_rows)
    return _primitive.make_spec(statement, arrays, **flags)


@pytest.mark.parametrize("config", [KernelConfig(), STRESS, KernelConfig(schedule="owned", window=2),
                                    KernelConfig(schedule="rows"), KernelConfig(schedule="split"),
                                    KernelConfig(schedule="tile", window=3)],
                         ids=["default", "stress", "owned", "rows", "split", "tile"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_catalog_kernel_matches_reference_and_xla(case, dtype, config, rng):
    operands = case.make(rng, dtype)
    spec = _spec(case.expression, operands)
    if dtype == jnp.bfloat16 and make_plan(spec, config).template == "dot":
        pytest.skip("Triton 3.6's interpreter computes bfloat16 tl.dot wrongly (it is right on GPUs: test_gpu.py)")
    actual = interpret(spec, operands, config)
    assert actual.dtype == dtype
    assert_allclose(actual, reference(case.expression, **operands), dtype)
    xla = jinsum.einsum(case.expression, **operands)
    assert_allclose(actual, np.asarray(xla, np.float64), dtype, err_msg="against the XLA lowering")


@pytest.mark.parametrize("config", [KernelConfig(), STRESS, KernelConfig(schedule="owned", window=2),
                                    KernelConfig(schedule="rows"), KernelConfig(schedule="tile", window=3),
                                    KernelConfig(schedule="split", window=2)],
                         ids=["default", "stress", "owned", "rows", "tile", "split"])
@pytest.mark.parametrize("case", [c for c in CATALOG if "+=" in c.expression], ids=repr)
def test_kernels_into_zeros_store_without_reading(case, config, rng):
    operands = case.make(rng, np.float32)
    spec = dataclasses.replace(_spec(case.expression, operands), zero_lhs=True)
    operands[spec.lhs.name] = np.zeros_like(operands[spec.lhs.name])
    source = generate(make_plan(spec, config))
    assert not re.search(r"(?<!\w)update\(", source)  # no load-add-store of the left-hand side
    assert_allclose(interpret(spec, operands, config), reference(case.expression, **operands), np.float32)


def _derived_specs():
    """The statements that jax.grad (with respect to every linear operand) and jax.vmap derive from the catalog."""
    derived = {}
    rng = np.random.default_rng(0)
    for case in CATALOG:
        operands = case.make(rng, np.float32)

        sorted_rows = ("Ai",) if "Ai" in operands else ()

        def loss(values, case=case, operands=operands, sorted_rows=sorted_rows):
            return jnp.sum(jinsum.einsum(case.expression, **{**operands, **values}, sorted_indices=sorted_rows) ** 2)

        values = {n: operands[n] for n in case.differentiated}
        for spec in specs_in(jax.grad(loss), values):
            derived.setdefault(str(spec.statement), spec)
        name = case.differentiated[-1]
        batched = np.stack([operands[name]] * 3)
        for spec in specs_in(jax.vmap(lambda x, case=case, operands=operands, name=name, s=sorted_rows: jinsum.einsum(
                case.expression, **{**operands, name: x}, sorted_indices=s)), batched):
            derived.setdefault(str(spec.statement), spec)
    return list(derived.values())


DERIVED = _derived_specs()


@pytest.mark.parametrize("spec", DERIVED, ids=lambda s: str(s.statement))
def test_derived_statement_kernels_match_reference(spec, rng):
    operands = random_operands(spec, rng)
    for config in (KernelConfig(), STRESS):
        assert_allclose(interpret(spec, operands, config), reference(str(spec.statement), **operands),
                        np.float32, err_msg=str(config))


def test_derived_statements_cover_the_transposes():
    statements = {str(s.statement) for s in DERIVED}
    assert "dB[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]" in statements
    assert "dAv[g,p] += B[Ak[g,p],n] * C[Ai[g],n]" in statements
    assert "dX[Ai[g],d] += Y[Ak[g,p],d] * S[g,p]" in statements  # the SDDMM's transpose: a sorted SpMM
    assert "dW[T[e],c,f] += X[C[e],c] * O[R[e],f]" in statements
    assert "C[Ai[g],n,b] += Av[g,p] * B[b,Ak[g,p],n]" in statements  # vmap over B


def test_block_spmm_source_uses_tensor_cores(rng):
    operands = next(c for c in CATALOG if c.name == "block_spmm_tiles").make(rng, np.float16)
    source = jinsum.triton_source("C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]", **operands)
    assert "tl.dot(" in source and "tl.float16" in source


def test_group_spmm_with_owned_rows_has_no_atomics(rng):
    operands = group_spmm(rng, np.float32)
    expression = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"
    for schedule in ("owned", "rows"):
        owned = jinsum.triton_source(expression, config=KernelConfig(schedule=schedule), sorted_indices=("Ai",),
                                     **operands)
        assert "atomic" not in owned and "update(" in owned
    split = jinsum.triton_source(expression, config=KernelConfig(schedule="split"), sorted_indices=("Ai",),
                                 **operands)
    assert "segment_update(" in split  # hub rows split across programs: atomics at window edges only


def test_row_programs_into_zeros_write_every_row_without_a_zero_fill(rng):
    """Row programs into zeros store empty rows' zeros themselves (the interpreter hands them a NaN-filled output,
    as the launcher leaves it unfilled); into a given left-hand side they leave empty rows alone."""
    operands = next(c for c in CATALOG if c.name == "block_spmm_tiles").make(rng, np.float32)
    operands["Ai"] = np.where(operands["Ai"] == 1, 0, operands["Ai"]).astype(np.int32)  # row 1 empty (still sorted)
    expression = "C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]"
    statement, arrays, flags = _einsum.prepare(
        expression, dict(operands, C=jax.ShapeDtypeStruct(operands["C"].shape, operands["C"].dtype)),
        sorted_indices=("Ai",))
    spec = _primitive.make_spec(statement, arrays, **flags)
    assert make_plan(spec).row_programs and make_plan(spec).covers_output
    assert not make_plan(_spec(expression, operands)).covers_output  # `+=` into a given C: read, not covered
    out = interpret(spec, {name: np.asarray(a) for name, a in arrays.items()})
    assert_allclose(out, reference(expression, **dict(operands, C=np.zeros_like(operands["C"]))), np.float32)
    assert not np.isnan(out).any() and not out[1].any()


def test_spmm_transpose_loops_slots_inside_and_skips_padding(rng):
    operands = group_spmm(rng, np.float32)
    transpose = dict(dB=np.zeros_like(operands["B"]), Ai=operands["Ai"], Ak=operands["Ak"], Av=operands["Av"],
                     C=operands["C"])
    expression = "dB[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]"
    plan = make_plan(_spec(expression, transpose))
    assert plan.write == "atomic" and plan.write_loops == ("p",) and plan.grid == ()
    source = jinsum.triton_source(expression, **transpose)
    # C[Ai[g],:] (T3[T4[i0],i2] in the kernel's names) is loaded once per group, outside the slot loop; a zero
    # value Av[g,p] skips its atomics.
    assert "T3 = C, T4 = Ai; i0 = g, i1 = p, i2 = n" in source
    assert source.index("# T3[T4[i0],i2]") < source.index("tl.static_range(")
    assert "!= 0, " in source.split("atomic_update(")[-1]


def test_fp32_dot_precision_follows_allow_tf32(rng):
    operands = next(c for c in CATALOG if c.name == "block_spmm_tiles").make(rng, np.float32)
    expression = "C[Ai[g],m,n] += Av[g,m,k,p] * B[Ak[g,p],k,n]"
    assert 'input_precision="tf32x3"' in jinsum.triton_source(expression, allow_tf32=False, **operands)
    assert 'input_precision="tf32"' in jinsum.triton_source(expression, allow_tf32=True, **operands)
    # None (the default) reads JAX's default matmul precision when traced, as jnp.dot does (the tests run under
    # "float32": conftest.py).
    with jax.default_matmul_precision("default"):
        assert 'input_precision="tf32"' in jinsum.triton_source(expression, **operands)
    with jax.default_matmul_precision("highest"):
        assert 'input_precision="tf32x3"' in jinsum.triton_source(expression, **operands)


def test_attention_precision_follows_jax_default(rng):
    q = jnp.asarray(rng.standard_normal((256, 2, 16)), jnp.float32)
    mask = jinsum.sequence_mask(256, 64, causal=True)
    def source():
        return jinsum.triton_source(lambda q: jinsum.attention(q, q, q, mask), q)
    with jax.default_matmul_precision("default"):
        assert 'input_precision="tf32"' in source()
    with jax.default_matmul_precision("float32"):
        assert 'input_precision="tf32x3"' in source() and 'input_precision="tf32"' not in source()


def test_plan_of_the_catalog():
    rng = np.random.default_rng(1)
    plans = {c.name: make_plan(_spec(c.expression, c.make(rng, np.float32))) for c in CATALOG}
    # Narrow rows (N = 5): the window of groups is the tile's row axis, written atomically.
    assert plans["group_spmm"].write == "atomic" and (plans["group_spmm"].rows, plans["group_spmm"].lanes) == ("g", "n")
    group = next(c for c in CATALOG if c.name == "group_spmm")
    wide = make_plan(_spec(group.expression, group.make(rng, np.float32)), KernelConfig(block=128))
    assert wide.write == "segmented" and wide.config.schedule == "split" and wide.rows is None
    assert plans["block_spmm_tiles"].template == "dot" and plans["block_sddmm"].template == "dot"
    # A group's rows gathered into a tile (a grouped product): Tensor Core tiles over (slots, h), c looped.
    assert plans["grouped_matmul"].template == "dot" and (plans["grouped_matmul"].dot.m,
                                                          plans["grouped_matmul"].dot.n) == ("p", "h")
    assert plans["coo_spmm"].write == "atomic"
    assert plans["sddmm"].lanes == "d" and plans["sddmm"].write == "set"
    assert plans["ell"].write == "update"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_wide_dot_tiles_fit_shared_memory(dtype):
    """A grouped product of wide tiles (128 x 256) pipelines its k tiles in the bytes a Hopper program may have
    (227 KiB): float32 factors take a shorter k tile, where k 64 asked 288 KiB and the launch failed."""
    G, P = 6, 128  # (groups of 128 slots: the product's m)
    operands = dict(X=jnp.zeros((500, 256), dtype), W=jnp.zeros((4, 256, 1024), dtype),
                    Ai=np.repeat(np.arange(3, dtype=np.int32), 2), Ak=np.zeros((G, P), np.int32),
                    H=jax.ShapeDtypeStruct((G, P, 1024), dtype))
    config = make_plan(_spec("H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]", operands)).config
    assert (config.block_m, config.block_n) == (128, 256)
    stage = (config.block_m + config.block_n) * config.block_k * jnp.dtype(dtype).itemsize
    assert config.num_stages * stage <= 227 * 1024


def _layer_specs():
    """The statements of every jinsum.nn layer's forward pass and gradient, on small graphs (and SparseLinear's)."""
    from flax import nnx  # noqa: PLC0415

    import jinsum.graphs as jg  # noqa: PLC0415

    import jinsum.nn as jnn  # noqa: PLC0415

    rng = np.random.default_rng(3)
    edge_index = np.stack([rng.integers(0, 9, 25), rng.integers(0, 9, 25)])
    A = jg.adjacency(edge_index, 9)
    x = jnp.asarray(rng.standard_normal((9, 4)).astype(np.float32))
    graph = jg.relational_graph(edge_index[0], edge_index[1], rng.integers(0, 3, 25), 9, 3)
    rngs = nnx.Rngs(0)
    cases = [(jnn.GCNConv(4, 3, rngs=rngs), A), (jnn.SAGEConv(4, 3, rngs=rngs), A),
             (jnn.GINConv(nnx.Linear(4, 3, rngs=rngs)), A), (jnn.GATConv(4, 3, heads=2, rngs=rngs), A),
             (jnn.RGCNConv(4, 3, num_relations=3, num_bases=2, rngs=rngs), graph),
             (jnn.SparseLinear(4, 6, jnn.random_pattern(4, 6, 0.4), rngs=rngs), None),
             (jnn.SparseLinear(4, 6, np.ones((2, 2)), block_shape=(2, 3), rngs=rngs), None)]
    specs = {}
    for layer, adjacency in cases:
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x, graphdef=graphdef, rest=rest, adjacency=adjacency):
            layer = nnx.merge(graphdef, params, rest)
            return jnp.sum((layer(x) if adjacency is None else layer(x, adjacency)) ** 2)

        for spec in specs_in(jax.grad(loss, argnums=(0, 1)), params, x):
            specs.setdefault(str(spec.statement) + repr([o.shape for o in spec.operands]), spec)
    q = jnp.asarray(rng.standard_normal((48, 2, 16)).astype(np.float32))
    pattern = jinsum.block_pattern(48, 16, local_blocks=1, global_blocks=1)
    attention = lambda q: jnp.sum(jinsum.attention(q, q, q, pattern) ** 2)  # noqa: E731
    for spec in specs_in(jax.grad(attention), q):
        specs.setdefault(str(spec.statement) + repr([o.shape for o in spec.operands]), spec)
    return list(specs.values())


LAYER_SPECS = _layer_specs()


@pytest.mark.parametrize("spec", LAYER_SPECS, ids=lambda s: str(s.statement))
def test_layer_statements_and_their_gradients_run_in_generated_kernels(spec, rng):
    operands = random_operands(spec, rng)
    assert_allclose(interpret(spec, operands), reference(str(spec.statement), **operands), np.float32)


@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig(schedule="owned", window=2),
                                    KernelConfig(schedule="rows")], ids=["default", "owned", "rows"])
@pytest.mark.parametrize("expression", ["C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]",  # SpMM
                                        "B[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]"])  # its transpose (a scatter)
def test_a_pattern_of_another_size_runs_the_same_kernel(expression, config):
    """Group, row and column counts are runtime arguments (`KernelPlan.sizes`): patterns of other sizes with the
    same feature width generate one source, which is right on each. A tall pattern (33 groups, two empty rows) and a
    wide one (21 groups, rows of up to 4, through several owned windows) run several programs with a short last
    window of groups under every schedule; a 5 x 3 one has four groups and an empty row."""
    sources, sizes = set(), set()
    for seed, (rows, cols, density) in enumerate([(31, 19, 0.15), (7, 41, 0.25), (5, 3, 0.5)]):
        rng = np.random.default_rng(seed)
        A = jinsum.GroupCOO.from_scipy(sp.random(rows, cols, density, random_state=seed, dtype=np.float32),
                                       group_size=4)
        operands = dict(Ai=np.asarray(A.Ai), Ak=np.asarray(A.Ak), Av=np.asarray(A.Av),
                        B=rng.standard_normal((cols, 24)).astype(np.float32),
                        C=rng.standard_normal((rows, 24)).astype(np.float32))
        spec = _spec(expression, operands)
        plan = make_plan(spec, config)
        if rows > 5:  # several programs, the last window of groups short (an SpMM's `rows`: a program per row)
            assert plan.grid_shape[0] > 1 and (plan.row_programs or len(A.Ai) % plan.config.window), plan.config
        sources.add(generate(plan))
        sizes.add(tuple(plan.sizes.values()))
        assert_allclose(interpret(spec, operands, config), reference(expression, **operands), np.float32,
                        err_msg=f"{rows} x {cols}")
    assert len(sources) == 1 and len(sizes) == 3


def test_long_reductions_are_cut_into_chunks_added_atomically(rng):
    """A dot plan updating a plain left-hand side over a long reduction (a SparseLinear's value gradient: one
    32 x 32 dot over the whole batch per block) cuts it into chunks summed by programs of their own and added
    atomically; the chunks, the last one short, add up to the reference. Short reductions and deterministic mode
    keep one program per output tile."""
    def spec_for(batch, deterministic=False):
        operands = dict(X=rng.standard_normal((batch, 6, 16)).astype(np.float32),
                        Dy=rng.standard_normal((batch, 5, 16)).astype(np.float32),
                        Ai=np.sort(rng.integers(0, 5, 5)).astype(np.int32),
                        Ak=rng.integers(0, 6, (5, 1)).astype(np.int32),
                        dAv=np.zeros((5, 16, 16, 1), np.float32))
        with jinsum.deterministic(deterministic):
            return _spec("dAv[g,m,k,p] += X[n,Ak[g,p],k] * Dy[n,Ai[g],m]", operands), operands

    spec, operands = spec_for(2500)
    plan = make_plan(spec)
    # (k tiles of 32 float32 terms: 2,500 in 3 chunks of 864)
    assert (plan.write, plan.config.k_chunks, plan.k_chunk, plan.config.window) == ("atomic", 3, 864, 1)
    assert "n in 3 chunks" in generate(plan)
    assert_allclose(interpret(spec, operands), reference(str(spec.statement), **operands), np.float32)
    # Chunks of a given count on a shorter batch: 300 in 5 chunks of 64 (4 k tiles of 16), the last 44 (a short
    # tile), in windows of 3 groups (the last of 2)
    short, operands = spec_for(300)
    config = KernelConfig(k_chunks=5, block_m=16, block_n=16, block_k=16, window=3)
    assert (make_plan(short, config).write, make_plan(short, config).k_chunk) == ("atomic", 64)
    assert_allclose(interpret(short, operands, config), reference(str(short.statement), **operands), np.float32,
                    err_msg=str(config))
    assert make_plan(spec_for(500)[0]).config.k_chunks == 1 and make_plan(spec_for(500)[0]).write == "update"
    assert make_plan(spec_for(2500, deterministic=True)[0]).config.k_chunks == 1


@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig(block_m=16, block_n=16, block_k=16, window=3),
                                    KernelConfig(block_m=16, block_n=32, block_k=32, num_stages=3),
                                    KernelConfig(block_k=16, schedule="rows")],
                         ids=["default", "small", "k32", "rows"])
def test_grouped_products_and_their_gradients_take_tensor_core_plans(config, rng):
    """A mixture of experts' product in grouped order and its two gradients are dot plans: the forward gathers a
    group's token rows into the tile; the input gradient adds each tile's rows into its tokens' rows (atomically,
    the tile's rows along the output's rows); the weight gradient walks each expert's groups and their slots as one
    reduction (`window_in_k`), its k tiles crossing group boundaries (24 slots a group, tiles of 16 and 32): with
    experts this few, in windows of groups that add each expert's part atomically (the `split` schedule; a window
    of 3 groups cuts experts' rows), or a program per expert (`rows`, where experts are many). An expert without
    groups gets a zero gradient; padding slots (token 0) take part like any slot. Groups past the
    last expert (expert parallelism's padding) read no matrix: they contribute zeros, without running their k loop
    or adding them atomically."""
    E, T, C, H, G, P = 4, 37, 16, 48, 9, 24
    Ai = np.sort(rng.choice([0, 1, 3], G)).astype(np.int32)  # expert 2: no group
    Ai[-2:] = E  # (past the last expert)
    Ak = rng.integers(0, T, (G, P)).astype(np.int32)
    Ak[:, -5:] = 0  # padding
    X, W = rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((E, C, H)).astype(np.float32)
    dH = rng.standard_normal((G, P, H)).astype(np.float32)
    cases = [("H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]", dict(X=X, W=W, H=np.zeros((G, P, H), np.float32)),
              ("p", "h", "c"), "update"),
             ("dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]", dict(dH=dH, W=W, dX=np.zeros((T, C), np.float32)),
              ("p", "c", "h"), "atomic"),
             ("dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]", dict(X=X, dH=dH, dW=np.zeros((E, C, H), np.float32)),
              ("c", "h", "p"), "segmented"),
             # RGCN's messages by edge: the edges grouped by relation, their sources read through the edge list
             ("H[g,p,h] += X[S[Ak[g,p]],c] * W[Ai[g],c,h]", dict(X=X, W=W, H=np.zeros((G, P, H), np.float32)),
              ("p", "h", "c"), "update"),
             ("dX[S[Ak[g,p]],c] += dH[g,p,h] * W[Ai[g],c,h]", dict(dH=dH, W=W, dX=np.zeros((T, C), np.float32)),
              ("p", "c", "h"), "atomic"),
             ("dW[Ai[g],c,h] += X[S[Ak[g,p]],c] * dH[g,p,h]", dict(X=X, dH=dH, dW=np.zeros((E, C, H), np.float32)),
              ("c", "h", "p"), "segmented")]
    edges = rng.integers(0, T, T).astype(np.int32)  # (S: each slot's token is the source of an edge)
    for expression, operands, roles, write in cases:
        operands = dict(operands, Ai=Ai, Ak=Ak, **({"S": edges} if "S[" in expression else {}))
        spec = _spec(expression, dict(operands, Ai=np.minimum(Ai, E - 1)))  # (concrete indices are range-checked)
        plan = make_plan(spec, config)
        assert plan.template == "dot" and (plan.dot.m, plan.dot.n, plan.dot.k) == roles, expression
        assert plan.write == write and plan.window_in_k == (write == "segmented"), expression
        if write == "segmented":
            assert plan.config.schedule == (config.schedule or "split") and plan.row_pointers, expression
        source = generate(plan)
        assert write == "segmented" or re.search(r"if in_range\(x\d+, rows_W\):", source), expression
        # The reference with one more expert, of zeros (its gradient dropped): what reads past the last reads 0.
        padded = {name: np.concatenate([a, np.zeros_like(a[:1])]) for name, a in operands.items() if name[-1] == "W"}
        expected = reference(expression, **dict(operands, **padded))
        assert_allclose(interpret(spec, operands, config), expected[:E] if "dW" in padded else expected, np.float32,
                        err_msg=expression)


def test_weight_gradient_windows_its_groups_only_where_rows_are_few(rng):
    """The weight gradient's rows (experts) times its output tiles make its row programs: fewer than
    `SPLIT_ROW_PROGRAMS`, it takes windows of groups instead, about that many programs in all."""
    from jinsum.kernels._plan import SPLIT_ROW_PROGRAMS  # noqa: PLC0415
    T, C, H, G, P = 50, 16, 16, 600, 16
    for experts, schedule in ((SPLIT_ROW_PROGRAMS - 1, "split"), (SPLIT_ROW_PROGRAMS, "rows")):
        operands = dict(X=np.zeros((T, C), np.float32), dH=np.zeros((G, P, H), np.float32),
                        Ai=np.sort(rng.integers(0, experts, G)).astype(np.int32),
                        Ak=rng.integers(0, T, (G, P)).astype(np.int32), dW=np.zeros((experts, C, H), np.float32))
        plan = make_plan(_spec("dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]", operands))
        assert plan.grid_shape[1] == 1 and plan.config.schedule == schedule
        if schedule == "split":  # (windows of 3 groups: 200 programs)
            assert plan.config.window == 3 and plan.grid_shape[0] == 200


def test_weight_gradient_gathers_its_rows_first_where_many_tiles_would(rng):
    """A weight gradient whose reduction walks an expert's entries and gathers their rows (`dW[Ai[g],c,h] +=
    X[Ak[g,p],c] * dH[g,p,h]`, or RGCN's through the edge list, `X[S[Ak[g,p]],c]`) gathers them once first where
    the output has `GATHER_FIRST_TILES` tiles or more along its columns (then a product on contiguous rows), and in
    the loop where it has fewer. Equal to the reference either way."""
    from jinsum._lowering._route import GATHER_FIRST_TILES  # noqa: PLC0415
    E, T, C, G, P = 3, 29, 16, 6, 16
    Ai = np.sort(rng.choice([0, 2], G)).astype(np.int32)
    Ak = rng.integers(0, T, (G, P)).astype(np.int32)
    config = KernelConfig(block_m=16, block_n=16, block_k=16)
    for gathered, H, split in (("X[Ak[g,p],c]", 16 * GATHER_FIRST_TILES, True),
                               ("X[S[Ak[g,p]],c]", 16 * GATHER_FIRST_TILES, True),
                               ("X[Ak[g,p],c]", 16 * (GATHER_FIRST_TILES - 1), False)):
        expression = f"dW[Ai[g],c,h] += {gathered} * dH[g,p,h]"
        operands = dict(X=rng.standard_normal((T, C)).astype(np.float32), Ai=Ai, Ak=Ak,
                        dH=rng.standard_normal((G, P, H)).astype(np.float32), dW=np.zeros((E, C, H), np.float32),
                        **({"S": rng.integers(0, T, T).astype(np.int32)} if "S[" in gathered else {}))
        spec = _spec(expression, operands)
        found = route(spec, config=config)
        if split:
            statements = (f"rows[g,p,c] += {gathered}", "dW[Ai[g],c,h] += rows[g,p,c] * dH[g,p,h]")
            assert tuple(str(s.statement) for s in found.pairwise) == statements
            assert make_plan(found.pairwise[1], config).window_in_k
            shown = jinsum.triton_source(expression, config=config, sorted_indices=("Ai",), **operands)
            assert all(f"# ---- statement: {statement}" in shown for statement in statements)
        else:
            assert found.plan is not None and found.plan.window_in_k
        assert_allclose(interpret(spec, operands, config), reference(expression, **operands), np.float32)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)], ids=str)
def test_three_factors_contract_a_tensor_core_pair_first(dtype, rng):
    """A sum of three factors with no Tensor Core plan, two of which have one, runs as two statements (`pairwise`):
    the mixture of experts' product with its combine weights and its experts' gradient (the rows scaled first, then
    the matmul) and its combine weights' gradient (the matmul, then a row-wise product); and an SpMM by a dense
    weight as `(A X) W` or `A (X W)`, whichever moves the narrower rows (never X W per entry). Equal to the
    reference."""
    E, T, C, N, G, P = 4, 37, 16, 48, 7, 16
    Ai = np.sort(rng.choice([0, 1, 3], G)).astype(np.int32)
    Ak = rng.integers(0, T, (G, P)).astype(np.int32)
    values = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    cases = [("Y[Ak[g,p],n] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,n]",
              dict(Av=values(G, P), X=values(T, C), W=values(E, C, N), Y=np.zeros((T, N), dtype)),
              # (scaling the c-wide rows first makes a smaller intermediate than the n-wide products)
              ("pair[g,p,c] += Av[g,p] * X[Ak[g,p],c]", "Y[Ak[g,p],n] += W[Ai[g],c,n] * pair[g,p,c]")),
             ("dW[Ai[g],c,n] += Av[g,p] * X[Ak[g,p],c] * dY[Ak[g,p],n]",
              dict(Av=values(G, P), X=values(T, C), dY=values(T, N), dW=np.zeros((E, C, N), dtype)),
              ("pair[g,p,c] += Av[g,p] * X[Ak[g,p],c]", "dW[Ai[g],c,n] += dY[Ak[g,p],n] * pair[g,p,c]")),
             ("dAv[g,p] += O[g,p,c] * W[Ai[g],c,n] * dY[Ak[g,p],n]",
              dict(O=values(G, P, C), W=values(E, C, N), dY=values(T, N), dAv=np.zeros((G, P), dtype)),
              ("pair[g,p,c] += W[Ai[g],c,n] * dY[Ak[g,p],n]", "dAv[g,p] += O[g,p,c] * pair[g,p,c]"))]
    for expression, operands, statements in cases:
        operands = dict(operands, Ai=Ai, Ak=Ak)
        spec = _spec(expression, operands)
        found = route(spec)
        assert found.pairwise and tuple(str(s.statement) for s in found.pairwise) == statements, expression
        assert "dot" in (make_plan(found.pairwise[0]).template, make_plan(found.pairwise[1]).template)
        shown = jinsum.triton_source(expression, sorted_indices=("Ai",), **operands)
        assert all(f"# ---- statement: {statement}" in shown for statement in statements)
        assert_allclose(interpret(spec, operands), reference(expression, **operands), dtype, err_msg=expression)
    # An SpMM by a dense weight: `(A X) W` where o is the wider side, the SpMM then moving the narrower rows;
    # `A (X W)` where c is (one row of X W per row of X, not per entry, then the SpMM)
    expression = "H[Ai[g],o] += Av[g,p] * X[Ak[g,p],c] * W[c,o]"
    for (c, o), statements, shape in [
            ((16, 48), ("pair[Ai[g],c] += Av[g,p] * X[Ak[g,p],c]", "H[i,o] += W[c,o] * pair[i,c]"), (20, 16)),
            ((48, 16), ("pair[j,o] += X[j,c] * W[c,o]", "H[Ai[g],o] += Av[g,p] * pair[Ak[g,p],o]"), (T, 16))]:
        spmm = dict(Av=values(G, P), X=values(T, c), W=values(c, o), H=np.zeros((20, o), dtype),
                    Ai=np.sort(rng.integers(0, 20, G)).astype(np.int32), Ak=Ak)
        spec = _spec(expression, spmm)
        found = route(spec)
        assert tuple(str(s.statement) for s in found.pairwise) == statements, (c, o)
        assert found.pairwise[0].lhs.shape == shape
        assert_allclose(interpret(spec, spmm), reference(expression, **spmm), dtype, err_msg=str((c, o)))


def test_a_pair_summed_to_one_number_is_not_split_off(rng):
    """Three factors where the only pairs to contract first sum to a scalar (`X0[a] * X2[I[a,b],c]` over every
    variable of theirs): no plan writes a 0-d array, so the statement stays whole (a lanes kernel), equal to the
    reference. (Found by the random statements: the route crashed planning the scalar.)"""
    expression = "Out[n] = X0[a] * X2[I[a,b],c] * X3[n]"
    operands = dict(X0=rng.standard_normal(3).astype(np.float32), I=rng.integers(0, 4, (3, 2)).astype(np.int32),
                    X2=rng.standard_normal((4, 5)).astype(np.float32), X3=rng.standard_normal(6).astype(np.float32),
                    Out=np.zeros(6, np.float32))
    spec = _spec(expression, operands)
    found = route(spec)
    assert found.kernel and not found.pairwise
    assert_allclose(interpret(spec, operands), reference(expression, **operands), np.float32)


def test_wide_outputs_are_not_cut_into_chunks():
    """A long reduction into an output of many tiles (a grouped product's 16,384 x 14,336 rows) runs unchunked,
    in one program per tile (no float32 atomics); wide tiles take 128 x 256 over 8 warps."""
    G, P, T, C, H, E = 128, 128, 8192, 4096, 14336, 8
    # (the spec from the operands' shapes: their 1.5 GB of zeros is never made)
    shapes = dict(X=jax.ShapeDtypeStruct((T, C), jnp.bfloat16), W=jax.ShapeDtypeStruct((E, C, H), jnp.bfloat16),
                  Ai=np.zeros(G, np.int32), Ak=np.zeros((G, P), np.int32),
                  H=jax.ShapeDtypeStruct((G, P, H), jnp.bfloat16))
    plan = make_plan(_primitive.make_spec(parse("H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"), shapes,
                                          sorted_indices={"Ai"}))
    assert (plan.write, plan.config.k_chunks, plan.out_dtype) == ("update", 1, np.dtype(jnp.bfloat16))
    config = plan.config
    assert (config.block_m, config.block_n, config.num_warps, config.num_stages, config.window) == (128, 256, 8, 3, 1)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_windows_carry_shared_rows_without_atomics(window, dtype, deterministic, rng):
    """An SpMM into zeros under the `split` schedule, with a 16-bit result or in deterministic mode, stores every
    row once: a hub row running through several windows is added up by the fixup kernel from each window's partial
    sums, and empty rows (before the first group's row, between rows, after the last) are stored as zeros by the
    first kernel; the output is never zero-filled (the interpreter's launcher fills it with NaN), and 16-bit
    outputs are written in their dtype. (Float32 results outside deterministic mode add shared rows atomically.)"""
    lengths = np.array([0, 0, 3, 61, 0, 1, 0, 0, 9, 2, 0, 0])  # empty rows first, between and last; a hub row
    # of 31 groups runs through more windows than the fixup kernel reads at once (`CHAIN`)
    rows = np.repeat(np.arange(lengths.size), lengths)
    cols = rng.integers(0, 10, rows.size)
    A = jinsum.GroupCOO.from_scipy(sp.csr_matrix((rng.standard_normal(rows.size), (rows, cols)), (lengths.size, 10)),
                                   group_size=2)
    B = rng.standard_normal((10, 7)).astype(dtype)
    operands = dict(Ai=np.asarray(A.Ai), Ak=np.asarray(A.Ak), Av=np.asarray(A.Av).astype(dtype), B=B,
                    C=np.zeros((lengths.size, 7), dtype))
    expression = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"
    spec = dataclasses.replace(_spec(expression, operands), zero_lhs=True, deterministic=deterministic)
    config = KernelConfig(schedule="split", window=window)
    plan = make_plan(spec, config)
    carried = deterministic or dtype.itemsize < 4
    assert plan.carries == plan.covers_output == (not plan.adds_atomically) == carried
    assert plan.out_dtype == (dtype if carried else np.float32)
    source = generate(plan)
    assert ("def jinsum_lanes_fixup(" in source) == ("segment_store(" not in source) == carried  # (atomic helper)
    actual = interpret(spec, operands, config)
    assert actual.dtype == dtype
    assert_allclose(actual, reference(expression, **operands), dtype)

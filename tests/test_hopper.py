"""The Hopper form of the tile core (`jinsum.kernels.hopper`, Gluon) on a machine without a GPU: which chains the
route gives it (sm_90 only, within its limits) and what Triton's compiler makes of the generated kernels for sm_90a
(Triton compiles for a target without the device: warp specialisation, wgmma, TMA, no spills, the softmax
overlapping the products). Gluon has no interpreter: the kernels' results are tested on the GPU
(`tests/test_gpu_attention.py`, `pytest -m gpu`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum.nn import route_tokens, routed_mlp
from jinsum._attention._api import build_chain
from jinsum._attention._chain_route import route_chain
from jinsum._frontend import _einsum
from jinsum._lang import _elementwise, epilogue_names
from jinsum._lowering._route import route
from jinsum._rules import _primitive
from jinsum.kernels import (ChainConfig, KernelConfig, chain_inputs, chain_kernel_name, chain_outputs, generate,
                            generate_chain, grouped_hopper_fallback, hopper_fallback, kernel_inputs, kernel_name,
                            kernel_scratch, statement_config)

triton = pytest.importorskip("triton")
HOPPER = ChainConfig(descriptors=True, hopper=True)
_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32", "int8": "*i8"}


def _chain(dtype=jnp.bfloat16, length=512, heads=4, kv_heads=2, head=128, batch=None, **options):
    """A chain of `jinsum.attention` over a causal block mask of documents (a captured array)."""
    lead = () if batch is None else (batch,)
    q = jnp.zeros((*lead, length, heads, head), dtype)
    k = jnp.zeros((*lead, length, kv_heads, head), dtype)
    doc = jnp.arange(length) // 200
    mask = jinsum.block_mask(lambda b, h, i, j: (i >= j) & (doc[i] == doc[j]), length, length, 128)
    return build_chain(q, k, k, options.pop("pattern", mask), **options)[0]


@pytest.mark.parametrize("kind, core", [("forward", "attention_rows("), ("dq", "attention_row_gradients("),
                                        ("dkdv", "attention_keys(")])
def test_the_route_gives_the_forward_and_the_backward_their_hopper_form_on_sm90_only(kind, core):
    chain = _chain()
    hopper = route_chain(chain, HOPPER).plan(kind)
    assert hopper.config.hopper and chain_kernel_name(hopper) == f"jinsum_attention_{kind}_hopper"
    assert "@gluon.jit" in generate_chain(hopper) and core in generate_chain(hopper)
    for config in (ChainConfig(descriptors=True), ChainConfig()):  # other GPUs, and the interpreter
        triton_form = route_chain(chain, config).plan(kind)
        assert not triton_form.config.hopper and "@triton.jit" in generate_chain(triton_form)
    for other in ("combine", "dq_sum", "dkdv_sum"):  # (the merges of long rows' pieces keep their Triton form)
        assert not route_chain(chain, HOPPER).plan(other).config.hopper


@pytest.mark.parametrize("options, reason", [
    (dict(dtype=jnp.float32), "float32 attention"),
    (dict(head=64), "heads of 64"),
    (dict(dropout=0.1, seed=0), "dropout"),
    (dict(key_padding_mask=np.ones(512, bool)), "key padding mask"),
])
def test_chains_outside_the_hopper_form_keep_the_triton_form_and_say_why(options, reason):
    chain = _chain(**options)
    for kind in ("forward", "dq", "dkdv"):
        plan = route_chain(chain, HOPPER).plan(kind)
        assert not plan.config.hopper
        assert reason in hopper_fallback(plan)


def test_the_backward_keeps_the_triton_form_for_a_score_mod_and_narrow_key_blocks():
    """A score_mod's derivative is not in the Hopper form of the backward, nor key blocks narrower than the
    backward over keys' 128 keys a program (the forward takes both)."""
    pattern = jinsum.block_mask(lambda b, h, i, j: i >= j, 512, 512, (128, 64))
    score_mod = _chain(score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j))
    for chain, kinds, reason in ((score_mod, ("dq", "dkdv"), "a score_mod in the backward"),
                                 (_chain(pattern=pattern), ("dkdv",), "blocks of 128 x 64")):
        route = route_chain(chain, HOPPER)
        assert route.plan("forward").config.hopper
        for kind in ("dq", "dkdv"):
            plan = route.plan(kind)
            assert plan.config.hopper == (kind not in kinds)
            if kind in kinds:
                assert reason in hopper_fallback(plan)


# Compiled in a process of its own: this one runs Triton's interpreter (`TRITON_INTERPRET=1`, for the Triton
# forms), under which Triton's library functions that Gluon kernels call are interpreted ones, which no compiler takes.
_COMPILE = """
import json, os, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource
from jinsum.kernels import load_kernel

source, signature, constants = sys.stdin.read().split("\\n#SIGNATURE\\n")
kernel = load_kernel(source)
signature, constants = json.loads(signature), json.loads(constants)
signature |= {name: "constexpr" for name in constants}
# (as the launcher compiles: XLA's buffers are 16-byte aligned)
attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
         if kind.startswith("*")}
compiled = triton.compile(GluonASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptxas = get_ptxas(90).path
with tempfile.TemporaryDirectory() as folder:
    ptx, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
    ptx.write_text(compiled.asm["ptx"])
    assembled = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(cubin)],
                               capture_output=True, text=True, check=True)
    sass = subprocess.run([str(Path(ptxas).with_name("cuobjdump")), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
print(json.dumps(dict(warps=compiled.metadata.num_warps, scratch=compiled.metadata.global_scratch_size,
                      assembler=assembled.stdout + assembled.stderr, sass=sass)))
"""


def _compiled(source: str, signature: dict, constants: dict | None = None) -> dict:
    """A generated Gluon kernel compiled for sm_90a (no GPU needed), assembled by ptxas -v and disassembled."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=f"{source}\n#SIGNATURE\n{json.dumps(signature)}"
                          f"\n#SIGNATURE\n{json.dumps(constants or {})}",
                          capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-3000:]
    return json.loads(done.stdout)


def _compiled_chain(chain, kind="forward") -> dict:
    plan = route_chain(chain, HOPPER).plan(kind)
    operand = {**chain.operand, "dO": chain.operand["O"], "Drow": chain.operand["LSE"], "dK": chain.operand["K"],
               "dV": chain.operand["V"]}
    signature = {f"p_{n}": _TYPES[str(operand[n].dtype)] if n in operand else _TYPES["int32"]
                 for n in chain_inputs(plan)}
    signature["p_flags"] = _TYPES["int8"]
    signature.update({f"o_{n}": _TYPES[str(operand[n].dtype)] if n in operand else _TYPES["float32"]
                      for n in chain_outputs(plan)})
    signature["scratch"] = "*u8"
    return _compiled(generate_chain(plan), signature)


def _spills(compiled: dict) -> int:
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", compiled["assembler"])
    assert found, compiled["assembler"]
    return max(map(int, found.groups()))


def _overlapped_exponentials(sass: str) -> list[int]:
    """After each wait that retires a tile's scores while the previous product still runs (`DEPBAR.LE gsb0,
    0x1`): the softmax's exponentials issued before the next wait, i.e. those overlapping the product."""
    lines = sass.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            count = 0
            for later in lines[i + 1:]:
                if "WARPGROUP.DEPBAR" in later:
                    break
                count += "MUFU.EX2" in later
            found.append(count)
    return found


@pytest.mark.parametrize("options", [
    dict(),  # bf16, head 128, grouped-query heads, a mask_mod with a captured array
    dict(dtype=jnp.float16, kv_heads=4, batch=2, score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j)),
], ids=["bf16-gqa", "fp16-batch-score_mod"])
def test_the_hopper_kernel_compiles_to_warp_specialised_wgmma_without_spills(options):
    compiled = _compiled_chain(_chain(**options))
    sass = compiled["sass"]
    assert compiled["warps"] == 12  # a consumer warpgroup, a second one and the producer's
    assert compiled["scratch"] == 640  # five TMA descriptors per program: three the producer's, one each consumer's
    # No tile in local memory: at most a few scalars (a score_mod's position tiles crowd the consumers' registers,
    # which then park some of the epilogue's pointers: 40 bytes with the one here, none without).
    assert _spills(compiled) <= (64 if "score_mod" in options else 0), compiled["assembler"]
    assert "HGMMA" in sass and "UTMALDG" in sass and "USETMAXREG" in sass
    overlapped = _overlapped_exponentials(sass)
    assert overlapped and min(overlapped) >= 64, overlapped  # a tile's 64 exponentials (per thread) overlap


@pytest.mark.parametrize("kind, descriptors", [("dq", 6), ("dkdv", 8)])
def test_the_hopper_backward_compiles_to_warp_specialised_wgmma_without_spills(kind, descriptors):
    """bf16, grouped-query heads, a mask_mod with a captured array. Over rows three wgmma groups a step (the
    scores and dP from shared memory, dQ with the score gradients as register operand); over keys four (the
    transposed scores and dP, then dV and dK); both products of scores issued before the first wait. Descriptors:
    over rows the producer's four and each consumer's dQ; over keys the producer's four and each consumer's dK and
    dV."""
    compiled = _compiled_chain(_chain(), kind)
    sass = compiled["sass"]
    assert compiled["warps"] == 12
    assert compiled["scratch"] == 128 * descriptors
    assert _spills(compiled) == 0, compiled["assembler"]
    assert "UTMALDG" in sass and "USETMAXREG" in sass
    shapes = re.findall(r"HGMMA\.(64x\d+x16)", sass)
    assert {"64x64x16", "64x128x16"} <= set(shapes), set(shapes)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass  # the scores retire while dP still runs


# ---- grouped products (a mixture of experts' projections, HeteroLinear) ----------------------------------------------
GROUPED_HOPPER = KernelConfig(hopper=True, programs=132)
_GATHERED = "H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"
_IN_ORDER = "O[g,p,n] += H[g,p,h] * W[Ai[g],h,n]"
_TRANSPOSED = "O[g,p,n] += H[g,p,h] * W[Ai[g],n,h]"
_SCALES = jnp.linspace(0.5, 1.5, 6)  # (a captured array: a group's scale)


def _grouped_route(expression=_GATHERED, dtype=jnp.bfloat16, groups=6, rows=128, k=256, n=384, epilogue=None,
                   config=GROUPED_HOPPER):
    experts = np.arange(groups, dtype=np.int32) * 3 // groups
    operands = dict(Ai=experts, W=jnp.zeros((3, n, k) if expression == _TRANSPOSED else (3, k, n), dtype))
    if expression == _GATHERED:
        operands |= dict(Ak=np.zeros((groups, rows), np.int32), X=jnp.zeros((500, k), dtype),
                         H=jax.ShapeDtypeStruct((groups, rows, n), dtype))
    else:
        operands |= dict(H=jnp.zeros((groups, rows, k), dtype), O=jax.ShapeDtypeStruct((groups, rows, n), dtype))
    statement, arrays, flags = _einsum.prepare(expression, operands, sorted_indices=("Ai",), allow_tf32=None)
    if epilogue is not None:
        traced, captured = _elementwise.trace(epilogue, "epilogue", "test", len(statement.lhs.indices))
        arrays.update(zip(epilogue_names(len(captured)), captured))
        spec = _primitive.make_spec(statement, arrays, epilogue=traced, **flags)
    else:
        spec = _primitive.make_spec(statement, arrays, **flags)
    with jinsum.small_terms(0):
        return route(spec, config=config)


def test_the_route_gives_grouped_products_their_hopper_form_on_sm90_only():
    for expression in (_GATHERED, _IN_ORDER):
        found = _grouped_route(expression)
        plan = found.plan
        assert plan.config.hopper and kernel_name(plan) == "jinsum_dot_update_hopper"
        source = generate(plan)
        assert "@gluon.jit" in source and "grouped_rows(" in source
        assert f"GATHER={expression == _GATHERED}" in source
        assert plan.grid_shape == (min(132, 6 * 2), 1)  # persistent programs over (group, column tile) items
        assert kernel_scratch(plan) == 128 * (3 if expression == _GATHERED else 4)
        triton_form = _grouped_route(expression, config=KernelConfig()).plan  # other GPUs, and the interpreter
        assert not triton_form.config.hopper and "@triton.jit" in generate(triton_form)
    assert statement_config() == KernelConfig()  # (no GPU here: the Triton form)


@pytest.mark.parametrize("options, reason", [
    (dict(dtype=jnp.float32), "float32 products"),
    (dict(rows=32), "groups of 32 rows"),
    (dict(k=96), "a reduction of 96"),
    (dict(n=100), "100 columns"),
])
def test_grouped_products_outside_the_hopper_form_keep_the_triton_form_and_say_why(options, reason):
    plan = _grouped_route(**options).plan
    assert not plan.config.hopper and "@triton.jit" in generate(plan)
    assert reason in grouped_hopper_fallback(plan)


def test_an_input_gradient_stores_its_products_in_the_hopper_form_then_adds_them_into_rows():
    expression = "dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]"
    statement, arrays, flags = _einsum.prepare(
        expression, dict(Ak=np.zeros((4, 128), np.int32), Ai=np.zeros(4, np.int32),
                         dH=jnp.zeros((4, 128, 256), jnp.bfloat16), W=jnp.zeros((2, 128, 256), jnp.bfloat16),
                         dX=jax.ShapeDtypeStruct((300, 128), jnp.bfloat16)),
        sorted_indices=("Ai",), allow_tf32=None)
    spec = _primitive.make_spec(statement, arrays, **flags)
    with jinsum.small_terms(0):
        found = route(spec, config=GROUPED_HOPPER)
        products, scatter = found.pairwise
        assert str(products.statement) == "products[g,p,c] += dH[g,p,h] * W[Ai[g],c,h]"
        assert str(scatter.statement) == "dX[Ak[g,p],c] += products[g,p,c]"
        plan = route(products, config=GROUPED_HOPPER).plan
        assert plan.config.hopper and "TRANSPOSED=True" in generate(plan)
        as_written = route(spec, config=KernelConfig())  # other GPUs: tiles added atomically
        assert as_written.plan.write == "atomic" and not as_written.pairwise
    assert grouped_hopper_fallback(as_written.plan) == "not a grouped product or sum into zeros"


def _weight_gradient(n=384, config=GROUPED_HOPPER):
    """The route of a grouped product's weight gradient (rows gathered by token, 3 experts' matrices of 128 x n)."""
    statement, arrays, flags = _einsum.prepare(
        "dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]",
        dict(Ak=np.zeros((6, 128), np.int32), Ai=np.arange(6, dtype=np.int32) // 2,
             X=jnp.zeros((500, 128), jnp.bfloat16), dH=jnp.zeros((6, 128, n), jnp.bfloat16),
             dW=jax.ShapeDtypeStruct((3, 128, n), jnp.bfloat16)),
        sorted_indices=("Ai",), allow_tf32=None)
    with jinsum.small_terms(0):
        found = route(_primitive.make_spec(statement, arrays, **flags), config=config)
        return found, found.pairwise and route(found.pairwise[1], config=config)


def test_a_weight_gradient_gathers_its_rows_then_sums_each_experts_groups_in_the_hopper_form():
    found, summed = _weight_gradient()
    rows, rest = found.pairwise
    assert str(rows.statement) == "rows[g,p,c] += X[Ak[g,p],c]"
    assert str(rest.statement) == "dW[Ai[g],c,h] += rows[g,p,c] * dH[g,p,h]"
    plan = summed.plan
    assert plan.config.hopper and plan.write == "segmented" and plan.row_pointers
    assert "grouped_sums(" in generate(plan) and kernel_scratch(plan) == 512
    assert plan.grid_shape == (3 * 1 * 2, 1)  # experts x tiles of 128 rows x tiles of 256 columns
    triton_form, _ = _weight_gradient(config=KernelConfig())  # 2 column tiles: gathered in the loop elsewhere
    assert triton_form.plan is not None and not triton_form.plan.config.hopper
    narrow, _ = _weight_gradient(n=100)  # 100 columns: no Hopper form, so the rows stay gathered in the loop
    assert narrow.pairwise is None and not narrow.plan.config.hopper


def _compiled_grouped(found) -> dict:
    plan = found.plan
    spec = plan.spec
    signature = {f"p_{n}": _TYPES[str(spec.operand[n].dtype if n in spec.operand else spec.epilogue.captures[
        spec.epilogue_names.index(n)].dtype)] for n in kernel_inputs(plan)}
    if plan.row_pointers:
        signature["p_row_starts"] = _TYPES["int32"]
    signature |= {"p_out": _TYPES[str(spec.lhs.dtype)], "scratch": "*u8"}
    constants = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "WINDOW", "NUM_STAGES"),
                         (plan.config.block_m, plan.config.block_n, 64, 1, plan.config.num_stages)))
    constants |= plan.sizes
    return _compiled(generate(plan), signature, constants)


@pytest.mark.parametrize("expression, options", [
    (_GATHERED, dict()),
    (_GATHERED, dict(dtype=jnp.float16, rows=64, n=128, epilogue=lambda v, g, p, n: v * _SCALES[g] + n)),
    (_IN_ORDER, dict()),
    (_TRANSPOSED, dict(n=256)),
    ("sums", dict()),
], ids=["gathered-bf16", "gathered-fp16-64-rows-epilogue", "in-order-bf16", "transposed-bf16", "weight-gradient"])
def test_the_grouped_hopper_kernel_compiles_to_warp_specialised_wgmma_without_spills(expression, options):
    found = _weight_gradient()[1] if expression == "sums" else _grouped_route(expression, **options)
    compiled = _compiled_grouped(found)
    sass = compiled["sass"]
    gathered = expression == _GATHERED
    assert compiled["warps"] == 12  # two consumer warpgroups and the producer's (4 warps, or 1 in a warpgroup)
    assert compiled["scratch"] == 128 * (3 if gathered else 4)
    assert _spills(compiled) == 0, compiled["assembler"]
    assert "HGMMA" in sass and "UTMALDG" in sass and "UTMASTG" in sass and "USETMAXREG" in sass
    assert ("LDGSTS" in sass) == gathered  # the rows gathered by cp.async; in grouped order by TMA


def test_autotune_tries_the_hopper_forms_knobs_on_sm90_where_the_plan_has_the_form(monkeypatch):
    from jinsum import _autotune  # noqa: PLC0415

    monkeypatch.setattr(_autotune, "statement_config", lambda: GROUPED_HOPPER)
    monkeypatch.setattr(_autotune, "has_tma", lambda: True)
    spec = _grouped_route().spec
    tried = _autotune.candidate_configs(spec)
    hopper = [c for c in tried if c.hopper]
    assert tried[0] == GROUPED_HOPPER and len({(c.block_n, c.num_stages) for c in hopper}) == len(hopper) > 1
    assert any(not c.hopper and c.descriptors for c in tried)  # (the Triton form's candidates stay)
    assert not any(c.hopper for c in _autotune.candidate_configs(_grouped_route(dtype=jnp.float32).spec))
    monkeypatch.setattr(_autotune, "statement_config", lambda: KernelConfig())  # other GPUs
    assert not any(c.hopper for c in _autotune.candidate_configs(spec))


def test_a_mixture_of_experts_step_runs_its_products_in_the_hopper_form_on_sm90():
    """`jax.grad` of `routed_mlp` (SwiGLU): the forward's three grouped products, the down projection's input
    gradient (the matrices transposed) and the up and gate projections' input gradients (split: products, then a
    scatter) take the Hopper form of a grouped product; the three weight gradients (their rows gathered first) that
    of a grouped sum."""
    rng = np.random.default_rng(0)
    tokens, experts, c, h = 4096, 4, 128, 256  # (groups of 128 rows: route_tokens' size for this capacity)
    x = jnp.asarray(rng.standard_normal((tokens, c)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    w_up, w_gate = (jnp.asarray(rng.standard_normal((experts, c, h)), jnp.bfloat16) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((experts, h, c)), jnp.bfloat16)

    def loss(x, w_up, w_gate, w_down):
        routing = route_tokens(logits, 2).combine.astype(jnp.bfloat16)
        return routed_mlp(x, routing, w_up, w_down, w_gate=w_gate).astype(jnp.float32).sum()

    with jinsum.small_terms(0):
        source = jinsum.triton_source(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w_up, w_gate, w_down,
                                      config=GROUPED_HOPPER)
    kernels = source.split("# ---- ")[1:]
    hopper = [k.splitlines()[0] for k in kernels if "grouped_rows(" in k]
    assert len(hopper) == 6, hopper
    assert sum("products[g,p,c] +=" in name for name in hopper) == 2
    sums = [k.splitlines()[0] for k in kernels if "grouped_sums(" in k]
    assert len(sums) == 3, sums
    assert not any("grouped_rows(" in k and "grouped_sums(" in k for k in kernels)

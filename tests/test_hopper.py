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

import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum._attention._api import build_chain
from jinsum._attention._chain_route import route_chain
from jinsum.kernels import ChainConfig, chain_inputs, chain_kernel_name, chain_outputs, generate_chain, hopper_fallback

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


def test_the_route_gives_the_forward_its_hopper_form_on_sm90_only():
    chain = _chain()
    hopper = route_chain(chain, HOPPER).plan("forward")
    assert hopper.config.hopper and chain_kernel_name(hopper) == "jinsum_attention_forward_hopper"
    assert "@gluon.jit" in generate_chain(hopper) and "attention_rows(" in generate_chain(hopper)
    for config in (ChainConfig(descriptors=True), ChainConfig()):  # other GPUs, and the interpreter
        triton_form = route_chain(chain, config).plan("forward")
        assert not triton_form.config.hopper and "@triton.jit" in generate_chain(triton_form)
    for kind in ("combine", "dq", "dkdv"):  # (the backward and the combine keep their Triton form)
        assert not route_chain(chain, HOPPER).plan(kind).config.hopper


@pytest.mark.parametrize("options, reason", [
    (dict(dtype=jnp.float32), "float32 attention"),
    (dict(head=64), "heads of 64"),
    (dict(dropout=0.1, seed=0), "dropout"),
    (dict(key_padding_mask=np.ones(512, bool)), "key padding mask"),
])
def test_chains_outside_the_hopper_form_keep_the_triton_form_and_say_why(options, reason):
    chain = _chain(**options)
    plan = route_chain(chain, HOPPER).plan("forward")
    assert not plan.config.hopper
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

source, signature = sys.stdin.read().split("\\n#SIGNATURE\\n")
kernel = load_kernel(source)
compiled = triton.compile(GluonASTSource(kernel, signature=json.loads(signature), constexprs={}),
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


def _compiled(chain) -> dict:
    """The generated Hopper kernel compiled for sm_90a (no GPU needed), assembled by ptxas -v and disassembled."""
    plan = route_chain(chain, HOPPER).plan("forward")
    operand = chain.operand
    signature = {f"p_{n}": _TYPES[str(operand[n].dtype)] if n in operand else _TYPES["int32"]
                 for n in chain_inputs(plan)}
    signature["p_flags"] = _TYPES["int8"]
    signature.update({f"o_{n}": _TYPES[str(operand[n].dtype)] if n in operand else _TYPES["float32"]
                      for n in chain_outputs(plan)})
    signature["scratch"] = "*u8"
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=f"{generate_chain(plan)}\n#SIGNATURE\n"
                          f"{json.dumps(signature)}", capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


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
    compiled = _compiled(_chain(**options))
    sass = compiled["sass"]
    assert compiled["warps"] == 12  # a consumer warpgroup, a second one and the producer's
    assert compiled["scratch"] == 640  # five TMA descriptors per program: three the producer's, one each consumer's
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", compiled["assembler"])
    # No tile in local memory: at most a few scalars (a score_mod's position tiles crowd the consumers' registers,
    # which then park some of the epilogue's pointers: 40 bytes with the one here, none without).
    assert spills and max(map(int, spills.groups())) <= (64 if "score_mod" in options else 0), compiled["assembler"]
    assert "HGMMA" in sass and "UTMALDG" in sass and "USETMAXREG" in sass
    overlapped = _overlapped_exponentials(sass)
    assert overlapped and min(overlapped) >= 64, overlapped  # a tile's 64 exponentials (per thread) overlap

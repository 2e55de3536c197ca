"""First calls: the persistent cache of compiled kernels (`jinsum._lowering._kernel_cache`) with a fake compiler (keys,
hits, corrupt entries, the size bound, the off switch, two processes writing at once), the autotune table under
concurrent writers and corruption and the key `einsum` looks it up under, and Triton started without torch. (A GPU
test in test_gpu.py checks that a second process loads the first one's kernels through jax-triton.)"""

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum._lowering import _kernel_cache


@dataclasses.dataclass
class Result:  # jax-triton's CompilationResult
    binary: str
    name: str
    shared_mem_bytes: int
    ttgir: str | None
    llir: str | None


class FakeCompiler:
    def __init__(self):
        self.calls = []

    def __call__(self, ttir, backend, options, compute_capability, platform):
        self.calls.append(str(ttir))
        return Result(binary=f"// ptx of {ttir} with {options}\n" + "x" * 400, name=f"kernel_{len(self.calls)}",
                      shared_mem_bytes=128 * len(self.calls), ttgir="ttgir", llir="llir")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cached fake compiler over an empty cache folder, with fresh counters."""
    monkeypatch.setenv("JINSUM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JINSUM_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("JINSUM_KERNEL_CACHE_MB", raising=False)
    monkeypatch.setattr(_kernel_cache, "STATS", _kernel_cache.CacheStats())
    compiler = FakeCompiler()
    return compiler, _kernel_cache.caching(compiler, Result, ("triton 0", "jax-triton 0", "jaxlib 0"))


def _entries():
    return sorted(_kernel_cache.directory().glob("*.json"))


def test_a_second_compile_of_the_same_kernel_loads_it(cache):
    compiler, compile_ttir = cache
    first = compile_ttir("module @a", None, "warps=4", 90, "cuda")
    again = compile_ttir("module @a", None, "warps=4", 90, "cuda")
    assert len(compiler.calls) == 1 and len(_entries()) == 1
    assert (again.binary, again.name, again.shared_mem_bytes) == (first.binary, first.name, first.shared_mem_bytes)
    info = _kernel_cache.kernel_cache_info()
    assert (info["compiled"], info["loaded"], info["entries"]) == (1, 1, 1) and info["bytes"] > 400


def test_everything_that_changes_the_binary_is_in_the_key(cache):
    compiler, compile_ttir = cache
    for ttir, options, capability in [("module @a", "warps=4", 90), ("module @b", "warps=4", 90),
                                      ("module @a", "warps=8", 90), ("module @a", "warps=4", 80)]:
        compile_ttir(ttir, None, options, capability, "cuda")
    assert len(compiler.calls) == 4 and len(_entries()) == 4
    other_versions = _kernel_cache.caching(compiler, Result, ("triton 1", "jax-triton 0", "jaxlib 0"))
    other_versions("module @a", None, "warps=4", 90, "cuda")
    assert len(compiler.calls) == 5


@pytest.mark.parametrize("damage", ["truncated", "digest", "not json"])
def test_a_corrupt_entry_is_ignored_and_rewritten(cache, damage):
    compiler, compile_ttir = cache
    compile_ttir("module @a", None, "", 90, "cuda")
    [path] = _entries()
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "digest":  # well-formed, but not what was sealed
        path.write_text(text.replace("x", "y"))
    else:
        path.write_bytes(b"\x00\xff")
    with pytest.warns(RuntimeWarning, match=r"kernel cache entry .* is corrupt .* compiled again and rewritten"):
        result = compile_ttir("module @a", None, "", 90, "cuda")
    assert len(compiler.calls) == 2 and "x" * 400 in result.binary
    assert _kernel_cache.STATS.rejected == 1
    compile_ttir("module @a", None, "", 90, "cuda")  # rewritten: loads now
    assert len(compiler.calls) == 2 and _kernel_cache.STATS.loaded == 1


def test_the_size_bound_deletes_the_least_recently_used_entries(cache, monkeypatch):
    compiler, compile_ttir = cache
    monkeypatch.setenv("JINSUM_KERNEL_CACHE_MB", str(1500 / 2**20))  # room for two entries of ~560 bytes
    for i, name in enumerate("abc"):
        compile_ttir(f"module @{name}", None, "", 90, "cuda")
        for path in _entries():  # distinct modification times, oldest first, whatever the file system's clock
            if f"@{name}" in path.read_text():
                os.utime(path, (1000 + i, 1000 + i))
    assert len(_entries()) == 2
    compile_ttir("module @b", None, "", 90, "cuda")  # b is loaded, so it becomes the most recently used
    compile_ttir("module @d", None, "", 90, "cuda")
    texts = " ".join(p.read_text() for p in _entries())
    assert "@b" in texts and "@d" in texts and "@c" not in texts and "@a" not in texts
    assert len(compiler.calls) == 4


def test_the_off_switch_and_other_platforms_compile_every_time(cache, monkeypatch):
    compiler, compile_ttir = cache
    compile_ttir("module @a", None, "", 90, "rocm")
    compile_ttir("module @a", None, "", 90, "rocm")
    monkeypatch.setenv("JINSUM_KERNEL_CACHE", "0")
    compile_ttir("module @a", None, "", 90, "cuda")
    compile_ttir("module @a", None, "", 90, "cuda")
    assert len(compiler.calls) == 4 and not _entries()
    assert not _kernel_cache.kernel_cache_info()["enabled"]


def test_a_cache_that_cannot_be_written_costs_the_cache_not_the_compile(cache, monkeypatch):
    compiler, compile_ttir = cache

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_kernel_cache, "write", full_disk)
    assert "x" * 400 in compile_ttir("module @a", None, "", 90, "cuda").binary
    assert len(compiler.calls) == 1 and not _entries()


@pytest.mark.parametrize("setting", ["lots", "-5", "nan"])
def test_a_bad_size_bound_is_named(cache, monkeypatch, setting):
    _, compile_ttir = cache
    monkeypatch.setenv("JINSUM_KERNEL_CACHE_MB", setting)
    with pytest.raises(ValueError, match=f"JINSUM_KERNEL_CACHE_MB must be a size in megabytes .* got '{setting}'"):
        compile_ttir("module @a", None, "", 90, "cuda")


def test_install_wraps_jax_tritons_compiler_once(cache):
    """A second `install` (every lowering calls it) adds no second cache, even after someone else wrapped the
    compiler (a profiler): one compile is counted once."""
    import types  # noqa: PLC0415

    compiler, _ = cache
    triton_lib = types.SimpleNamespace(compile_ttir_inplace=compiler, CompilationResult=Result, code_gen=None,
                                       _triton=types.SimpleNamespace(ir=None))
    _kernel_cache.install(triton_lib, versions=("v",))
    cached = triton_lib.compile_ttir_inplace
    triton_lib.compile_ttir_inplace = lambda *args: cached(*args)  # a timing wrapper, say
    _kernel_cache.install(triton_lib, versions=("v",))
    triton_lib.compile_ttir_inplace("module @a", None, "", 90, "cuda")
    triton_lib.compile_ttir_inplace("module @a", None, "", 90, "cuda")
    assert len(compiler.calls) == 1 and (_kernel_cache.STATS.compiled, _kernel_cache.STATS.loaded) == (1, 1)


def test_two_processes_writing_the_same_entries(tmp_path):
    script = textwrap.dedent("""
        import dataclasses, sys
        from jinsum._lowering import _kernel_cache

        @dataclasses.dataclass
        class Result:
            binary: str
            name: str
            shared_mem_bytes: int
            ttgir: object
            llir: object

        def compile_ttir(ttir, backend, options, capability, platform):
            return Result("ptx " + ttir * 2000, "k", 0, None, None)

        cached = _kernel_cache.caching(compile_ttir, Result, ("v",))
        for round in range(3):
            for i in range(40):
                assert cached(f"module @{i}", None, "", 90, "cuda").binary == "ptx " + f"module @{i}" * 2000
        print(_kernel_cache.STATS.rejected)
    """)
    env = {**os.environ, "JINSUM_CACHE_DIR": str(tmp_path)}
    processes = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0]
    assert [int(out) for out in outputs] == [0, 0]  # neither ever read a partial entry
    folder = tmp_path / "compiled"
    assert len(list(folder.glob("*.json"))) == 40 and not list(folder.glob("*.tmp"))


def test_threads_compiling_the_same_kernels_at_once(cache):
    compiler, compile_ttir = cache
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: compile_ttir(f"module @{i % 10}", None, "", 90, "cuda").binary, range(120)))
    assert all(f"module @{i % 10}" in binary for i, binary in enumerate(results))
    assert _kernel_cache.STATS.rejected == 0 and len(_entries()) == 10
    assert not list(_kernel_cache.directory().glob("*.tmp"))


AUTOTUNE_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from jinsum._rules import _primitive  # noqa: PLC0415
    from jinsum._lang import parse
    from jinsum.kernels import KernelConfig, store_tuned_config

    for n in range(int(sys.argv[1]), int(sys.argv[1]) + 30):  # thirty statements of its own shapes
        arrays = dict(C=np.zeros((n, 4), np.float32), A=np.zeros((n, 3), np.float32), B=np.zeros((3, 4), np.float32))
        spec = _primitive.make_spec(parse("C[i,j] += A[i,k] * B[k,j]"), arrays)
        store_tuned_config(spec, KernelConfig(block=n))
""")


def test_processes_storing_tuned_configs_at_once_lose_none(tmp_path):
    env = {**os.environ, "JINSUM_CACHE_DIR": str(tmp_path / "kernels"), "JAX_PLATFORMS": "cpu"}
    processes = [subprocess.Popen([sys.executable, "-c", AUTOTUNE_WRITER, str(100 * k)], env=env) for k in range(4)]
    assert [p.wait(timeout=300) for p in processes] == [0] * 4
    table = json.loads((tmp_path / "autotune.json").read_text())
    assert sorted(config["block"] for config in table.values()) == [100 * k + n for k in range(4) for n in range(30)]
    assert not list(tmp_path.glob("*.tmp"))


def test_an_unreadable_autotune_table_is_ignored_with_a_warning(tmp_path, monkeypatch):
    from jinsum._rules import _primitive  # noqa: PLC0415
    from jinsum._lang import parse  # noqa: PLC0415
    from jinsum.kernels import KernelConfig, _tuned, store_tuned_config, tuned_config  # noqa: PLC0415

    monkeypatch.setenv("JINSUM_CACHE_DIR", str(tmp_path / "kernels"))
    _tuned._stored.cache_clear()
    (tmp_path / "autotune.json").write_text('{"half a table": ')
    spec = _primitive.make_spec(parse("C[i] += A[i]"), dict(C=np.zeros(3, np.float32), A=np.ones(3, np.float32)))
    with pytest.warns(RuntimeWarning, match=r"autotune table .* cannot be read .* the next jinsum.autotune rewrites"):
        assert tuned_config(spec) is None
    with pytest.warns(RuntimeWarning):  # (read again under the lock, still broken) ...
        store_tuned_config(spec, KernelConfig(block=8))
    assert tuned_config(spec) == KernelConfig(block=8)  # ... and replaced by a whole table
    _tuned._stored.cache_clear()


def _front_end_inputs(triton, rows: int = 300):
    """What jax-triton hands Triton's front end for one of jinsum's generated kernels (an SpMM), on CPU."""
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import scipy.sparse as sp  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: PLC0415

    import jinsum  # noqa: PLC0415
    from jinsum._frontend import _einsum  # noqa: PLC0415
    from jinsum._rules import _primitive  # noqa: PLC0415
    from jinsum.kernels import KernelConfig, generate, load_kernel, make_plan  # noqa: PLC0415

    A = jinsum.GroupCOO.from_scipy(sp.random(rows, 200, 0.05, random_state=0, dtype=np.float32))
    statement, arrays, flags = _einsum.prepare("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]",
                                               dict(A=A, B=jnp.ones((200, 64)), C=jnp.zeros((rows, 64))),
                                               sorted_indices=("Ai",))
    plan = make_plan(_primitive.make_spec(statement, arrays, **flags), KernelConfig(schedule="split"))
    source = generate(plan)
    assert "tl.range(" in source  # a loop: its variables are named after the source's in the front end's TTIR only
    fn = load_kernel(source)
    constants = dict(BLOCK_ROWS=plan.config.block_rows, BLOCK=plan.config.block, WINDOW=plan.config.window,
                     NUM_STAGES=plan.config.num_stages)
    signature = {n: "constexpr" if n in constants else ("*i32" if n in ("p_Ai", "p_Ak") else "*fp32")
                 if n.startswith("p_") else "i32" for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.startswith("p_")}
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    options = backend.parse_options(dict(num_warps=4, num_stages=3, num_ctas=1, debug=False))
    return backend, options, fn, constants, signature, attrs


def check_front_end_cache() -> None:
    """The body of the test below, in a process without Triton's interpreter (its front end needs real kernels)."""
    import types  # noqa: PLC0415

    import triton  # noqa: PLC0415
    from triton._C.libtriton import ir  # noqa: PLC0415
    from triton.compiler import code_generator, compiler  # noqa: PLC0415

    backend, options, fn, constants, signature, attrs = _front_end_inputs(triton)
    runs = []

    def ast_to_ttir(*args, **kwargs):
        runs.append(args[0])
        return code_generator.ast_to_ttir(*args, **kwargs)

    front = _kernel_cache.FrontEnd(types.SimpleNamespace(ast_to_ttir=ast_to_ttir), ir, ("v",))

    def lower(kernel=fn, source=None):  # as jax-triton's get_or_create_triton_kernel does it, in a fresh context
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        source = source or compiler.ASTSource(kernel, constexprs=constants, signature=signature, attrs=attrs)
        return front.ast_to_ttir(kernel, source, options=options, context=context,
                                 codegen_fns=backend.get_codegen_implementation(options),
                                 module_map=backend.get_module_map())

    def ptx(module):
        metadata = {}
        for stage in (backend.make_ttir, backend.make_ttgir, backend.make_llir, backend.make_ptx):
            module = stage(module, metadata, options, 90)
        return module

    text = str(lower())
    again = lower()
    assert len(runs) == 1 and _kernel_cache.STATS.parsed == 1, (runs, _kernel_cache.STATS)
    assert str(again) == text  # so the compiled kernel's key (the TTIR text) is the same in both processes
    assert ptx(again) == ptx(lower())
    [entry] = _kernel_cache.directory().glob("*.ttir")
    entry.write_text(entry.read_text()[:-200])
    assert str(lower()) == text and len(runs) == 2 and _kernel_cache.STATS.rejected == 1

    @triton.jit
    def other(p_x):
        pass

    lower(other, compiler.ASTSource(other, signature={"p_x": "*fp32"}))
    assert runs[-1] is other and len(list(_kernel_cache.directory().glob("*.ttir"))) == 1
    print("ok")


def test_the_front_end_of_a_generated_kernel_is_parsed_in_a_later_process(tmp_path):
    """The TTIR of jinsum's kernels is kept: a later lowering parses it, prints the same text (so the compiled
    kernel's lookup hits) and compiles to the same PTX; a corrupt entry runs the front end again; other kernels
    are left alone."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(JINSUM_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import test_kernel_cache as t; t.check_front_end_cache()"],
                          cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_autotune_stores_its_config_where_einsum_looks_it_up(tmp_path, monkeypatch):
    """`jinsum.autotune` with `einsum`'s defaults tunes the call `einsum` makes: the stored configuration is the one
    the lowering of that call finds (tuning once stored it under `tf32=False` while `einsum` at the default
    precision looked it up under `tf32=True`, so it was never used)."""
    from jinsum import _autotune  # noqa: PLC0415
    from jinsum.kernels import KernelConfig, _tuned, tuned_config  # noqa: PLC0415

    monkeypatch.setenv("JINSUM_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(_autotune, "_require_gpu", lambda: None)  # (timed on the CPU: this test is about the key)
    _tuned._stored.cache_clear()
    expression = "C[i,j] += A[i,k] * B[k,j]"
    operands = dict(A=jnp.ones((8, 4), jnp.float32), B=jnp.ones((4, 8), jnp.float32))
    chosen = KernelConfig(block=16)
    assert jinsum.autotune(expression, configs=[chosen], calls=1, **operands) == chosen
    (spec,) = [e.params["spec"] for e in jax.make_jaxpr(lambda: jinsum.einsum(expression, **operands))().eqns
               if e.primitive is jinsum.jinsum_p]
    assert tuned_config(spec) == chosen
    _tuned._stored.cache_clear()

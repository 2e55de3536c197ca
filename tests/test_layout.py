"""The package's folders are its pipeline, and imports run one way through it.

Every module of `jinsum/` (and `kernels/`, shipped as `jinsum.kernels`) belongs to a stage; a module may import its
own stage and stages below it, never one above or beside it. Read from the source with `ast`, lazy imports inside
functions included, so a new feature that reaches back up (`_rules` importing `_lowering`, `formats` importing
anything of jinsum's) fails here rather than in an import cycle months later.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Stage of each top-level part of the package: a module may import only parts of a lower number (or its own part).
# Parts of one number are independent of each other (kernels/ and _rules/ both build on _lang/ alone).
STAGES = {
    "jinsum._config": -1, "jinsum.timing": 0,             # switches: read by every stage
    "jinsum._lang": 0,                                  # the notation (and the element-wise tracer it holds)
    "jinsum.formats": 0,                                # sparse formats: pytrees of index arrays, their builders
    "jinsum._rules": 1, "jinsum.kernels": 1,            # the primitive and its rules; the code generator
    "jinsum.datasets": 1,                               # graphs read or generated into formats
    "jinsum.sampling": 1,                               # sub-graphs drawn on the device into formats
    "jinsum._frontend": 2, "jinsum._lowering": 2,       # statements bound to the primitive; its lowerings
    "jinsum._attention": 3,                             # the attention chain, through every stage above
    "jinsum.graphs": 3,                                 # graph data into formats (kNN through _lowering); no Flax
    "jinsum._inspect": 4, "jinsum._autotune": 4,        # tools over the whole pipeline
    "jinsum": 5,                                        # the public surface (jinsum/__init__.py re-exports all)
    "jinsum.testing": 5,
    "jinsum.shard": 6,                                  # built on the public surface
    "jinsum.nn": 7,                                     # layers, over one device or a partition
}


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, for jinsum/ and kernels/ (the symlink jinsum/kernels is not followed twice)."""
    found = {}
    for top, package in ((ROOT / "jinsum", "jinsum"), (ROOT / "kernels", "jinsum.kernels")):
        for path in sorted(top.rglob("*.py")):
            relative = path.relative_to(top)
            if relative.parts[0] == "kernels" and package == "jinsum":
                continue
            parts = [package, *relative.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _part(module: str) -> str:
    """The stage part a module belongs to: the longest prefix named in STAGES."""
    candidates = [p for p in STAGES if module == p or module.startswith(p + ".")]
    assert candidates, f"{module} belongs to no stage: add its folder to STAGES in {__file__}"
    return max(candidates, key=len)


def _imports(path: pathlib.Path) -> set[str]:
    """The jinsum modules a file imports (`from jinsum import x` names module x where x is one)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "jinsum"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jinsum":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in MODULES else node.module)
    return names


def test_every_module_has_a_stage():
    assert len(MODULES) > 50
    for module in MODULES:
        _part(module)


def test_imports_run_down_the_pipeline():
    wrong = []
    for module, path in MODULES.items():
        if module == "jinsum":  # the public surface re-exports every stage
            continue
        mine = _part(module)
        for imported in _imports(path):
            theirs = _part(imported)
            if theirs != mine and STAGES[theirs] >= STAGES[mine]:
                wrong.append(f"{path.relative_to(ROOT)} ({mine}, stage {STAGES[mine]}) imports {imported} "
                             f"({theirs}, stage {STAGES[theirs]})")
    assert not wrong, "imports that run up or across the pipeline:\n" + "\n".join(wrong)


def test_the_checker_sees_a_wrong_import(tmp_path):
    """The walk finds lazy imports and `from jinsum import module` forms (a check that cannot fail is no check)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from jinsum import _lowering\n    import jinsum._rules._derive\n")
    assert _imports(source) == {"jinsum._lowering", "jinsum._rules._derive"}
    assert STAGES[_part("jinsum._lowering._triton")] > STAGES[_part("jinsum._rules._primitive")]


def test_top_level_holds_only_the_surface_and_tools():
    """New stages get a folder: the private modules left at the top are the configuration and the tools."""
    top = {p.stem for p in (ROOT / "jinsum").glob("*.py")}
    assert top == {"__init__", "_config", "_inspect", "_autotune", "testing", "timing"}, (
        f"jinsum/ holds top-level modules {sorted(top)}: put a new stage's modules in a subpackage named after the "
        "stage, and add it to STAGES")


def test_public_imports_load_only_modules_of_the_tree():
    """`import jinsum, jinsum.graphs, jinsum.nn, jinsum.shard` in a fresh interpreter loads no jinsum module that has
    no file here (no shim left behind under an old name)."""
    code = ("import sys, jinsum, jinsum.graphs, jinsum.nn, jinsum.shard\n"
            "print('\\n'.join(m for m in sys.modules if m == 'jinsum' or m.startswith('jinsum.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    assert "jinsum._rules._primitive" in loaded
    assert set(loaded) <= set(MODULES), sorted(set(loaded) - set(MODULES))


_WITHOUT_FLAX = """
import importlib.abc, json, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("flax", "optax"):
            raise ImportError(f"{name} is blocked: jinsum.graphs must not need it")
        return None

sys.meta_path.insert(0, Blocked())
import numpy as np
import jinsum.graphs as jg

graphs = [dict(x=np.ones((3, 2)), edge_index=np.array([[0, 1], [1, 2]])),
          dict(x=np.ones((2, 2)), edge_index=np.array([[1], [0]]))]
(batch,) = jg.GraphLoader(graphs, batch_size=2, budget=jg.GraphBudget(nodes=8, edges=4, graphs=2))
edge_index = jg.knn_graph(np.array([[0.0], [1.0], [3.0]], np.float32), k=1)
print(json.dumps(dict(
    batch=np.asarray(batch.adjacency().todense()).tolist(), node_graph=np.asarray(batch.node_graph()).tolist(),
    knn_graph=np.asarray(edge_index).tolist(), adjacency=np.asarray(jg.adjacency(edge_index, 3).todense()).tolist(),
    nn=sorted(m for m in sys.modules if m == "jinsum.nn" or m.startswith("jinsum.nn.")))))
"""


def test_graph_data_loads_without_flax():
    """`jinsum.graphs` sits below the layers: in a fresh interpreter where flax and optax cannot be imported it loads,
    pads a batch of two small graphs and builds its adjacency on the device, a kNN graph and an adjacency."""
    run = subprocess.run([sys.executable, "-c", _WITHOUT_FLAX], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    batch = [[0] * 8 for _ in range(8)]
    for dst, src in ((1, 0), (2, 1), (3, 4)):  # graph 0's edges 0 -> 1 -> 2, graph 1's 1 -> 0 after graph 0's nodes
        batch[dst][src] = 1
    assert out["batch"] == batch
    assert out["node_graph"] == [0, 0, 0, 1, 1, 2, 2, 2]  # (padding nodes: graph 2, one past the last)
    assert out["knn_graph"] == [[1, 0, 1], [0, 1, 2]]  # each point's nearest (source) into it (target)
    assert out["adjacency"] == [[0, 1, 0], [1, 0, 0], [0, 1, 0]]  # A[dst, src]
    assert out["nn"] == []  # (the layers' stage is never loaded)


def test_primitives_import_no_lowering():
    """The attention primitives, like the statement primitive, know no lowering: their lowerings register themselves
    on them (`jinsum._attention._lowering`, as `jinsum._lowering` does on `jinsum_p`), and what runs on CUDA is what
    the chain's route (`_chain_route`), made once when the chain is bound, holds."""
    lowerings = ("jinsum._lowering", "jinsum._attention._lowering", "jinsum._attention._chain_triton",
                 "jinsum._attention._chain_reference")
    wrong = [f"{module} imports {imported}" for module in ("jinsum._attention._chain_primitive",
                                                           "jinsum._attention._chain_route")
             for imported in _imports(MODULES[module])
             if any(imported == lowering or imported.startswith(lowering + ".") for lowering in lowerings)]
    assert not wrong, wrong

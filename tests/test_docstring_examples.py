"""The docstrings' examples cannot drift from the code: every `>>>` example of a public name (the names that
docs/api/*.rst documents, with their methods and properties) runs here as a doctest, on the CPU, in a namespace
that holds what a reader has imported (`jax`, `jnp`, `np`, `nnx`, `jinsum` and its public modules). Each docstring
is one case, its lines run in order in a fresh copy of that namespace; the examples over a mesh see the 4 CPU
devices of tests/conftest.py. Examples that need a GPU or several processes are prose or `::` blocks in the
docstrings, not `>>>` lines. Outputs shown are shapes, dtypes and small integers, never float digits."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jinsum  # noqa: E402
import jinsum.datasets  # noqa: E402
import jinsum.formats  # noqa: E402
import jinsum.graphs  # noqa: E402
import jinsum.kernels  # noqa: E402
import jinsum.nn  # noqa: E402
import jinsum.sampling  # noqa: E402
import jinsum.shard  # noqa: E402
import jinsum.testing  # noqa: E402
import jinsum.timing  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^\.\. auto(?:function|class|exception|data)::\s+(\S+)", re.M)
DOCUMENTED = sorted({m for page in (ROOT / "docs" / "api").glob("*.rst") for m in DIRECTIVE.findall(page.read_text())})
NAMESPACE = {"jax": jax, "jnp": jnp, "np": np, "nnx": nnx, "jinsum": jinsum}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def source_file(obj) -> str | None:
    try:
        return inspect.getsourcefile(inspect.unwrap(obj))
    except TypeError:  # settings (JAX configuration states) and constants
        return None


def documented_examples() -> dict[str, doctest.DocTest]:
    """`name -> DocTest` for every docstring with a `>>>` line among the documented objects and their public
    members (a class's methods, class methods and properties; private helpers are not part of the reference)."""
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    found = {}
    for qualified in DOCUMENTED:
        module, _, name = qualified.rpartition(".")
        obj = getattr(importlib.import_module(module), name)
        for test in finder.find(obj, qualified, module=False, globs={}):
            test.filename = source_file(obj)  # named in a failure's report, with the docstring's line
            member = test.name[len(qualified):].split(".")
            if test.examples and not any(part.startswith("_") for part in member):
                found[test.name] = test
    return found


EXAMPLES = documented_examples()


def test_the_examples_are_found():
    assert len(EXAMPLES) >= 40, sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example_runs(name):
    test = EXAMPLES[name]
    test.globs = dict(NAMESPACE)
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    try:
        result = runner.run(test, out=report.append, clear_globs=True)
    finally:
        test.globs = {}
    assert result.failed == 0, "".join(report)

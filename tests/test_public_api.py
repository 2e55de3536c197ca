"""The public API: every public name of every public module, each exported from one place and documented in the API
reference (docs/api/*.rst) with a docstring. A new public name without a page fails here, as does a second
export of the same object (an alias)."""

from __future__ import annotations

import importlib
import pathlib
import re
import types

import jax
import jax.extend
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The modules users import; `jinsum.formats` is where the top level's formats live (its other names are public
# under it), and `jinsum.testing` declares its public names in `__all__`.
MODULES = ("jinsum", "jinsum.formats", "jinsum.nn", "jinsum.graphs", "jinsum.sampling", "jinsum.shard",
           "jinsum.datasets", "jinsum.timing", "jinsum.kernels", "jinsum.testing")
DIRECTIVE = re.compile(r"^\.\. auto(?:function|class|exception|data)::\s+(\S+)", re.M)


def public_names(name: str) -> dict[str, object]:
    """`module.name -> object` for the public names of a module: `__all__` where it has one, else every name without
    an underscore that is not a module and not an object from outside jinsum (typing helpers, `annotations`)."""
    module = importlib.import_module(name)
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    found = {}
    for n in names:
        obj = getattr(module, n)
        home = getattr(obj, "__module__", None) or type(obj).__module__
        if isinstance(obj, types.ModuleType) or n == "annotations":
            continue
        if not (home.startswith("jinsum") or type(obj).__module__.startswith("jax._src.config")
                or isinstance(obj, (str, tuple, int, jax.extend.core.Primitive))):
            continue
        found[f"{name}.{n}"] = obj
    return found


PUBLIC = {qualified: obj for module in MODULES for qualified, obj in public_names(module).items()}
DOCUMENTED = {m for page in (ROOT / "docs" / "api").glob("*.rst") for m in DIRECTIVE.findall(page.read_text())}


def test_every_public_name_is_in_the_api_reference():
    missing = sorted(set(PUBLIC) - DOCUMENTED)
    # The top level's formats are documented once, under the top level.
    missing = [q for q in missing if not (q.startswith("jinsum.formats.") and f"jinsum.{q.rsplit('.', 1)[1]}" in
                                          DOCUMENTED)]
    assert not missing, f"public names missing from docs/api/*.rst: {missing}"
    stale = sorted(DOCUMENTED - set(PUBLIC))
    assert not stale, f"docs/api/*.rst documents names that are not public: {stale}"


def test_each_object_is_exported_from_one_place():
    homes: dict[int, list[str]] = {}
    for qualified, obj in PUBLIC.items():
        if not isinstance(obj, (str, tuple, int)):
            homes.setdefault(id(obj), []).append(qualified)

    def formats(names):  # the top level's formats, implemented in jinsum.formats
        return len(names) == 2 and {n.rsplit(".", 1)[0] for n in names} == {"jinsum", "jinsum.formats"}

    twice = [sorted(names) for names in homes.values() if len(names) > 1 and not formats(names)]
    assert not twice, f"objects exported under several names (keep one): {twice}"


@pytest.mark.parametrize("qualified", sorted(q for q, o in PUBLIC.items() if not isinstance(o, (str, tuple, int))))
def test_public_names_have_docstrings(qualified):
    obj = PUBLIC[qualified]
    doc = getattr(obj, "__doc__", None)
    assert doc and doc.strip() and doc is not type(obj).__doc__, f"{qualified} has no docstring"

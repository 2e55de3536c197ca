"""The documentation cannot drift from the code: every guide's Python blocks run here, in order, in one namespace
per guide (as a reader pastes them), the docs build with Sphinx with warnings as errors, and every `JINSUM_*`
variable that the code reads is on the settings page."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(path: pathlib.Path) -> list[str]:
    """The ```python blocks of a Markdown page (other fences, such as ```text or ```bash, are not run)."""
    return BLOCK.findall(path.read_text())


@pytest.mark.parametrize("guide", GUIDES + [DOCS / "index.md"], ids=lambda p: p.stem)
def test_guide_code_runs(guide):
    blocks = python_blocks(guide)
    assert blocks, f"{guide.name} has no Python block to run"
    namespace = {"__name__": f"docs_{guide.stem}"}
    for number, code in enumerate(blocks, 1):
        try:
            exec(compile(code, f"{guide.name}, block {number}", "exec"), namespace)  # noqa: S102
        except Exception as error:
            raise AssertionError(f"{guide.name}, block {number} failed:\n{code}") from error


def test_every_environment_variable_is_on_the_settings_page():
    read = set()
    for folder in ("jinsum", "kernels", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            read |= set(re.findall(r"JINSUM_[A-Z0-9_]+", path.read_text()))
    documented = set(re.findall(r"JINSUM_[A-Z0-9_]+", (DOCS / "api" / "settings.rst").read_text()))
    assert read <= documented, f"undocumented on docs/api/settings.rst: {sorted(read - documented)}"


def test_the_docs_build_with_warnings_as_errors(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                             str(tmp_path / "html")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]

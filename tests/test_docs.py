"""The documentation cannot drift from the code: every guide's Python blocks run here, in order, in one namespace
per guide (as a reader pastes them), the docs build with Sphinx with warnings as errors, and every `JINSUM_*`
variable that the code reads is on the settings page."""

from __future__ import annotations

import pathlib
import re
import warnings

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
        assert (ROOT / folder).is_dir(), folder
        for path in (ROOT / folder).rglob("*.py"):
            read |= set(re.findall(r"JINSUM_[A-Z0-9_]+", path.read_text()))
    assert {"JINSUM_TRITON", "JINSUM_FUSE", "JINSUM_SMALL_TERMS"} <= read  # (the search found the settings)
    documented = set(re.findall(r"JINSUM_[A-Z0-9_]+", (DOCS / "api" / "settings.rst").read_text()))
    assert read <= documented, f"undocumented on docs/api/settings.rst: {sorted(read - documented)}"


def test_every_citation_of_design_md_names_one_of_its_sections():
    """Code and docs cite DESIGN.md's sections by title (`DESIGN.md, "Dot plans"`): each title cited exists, so a
    renamed section cannot leave pointers to nowhere."""
    titles = {line.lstrip("#").strip() for line in (ROOT / "DESIGN.md").read_text().splitlines()
              if line.startswith("#")}
    cited = {}
    for folder in ("jinsum", "kernels", "tests", "benchmarks", "examples", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".rst") and "_build" not in path.parts:
                # (a citation may wrap onto the next line of a comment or docstring)
                text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text())
                for title in re.findall(r'DESIGN\.md[,:]? "([^"]+)"', text):
                    cited.setdefault(title, path.relative_to(ROOT).as_posix())
    assert len(cited) > 10, sorted(cited)
    missing = {title: where for title, where in cited.items() if title not in titles}
    assert not missing, f"cited but not a section of DESIGN.md (title: first file citing it): {missing}"


def test_the_docs_build_with_warnings_as_errors(tmp_path, capsys):
    """`make docs`'s build (`sphinx -W --keep-going -q -b html`, no colours in the report), run in this process:
    autodoc finds jinsum imported already, where a second Python would start and import it (and JAX) again."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    from sphinx.cmd.build import build_main  # noqa: PLC0415  (only where Sphinx is installed)

    # Sphinx's and its extensions' deprecations of their own APIs are not the docs' warnings (a separate Python hid
    # them, as it hides every DeprecationWarning raised outside __main__).
    with warnings.catch_warnings():
        for category in (DeprecationWarning, PendingDeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"(sphinx|myst_parser)\.")
        status = build_main(["-W", "--keep-going", "-q", "-N", "-b", "html", str(DOCS), str(tmp_path / "html")])
    assert status == 0, capsys.readouterr().err[-5000:]
    assert (tmp_path / "html" / "index.html").is_file()

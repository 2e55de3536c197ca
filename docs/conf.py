"""Sphinx configuration of jinsum's documentation: `make docs` builds it offline into docs/_build/html, with
warnings as errors. The API reference is autodoc over the docstrings (Google style, read by napoleon); the guides
are MyST Markdown, and their Python blocks run in the tests (tests/test_docs.py)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "jinsum"
author = "jinsum's maintainers"
copyright = "2026, jinsum's maintainers"  # noqa: A001 (Sphinx's name)

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

# Docstrings write code in single backquotes, as Markdown does: render them as code.
default_role = "code"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "jinsum"
html_theme_options = {"description": "Sparse tensor algebra for JAX, fast on GPUs", "fixed_sidebar": True}

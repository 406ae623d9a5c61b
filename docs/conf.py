"""Sphinx configuration: the API reference comes from the docstrings (pinloader's Python modules
and, for the C types, the extension's own docstrings), so the extension must be built first
(``python setup.py build_ext --inplace`` or ``pip install -e .``). The benchmark tables are
generated at build time from the committed JSON in benchmarks/results/ (docs/_bench.py)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the pinloader of this tree, ahead of any installed copy
sys.path.insert(0, str(DOCS))

import pinloader  # noqa: E402

import _bench  # noqa: E402

project = "pinloader"
author = "the pinloader authors"
copyright = "the pinloader authors"
release = version = pinloader.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build", "_generated"]
templates_path: list[str] = []
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_title = f"pinloader {release}"
try:
    import furo  # noqa: F401
    html_theme = "furo"
except ImportError:  # the docs extra brings furo; the built-in theme works too
    html_theme = "alabaster"

autodoc_member_order = "bysource"
# The front doors import their framework at import time; the reference needs none of them, so
# a framework that is not installed is stood in for while the docstrings are read.
autodoc_mock_imports = [m for m in ("torch", "jax", "cupy") if importlib.util.find_spec(m) is None]
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
napoleon_numpy_docstring = True
napoleon_google_docstring = False
# No intersphinx: the build needs no network.
nitpicky = False



def _quote_device_strings(app, what, name, obj, options, lines):
    """Napoleon reads "'cuda:N' or 'cpu'" in a C property's docstring as "type: text"; code
    markup keeps the colon inside a device string from being taken as that separator."""
    if what in ("attribute", "property"):
        lines[:] = [re.sub(r"'([^'\s]*:[^'\s]*)'", r"``'\1'``", line) for line in lines]


def setup(app):
    app.connect("autodoc-process-docstring", _quote_device_strings, priority=100)


_bench.write_tables(ROOT / "benchmarks" / "results" / "h200_2026-12-01", DOCS / "_generated")

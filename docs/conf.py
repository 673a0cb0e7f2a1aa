"""Sphinx configuration of rlkit's site: `make docs` builds it strictly (warnings are errors), offline.

The tutorial notebooks are rendered from copies in docs/notebooks/ that `make test` (or `make docs`) executed
once with nbmake; the build never executes them (nb_execution_mode = "off") and fails when one has no outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent / "_ext")]

project = "rlkit"
author = "the rlkit authors"
copyright = "2026, the rlkit authors"
release = "0.1.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "rlkit_docs",
]
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "BENCHMARKS.md"]  # BENCHMARKS: included by benchmarks.md
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}

# Strict: every reference to rlkit must resolve. Other libraries' names (torch, pandas, builtins) are not linked:
# the site is built offline, without intersphinx inventories.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!rlkit\b).*"), (r"py:.*", r"rlkit\.runtime\.roles\.[RT]")]  # and type variables

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks: render the outputs nbmake produced; never execute here; no widget JavaScript from a CDN (the
# widgets' own HTML fallback shows instead).
nb_execution_mode = "off"
nb_ipywidgets_js = {}
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_merge_streams = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Returns", "params_style")]  # "name: what" lines are names, not types

html_theme = "pydata_sphinx_theme"
html_title = "rlkit"
html_logo = "_static/logo.svg"
html_static_path = ["_static"]
html_css_files = ["rlkit.css"]
html_theme_options = {
    "navbar_end": ["navbar-icon-links"],
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": [],
    "secondary_sidebar_items": ["page-toc"],
}
html_show_sourcelink = False
html_copy_source = False  # the notebooks' sources would double the site's size

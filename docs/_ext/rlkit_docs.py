"""rlkit's Sphinx directives: the settings reference and the API reference, both made from the code.

``.. rlkit-settings:: rlkit.GRPOConfig`` lists every setting of a config, table by table (from
:func:`rlkit.config.fields.settings`); ``:relative-to: rlkit.GRPOConfig`` keeps only what differs from another
config's. ``.. rlkit-api:: rlkit`` documents every name of a module's ``__all__`` with autodoc. A build where a
tutorial notebook has no outputs fails: the site shows notebooks executed once by ``make test`` (nbmake), never
executes them itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

from rlkit.config.fields import Setting, settings


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _parse(directive: SphinxDirective, lines: list[str]) -> list:
    """The nodes of reStructuredText ``lines`` made by ``directive`` (their directives, autodoc's too, run)."""
    holder = nodes.section()
    holder.document = directive.state.document
    source = f"<{directive.name} {directive.arguments[0]}>"
    directive.state.nested_parse(StringList(lines, source=source), 0, holder)
    return holder.children


def _setting_lines(config: str, s: Setting) -> list[str]:
    """A setting's block, with a label to link to, e.g. ``grpoconfig.rollout.temperature``."""
    where = f"{s.table}.{s.name}" if s.table else s.name
    doc = s.doc.splitlines() or ["(no doc)"]
    return [
        f".. _{config.rpartition('.')[2].lower()}.{where}:",
        "",
        f"``{s.name}`` : ``{s.annotation}`` = ``{s.default}``",
        *(f"   {line}" for line in doc),
        "",
    ]


class SettingsDirective(SphinxDirective):
    """Every setting of one config class, grouped by TOML table."""

    required_arguments = 1
    option_spec = {"relative-to": directives.unchanged}

    def run(self) -> list:
        config = _resolve(self.arguments[0])
        shown = settings(config)  # type: ignore[arg-type]
        if "relative-to" in self.options:
            base = {(s.table, s.name, s.default, s.doc) for s in settings(_resolve(self.options["relative-to"]))}
            shown = [s for s in shown if (s.table, s.name, s.default, s.doc) not in base]
        lines: list[str] = []
        for table in dict.fromkeys(s.table for s in shown):
            title = f"``[{table}]``" if table else "Top level"
            lines += [".. rubric:: " + title, "", ".. container:: rlkit-settings", ""]
            for s in (s for s in shown if s.table == table):
                lines += [f"   {line}" if line else "" for line in _setting_lines(self.arguments[0], s)]
        return _parse(self, lines)


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "autoclass"
    return "autofunction" if inspect.isfunction(obj) else "autodata"


def _api_lines(module_name: str, names: list[str] | None = None) -> list[str]:
    """autodoc directives for ``names`` (default ``module_name.__all__``), less what the top-level ``rlkit``
    already documents."""
    module, top = importlib.import_module(module_name), importlib.import_module("rlkit")
    at_top = {id(getattr(top, name)): name for name in top.__all__} if module is not top else {}
    lines: list[str] = []
    for name in names or module.__all__:
        obj = getattr(module, name)
        if id(obj) in at_top:
            lines += [f"``{name}``: see :py:obj:`rlkit.{at_top[id(obj)]}`.", ""]
            continue
        kind = _kind(obj)
        lines += [f".. {kind}:: {module_name}.{name}"]
        if kind == "autoclass":
            lines += ["   :members:", "   :show-inheritance:"]
        lines += [""]
    return lines


class ApiDirective(SphinxDirective):
    """autodoc of every name in a module's ``__all__`` (or of those given as ``:names:``)."""

    required_arguments = 1
    option_spec = {"names": directives.unchanged}

    def run(self) -> list:
        names = self.options["names"].split() if "names" in self.options else None
        return _parse(self, _api_lines(self.arguments[0], names))


_ATTRIBUTES = ("attribute", "data", "property")
_ATTRIBUTE_DOCS: dict[str, list[str]] = {}


def _stash_attribute_doc(app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    if what in _ATTRIBUTES:
        _ATTRIBUTE_DOCS[name] = list(lines)


def _restore_attribute_doc(app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """An attribute's docstring is prose: napoleon would read a first line "text (x): more" as "type: text"."""
    if what in _ATTRIBUTES and name in _ATTRIBUTE_DOCS:
        lines[:] = _ATTRIBUTE_DOCS.pop(name)


PLOTLY = "application/vnd.plotly.v1+json"


def _with_plotly_html(output: dict) -> bool:
    """Put a plotly figure's HTML form (plotly.js inlined: the page fetches nothing) in place of its JSON, which
    myst-nb has no renderer for; True if the output changed."""
    data = output.get("data", {})
    if PLOTLY not in data:
        return False
    import plotly.io

    figure = plotly.io.from_json(json.dumps(data.pop(PLOTLY)))
    data.setdefault("text/html", plotly.io.to_html(figure, include_plotlyjs=True, full_html=False))
    return True


def prepare_notebooks(app: Sphinx) -> None:
    """Fail the build when a tutorial notebook in the site has no outputs (it was never executed); give plotly
    figures an HTML form, which myst-nb renders (it has no renderer of plotly's own type)."""
    folder = Path(app.srcdir) / "notebooks"
    found = sorted(folder.glob("*.ipynb"))
    if not found:
        raise ExtensionError(f"no executed notebooks in {folder}: run `make docs` (it executes them once)")
    notebooks = {path: json.loads(path.read_text()) for path in found}
    bare = [p.name for p, nb in notebooks.items() if not any(c.get("outputs") for c in nb["cells"])]
    if bare:
        raise ExtensionError(f"notebooks without outputs in {folder}: {', '.join(bare)} (execute them: make docs)")
    for path, notebook in notebooks.items():
        changed = [_with_plotly_html(o) for cell in notebook["cells"] for o in cell.get("outputs", [])]
        if any(changed):
            path.write_text(json.dumps(notebook, indent=1))


def use_this_checkouts_widgets() -> None:
    """Document this checkout's widgets/ as ``rlkit.widgets``, even where an editable install of another
    checkout maps the package elsewhere (as tests/conftest.py does)."""
    folder = Path(importlib.import_module("rlkit").__file__).parents[1] / "widgets"  # type: ignore[arg-type]
    spec = importlib.util.spec_from_file_location(
        "rlkit.widgets", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlkit.widgets"] = module
    spec.loader.exec_module(module)


def setup(app: Sphinx) -> dict:
    use_this_checkouts_widgets()
    app.add_directive("rlkit-settings", SettingsDirective)
    app.add_directive("rlkit-api", ApiDirective)
    app.connect("builder-inited", prepare_notebooks)
    app.connect("autodoc-process-docstring", _stash_attribute_doc, priority=400)  # before napoleon (500)
    app.connect("autodoc-process-docstring", _restore_attribute_doc, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

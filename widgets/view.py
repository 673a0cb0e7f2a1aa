"""What every view shares: plotly figures, a static HTML/text summary, a live widget and a self-contained export.

A view is built from recorded diagnostics data (no cluster needed) and shown three ways:

- in a kernel with a widget front end, as a widget (figures drawn by plotly's own JupyterLab renderer,
  which ships with the plotly package: nothing is fetched);
- anywhere else (nbconvert, GitHub, a console), as its ``text/html`` summary (plain tables, no script)
  or ``text/plain``;
- as a file: :meth:`View.to_html` writes one page with plotly.js inlined, which opens offline.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

PLOTLY_MIME = "application/vnd.plotly.v1+json"

STYLE = """
.rlkit-view table{border-collapse:collapse;font-size:12px;margin:4px 0}
.rlkit-view th,.rlkit-view td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
.rlkit-view .flag{color:#b00020;font-weight:bold}
.rlkit-view .ok{color:#137333}
.rlkit-view .note{color:#555}
"""


class View:
    """Base of the views: subclasses give ``title``, :meth:`figures`, :meth:`summary_html` and :meth:`summary_text`."""

    title = ""

    _box = None  # the live widget, built on first use

    def figures(self) -> list:
        """The plotly figures of this view (may be empty)."""
        return []

    def summary_html(self) -> str:
        """The view's facts as script-free HTML (tables, flags)."""
        raise NotImplementedError

    def summary_text(self) -> str:
        """The view's facts as plain text."""
        raise NotImplementedError

    def export_html(self) -> str:
        """What :meth:`to_html` writes below the figures: the summary by default."""
        return self.summary_html()

    def controls(self) -> list:
        """Widgets shown above the figures (paging, choices); none by default."""
        return []

    def __str__(self) -> str:
        return self.summary_text()

    # -- display ----------------------------------------------------------------------------------

    def static_html(self) -> str:
        """The ``text/html`` fallback: title and summary, no script, nothing fetched."""
        title = html.escape(self.title)
        return f'<div class="rlkit-view"><style>{STYLE}</style><h4>{title}</h4>{self.summary_html()}</div>'

    def widget(self):
        """The live ipywidgets view (built once; :meth:`refresh` redraws it)."""
        import ipywidgets as w

        if self._box is None:
            self._summary_widget = w.HTML()
            self._box = w.VBox([*self.controls(), self._summary_widget], layout=w.Layout(width="100%"))
            self.refresh()
        return self._box

    def refresh(self) -> None:
        """Redraw the live widget from the view's current data (no-op before :meth:`widget`); thread-safe to call."""
        if self._box is None:
            return
        import ipywidgets as w

        figures = self.figures()
        plots = [c for c in self._box.children if isinstance(c, w.Output)]
        if len(plots) != len(figures):
            plots = [w.Output() for _ in figures]
            self._box.children = [*self.controls(), *plots, self._summary_widget]
        for out, fig in zip(plots, figures, strict=True):
            out.outputs = (figure_output(fig),)
        self._summary_widget.value = f'<div class="rlkit-view"><style>{STYLE}</style>{self.summary_html()}</div>'

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        bundle = {}
        try:
            bundle.update(self.widget()._repr_mimebundle_())
        except ImportError:  # no ipywidgets: the static fallbacks below
            pass
        bundle.update({"text/html": self.static_html(), "text/plain": self.summary_text()})
        return bundle

    def to_html(self, path: str | Path) -> Path:
        """Write this view as one self-contained HTML file (plotly.js inlined: opens offline); returns its path."""
        return write_page(path, self.title, [self])


def figure_output(fig) -> dict:
    """A display_data output drawing ``fig`` with the plotly mime renderer (text/plain where there is none)."""
    data = json.loads(fig.to_json())
    title = fig.layout.title.text or "plotly figure"
    return {"output_type": "display_data", "data": {PLOTLY_MIME: data, "text/plain": f"<{title}>"}, "metadata": {}}


def write_page(path: str | Path, title: str, views: Sequence[View]) -> Path:
    """Write ``views`` (figures and summaries) into one HTML page with plotly.js inlined once; returns its path."""
    from plotly.offline import get_plotlyjs

    sections = []
    for view in views:
        figures = "".join(f.to_html(full_html=False, include_plotlyjs=False) for f in view.figures())
        sections.append(f"<section><h2>{html.escape(view.title)}</h2>{figures}{view.export_html()}</section>")
    page = (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>body{{font-family:sans-serif;margin:2em}}{STYLE}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head>'
        f'<body class="rlkit-view"><h1>{html.escape(title)}</h1>{"".join(sections)}</body></html>\n'
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


def table_html(df: pd.DataFrame, *, digits: int = 4) -> str:
    """A DataFrame as a plain HTML table (values escaped, floats to ``digits`` significant digits)."""
    return df.to_html(index=False, border=0, float_format=lambda v: f"{v:.{digits}g}", na_rep="")


def table_text(df: pd.DataFrame, *, digits: int = 4) -> str:
    return df.to_string(index=False, float_format=lambda v: f"{v:.{digits}g}")

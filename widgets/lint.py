"""LintView: FSDP lint findings (id, severity, ranks, what is wrong, evidence, fix) as a table, errors first."""

from __future__ import annotations

import html

from rlkit.diagnostics import Findings
from rlkit.widgets.view import View

SEVERITY_COLORS = {"error": "#b00020", "warning": "#b26a00"}


class LintView(View):
    """The findings of :func:`rlkit.diagnostics.lint` (or ``trainer.lint()``)."""

    title = "FSDP lint"

    def __init__(self, findings: Findings):
        self.findings = findings

    @classmethod
    def from_trainer(cls, trainer) -> LintView:
        return cls(trainer.lint())

    def update(self, findings: Findings) -> None:
        self.findings = findings
        self.refresh()

    def counts(self) -> dict[str, int]:
        """Findings per severity."""
        return {s: sum(f.severity == s for f in self.findings) for s in SEVERITY_COLORS}

    def summary_html(self) -> str:
        if not len(self.findings):
            return '<p class="ok">No findings: none of the classic FSDP mistakes was found.</p>'
        counts = ", ".join(f"{n} {s}(s)" for s, n in self.counts().items() if n)
        rows = []
        for f in self.findings:
            color = SEVERITY_COLORS.get(f.severity, "#333")
            badge = f'<span style="color:white;background:{color};padding:0 4px;border-radius:3px">{f.severity}</span>'
            cells = [badge, f"<code>{html.escape(f.id)}</code>", ", ".join(map(str, f.ranks)),
                     html.escape(f.message), html.escape(f.evidence), html.escape(f.fix)]
            rows.append(f'<tr class="finding-{f.severity}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        head = "".join(f"<th>{h}</th>" for h in ("severity", "id", "ranks", "what is wrong", "evidence", "fix"))
        return f'<p class="flag">{counts}</p><table><tr>{head}</tr>{"".join(rows)}</table>'

    def summary_text(self) -> str:
        return str(self.findings)

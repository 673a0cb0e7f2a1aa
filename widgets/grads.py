"""GradNormView: each rank's local gradient norm per unit against the true global norm; disagreements flagged."""

from __future__ import annotations

import html

from rlkit.diagnostics import GradNorms
from rlkit.widgets.view import View, table_html, table_text

FLAG = "#d62728"
OK = "#1f77b4"
NONE_YET = "no update yet: gradient norms are recorded by each optimizer step"


class GradNormView(View):
    """Per-unit local norms of every rank next to the unit's global norm, and each rank's reported global norm
    against the true one. Ranks named in ``norms.mismatches`` (loss, global norm or replicated tensors that
    disagree) are drawn red and listed."""

    title = "gradient norms"

    def __init__(self, norms: GradNorms | None):
        self.norms = norms

    @classmethod
    def from_trainer(cls, trainer) -> GradNormView:
        return cls(trainer.grad_norms())

    def update(self, norms: GradNorms | None) -> None:
        self.norms = norms
        self.refresh()

    @property
    def flagged(self) -> list[int]:
        """Ranks with at least one mismatch."""
        return [] if self.norms is None else sorted({int(r) for r in self.norms.mismatches["rank"]})

    def figures(self) -> list:
        if self.norms is None:
            return []
        import plotly.graph_objects as go

        units, ranks, flagged = self.norms.units, self.norms.ranks, self.flagged
        per_unit = go.Figure()
        for r in ranks["rank"]:
            bad = r in flagged
            per_unit.add_trace(
                go.Bar(
                    x=units["unit"],
                    y=units[f"rank{r}"],
                    name=f"rank {r}" + (" (mismatch)" if bad else ""),
                    marker_line={"color": FLAG if bad else "white", "width": 3 if bad else 0},
                )
            )
        per_unit.add_trace(
            go.Scatter(
                x=units["unit"],
                y=units["global"],
                name="global",
                mode="markers",
                marker={"symbol": "diamond", "size": 11, "color": "black"},
            )
        )
        per_unit.update_layout(
            title="gradient norm per unit: each rank's local part and the global norm",
            barmode="group",
            yaxis_title="L2 norm",
            height=340,
            margin={"t": 40},
        )
        reported = ranks["reported_norm"].fillna(ranks["local_norm"])
        colors = [
            FLAG if (r in flagged or not ok) else OK for r, ok in zip(ranks["rank"], ranks["norm_ok"], strict=True)
        ]
        per_rank = go.Figure(
            go.Bar(x=[f"rank {r}" for r in ranks["rank"]], y=reported, marker_color=colors, name="reported global norm")
        )
        per_rank.add_hline(
            y=self.norms.global_norm,
            line={"dash": "dash", "color": "black"},
            annotation_text=f"true global norm {self.norms.global_norm:.6g}",
        )
        per_rank.update_layout(
            title="global norm each rank used against the true one", yaxis_title="L2 norm", height=300, margin={"t": 40}
        )
        return [per_unit, per_rank]

    def summary_html(self) -> str:
        if self.norms is None:
            return f'<p class="note">{NONE_YET}</p>'
        head = f"True global gradient norm {self.norms.global_norm:.6g}; "
        if self.norms.ok:
            status = f'<p class="ok">{html.escape(head)}all ranks agree.</p>'
        else:
            status = (
                f'<p class="flag">{html.escape(head)}{len(self.norms.mismatches)} disagreement(s) on rank(s) '
                f"{', '.join(map(str, self.flagged))}:</p>" + table_html(self.norms.mismatches)
            )
        return status + table_html(self.norms.ranks, digits=6) + table_html(self.norms.units, digits=6)

    def summary_text(self) -> str:
        if self.norms is None:
            return f"gradient norms: {NONE_YET}"
        lines = [
            f"gradient norms: true global norm {self.norms.global_norm:.6g}; "
            + ("all ranks agree" if self.norms.ok else f"MISMATCH on rank(s) {self.flagged}")
        ]
        if not self.norms.ok:
            lines.append(table_text(self.norms.mismatches))
        lines.append(table_text(self.norms.ranks, digits=6))
        return "\n".join(lines)

"""FSDP lint: the classic FSDP1 / FSDP2 mistakes, found in the per-rank reports of :func:`inspect`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import pandas as pd

from rlkit.diagnostics import rules
from rlkit.diagnostics.inspection import RankReport

SEVERITIES = ("error", "warning")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem: what is wrong, the evidence, and the fix."""

    id: str
    """Stable identifier, e.g. "optimizer-before-wrap"."""
    severity: str
    """"error" (training is wrong or will fail) or "warning" (it works, but wastes memory or hides something)."""
    message: str
    evidence: str
    fix: str
    ranks: tuple[int, ...]
    """The ranks where it was found."""


@dataclass
class Findings:
    """The lint result: a list of :class:`Finding`, errors first. Empty means nothing was found."""

    items: list[Finding]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    @property
    def ids(self) -> list[str]:
        return [f.id for f in self.items]

    def to_pandas(self) -> pd.DataFrame:
        return pd.DataFrame([asdict(f) for f in self.items], columns=list(Finding.__dataclass_fields__))

    def __str__(self) -> str:
        if not self.items:
            return "FSDP lint: no findings"
        blocks = [
            f"[{f.severity}] {f.id} (ranks {', '.join(map(str, f.ranks))})\n  {f.message}\n"
            f"  evidence: {f.evidence}\n  fix: {f.fix}"
            for f in self.items
        ]
        return f"FSDP lint: {len(self.items)} finding(s)\n" + "\n".join(blocks)


def lint(reports: Sequence[RankReport]) -> Findings:
    """Run every rule over the reports of all ranks (one :class:`RankReport` per rank, any order)."""
    reports = sorted(reports, key=lambda r: r.rank)
    found: dict[tuple[str, str], dict] = {}
    for report in reports:
        for rule in rules.PER_RANK:
            for item in rule(report):
                _merge(found, item, report.rank)
    for across in rules.ACROSS_RANKS:
        for item in across(reports):
            _merge(found, item, None)
    items = [Finding(**{**v, "ranks": tuple(v["ranks"])}) for v in found.values()]
    return Findings(sorted(items, key=lambda f: SEVERITIES.index(f.severity)))


def _merge(found: dict, item: rules.Raw, rank: int | None) -> None:
    """The same finding on several ranks becomes one, listing the ranks (evidence: the first rank's)."""
    entry = found.setdefault((item.id, item.message), {**item._asdict(), "ranks": []})
    ranks = item.ranks if rank is None else (rank,)
    entry["ranks"] += [r for r in ranks if r not in entry["ranks"]]

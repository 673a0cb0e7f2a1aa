"""RolloutView: a step's samples page by page, completion tokens coloured by advantage, mismatch, log-prob gap or
log-prob, and the tokens where engine and trainer disagree most."""

from __future__ import annotations

import html
import math
from collections.abc import Callable

import torch

from rlkit.data.batch import Batch
from rlkit.widgets.view import View

COLOURINGS = ("advantage", "logprob_gap", "mismatch", "logprob")
GAP_FULL = 1.0
"""A trainer-vs-engine log-prob gap of this many nats or more is drawn fully red (healthy runs: < 1e-3)."""
OBSERVATION_STYLE = "background:#e8e8e8;color:#666;white-space:pre"
"""How a trajectory's observation tokens (attended to, not the model's, not trained on) are drawn."""
LOGPROB_FULL = 5.0
"""A token log-prob of minus this or lower (p < 0.7%) is drawn fully red."""
TOP_TOKENS = 8
"""How many of the most mismatched tokens the view lists."""
LEGENDS = {
    "advantage": "green: positive advantage, red: negative (deeper: larger, relative to the batch's largest)",
    "mismatch": "red: the trainer gives the token more probability than the engine did (delta = trainer - engine "
    "log-prob > 0), blue: less (deeper: larger, relative to the batch's largest |delta|)",
    "logprob_gap": f"red: |trainer - engine| log-prob of the token (full at {GAP_FULL:g} nat; healthy runs stay white)",
    "logprob": f"red: unlikely tokens under the rollout engine (full at log-prob -{LOGPROB_FULL:g})",
}


def token_rgba(value: float, colouring: str, scale: float) -> str:
    """The background of a token: green/red by sign for advantages, red/blue by sign for the mismatch (both relative
    to ``scale``), red for large gaps and unlikely tokens (absolute scales :data:`GAP_FULL`, :data:`LOGPROB_FULL`)."""
    if not math.isfinite(value):  # no engine log-prob for this row
        return "rgba(0,0,0,0.00)"
    if colouring in ("advantage", "mismatch"):
        alpha = min(1.0, abs(value) / scale) * 0.6 if scale > 0 else 0.0
        if colouring == "mismatch":
            return f"rgba(210,0,0,{alpha:.2f})" if value >= 0 else f"rgba(0,70,220,{alpha:.2f})"
        return f"rgba(0,150,0,{alpha:.2f})" if value >= 0 else f"rgba(210,0,0,{alpha:.2f})"
    full = GAP_FULL if colouring == "logprob_gap" else LOGPROB_FULL
    size = value if colouring == "logprob_gap" else -value
    return f"rgba(210,0,0,{min(1.0, max(size, 0.0) / full) * 0.6:.2f})"


class RolloutView(View):
    """The samples of a :class:`~rlkit.data.batch.Batch` (``trainer.last_batch``): prompt, completion tokens coloured
    by ``colouring`` (see :data:`COLOURINGS`), reward terms, reward, advantage, finish reason, largest log-prob gap.

    ``decode(token_id) -> str`` shows tokens as text (default: the ids). The figure shows each prompt group's rewards:
    a group whose samples all got the same reward has zero advantage and teaches nothing.
    """

    title = "rollouts"

    def __init__(
        self,
        batch: Batch | None,
        decode: Callable[[int], str] | None = None,
        *,
        colouring: str | None = None,
        page_size: int = 8,
    ):
        if colouring is not None and colouring not in COLOURINGS:
            raise ValueError(f"colouring={colouring!r}: must be one of {COLOURINGS}")
        self.batch = batch
        self.decode = decode or str
        self.colouring = colouring
        self.page_size = page_size
        self.page = 0
        self._controls: list | None = None

    @classmethod
    def from_trainer(cls, trainer, **kwargs) -> RolloutView:
        return cls(trainer.last_batch, lambda i: trainer.tokenizer.decode([i]), **kwargs)

    def update(self, batch: Batch | None) -> None:
        self.batch = batch
        self.page = min(self.page, self.pages - 1)
        self.refresh()

    # -- data ---------------------------------------------------------------------------------------

    def _shown(self) -> Batch:
        """The batch on display (the views that draw samples are only drawn when there is one)."""
        if self.batch is None:
            raise ValueError("no batch to show: run a step first")
        return self.batch

    @property
    def pages(self) -> int:
        return 1 if self.batch is None else max(1, math.ceil(len(self.batch) / self.page_size))

    def available(self) -> list[str]:
        """The colourings this batch has data for."""
        b = self.batch
        if b is None:
            return []
        scored = b.old_logprobs is not None
        have = {"advantage": b.advantages is not None, "mismatch": scored, "logprob_gap": scored, "logprob": True}
        return [c for c in COLOURINGS if have[c]]

    def current_colouring(self) -> str | None:
        options = self.available()
        if self.colouring in options:
            return self.colouring
        return options[0] if options else None

    def token_values(self, colouring: str) -> torch.Tensor:
        """[B, T] the value each response token is coloured by."""
        b = self._shown()
        if colouring == "advantage":
            assert b.advantages is not None, "no advantages to colour by yet"
            adv = b.advantages.float()
            return adv[:, None].expand_as(b.response_mask) if adv.dim() == 1 else adv
        if colouring == "mismatch" and b.old_logprobs is not None:
            return torch.where(b.engine_checked(), b.old_logprobs - b.rollout_logprobs, torch.nan)
        gap = b.logprob_gap_tokens()
        if colouring == "logprob_gap" and gap is not None:
            return gap
        return b.rollout_logprobs

    def top_mismatched(self, count: int = TOP_TOKENS) -> list[dict[str, object]]:
        """The ``count`` response tokens with the largest ``|trainer - engine|`` log-prob: sample, position, token,
        engine and trainer log-probs, delta and ratio (empty before the trainer scored the rollout)."""
        b = self._shown()
        if b.old_logprobs is None:
            return []
        delta = torch.where(b.engine_checked(), b.old_logprobs - b.rollout_logprobs, torch.nan)
        flat = delta.abs().nan_to_num(-1.0).flatten()
        ids = b.input_ids[:, b.prompt_length :]
        width = delta.shape[1]
        out = []
        for index in flat.argsort(descending=True)[:count].tolist():
            i, t = divmod(index, width)
            if flat[index] < 0:
                break
            d = float(delta[i, t])
            out.append({"sample": i, "position": t, "token": self.decode(int(ids[i, t])),
                        "engine": float(b.rollout_logprobs[i, t]), "trainer": float(b.old_logprobs[i, t]),
                        "delta": d, "ratio": math.exp(max(min(d, 20.0), -20.0))})  # fmt: skip
        return out

    def top_html(self) -> str:
        """The :meth:`top_mismatched` tokens as a table (nothing before the trainer scored the rollout)."""
        top = self.top_mismatched()
        if not top:
            return ""
        head = "".join(f"<th>{h}</th>" for h in ("sample", "position", "token", "engine", "trainer", "delta", "ratio"))
        rows = "".join(
            f"<tr><td>{r['sample']}</td><td>{r['position']}</td><td>{html.escape(repr(r['token']))}</td>"
            f"<td>{r['engine']:.4g}</td><td>{r['trainer']:.4g}</td><td>{r['delta']:.3g}</td><td>{r['ratio']:.4g}</td></tr>"
            for r in top
        )
        return f"<p>Most mismatched tokens (trainer vs engine log-prob):</p><table><tr>{head}</tr>{rows}</table>"

    # -- rendering ----------------------------------------------------------------------------------

    def tokens_html(self, i: int, values: torch.Tensor, colouring: str, scale: float) -> str:
        """Sample ``i``'s completion as coloured spans; each span's title gives the token and its value (a trajectory's
        observation tokens grey)."""
        b = self._shown()
        ids = b.input_ids[i, b.prompt_length :]
        spans = []
        for t in range(int(b.trajectory_lengths[i])):
            text, value = self.decode(int(ids[t])), float(values[i, t])
            if not b.response_mask[i, t]:  # a trajectory's observation token: attended, not the model's
                spans.append(f'<span style="{OBSERVATION_STYLE}">{html.escape(text)}</span>')
                continue
            spans.append(
                f'<span title="{html.escape(repr(text))} {colouring} {value:.4g}" '
                f'style="background:{token_rgba(value, colouring, scale)};white-space:pre">'
                f"{html.escape(text) or '&#9251;'}</span>"
            )
        return "".join(spans)

    def rows_html(self, indices: range) -> str:
        b, colouring = self._shown(), self.current_colouring() or "logprob"
        values = self.token_values(colouring)
        scale = float(values.abs().nan_to_num(0.0).max()) if colouring in ("advantage", "mismatch") else 0.0
        gaps = b.logprob_gap()
        terms = list(b.reward_terms)
        head = [
            "#",
            "rank",
            "group",
            "prompt",
            f"completion (coloured by {colouring})",
            *terms,
            "reward",
            "advantage",
            "finish",
            "max gap",
        ]
        rows = []
        for i in indices:
            cells = [
                str(i),
                "" if b.rank is None else str(int(b.rank[i])),
                str(int(b.group[i])),
                html.escape(b.prompts[i]),
                self.tokens_html(i, values, colouring, scale),
                *(f"{float(b.reward_terms[t][i]):.4g}" for t in terms),
                "" if b.rewards is None else f"{float(b.rewards[i]):.4g}",
                "" if b.advantages is None else f"{float(b.advantages[i].float().mean()):.4g}",
                b.finish_reason[i],
                "" if gaps is None else f"{float(gaps[i]):.3g}",
            ]
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"

    def _page_indices(self) -> range:
        start = self.page * self.page_size
        return range(start, min(start + self.page_size, len(self._shown())))

    def _headline(self) -> str:
        b = self._shown()
        parts = [f"{len(b)} samples in {len(set(b.group.tolist()))} group(s)"]
        if b.rewards is not None:
            parts.append(f"mean reward {float(b.rewards.mean()):.4g}")
            parts.append(f"{len(self.silent_groups())} group(s) with one reward for all samples (no signal)")
        gaps = b.logprob_gap()
        if gaps is not None:
            parts.append(f"largest trainer-vs-engine log-prob gap {float(gaps.max()):.3g}")
        return "; ".join(parts)

    def silent_groups(self) -> list[int]:
        """Prompt groups whose samples all got the same reward (their advantages are zero)."""
        b = self._shown()
        rewards = b.rewards
        if rewards is None:
            return []
        return sorted(int(g) for g in b.group.unique() if rewards[b.group == g].unique().numel() == 1)

    def summary_html(self) -> str:
        if self.batch is None:
            return '<p class="note">no rollout yet</p>'
        return (
            f"<p>{html.escape(self._headline())}. Page {self.page + 1} of {self.pages}.</p>"
            + self._legend()
            + self.rows_html(self._page_indices())
            + self.top_html()
        )

    def export_html(self) -> str:
        if self.batch is None:
            return self.summary_html()
        body = self._legend() + self.rows_html(range(len(self.batch))) + self.top_html()
        return f"<p>{html.escape(self._headline())}.</p>" + body

    def _legend(self) -> str:
        legend = html.escape(LEGENDS[self.current_colouring() or "logprob"])
        return f'<p class="note">Tokens: {legend}; hover a token for its value.</p>'

    def summary_text(self) -> str:
        if self.batch is None:
            return "rollouts: none yet"
        table = self.batch.to_pandas().iloc[list(self._page_indices())]
        columns = [c for c in ("group", "prompt", "completion", "reward", "advantage", "finish_reason") if c in table]
        return f"rollouts: {self._headline()}\n{table[columns].to_string()}"

    def figures(self) -> list:
        b = self.batch
        if b is None or b.rewards is None:
            return []
        import plotly.graph_objects as go

        fig = go.Figure(
            go.Box(
                x=b.group.tolist(),
                y=b.rewards.tolist(),
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
                name="reward",
                text=[c[:40] for c in b.completions],
            )
        )
        fig.update_layout(
            title="rewards per prompt group", xaxis_title="group", yaxis_title="reward", height=300, margin={"t": 40}
        )
        return [fig]

    # -- widget controls ----------------------------------------------------------------------------

    def controls(self) -> list:
        if self._controls is None:
            import ipywidgets as w

            colour = w.Dropdown(
                options=COLOURINGS, value=self.current_colouring() or COLOURINGS[0], description="colour by"
            )
            prev, nxt = (
                w.Button(description="◀", layout={"width": "40px"}),
                w.Button(description="▶", layout={"width": "40px"}),
            )
            colour.observe(lambda change: self._set(colouring=change["new"]), names="value")
            prev.on_click(lambda _: self._set(page=self.page - 1))
            nxt.on_click(lambda _: self._set(page=self.page + 1))
            self._controls = [w.HBox([colour, prev, nxt])]
        return self._controls

    def _set(self, *, page: int | None = None, colouring: str | None = None) -> None:
        if page is not None:
            self.page = max(0, min(page, self.pages - 1))
        if colouring is not None:
            self.colouring = colouring
        self.refresh()

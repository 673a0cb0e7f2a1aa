"""TrajectoryView: a multi-turn step's trajectories turn by turn, as the trainer saw them.

Each model turn's tokens are coloured like the rollout view's (by advantage, log-prob gap or log-prob);
the observation tokens between turns (tool results, the environment's replies), which the model attends
to but is not trained on, are grey. Beside each turn: its tool calls with their arguments, status and
result, the environment's reward, how the turn ended, and the turn's mean trainer-vs-engine log-prob gap.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable

import torch

from rlkit.data.batch import Batch
from rlkit.data.trajectories import Turn
from rlkit.widgets.rollouts import COLOURINGS, OBSERVATION_STYLE, RolloutView, token_rgba

STATUS_CLASS = {"ok": "ok", "not_run": ""}
"""The CSS class of a tool call's status (every other status is flagged; "not_run" is no failure: its result could
never have been shown)."""


def turns_html(
    batch: Batch, i: int, values: torch.Tensor, colouring: str, scale: float, decode: Callable[[int], str]
) -> str:
    """Trajectory ``i`` as a table with a row per turn: its tokens (model: coloured; observation: grey), calls,
    environment reward, how it ended and its mean log-prob gap; an environment's opening (its first observation
    and the generation prompt) first."""
    assert batch.trajectories is not None
    trajectory = batch.trajectories[i]
    gap = batch.logprob_gap_tokens()
    ids = batch.input_ids[i, batch.prompt_length :]
    rows = []
    opening = trajectory.turns[0].start if trajectory.turns else 0
    if opening:
        grey = "".join(f'<span style="{OBSERVATION_STYLE}">{html.escape(decode(int(ids[t])))}</span>'
                       for t in range(opening))  # fmt: skip
        rows.append(f'<tr><td></td><td style="text-align:left">{grey}</td><td></td><td></td><td>opening</td>'
                    "<td></td></tr>")  # fmt: skip
    for turn in trajectory.turns:
        model = "".join(_token(decode(int(ids[t])), float(values[i, t]), colouring, scale)
                        for t in range(turn.start, turn.end))  # fmt: skip
        observation = "".join(
            f'<span style="{OBSERVATION_STYLE}">{html.escape(decode(int(ids[t])))}</span>'
            for t in range(turn.end, turn.observation_end)
        )
        gap_mean = _turn_gap(batch, gap, i, turn)
        rows.append(
            f'<tr><td>{turn.index}</td><td style="text-align:left">{model}{observation}</td>'
            f'<td style="text-align:left">{_calls_html(turn)}</td>'

            f"<td>{turn.reward:.4g}</td><td>{html.escape(turn.finish)}</td>"
            f"<td>{'' if math.isnan(gap_mean) else f'{gap_mean:.3g}'}</td></tr>"
        )
    head = "".join(f"<th>{h}</th>" for h in ("turn", "tokens (grey: observation)", "tool calls", "env reward",
                                             "ended", "gap"))  # fmt: skip
    notes = []
    if trajectory.error:
        notes.append(f'<p class="flag">{html.escape(trajectory.error)}</p>')
    if trajectory.drift:
        notes.append(f'<p class="flag">template drift: {html.escape(trajectory.drift)}</p>')
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>{''.join(notes)}"


def _token(text: str, value: float, colouring: str, scale: float) -> str:
    """A model token as a span coloured by its value; the title gives the token and the value."""
    return (f'<span title="{html.escape(repr(text))} {colouring} {value:.4g}" '
            f'style="background:{token_rgba(value, colouring, scale)};white-space:pre">'
            f"{html.escape(text) or '&#9251;'}</span>")  # fmt: skip


def _calls_html(turn: Turn) -> str:
    """Each call as ``name(arguments) -> result`` with its status (failures flagged)."""
    lines = []
    for call in turn.calls:
        args = "" if call.arguments is None else ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
        status = f'<span class="{STATUS_CLASS.get(call.status, "flag")}">{call.status}</span>'
        lines.append(f"{html.escape(call.name or '?')}({html.escape(args)}) &rarr; {html.escape(call.result)} {status}")
    return "<br>".join(lines)


def _turn_gap(batch: Batch, gap: torch.Tensor | None, i: int, turn: Turn) -> float:
    """The mean |trainer - engine| log-prob over the turn's checked model tokens (NaN before the trainer's pass)."""
    if gap is None:
        return math.nan
    checked = batch.engine_checked()[i, turn.start : turn.end]
    return float(gap[i, turn.start : turn.end][checked].mean()) if checked.any() else math.nan


class TrajectoryView(RolloutView):
    """The trajectories of a multi-turn :class:`~rlkit.data.batch.Batch` (``trainer.last_batch`` or
    ``trainer.rollout()``), a few per page: each one's reward, advantage and finish reason, then its turns
    (see :func:`turns_html`). ``colouring`` is one of ``rlkit.widgets.rollouts.COLOURINGS``."""

    title = "trajectories"

    def __init__(
        self,
        batch: Batch | None,
        decode: Callable[[int], str] | None = None,
        *,
        colouring: str | None = None,
        page_size: int = 4,
    ):
        if batch is not None and batch.trajectories is None:
            raise ValueError("this batch holds single-turn completions: show it with RolloutView")
        super().__init__(batch, decode, colouring=colouring, page_size=page_size)

    def rows_html(self, indices: range) -> str:
        b, colouring = self._shown(), self.current_colouring() or COLOURINGS[-1]
        values = self.token_values(colouring)
        scale = float(values.abs().max()) if colouring == "advantage" else 0.0
        assert b.trajectories is not None
        blocks = []
        for i in indices:
            trajectory = b.trajectories[i]
            facts = [f"trajectory {i}", f"group {int(b.group[i])}", f"{len(trajectory.turns)} turn(s)",
                     f"{trajectory.tool_calls} tool call(s)", f"finish: {trajectory.finish_reason}"]  # fmt: skip
            if b.rewards is not None:
                facts.append(f"reward {float(b.rewards[i]):.4g}")
            if b.advantages is not None:
                model = b.response_mask[i] > 0
                facts.append(f"advantage {float(b.advantages[i][model].mean()) if model.any() else 0.0:.4g}")
            blocks.append(
                f"<h5>{html.escape(' · '.join(facts))}</h5><p>{html.escape(b.prompts[i])}</p>"
                + turns_html(b, i, values, colouring, scale, self.decode)
            )
        return "".join(blocks)

    def _legend(self) -> str:
        return super()._legend().replace("</p>", "; grey: observation tokens (attended, not trained on).</p>")

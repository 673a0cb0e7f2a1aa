"""The views built from recorded diagnostics data: what each shows (traces, values, flags), its static fallbacks,
the offline export, and that ``import rlkit`` stays free of Jupyter."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch

pytest.importorskip("ipywidgets")

from rlkit import diagnostics as dx
from rlkit.data.batch import Batch
from rlkit.diagnostics.grads import GradEntry
from rlkit.diagnostics.lint import Finding, Findings
from rlkit.diagnostics.memory import MiB
from rlkit.widgets import GradNormView, LintView, MemoryView, RolloutView, ShardingView, TrainingView
from rlkit.widgets.rollouts import token_rgba
from rlkit.widgets.runner import Throttle
from rlkit.widgets.view import PLOTLY_MIME

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


# -- recorded data ----------------------------------------------------------------------------------


def param(rank, name, unit, global_shape, local_shape, nbytes):
    return {
        "rank": rank,
        "name": name,
        "unit": unit,
        "global_shape": global_shape,
        "dtype": "float32",
        "local_shape": local_shape,
        "local_numel": nbytes // 4,
        "local_bytes": nbytes,
        "device": "cpu",
        "requires_grad": True,
        "shards": 2 if unit is not None else 1,
        "shard_index": rank if unit else 0,
        "grad_bytes": nbytes,
        "optim_bytes": 2 * nbytes,
        "replaced": False,
        "replacement_shape": None,
    }


def sharding(unwrapped: bool) -> dx.Sharding:
    """Two ranks, FSDP2: a root unit (norm) and layers.0 (w: 8x4 split in 2); optionally head.w left unwrapped."""
    params = []
    for r in (0, 1):
        params += [param(r, "norm.weight", "", (4,), (2,), 8), param(r, "layers.0.w", "layers.0", (8, 4), (4, 4), 64)]
        if unwrapped:
            params.append(param(r, "head.w", None, (3, 4), (3, 4), 48))
    units = pd.DataFrame(
        [
            {
                "name": "(root)",
                "api": "FSDP2",
                "strategy": "FULL_SHARD",
                "shard_size": 2,
                "params": 1,
                "numel": 4,
                "rank0_mb": 8 / MiB,
                "rank1_mb": 8 / MiB,
            },
            {
                "name": "layers.0",
                "api": "FSDP2",
                "strategy": "FULL_SHARD",
                "shard_size": 2,
                "params": 1,
                "numel": 32,
                "rank0_mb": 64 / MiB,
                "rank1_mb": 64 / MiB,
            },
        ]
    )
    scaling = pd.DataFrame(
        [
            {
                "world_size": 1,
                "source": "whole model",
                "parameters_mb": 1.0,
                "gradients_mb": 1.0,
                "optimizer_mb": 2.0,
                "per_rank_mb": 4.0,
                "ideal_mb": 4.0,
                "vs_ideal": 1.0,
            },
            {
                "world_size": 2,
                "source": "measured",
                "parameters_mb": 0.6,
                "gradients_mb": 0.6,
                "optimizer_mb": 1.2,
                "per_rank_mb": 2.4,
                "ideal_mb": 2.0,
                "vs_ideal": 1.2,
            },
        ]
    )
    totals = pd.DataFrame([{"rank": r, "role": "model", "tensors": 2, "parameters_mb": 1.0} for r in (0, 1)])
    return dx.Sharding(
        params=pd.DataFrame(params),
        units=units,
        totals=totals,
        unwrapped=["head.w"] if unwrapped else [],
        scaling=scaling,
    )


def marks(steps=(1, 2), *, gpu: bool = False) -> pd.DataFrame:
    """Per-rank marks of two phases per step; parameters 10 + rank MiB, other grows by 1 MiB a step."""
    rows = []
    for step in steps:
        for rank in (0, 1):
            for i, phase in enumerate(("rollout", "optimizer_step")):
                parts = {
                    "parameters_mb": 10.0 + rank,
                    "gradients_mb": 5.0 * i,
                    "optimizer_mb": 20.0 * i,
                    "engine_mb": 7.0,
                    "other_mb": 100.0 + step,
                }
                total = sum(parts.values())
                rows.append(
                    {
                        "step": step,
                        "rank": rank,
                        "index": i,
                        "phase": phase,
                        "rss_mb": total + 300,
                        "allocated_mb": total if gpu else math.nan,
                        "reserved_mb": math.nan,
                        "peak_mb": total + 1 if gpu else math.nan,
                        **parts,
                    }
                )
    return pd.DataFrame(rows)


def grad_norms(*, bad_rank1: bool) -> dx.GradNorms:
    """layers.0.w sharded over 2 ranks (sumsq 9 and 16), head.w replicated (sumsq 4 on both): global sqrt(29)."""
    true = math.sqrt(29)
    reports = []
    for rank, sumsq in ((0, 9.0), (1, 16.0)):
        reports.append(
            dx.GradReport(
                rank=rank,
                world_size=2,
                loss=0.5,
                global_norm=7.0 if (bad_rank1 and rank == 1) else true,
                entries=[
                    GradEntry(name="layers.0.w", unit="layers.0", shards=2, shard_index=rank, sumsq=sumsq),
                    GradEntry(name="head.w", unit="", shards=1, shard_index=0, sumsq=4.0),
                ],
                checksums={"grad:head.w": 11 if (bad_rank1 and rank == 1) else 10},
            )
        )
    return dx.grad_norms(reports)


def batch() -> Batch:
    """4 samples in 2 groups, prompt width 2, response width 3; sample 1 stops after 2 tokens."""
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
    rollout_lp = torch.full((4, 3), -0.5)
    logprobs = rollout_lp.clone()
    logprobs[2, 1] = -2.5  # a gap of 2 nats on one token
    ids = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 4, 5, 0], [0, 1, 6, 7, 2], [0, 1, 3, 3, 3]])
    return Batch(
        prompts=["ab"] * 4,
        completions=["cde", "ef", "ghc", "ddd"],
        input_ids=ids,
        attention_mask=torch.cat([torch.ones(4, 2, dtype=torch.long), response_mask.long()], dim=1),
        response_mask=response_mask,
        rollout_logprobs=rollout_lp,
        old_logprobs=logprobs,
        group=torch.tensor([0, 0, 1, 1]),
        rank=torch.tensor([0, 0, 1, 1]),
        finish_reason=["length", "stop"] * 2,
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        reward_terms={"correct": torch.tensor([1.0, 0.0, 1.0, 1.0])},
        advantages=torch.tensor([0.7, -0.7, 0.0, 0.0]).unsqueeze(1).expand(4, 3),  # [B, T], per token
    )


def decode(i: int) -> str:
    return "abcdefgh"[i]


# -- sharding -----------------------------------------------------------------------------------------


def test_sharding_view_grid_hover_and_unwrapped_highlight():
    view = ShardingView(sharding(unwrapped=True))
    (fig,) = view.figures()
    heat = fig.data[0]
    assert list(heat.y) == ["(root)", "layers.0", "(unwrapped)"] and list(heat.x) == ["rank 0", "rank 1"]
    assert (heat.z * MiB).tolist() == [[8, 8], [64, 64], [48, 48]]
    hover = heat.text[1][1]
    assert "layers.0</b> on rank 1" in hover and "layers.0.w: (8, 4) -> (4, 4) float32, 64 B" in hover
    assert "head.w: (3, 4) -> (3, 4)" in heat.text[2][0]
    (box,) = fig.layout.shapes  # the unwrapped row, outlined in red
    assert (box.y0, box.y1, box.line.color) == (1.5, 2.5, "red")
    assert "1 unwrapped" in fig.layout.annotations[0].text
    assert 'class="flag"' in view.summary_html() and "head.w" in view.summary_html()
    assert "no FSDP unit manages" in view.summary_text()


def test_sharding_view_without_unwrapped_has_no_highlight():
    view = ShardingView(sharding(unwrapped=False))
    (fig,) = view.figures()
    assert list(fig.data[0].y) == ["(root)", "layers.0"] and not fig.layout.shapes
    assert 'class="flag"' not in view.summary_html()


# -- memory -------------------------------------------------------------------------------------------


def test_memory_view_stacks_latest_step_by_category_and_tracks_totals():
    view = MemoryView(marks(), sharding(unwrapped=False).scaling)
    by_phase, across, scaling = view.figures()
    assert [t.name for t in by_phase.data] == ["parameters", "gradients", "optimizer", "engine", "other"]
    assert by_phase.layout.barmode == "stack" and "step 2" in by_phase.layout.title.text
    params, other = by_phase.data[0], by_phase.data[4]
    assert [list(a) for a in params.x] == [["rank 0"] * 2 + ["rank 1"] * 2, ["rollout", "optimizer_step"] * 2]
    assert list(params.y) == [10, 10, 11, 11] and list(other.y) == [102] * 4  # step 2 only
    # CPU: the total is RSS; one line per rank over step:phase
    assert [t.name for t in across.data] == ["rank 0", "rank 1"]
    assert list(across.data[0].x) == ["1:rollout", "1:optimizer_step", "2:rollout", "2:optimizer_step"]
    assert list(across.data[0].y) == [
        10 + 7 + 101 + 300,
        10 + 5 + 20 + 7 + 101 + 300,
        10 + 7 + 102 + 300,
        10 + 5 + 20 + 7 + 102 + 300,
    ]
    assert list(scaling.data[-1].y) == [4.0, 2.0] and scaling.data[-1].name == "ideal 1/N"
    assert "vs ideal 1.20" in scaling.data[-1].text[1]


def test_memory_view_on_gpu_uses_allocated_and_draws_peaks():
    view = MemoryView(marks(steps=(3,), gpu=True))
    assert len(view.figures()) == 2  # no scaling table given
    across = view.figures()[1]
    assert [t.name for t in across.data] == ["rank 0", "rank 0 peak", "rank 1", "rank 1 peak"]
    assert list(across.data[0].y) == [10 + 7 + 103, 10 + 5 + 20 + 7 + 103]
    assert list(across.data[1].y) == [10 + 7 + 103 + 1, 10 + 5 + 20 + 7 + 103 + 1]
    assert "Highest total per rank: rank 0: 145 MiB, rank 1: 146 MiB" in view.summary_html()


def test_memory_view_before_any_mark():
    view = MemoryView(dx.memory_table([[], []]))
    assert view.figures() == [] and "no memory marks yet" in view.summary_html()


# -- gradient norms -----------------------------------------------------------------------------------


def test_grad_norm_view_draws_local_and_global_norms_and_flags_the_odd_rank():
    view = GradNormView(grad_norms(bad_rank1=True))
    assert view.flagged == [1]
    per_unit, per_rank = view.figures()
    rank0, rank1, glob = per_unit.data
    assert list(rank0.x) == ["layers.0", "(root)"]
    assert list(rank0.y) == pytest.approx([3.0, 2.0]) and list(rank1.y) == pytest.approx([4.0, 2.0])
    assert list(glob.y) == pytest.approx([5.0, 2.0])
    assert rank1.name == "rank 1 (mismatch)" and rank1.marker.line.color == "#d62728"
    assert list(per_rank.data[0].y) == pytest.approx([math.sqrt(29), 7.0])
    assert list(per_rank.data[0].marker.color) == ["#1f77b4", "#d62728"]
    assert per_rank.layout.shapes[0].y0 == pytest.approx(math.sqrt(29))
    summary = view.summary_html()
    assert 'class="flag"' in summary and "reported 7, true 5.38516" in summary and "replicated grad" in summary
    assert "MISMATCH on rank(s) [1]" in view.summary_text()


def test_grad_norm_view_when_ranks_agree_and_before_any_update():
    view = GradNormView(grad_norms(bad_rank1=False))
    assert view.flagged == [] and "all ranks agree" in view.summary_html()
    assert all(t.marker.line.width == 0 for t in view.figures()[0].data[:2])
    empty = GradNormView(None)
    assert empty.figures() == [] and "no update yet" in empty.summary_text()


# -- rollouts -----------------------------------------------------------------------------------------


def spans(page_html: str) -> list[tuple[str, str]]:
    """(background, text) of every token span."""
    return re.findall(r'style="background:(rgba\([^)]*\));white-space:pre">([^<]*)</span>', page_html)


def test_rollout_view_colours_tokens_by_advantage_and_pages():
    view = RolloutView(batch(), decode, page_size=2)
    assert view.pages == 2 and view.current_colouring() == "advantage"
    page = view.summary_html()
    tokens = spans(page)
    assert [t for _, t in tokens] == ["c", "d", "e", "e", "f"]  # samples 0 and 1; sample 1 has 2 tokens
    assert {c for c, _ in tokens[:3]} == {"rgba(0,150,0,0.60)"} and {c for c, _ in tokens[3:]} == {"rgba(210,0,0,0.60)"}
    assert "Page 1 of 2" in page and "1 group(s) with one reward for all samples" in page
    view._set(page=5)  # clamped to the last page
    assert view.page == 1 and [t for _, t in spans(view.summary_html())] == ["g", "h", "c", "d", "d", "d"]
    assert len(spans(view.export_html())) == 11  # the export shows every sample


def test_rollout_view_colours_the_logprob_gap_and_draws_rewards_per_group():
    view = RolloutView(batch(), decode, colouring="logprob_gap", page_size=4)
    colours = [c for c, _ in spans(view.summary_html())]
    assert colours[6] == "rgba(210,0,0,0.60)"  # sample 2, token 1: a gap of 2 nats
    assert colours.count("rgba(210,0,0,0.00)") == 10
    assert "largest trainer-vs-engine log-prob gap 2" in view.summary_html()
    assert view.silent_groups() == [1]
    (fig,) = view.figures()
    assert list(fig.data[0].x) == [0, 0, 1, 1] and list(fig.data[0].y) == [1.0, 0.0, 1.0, 1.0]
    assert token_rgba(-5.0, "logprob", 0) == "rgba(210,0,0,0.60)" and token_rgba(-0.5, "logprob", 0).endswith("0.06)")


def test_rollout_view_colours_the_mismatch_by_sign_and_lists_the_top_tokens():
    b = batch()
    b.old_logprobs[0, 0] = -0.25  # the trainer more confident than the engine by 0.25 nats
    b.rollout_logprobs[3] = torch.nan  # a row without engine log-probs
    view = RolloutView(b, decode, colouring="mismatch", page_size=4)
    colours = [c for c, _ in spans(view.summary_html())]
    assert colours[0] == "rgba(210,0,0,0.07)"  # +0.25 of the largest |delta|, 2: 0.125 * 0.6
    assert colours[6] == "rgba(0,70,220,0.60)"  # sample 2, token 1: -2, the largest
    assert colours[-3:] == ["rgba(0,0,0,0.00)"] * 3  # no engine log-probs, no colour
    top = view.top_mismatched(2)
    assert [(r["sample"], r["position"], r["token"]) for r in top] == [(2, 1, "h"), (0, 0, "c")]
    assert top[0]["delta"] == pytest.approx(-2.0) and top[0]["ratio"] == pytest.approx(math.exp(-2.0))
    assert "Most mismatched tokens" in view.summary_html() and "Most mismatched tokens" in view.export_html()
    b.old_logprobs = None
    unscored = RolloutView(b, decode)
    assert unscored.top_mismatched() == [] and "Most mismatched" not in unscored.export_html()


def test_rollout_view_before_scoring_and_before_any_rollout():
    b = batch()
    b.rewards, b.advantages, b.reward_terms = None, None, {}
    view = RolloutView(b, decode)
    assert view.available() == ["logprob_gap", "mismatch", "logprob"] and view.current_colouring() == "logprob_gap"
    assert view.figures() == []
    assert "no rollout yet" in RolloutView(None).summary_html()
    with pytest.raises(ValueError, match="colouring='reward'"):
        RolloutView(b, colouring="reward")


# -- lint, training curves ------------------------------------------------------------------------------


def test_lint_view_lists_findings_escaped_errors_first():
    findings = Findings(
        [
            Finding(
                id="optimizer-before-wrap",
                severity="error",
                message="stale <params>",
                evidence="3 tensors",
                fix="wrap first",
                ranks=(0, 1),
            ),
            Finding(
                id="no-shard", severity="warning", message="NO_SHARD", evidence="unit ''", fix="FULL_SHARD", ranks=(1,)
            ),
        ]
    )
    view = LintView(findings)
    page = view.summary_html()
    assert view.counts() == {"error": 1, "warning": 1} and "1 error(s), 1 warning(s)" in page
    assert page.index('class="finding-error"') < page.index('class="finding-warning"')
    assert "stale &lt;params&gt;" in page and "<params>" not in page
    assert "[error] optimizer-before-wrap (ranks 0, 1)" in view.summary_text()
    assert "No findings" in LintView(Findings([])).summary_html()


def test_training_view_curves():
    history = pd.DataFrame(
        {
            "step": [1, 2, 3],
            "reward/mean": [0.2, 0.5, 0.9],
            "reward/std": [0.1] * 3,
            "kl/mean": [0.0, 0.01, 0.02],
            "response/length/mean": [3.0, 4.0, 4.0],
            "time/rollout": [1.0] * 3,
            "time/update": [2.0] * 3,
            "time/step": [3.0] * 3,
        }
    )
    reward, other = TrainingView(history).figures()
    assert list(reward.data[2].y) == [0.2, 0.5, 0.9]
    assert [t.name for t in other.data] == ["kl/mean", "length/mean", "rollout", "update"]
    assert TrainingView(pd.DataFrame()).figures() == []


# -- display, export, live widget -----------------------------------------------------------------------


def all_views():
    return [
        ShardingView(sharding(unwrapped=True)),
        MemoryView(marks(), sharding(unwrapped=True).scaling),
        GradNormView(grad_norms(bad_rank1=True)),
        RolloutView(batch(), decode),
        LintView(Findings([])),
        TrainingView(
            pd.DataFrame(
                {
                    "step": [1],
                    "reward/mean": [0.5],
                    "reward/std": [0.0],
                    "kl/mean": [0.0],
                    "response/length/mean": [2.0],
                }
            )
        ),
    ]


@pytest.mark.parametrize("view", all_views(), ids=lambda v: v.title)
def test_every_view_has_static_fallbacks_and_an_offline_export(view, tmp_path):
    bundle = view._repr_mimebundle_()
    assert {"text/html", "text/plain", WIDGET_MIME} <= set(bundle)
    assert "<script" not in bundle["text/html"] and bundle["text/plain"] == view.summary_text()
    page = view.to_html(tmp_path / "view.html").read_text()
    assert "Plotly" in page and len(page) > 1_000_000  # plotly.js inlined
    assert not re.search(r"<(script|link|img)[^>]+(src|href)\s*=", page), "the export references an outside file"
    assert page.count("plotly-graph-div") == len(view.figures())


def test_live_widget_draws_figures_with_the_plotly_renderer_and_follows_updates():
    view = MemoryView(marks(steps=(1,)))
    box = view.widget()
    plots = [c for c in box.children if c.__class__.__name__ == "Output"]
    assert len(plots) == 2
    drawn = plots[1].outputs[0]["data"][PLOTLY_MIME]
    assert len(drawn["data"]) == 2 and drawn["layout"]["title"]["text"].startswith("total MiB")
    view.update(marks(steps=(1, 2)), sharding(unwrapped=False).scaling)
    plots = [c for c in box.children if c.__class__.__name__ == "Output"]
    assert len(plots) == 3 and "step 2" in plots[0].outputs[0]["data"][PLOTLY_MIME]["layout"]["title"]["text"]
    assert "rank 1: 445 MiB" in box.children[-1].value  # CPU: RSS


def test_live_widget_of_a_view_without_figures_shows_its_summary():
    box = LintView(Findings([])).widget()
    assert len(box.children) == 1 and "No findings" in box.children[0].value
    view = RolloutView(batch(), decode, page_size=2)
    controls, plot, summary = view.widget().children
    assert "Page 1 of 2" in summary.value
    controls.children[2].click()  # the next-page button
    assert "Page 2 of 2" in summary.value and plot.outputs[0]["data"][PLOTLY_MIME]["layout"]["title"]["text"]


def test_throttle_passes_once_per_interval():
    now = [0.0]
    throttle = Throttle(2.0, clock=lambda: now[0])
    seen = []
    for t in (0.0, 0.5, 1.9, 2.0, 2.1, 5.0):
        now[0] = t
        seen.append(throttle.ready())
    assert seen == [True, False, False, True, False, True]


def test_import_rlkit_loads_no_jupyter_module():
    code = (
        "import sys, rlkit, rlkit.diagnostics, rlkit.trainer; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'ipywidgets', 'IPython', 'ipykernel', 'jupyter_client', 'jupyter_core', 'comm', 'widgetsnbextension'} "
        "or m.startswith('rlkit.widgets')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

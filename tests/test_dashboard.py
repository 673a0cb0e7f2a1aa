"""Dashboard(trainer) on 2 gloo workers and the tiny model: steps run in the background, Stop ends a run between
steps, every view follows the trainer, a failing run is shown and leaves the dashboard usable."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("ipywidgets")

import rlkit
from rlkit.data.rewards import RewardError
from rlkit.models import resolve_model_dir
from rlkit.widgets import Dashboard
from rlkit.widgets.runner import Runner

SMALL = dict(model="tiny", seed=0, prompts_per_step=4, group_size=4, rollout=rlkit.RolloutConfig(max_new_tokens=4))
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_dashboard_steps_in_the_background_and_views_follow(cluster, tmp_path):
    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**SMALL))
    dash = Dashboard(trainer, refresh_s=0)
    views = dash.views
    assert "step 0" in dash._status.value
    assert views["grad norms"].norms is None and views["rollouts"].batch is None and views["memory"].marks.empty
    layers = json.loads((resolve_model_dir("tiny") / "config.json").read_text())["num_hidden_layers"]
    assert list(views["sharding"].grid().index) == ["(root)", *(f"model.layers.{i}" for i in range(layers))]
    assert len(views["lint"].findings) == 0 and "all ranks alive" in dash._cluster.value

    start = time.monotonic()
    dash._step_button.click()  # what the browser's click does
    assert time.monotonic() - start < 0.5 and dash.running and dash._step_button.disabled
    with pytest.raises(RuntimeError, match="already going"):
        dash.run(1)
    with pytest.raises(RuntimeError, match="a run is going"):
        dash.refresh()
    assert dash.wait(120) and not dash.running and dash.error is None
    assert "step 1" in dash._status.value and (dash._bar.value, dash._bar.max) == (1, 1)
    assert not dash._step_button.disabled and dash._stop_button.disabled
    assert list(views["training"].history["step"]) == [1]
    assert len(views["rollouts"].batch) == 16
    assert views["grad norms"].norms.global_norm == pytest.approx(trainer.history["actor/grad_norm"].iloc[-1], rel=1e-5)
    assert set(views["memory"].marks["step"]) == {1}

    dash.run(50)
    wait_for(lambda: trainer.steps_done >= 3)
    dash._stop_button.click()
    assert dash.wait(120) and dash.error is None
    done = trainer.steps_done
    assert 3 <= done < 50, "Stop did not end the run between steps"
    assert f"step {done}" in dash._status.value and dash._bar.value == done - 1 and dash._bar.max == 50
    assert list(views["training"].history["step"]) == list(range(1, done + 1))
    assert sorted(set(views["memory"].marks["step"])) == list(
        range(1, done + 1)
    )  # every step's marks, not just the drawn ones
    drawn = views["training"].widget().children[0].outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert drawn["layout"]["title"]["text"] == "reward" and len(drawn["data"]) == 3

    bundle = dash._repr_mimebundle_()
    assert {WIDGET_MIME, "text/html", "text/plain"} <= set(bundle) and "<script" not in bundle["text/html"]
    assert f"rlkit dashboard: step {done}" in bundle["text/plain"]
    page = dash.to_html(tmp_path / "dash.html").read_text()
    assert page.count("plotly-graph-div") == sum(len(v.figures()) for v in views.values())


@pytest.mark.timeout(300)
def test_a_failing_run_is_shown_and_the_dashboard_stays_usable(cluster):
    calls = []

    def flaky(prompts, completions, **fields):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("flaky reward")
        return [float(len(c)) for c in completions]

    trainer = rlkit.Trainer(cluster, rlkit.GRPOConfig(**SMALL), reward_fn=flaky)
    dash = Dashboard(trainer, refresh_s=3600)  # the throttle holds redraws back until the end of the run
    dash.run(5)
    assert dash.wait(120)
    assert isinstance(dash.error, RewardError) and "flaky reward" in dash._error.value
    assert "Nothing is lost" in dash._error.value  # the notebook's advice, a note of the error
    assert trainer.steps_done == 1 and list(dash.views["training"].history["step"]) == [1]
    assert not dash._run_button.disabled
    dash.step()
    assert dash.wait(120) and dash.error is None and dash._error.value == "" and trainer.steps_done == 2


class Steps:
    """A stand-in for Trainer.fit's contract (on_step after each step), to pin the runner's thread discipline."""

    def __init__(self):
        self.steps_done = 0

    def fit(self, steps, *, progress, on_step):
        for _ in range(steps):
            self.steps_done += 1
            on_step({"step": self.steps_done})


def test_runner_calls_back_in_order_and_stays_running_until_on_end_returned():
    events = []
    runner = None

    def on_step(row):
        events.append(("step", row["step"], runner.running))
        if row["step"] == 2:
            runner.stop()

    runner = Runner(
        Steps(),
        on_step=on_step,
        on_end=lambda e: events.append(("end", e, runner.running)),
        on_idle=lambda: events.append(("idle", runner.running)),
    )
    runner.start(10)
    assert runner.wait(10)
    assert events == [("step", 1, True), ("step", 2, True), ("end", None, True), ("idle", False)]
    with pytest.raises(ValueError, match="steps=0"):
        runner.start(0)

"""Dashboard(trainer): Step / Run N / Stop, a progress bar, the cluster's status, and a tab per view, kept live."""

from __future__ import annotations

import html
import logging
from pathlib import Path

import pandas as pd

from rlkit.widgets.grads import GradNormView
from rlkit.widgets.history import TrainingView
from rlkit.widgets.lint import LintView
from rlkit.widgets.memory import MemoryView
from rlkit.widgets.rollouts import RolloutView
from rlkit.widgets.runner import Runner, Throttle
from rlkit.widgets.sharding import ShardingView
from rlkit.widgets.trajectories import TrajectoryView
from rlkit.widgets.view import STYLE, table_html, write_page

logger = logging.getLogger(__name__)


class Dashboard:
    """A live control panel of one :class:`rlkit.Trainer`.

    Step and Run N train in a background thread (:meth:`step`, :meth:`run`), so the kernel stays free; Stop
    ends a run after the step in progress (:meth:`stop`). The step counter and progress bar move every step;
    the views (training curves, sharding, memory, gradient norms, rollouts, lint) redraw at most once per
    ``refresh_s`` seconds during a run and always at its end. Memory marks are recorded every step, so the
    memory tab shows them across steps. Call the trainer yourself only while no run goes (``.running``);
    then :meth:`refresh` shows what you did.
    """

    def __init__(self, trainer, *, refresh_s: float = 2.0, run_steps: int = 10):
        self.trainer = trainer
        self.error: BaseException | None = None
        """The exception that ended the last run, if one did."""
        self._memory: dict[int, pd.DataFrame] = {}
        self._throttle = Throttle(refresh_s)
        self._runner = Runner(trainer, on_step=self._after_step, on_end=self._after_run, on_idle=self._idle)
        sharding = trainer.sharding()
        self.views = {
            "training": TrainingView(trainer.history),
            "sharding": ShardingView(sharding),
            "memory": MemoryView(self._record_memory(), sharding.scaling),
            "grad norms": GradNormView(self._grad_norms()),
            "rollouts": (TrajectoryView if getattr(trainer, "agent", None) else RolloutView).from_trainer(trainer),
            "lint": LintView(trainer.lint()),
        }
        self._build(run_steps)
        self._set_progress(0, 0)

    # -- what a person calls ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._runner.running

    def step(self) -> None:
        """One step in the background (the Step button)."""
        self.run(1)

    def run(self, steps: int) -> None:
        """``steps`` steps in the background (the Run button); returns at once."""
        if self.running:
            raise RuntimeError("a run is already going: stop it (Stop button or .stop()) or wait for it")
        self.error = None
        self._error.value = ""
        self._set_progress(0, steps)
        self._set_buttons(running=True)
        try:
            self._runner.start(steps)
        except Exception:
            self._set_buttons(running=False)
            raise

    def stop(self) -> None:
        """End the run after the step in progress (the Stop button)."""
        if self.running:
            self._runner.stop()
            self._status.value = self._status.value + " · stopping after this step"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current run ended (False if ``timeout`` seconds passed first)."""
        return self._runner.wait(timeout)

    def refresh(self) -> None:
        """Re-read every diagnostic from the trainer and redraw (only while no run goes)."""
        if self.running:
            raise RuntimeError("a run is going: the dashboard refreshes itself; stop it first to refresh by hand")
        self._refresh(full=True)

    def to_html(self, path: str | Path) -> Path:
        """Every view in one self-contained HTML file (plotly.js inlined: opens offline); returns its path."""
        return write_page(path, f"rlkit dashboard: step {self.trainer.steps_done}", list(self.views.values()))

    def widget(self):
        """The dashboard's ipywidgets box (what a cell shows)."""
        return self._box

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {**self._box._repr_mimebundle_(), "text/html": self.static_html(), "text/plain": self.summary_text()}

    def static_html(self) -> str:
        """The ``text/html`` fallback: step, cluster status and each view's summary (no script)."""
        views = "".join(v.static_html() for v in self.views.values())
        return (
            f'<div class="rlkit-view"><style>{STYLE}</style><h3>rlkit dashboard: step {self.trainer.steps_done}'
            f"</h3>{self._cluster_html()}</div>{views}"
        )

    def summary_text(self) -> str:
        return "\n\n".join(
            [f"rlkit dashboard: step {self.trainer.steps_done}"] + [v.summary_text() for v in self.views.values()]
        )

    # -- the run's callbacks (background thread) ------------------------------------------------------

    def _after_step(self, row: dict) -> None:
        self._done += 1
        self._set_progress(self._done, self._total, row)
        self._record_memory()
        if self._throttle.ready():
            self._refresh(full=False)

    def _after_run(self, error: BaseException | None) -> None:
        self.error = error
        try:
            self._refresh(full=error is None)
        except Exception as exc:  # the cluster may be gone: say so instead of dying in the thread
            logger.exception("dashboard refresh failed")
            error = error or exc
        if error is not None:
            text = "\n".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", [])])  # with the advice
            self._error.value = f'<pre class="flag" style="color:#b00020">{html.escape(text)}</pre>'

    def _idle(self) -> None:
        self._set_buttons(running=False)
        self._set_progress(self._done, self._total)

    # -- internals -----------------------------------------------------------------------------------

    def _refresh(self, *, full: bool) -> None:
        """Redraw from the trainer; ``full`` also re-inspects sharding and runs the lint (an inspect on every rank)."""
        t, v = self.trainer, self.views
        v["training"].update(t.history)
        v["rollouts"].update(t.last_batch)
        v["grad norms"].update(self._grad_norms())
        if full:
            v["sharding"].update(t.sharding())
            v["lint"].update(t.lint())
        v["memory"].update(self._record_memory(), v["sharding"].sharding.scaling)
        self._cluster.value = self._cluster_html()
        self._set_progress(self._done, self._total)

    def _record_memory(self) -> pd.DataFrame:
        """Keep this step's marks (once per step); returns the marks of every recorded step."""
        step = self.trainer.steps_done
        if step not in self._memory:
            marks = self.trainer.memory()
            if not marks.empty:
                self._memory[step] = marks.assign(step=step)
        frames = list(self._memory.values())
        return pd.concat(frames, ignore_index=True) if frames else self.trainer.memory().assign(step=step)

    def _grad_norms(self):
        """The last update's gradient norms, or None before the first update."""
        try:
            return self.trainer.grad_norms()
        except RuntimeError as exc:
            if "no update has run yet" in str(exc):  # the trainer's own message; anything else is a real failure
                return None
            raise

    def _cluster_html(self) -> str:
        status = self.trainer.cluster.status()
        down = status[~status["alive"]]
        head = (
            '<p class="ok">cluster: all ranks alive</p>'
            if down.empty
            else f'<p class="flag">cluster: rank(s) {", ".join(map(str, down["rank"]))} not alive</p>'
        )
        return head + table_html(status)

    def _set_progress(self, done: int, total: int, row: dict | None = None) -> None:
        self._done, self._total = done, total
        self._bar.max = max(total, 1)
        self._bar.value = done
        parts = [f'<b class="rlkit-step">step {self.trainer.steps_done}</b>']
        if row is not None:
            parts.append(f"reward {row['reward/mean']:.3f}")
        elif len(self.trainer.history):
            parts.append(f"reward {self.trainer.history['reward/mean'].iloc[-1]:.3f}")
        if total:
            parts.append(f"{done}/{total} steps of this run")
        self._status.value = " · ".join(parts)

    def _set_buttons(self, *, running: bool) -> None:
        for button in (self._step_button, self._run_button, self._refresh_button):
            button.disabled = running
        self._stop_button.disabled = not running

    def _build(self, run_steps: int) -> None:
        import ipywidgets as w

        self._step_button = w.Button(description="Step", icon="step-forward", tooltip="one step in the background")
        self._run_button = w.Button(description="Run", icon="play", tooltip="run N steps in the background")
        self._steps = w.BoundedIntText(
            value=run_steps, min=1, max=1_000_000, description="N", layout={"width": "140px"}
        )
        self._stop_button = w.Button(description="Stop", icon="stop", disabled=True, tooltip="stop after this step")
        self._refresh_button = w.Button(description="Refresh", icon="refresh", tooltip="re-read every diagnostic")
        self._step_button.on_click(lambda _: self.step())
        self._run_button.on_click(lambda _: self.run(self._steps.value))
        self._stop_button.on_click(lambda _: self.stop())
        self._refresh_button.on_click(lambda _: self.refresh())
        self._bar = w.IntProgress(min=0, max=1, value=0, layout={"width": "240px"})
        self._status = w.HTML()
        self._status.add_class("rlkit-status")
        self._error = w.HTML()
        self._cluster = w.HTML(self._cluster_html())
        cluster = w.Accordion(children=[self._cluster], titles=("cluster status",))
        tabs = w.Tab(children=[view.widget() for view in self.views.values()], titles=tuple(self.views))
        controls = w.HBox([self._step_button, self._run_button, self._steps, self._stop_button, self._refresh_button])
        self._box = w.VBox([controls, w.HBox([self._bar, self._status]), self._error, cluster, tabs])
        self._box.add_class("rlkit-dashboard")

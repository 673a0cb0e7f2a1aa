"""Engine pieces without an engine: which rows carry log-probs, the sleep decision, collecting vLLM's outputs,
the shared weight buffers and the engine-side direct-copy plan (checked against a loader that stacks)."""

import logging
from types import SimpleNamespace

import psutil
import pytest
import torch

from rlkit import ConfigError, GRPOConfig, RolloutConfig
from rlkit.rollout.base import logprob_prompts
from rlkit.rollout.sleep import AWAKE_HEADROOM, SleepPolicy
from rlkit.rollout.vllm import _to_generation
from rlkit.rollout.vllm_weights import SharedWeights
from rlkit.rollout.vllm_worker import WorkerExtension, stacking_plan

GIB = 2**30


@pytest.mark.parametrize(
    ("prompts", "fraction", "chosen"),
    [(64, 0.125, list(range(0, 64, 8))), (5, 0.5, [0, 1, 3]), (4, 0.0, []), (3, 1.0, [0, 1, 2]), (1, 0.01, [0]),
     (30, 0.1, [0, 10, 20])],
)
def test_logprob_prompts_are_evenly_spaced(prompts, fraction, chosen):
    assert logprob_prompts(prompts, fraction).nonzero().flatten().tolist() == chosen


def test_engine_settings_are_validated():
    assert RolloutConfig().sleep == "auto" and RolloutConfig().engine_logprobs == 0.125
    with pytest.raises(ConfigError) as err:
        GRPOConfig(rollout=RolloutConfig(engine_logprobs=1.5, sleep="sometimes"))
    assert len(err.value.problems) == 2
    assert "rollout.engine_logprobs=1.5" in str(err.value) and "('auto', 'always', 'never')" in str(err.value)


def test_sleep_policy_fixed_modes():
    for mode, expected in (("always", True), ("never", False)):
        assert SleepPolicy(mode).should_sleep(free=100 * GIB, held=0, total=140 * GIB) is expected


def test_auto_sleeps_until_an_update_is_measured_then_stays_awake_while_it_fits(caplog):
    total = 140 * GIB
    policy = SleepPolicy("auto")
    assert policy.should_sleep(free=60 * GIB, held=2 * GIB, total=total), "nothing measured yet"
    policy.record_update(20 * GIB)  # the update's high-water mark, engine asleep
    # awake: 60 GiB free, the trainer holds 2 and needs 18 more: 42 left >= 14 spare
    with caplog.at_level(logging.INFO, logger="rlkit.rollout.sleep"):
        assert not policy.should_sleep(free=60 * GIB, held=2 * GIB, total=total)
    assert any("stays awake" in r.getMessage() for r in caplog.records)
    edge = int(AWAKE_HEADROOM * total) + 18 * GIB
    assert not policy.should_sleep(free=edge, held=2 * GIB, total=total)
    assert policy.should_sleep(free=edge - 1, held=2 * GIB, total=total)
    policy.record_update(10 * GIB)  # a smaller update does not lower the need
    assert policy.need == 20 * GIB
    policy.record_update(70 * GIB)  # a need that grew past the room puts it back to sleep
    assert policy.should_sleep(free=60 * GIB, held=20 * GIB, total=total)


def completion(tokens: list[int], logprobs: list[float] | None, index: int = 0, reason: str = "length"):
    flat = None if logprobs is None else SimpleNamespace(logprobs=logprobs)
    return SimpleNamespace(token_ids=tokens, logprobs=flat, finish_reason=reason, index=index)


def test_outputs_are_collected_like_a_row_by_row_loop():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 5, 2, 4]
    rows = torch.tensor([True, True, False, False, True, True])
    outs = []
    for length, has in zip(lengths, rows.tolist(), strict=True):
        ids = torch.randint(1, 50, (length,), generator=gen).tolist()
        outs.append(completion(ids, torch.randn(length, generator=gen).tolist() if has else None))
    got = _to_generation(outs, rows, width=5, pad_token_id=0, device=torch.device("cpu"))
    for i, (c, has) in enumerate(zip(outs, rows.tolist(), strict=True)):
        k = len(c.token_ids)
        assert got.response_ids[i, :k].tolist() == c.token_ids and (got.response_ids[i, k:] == 0).all()
        assert got.response_mask[i].tolist() == [1.0] * k + [0.0] * (5 - k)
        if has:
            assert torch.equal(got.logprobs[i, :k], torch.tensor(c.logprobs.logprobs))
            assert (got.logprobs[i, k:] == 0).all()
        else:
            assert got.logprobs[i].isnan().all()
    assert torch.equal(got.logprob_rows, rows)


def test_outputs_with_missing_logprobs_are_refused():
    outs = [completion([1, 2, 3], [-0.1, -0.2])]
    with pytest.raises(RuntimeError, match="2 log-probs for 3 sampled tokens"):
        _to_generation(outs, torch.tensor([True]), width=4, pad_token_id=0, device=torch.device("cpu"))


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint-format layer: separate q/k/v and gate/up, as an HF model names them (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"l.attn.q_proj.weight": (4, 3), "l.attn.k_proj.weight": (2, 3), "l.attn.v_proj.weight": (2, 3),
              "l.attn.q_proj.bias": (4,), "l.attn.k_proj.bias": (2,), "l.attn.v_proj.bias": (2,),
              "l.mlp.gate_proj.weight": (5, 3), "l.mlp.up_proj.weight": (5, 3), "l.mlp.down_proj.weight": (3, 5),
              "embed.weight": (7, 3)}
    return [(name, torch.randn(shape, generator=gen)) for name, shape in shapes.items()]


def test_shared_weights_pack_once_then_fill_in_place():
    shared = SharedWeights(iter(weights(0)), torch.bfloat16)
    pointers = [b.data_ptr() for b in shared.buffers]
    new = weights(1)
    shared.fill(iter(new))
    assert [b.data_ptr() for b in shared.buffers] == pointers
    for (name, view), (expected_name, tensor) in zip(shared.views, new, strict=True):
        assert name == expected_name and view.dtype == torch.bfloat16 and torch.equal(view, tensor.bfloat16())
    renamed = [("other", t) if i == 3 else (n, t) for i, (n, t) in enumerate(new)]
    with pytest.raises(RuntimeError, match="weight 3 is other"):
        shared.fill(iter(renamed))
    with pytest.raises(RuntimeError, match="9 weights arrived where the engine's buffers hold 10"):
        shared.fill(iter(new[:-1]))
    with pytest.raises(RuntimeError, match="weight 10 is extra"):
        shared.fill(iter([*new, ("extra", torch.zeros(1))]))


class Fused(torch.nn.Module):
    """The engine's kernel-format layer: fused qkv and gate_up, as vLLM's Qwen2 holds them."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Module()
        self.l.attn = torch.nn.Module()
        self.l.attn.qkv_proj = torch.nn.Linear(3, 8)
        self.l.mlp = torch.nn.Module()
        self.l.mlp.gate_up_proj = torch.nn.Linear(3, 10, bias=False)
        self.l.mlp.down_proj = torch.nn.Linear(5, 3, bias=False)
        self.embed = torch.nn.Embedding(7, 3)
        self.to(torch.bfloat16).requires_grad_(False)


class FakeWorker(WorkerExtension):
    """vLLM's worker as the extension sees it: a model runner and a loader that stacks (and optionally scales)."""

    def __init__(self, model: Fused, scale: float = 1.0):
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.loads = 0
        self.scale = scale

    def reload_weights(self, weights_iterator):
        self.loads += 1
        w = dict(weights_iterator)
        m = self.model_runner.get_model()
        qkv = [f"l.attn.{p}_proj" for p in "qkv"]
        m.l.attn.qkv_proj.weight.copy_(torch.cat([w[f"{p}.weight"] for p in qkv]) * self.scale)
        m.l.attn.qkv_proj.bias.copy_(torch.cat([w[f"{p}.bias"] for p in qkv]))
        m.l.mlp.gate_up_proj.weight.copy_(torch.cat([w["l.mlp.gate_proj.weight"], w["l.mlp.up_proj.weight"]]))
        m.l.mlp.down_proj.weight.copy_(w["l.mlp.down_proj.weight"])
        m.embed.weight.copy_(w["embed.weight"])


def attach(worker: FakeWorker, shared: SharedWeights) -> None:
    """What rlkit_attach does once the IPC handles are opened: views of the buffers, bound to a known plan."""
    worker._rlkit_views = shared.views
    worker._rlkit_copies = worker._rlkit_bind(getattr(worker, "_rlkit_plan", None))


def loader_result(seed: int) -> dict[str, torch.Tensor]:
    model = Fused()
    FakeWorker(model).reload_weights(iter(SharedWeights(iter(weights(seed)), torch.bfloat16).views))
    return {n: p.clone() for n, p in model.named_parameters()}


def test_direct_copies_after_the_first_sync_equal_the_loader():
    model = Fused()
    worker, shared = FakeWorker(model), SharedWeights(iter(weights(0)), torch.bfloat16)
    attach(worker, shared)
    assert worker.rlkit_reload_attached() == "loader"
    for seed in (1, 2):
        shared.fill(iter(weights(seed)))
        assert worker.rlkit_reload_attached() == "direct"
        expected = loader_result(seed)
        assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    assert worker.loads == 1
    worker.rlkit_detach()  # the engine slept: the trainer packs new buffers, the plan carries over
    attach(worker, SharedWeights(iter(weights(3)), torch.bfloat16))
    assert worker.rlkit_reload_attached() == "direct"
    assert all(torch.equal(p, loader_result(3)[n]) for n, p in model.named_parameters())


def test_a_loader_that_does_more_than_stack_keeps_the_loader():
    worker = FakeWorker(Fused(), scale=2.0)
    shared = SharedWeights(iter(weights(0)), torch.bfloat16)
    attach(worker, shared)
    assert [worker.rlkit_reload_attached() for _ in range(2)] == ["loader", "loader"]
    assert worker.loads == 2


def test_stacking_plan_needs_every_source_with_matching_rows():
    params = {"a.qkv_proj.weight": (8, 3), "a.o_proj.weight": (3, 3)}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    sources = {"a.q_proj.weight": (4, 3), "a.k_proj.weight": (2, 3), "a.v_proj.weight": (2, 3),
               "a.o_proj.weight": (3, 3)}
    assert stacking_plan(params, packed, sources) == [
        ("a.qkv_proj.weight", [("a.q_proj.weight", 0, 4), ("a.k_proj.weight", 4, 2), ("a.v_proj.weight", 6, 2)]),
        ("a.o_proj.weight", [("a.o_proj.weight", 0, 3)]),
    ]
    assert stacking_plan(params, packed, {**sources, "a.v_proj.weight": (3, 3)}) is None  # rows do not add up
    assert stacking_plan(params, packed, {k: v for k, v in sources.items() if "k_proj" not in k}) is None
    assert stacking_plan({"t.scale": ()}, {}, {"t.scale": ()}) is None  # scalars: leave them to the loader


class SleepingLLM:
    """vLLM's ``LLM`` as far as sleep mode goes: asleep (cuMem unmapped) its weights fault when a worker reads them."""

    llm_engine = "running"

    def __init__(self):
        self.asleep: set[str] = set()
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(f"wake {tags[0]}")
        self.asleep -= set(tags)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if "weights" in self.asleep:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.calls.append(method)
        return [({}, 0)]


def sleeping_engine(asleep: bool):
    """A VLLMEngine around a SleepingLLM (nothing of vLLM's started), asleep or awake."""
    from rlkit.rollout.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine._shared, engine._asleep = SleepingLLM(), None, set()
    if asleep:
        engine._sleep_now()
        engine.llm.calls.clear()
    return engine


@pytest.mark.parametrize("asleep", [True, False])
def test_the_vllm_engine_s_weights_are_read_awake_and_it_is_left_as_it_was(asleep):
    from rlkit.diagnostics.rescore import engine_fingerprints

    engine = sleeping_engine(asleep)
    with engine.weights_awake():
        assert engine_fingerprints(engine, {}) == ({}, 0)
    woken = ["wake weights", "wake kv_cache"]
    assert engine.llm.calls == (woken + ["rlkit_fingerprints", "sleep 1"] if asleep else ["rlkit_fingerprints"])
    assert engine.llm.asleep == ({"weights", "kv_cache"} if asleep else set())
    assert engine._asleep == engine.llm.asleep


def test_a_sleeping_vllm_engine_sleeps_again_when_the_read_fails():
    engine = sleeping_engine(True)
    with pytest.raises(ValueError, match="a probe failed"), engine.weights_awake():
        raise ValueError("a probe failed")
    assert engine.llm.asleep == {"weights", "kv_cache"} and engine.llm.calls[-1] == "sleep 1"


def test_the_engine_s_processes_leave_out_multiprocessing_s_resource_tracker():
    """The resource tracker a worker starts with its first shared memory lives until the worker exits: counted as
    the engine's, close() waited for it in vain and left the engine's shared memory behind (tests/test_vllm_tp.py)."""
    from multiprocessing import shared_memory

    from rlkit.rollout.vllm import _descendants

    block = shared_memory.SharedMemory(create=True, size=16)
    try:
        helpers = [p for p in psutil.Process().children(recursive=True)
                   if "multiprocessing.resource_tracker" in " ".join(p.cmdline())]  # fmt: skip
        assert helpers, "no resource tracker started"
        assert not {p.pid for p in helpers} & {p.pid for p in _descendants()}
    finally:
        block.close()
        block.unlink()


def test_an_empty_logprob_rows_asks_no_prompts_log_probs_of_any_shard():
    from rlkit.rollout.vllm import VLLMEngine

    engine = SimpleNamespace(logprob_fraction=0.5)
    shards = [(torch.zeros(3, 2), torch.ones(3, 2)), (torch.zeros(0, 2), torch.ones(0, 2)), (torch.zeros(2, 2),) * 2]
    none = VLLMEngine._logprob_prompts(engine, shards, ())  # type: ignore[arg-type]
    assert [rows.tolist() for rows in none] == [[False] * 3, [], [False] * 2]
    picked = VLLMEngine._logprob_prompts(engine, shards, None)  # type: ignore[arg-type]
    assert [rows.tolist() for rows in picked] == [[True, True, False], [], [True, False]]  # ceil(0.5 x N)
    with pytest.raises(ValueError, match="4 values for 5 prompts"):
        VLLMEngine._logprob_prompts(engine, shards, (False,) * 4)  # type: ignore[arg-type]


def test_validation_samples_ask_the_engine_for_no_log_probs():
    """PolicyWorker.sample returns no log-probs, so it asks none (vLLM would compute them for the whole batch)."""
    from rlkit.rollout.base import Generation, SamplingParams
    from rlkit.workers.phases import PhaseClock
    from rlkit.workers.policy import PolicyWorker

    asked = []

    def generate(ids, mask, params):
        asked.append(params)
        rows = len(ids) * params.n
        return Generation(response_ids=torch.ones(rows, 4, dtype=torch.long), response_mask=torch.ones(rows, 4),
                          logprobs=torch.full((rows, 4), float("nan")),
                          logprob_rows=torch.zeros(rows, dtype=torch.bool), finish_reason=["length"] * rows)

    worker = SimpleNamespace(clock=PhaseClock(torch.device("cpu")), device=torch.device("cpu"),
                             config=SimpleNamespace(rollout=SimpleNamespace(tensor_parallel_size=1)),
                             engine=SimpleNamespace(generate=generate, sleep=lambda: None),
                             memory=SimpleNamespace(memory_mb=lambda: {}))  # fmt: skip
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3)
    out = PolicyWorker.sample(worker, torch.ones(3, 5, dtype=torch.long), torch.ones(3, 5), params)  # type: ignore[arg-type]
    assert asked == [SamplingParams(n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3, logprob_rows=())]
    assert out.response_ids.shape == (6, 4) and out.finish_reason == ["length"] * 6

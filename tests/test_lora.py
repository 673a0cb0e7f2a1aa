"""LoRA: the sharded update on 2 gloo workers against a one-process peft reference, the reference policy with the
adapters off, merged weights, the binding checks."""

import dataclasses
import json

import pytest
import torch
from role_runs import rank_share, save_model_dir
from test_fsdp import CLIP, KL, LR, WIDTH, make_batch, small_model

import rlkit
from rlkit.algos import clipped_policy_loss, kl_estimate
from rlkit.models.logprobs import response_logprobs
from rlkit.models.lora import adapters_disabled, apply_lora, bind, merged_weights

pytest.importorskip("peft")

LORA = rlkit.LoraConfig(rank=4, alpha=8.0)


def config(version: int, checkpointing: bool = False) -> rlkit.GRPOConfig:
    return rlkit.GRPOConfig(
        clip_eps=CLIP,
        kl_coef=KL,
        micro_batch_size=2,
        rollout=rlkit.RolloutConfig(max_new_tokens=WIDTH),
        data=rlkit.DataConfig(max_prompt_tokens=6),
        optim=rlkit.OptimConfig(lr=LR, max_grad_norm=0.5),
        fsdp=rlkit.FSDPConfig(version=version, activation_checkpointing=checkpointing),
        lora=LORA,
    )


def start_adapters() -> dict[str, torch.Tensor]:
    """Adapters with B != 0 (a fresh B is 0, which would leave A's first gradient 0): by parameter path."""
    model = small_model()
    apply_lora(model, LORA)
    gen = torch.Generator().manual_seed(3)
    return {n: 0.1 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters() if p.requires_grad}


def reference_update() -> dict:
    """One process, peft's own PeftModel: the update's loss, adapter gradients (after clipping) and adapters."""
    import peft

    model = peft.get_peft_model(small_model(), peft.LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear"))
    peft.set_peft_model_state_dict(model, {"base_model.model." + k: v for k, v in start_adapters().items()})
    batch = make_batch()
    trained = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trained.values(), lr=LR, weight_decay=0.0)
    logp, _ = response_logprobs(model, batch["input_ids"], batch["attention_mask"], response_width=WIDTH,
                                temperature=1.0)  # fmt: skip
    per_token, _ = clipped_policy_loss(logp, batch["old_logprobs"], batch["advantages"], CLIP)
    per_token = per_token + KL * kl_estimate(logp, batch["ref_logprobs"], "k3")
    mask = batch["response_mask"]
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained.values(), 0.5)
    grads = {n: p.grad.clone() for n, p in trained.items()}
    optimizer.step()
    return {"loss": loss.item(), "grads": grads, "adapters": {n: p.detach().clone() for n, p in trained.items()}}


def sharded_update(model_dir: str, version: int, checkpointing: bool) -> dict:
    """On a worker: rlkit's PolicyWorker with LoRA from the same adapters, half the batch on this rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from rlkit.fsdp import iter_full_params
    from rlkit.fsdp.full_params import clean_name
    from rlkit.models.lora import is_adapter_param
    from rlkit.workers import PolicyRows, PolicyWorker

    worker = PolicyWorker(config(version, checkpointing), model_dir)
    model = worker.actor.model
    set_model_state_dict(model, start_adapters(), options=StateDictOptions(full_state_dict=True, strict=False))
    before = {n: t for n, t in iter_full_params(model) if not is_adapter_param(n)}
    share = rank_share(make_batch())
    fields = ("input_ids", "attention_mask", "response_mask", "advantages", "old_logprobs", "ref_logprobs")
    result = worker.update(PolicyRows(**{k: share[k] for k in fields}))
    grads = {}
    if version == 2:  # FSDP1's flat gradients are checked through the weights
        for name, p in model.named_parameters():
            if p.requires_grad:
                grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    after = dict(iter_full_params(model))
    with worker.reference_model() as reference:
        assert reference is model
        ref_logp, _ = response_logprobs(reference, share["input_ids"], share["attention_mask"], response_width=WIDTH,
                                        temperature=1.0)  # fmt: skip
    report = worker.grad_report()
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    optimized = sorted(names[id(p)] for g in worker.actor.optimizer.param_groups for p in g["params"])
    worker.close()
    return {
        "loss": result.metrics["actor/loss"],
        "grads": grads,
        "adapters": {n: t for n, t in after.items() if is_adapter_param(n)},
        "frozen_moved": [n for n, t in before.items() if not torch.equal(t, after[n])],
        "ref_logprobs": ref_logp.detach(),
        "reported": sorted(e.name for e in report.entries),
        "optimized": optimized,
        "binding": worker.lora_binding.summary(),
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_model_dir(small_model(), tmp_path_factory.mktemp("small"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("version,checkpointing", [(2, False), (2, True), (1, True)])
def test_lora_update_equals_one_process_peft_reference(cluster, model_dir, version, checkpointing):
    ref = reference_update()
    base = small_model()
    batch = make_batch()
    for rank, got in enumerate(cluster.run(sharded_update, model_dir, version, checkpointing)):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert got["adapters"].keys() == ref["adapters"].keys()
        for name, want in ref["adapters"].items():
            torch.testing.assert_close(got["adapters"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-7, msg=name)
        assert got["frozen_moved"] == []
        # the KL reference is the base model: the adapters off, no copy
        share = {k: v[rank * 4 : (rank + 1) * 4] for k, v in batch.items()}
        base_logp, _ = response_logprobs(base, share["input_ids"], share["attention_mask"], response_width=WIDTH,
                                         temperature=1.0)  # fmt: skip
        torch.testing.assert_close(got["ref_logprobs"], base_logp.detach(), rtol=1e-5, atol=1e-5)
        # only the adapters are optimized and in the gradient report
        assert got["optimized"] == sorted(ref["adapters"])
        assert got["reported"] and all(".lora_" in n for n in got["reported"])
        assert got["binding"] == {name: 2 for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip



def bf16_update(model_dir: str, version: int, reference_first: bool) -> dict:
    """On a worker: the GPU's dtypes on gloo (a bf16 base, bf16 compute, fp32 adapters, fp32 reduction): optionally
    the KL reference's pass (the adapters off) first, as a step does, then the update."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from rlkit.workers import PolicyRows, PolicyWorker

    cfg = config(version)
    cfg.fsdp.param_dtype = "bf16"
    worker = PolicyWorker(cfg, model_dir)
    model = worker.actor.model
    set_model_state_dict(model, start_adapters(), options=StateDictOptions(full_state_dict=True, strict=False))
    share = rank_share(make_batch())
    if reference_first:
        with worker.reference_model() as reference:
            worker._scored_logprobs(reference, share["input_ids"], share["attention_mask"])
    fields = ("input_ids", "attention_mask", "response_mask", "advantages", "old_logprobs", "ref_logprobs")
    result = worker.update(PolicyRows(**{k: share[k] for k in fields}))
    trained = [p for p in model.parameters() if p.requires_grad]
    state = [t for p in trained for t in worker.actor.optimizer.state[p].values() if t.dim() > 0]
    worker.close()
    return {
        "norm": result.metrics["actor/grad_norm"],
        "grads": [p.grad.full_tensor() for p in trained] if version == 2 else [],  # FSDP1's are flat views
        "fsdp2_grad_dtypes": _fsdp2_grad_dtypes(model),
        "dtypes": {
            "base": {str(p.dtype) for p in model.parameters() if not p.requires_grad},
            "adapters": {str(p.dtype) for p in trained},
            "grads": {str(p.grad.dtype) for p in trained},
            "adam": {str(t.dtype) for t in state},
        },
    }


def _fsdp2_grad_dtypes(model: torch.nn.Module) -> set[str]:
    """The dtypes FSDP2's units cast their reduced gradients to (what the GPU's backward assigns to the adapters):
    torch 2.13 on CPU reaches the same state as torch 2.11 on CUDA but does not refuse the assignment, so the test
    reads the state (a private attribute: FSDP2 has no public one)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for unit in units for g in unit._get_fsdp_state()._fsdp_param_groups]
    return {str(g._orig_dtype) for g in groups if any(p.sharded_param.requires_grad for p in g.fsdp_params)}


@pytest.mark.numeric
@pytest.mark.timeout(180)
@pytest.mark.parametrize("version", [2, 1])
def test_lora_in_the_gpus_dtypes_after_the_reference_pass(cluster, model_dir, version):
    """What broke LoRA's first backward on the GPU: the step's first forward is the KL reference's, with the adapters
    switched off. FSDP2 then saw no trained parameter and kept the adapters' gradients in bf16 (torch 2.11 on CUDA
    refuses to assign them to the fp32 adapters; on CPU this shows in the state FSDP2 records), and FSDP1's adapter
    units got fp32 inputs for bf16 weights. The reference pass must
    change nothing: the gradient is the same with and without it, and every trained tensor stays fp32."""
    plain, after_reference = (cluster.run(bf16_update, model_dir, version, first)[0] for first in (False, True))
    assert after_reference["norm"] == pytest.approx(plain["norm"], rel=1e-6)
    assert plain["norm"] > 0
    for got, want in zip(after_reference["grads"], plain["grads"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert after_reference["fsdp2_grad_dtypes"] == ({"torch.float32"} if version == 2 else set())
    fp32 = {"torch.float32"}
    assert after_reference["dtypes"] == {"base": {"torch.bfloat16"}, "adapters": fp32, "grads": fp32, "adam": fp32}

def test_merged_weights_give_the_adapted_models_outputs():
    model = small_model()
    apply_lora(model, LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(start_adapters()[name])
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    base = small_model()
    with torch.no_grad():
        adapted = model(ids).logits
        with adapters_disabled(model):
            torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
        merged = dict(merged_weights(model.named_parameters(), LORA.alpha / LORA.rank))
        assert merged.keys() == dict(base.named_parameters()).keys()
        base.load_state_dict(merged)
        torch.testing.assert_close(base(ids).logits, adapted, rtol=1e-5, atol=1e-5)
        assert (adapted - small_model()(ids).logits).abs().max() > 0.1  # the adapters do move the outputs


def test_target_lists_that_bind_nothing_or_some_layers_are_errors_naming_what_matched():
    model = small_model()
    assert bind(model, rlkit.LoraConfig(rank=2, target_modules=["q_proj", "v_proj"])).summary() == {
        "self_attn.q_proj": 2, "self_attn.v_proj": 2}  # fmt: skip
    with pytest.raises(ValueError, match=r"matches no module.*\['down_proj', 'gate_proj', 'k_proj'"):
        bind(model, rlkit.LoraConfig(rank=2, target_modules=["query_key_value"]))
    with pytest.raises(ValueError, match=r"unevenly \(1 of 2 layers.*model.layers.1': \[\]"):
        bind(model, rlkit.LoraConfig(rank=2, target_modules=["layers.0.self_attn.q_proj"]))
    with pytest.raises(ValueError, match="not linear layers"):
        bind(model, rlkit.LoraConfig(rank=2, target_modules=["embed_tokens"]))


def test_adapter_sync_needs_adapters_and_nothing_trained_whole():
    with pytest.raises(rlkit.ConfigError) as err:
        rlkit.GRPOConfig(rollout=rlkit.RolloutConfig(lora_sync="adapter"),
                         lora=rlkit.LoraConfig(rank=4, modules_to_save=["lm_head"]))  # fmt: skip
    assert "lora.modules_to_save=['lm_head']" in str(err.value)
    with pytest.raises(rlkit.ConfigError, match="without adapters"):
        rlkit.GRPOConfig(rollout=rlkit.RolloutConfig(lora_sync="adapter"))


def test_a_target_list_matching_nothing_is_reported_before_launch():
    from rlkit.diagnostics.preflight import check_launch

    config = rlkit.GRPOConfig(model="tiny", lora=rlkit.LoraConfig(rank=4, target_modules=["qkv_proj", "dense"]))
    with pytest.raises(rlkit.ConfigError, match=r"target_modules=\['qkv_proj', 'dense'\] matches no module.*'q_proj'"):
        check_launch(config, 2)


QWEN_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
ONE_H200 = dict(device_memory_gib=139.8, world_size=1, prompt_tokens=256, response_tokens=1024, samples_per_step=64,
                micro_batch_size=4, padding_free=True, padding_mask=False, activation_checkpointing=True,
                reference=True, engine="vllm", gpu_memory_utilization=0.3)
"""A GRPO run with a KL term on one H200, vLLM colocated."""


@pytest.mark.parametrize("shape,adapters", [(QWEN_7B, 40_370_176), (LLAMA_8B, 41_943_040)])
def test_memory_estimate_fits_7b_and_8b_on_one_device_with_lora_not_without(shape, adapters):
    from rlkit import diagnostics as dx
    from rlkit.diagnostics.memory_terms import GiB, ModelShape

    model = ModelShape.from_config(shape)
    assert model.lora_params(16) == adapters  # 16 * (in + out) of q, k, v, o, gate, up, down in every layer
    full = dx.estimate_memory(shape, **ONE_H200)
    lora = dx.estimate_memory(shape, **ONE_H200, lora_rank=16)
    assert not full.fits and lora.fits
    state = lora.phases["update"]
    assert state["parameters"] * GiB == pytest.approx(2 * model.num_parameters + 4 * adapters, abs=1)  # bf16 + fp32
    # the adapters' sharded gradients at the optimizer step (in the update they accumulate unsharded: "gathered")
    assert lora.phases["optimizer_step"]["gradients"] * GiB == pytest.approx(4 * adapters, abs=1)
    assert state["optimizer"] * GiB == pytest.approx(8 * adapters, abs=1)
    # full fine-tuning holds fp32 parameters, gradients, AdamW state and a reference copy: 20 bytes a parameter
    assert full.phases["update"]["parameters"] * GiB == pytest.approx(8 * model.num_parameters, abs=1)
    assert full.peak_gib - lora.peak_gib > 100


@pytest.mark.parametrize("prompts", [1, 2, 7, 64])
def test_vllm_keeps_one_prompts_log_probs_with_adapters_when_none_are_asked_for(prompts):
    from rlkit.rollout.base import logprob_prompts
    from rlkit.rollout.build import logprob_fraction

    assert logprob_prompts(prompts, logprob_fraction(0.0, True, max_num_seqs=64 * 8)).sum() == 1
    assert logprob_prompts(prompts, logprob_fraction(0.0, False, max_num_seqs=64 * 8)).sum() == 0
    asked = logprob_prompts(prompts, logprob_fraction(0.125, True, max_num_seqs=64 * 8))
    assert torch.equal(asked, logprob_prompts(prompts, 0.125))



def launch_problems(world_size: int = 2, **lora) -> str:
    """The pre-launch check's message for the tiny model (tied embeddings) with ``[lora]`` settings ("" if none)."""
    from rlkit.diagnostics.preflight import check_launch

    fsdp = rlkit.FSDPConfig(version=lora.pop("fsdp_version", 2))
    try:
        check_launch(rlkit.GRPOConfig(model="tiny", fsdp=fsdp, lora=rlkit.LoraConfig(rank=4, **lora)), world_size)
    except rlkit.ConfigError as err:
        return str(err)
    return ""


def test_modules_to_save_must_name_modules_and_not_the_head_or_the_embedding():
    """The tiny model ties its head to its embedding: a trained copy of either would be trained on one side only
    (the hf engine's sync wrote it into the shared weight, the export dropped it), and the fused head reads the
    head's weight itself (padding-free rollouts crashed)."""
    assert "'lm_head' is the model's output head" in launch_problems(modules_to_save=["lm_head"])
    assert "'embed_tokens' is the model's input embedding" in launch_problems(modules_to_save=["embed_tokens"])
    assert "lora.modules_to_save: ['score'] match no module" in launch_problems(modules_to_save=["score"])
    assert launch_problems(modules_to_save=["input_layernorm"]) == ""


def test_target_entries_that_match_nothing_are_named_even_when_others_match():
    message = launch_problems(target_modules=["q_proj", "nonexistent_proj"])
    assert "lora.target_modules: ['nonexistent_proj'] match no module" in message and "'q_proj'" in message


def test_lora_settings_without_a_rank_and_adapter_dropout_in_rl_are_errors():
    with pytest.raises(rlkit.ConfigError, match=r"lora: alpha, target_modules set but lora.rank is 0"):
        rlkit.GRPOConfig(lora=rlkit.LoraConfig(alpha=16.0, target_modules=["q_proj"]))
    with pytest.raises(rlkit.ConfigError, match=r"lora.dropout=0.1: RL compares"):
        rlkit.GRPOConfig(lora=rlkit.LoraConfig(rank=8, dropout=0.1))
    with pytest.raises(rlkit.ConfigError, match=r"critic.lora.dropout=0.05"):
        rlkit.PPOConfig(critic=rlkit.CriticConfig(lora=rlkit.LoraConfig(rank=8, dropout=0.05)))


def test_fsdp1_lora_on_an_unsharded_rank_with_tied_embeddings_is_refused_before_launch():
    """torch's FSDP1 (use_orig_params, not sharding) leaves the frozen tied weight as a plain tensor after the first
    training forward, and the engine's sync then fails (seen on the H200 and on one CPU rank); 2 ranks shard."""
    assert "fsdp.version=1 with lora.rank=4 on 1 rank(s)" in launch_problems(world_size=1, fsdp_version=1)
    assert launch_problems(world_size=2, fsdp_version=1) == ""
    assert launch_problems(world_size=1, fsdp_version=2) == ""


def test_the_lora_line_counts_what_trains():
    from rlkit.models import describe_lora, load_causal_lm
    from rlkit.models.tiny import TINY_MODEL_DIR

    lora = rlkit.LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])
    model = load_causal_lm(TINY_MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    line = describe_lora(rlkit.GRPOConfig(model="tiny", lora=lora))
    assert line == (f"LoRA r=8, alpha 16 (scale 2) on q_proj, v_proj in 2 of 2 decoder layers: {trained / 1e6:.2f}M "
                    f"trainable parameters of {total / 1e6:.2f}M ({100 * trained / total:.2f}%); the rest frozen")


def test_a_resume_names_each_lora_setting_that_changed_the_checkpoints_shapes(tmp_path):
    from rlkit.trainer import checkpoints

    saved = rlkit.GRPOConfig(lora=rlkit.LoraConfig(rank=8, target_modules=["q_proj"]))
    (tmp_path / checkpoints.META).write_text(json.dumps({"config": saved.to_dict()}))
    assert checkpoints.resume_problems(tmp_path, dataclasses.replace(saved, steps=500)) == []
    changed = dataclasses.replace(saved, lora=rlkit.LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    problems = checkpoints.resume_problems(tmp_path, changed)
    assert [p.split(":")[0] for p in problems] == [
        f"the checkpoint {tmp_path.name} has lora.rank 8, the config 4",
        f"the checkpoint {tmp_path.name} has lora.target_modules ['q_proj'], the config ['q_proj', 'v_proj']",
    ]


def test_the_backward_holds_no_gradients_of_a_frozen_base():
    """Gathered in backward: the root's and one layer's gradients beside the units; with LoRA only the adapters'
    (a layer's share), not the base's in the compute dtype (2.46 GiB at Qwen2.5-7B, r=16, counted before)."""
    from rlkit.diagnostics.memory_terms import MemorySetting, ModelShape, gathered_bytes

    shape = ModelShape.from_config(QWEN_7B)
    for keep in (False, True):
        setting = MemorySetting(**ONE_H200, lora_rank=16, compute_dtype="bf16", keep_unsharded=keep)
        extra = gathered_bytes(shape, setting, 2, backward=True) - gathered_bytes(shape, setting, 2, backward=False)
        per_layer = shape.lora_params(16) // shape.num_layers
        # bf16 gradients of a layer's adapters, and without keep_unsharded their fp32 copies for the reduction
        assert extra == per_layer * (2 if keep else 2 + 4)

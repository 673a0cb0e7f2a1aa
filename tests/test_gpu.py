"""GPU path: nccl, bf16 compute, one process per GPU (marked gpu; skipped without CUDA devices)."""

import importlib.util

import pytest
import torch
from role_runs import save_model_dir

import rlkit
from tests.test_vllm import skip_syncs

pytestmark = pytest.mark.gpu


def small_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )


def update_and_gather(model_dir: str, version: int) -> dict:
    """On a worker: one bf16-compute FSDP update of a small Qwen2 on this rank's half of a batch."""
    from role_runs import policy_update

    from rlkit.runtime import context

    ctx = context()
    cfg = rlkit.GRPOConfig(rollout=rlkit.RolloutConfig(max_new_tokens=8), fsdp=rlkit.FSDPConfig(version=version))
    gen = torch.Generator().manual_seed(0)
    n = 8 * ctx.world_size
    batch = {
        "input_ids": torch.randint(0, 512, (n, 24), generator=gen),
        "attention_mask": torch.ones(n, 24, dtype=torch.long),
        "response_mask": torch.ones(n, 8),
        "old_logprobs": torch.full((n, 8), -6.0),
        "advantages": torch.randn(n, 8, generator=gen),
    }
    result = policy_update(model_dir, cfg, batch)
    return {
        "loss": result["metrics"]["actor/loss"],
        "norm": result["metrics"]["actor/grad_norm"],
        "checksums": {k: v.double().sum().item() for k, v in result["weights"].items()},
        "backend": ctx.backend,
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("version", [2, 1])
def test_two_gpu_update_agrees_across_ranks(tmp_path, version):
    model_dir = save_model_dir(small_qwen2(), tmp_path)
    with rlkit.launch(world_size=2, device="cuda") as cluster:
        first, second = cluster.run(update_and_gather, model_dir, version)
    assert first["backend"] == "nccl"
    assert first["loss"] == second["loss"] and first["norm"] == second["norm"]
    assert first["checksums"] == second["checksums"]


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2])
def test_trainer_steps_on_gpus(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices")
    config = rlkit.GRPOConfig(
        model="tiny", prompts_per_step=16, group_size=8, kl_coef=0.01, rollout=rlkit.RolloutConfig(max_new_tokens=6)
    )
    with rlkit.launch(world_size=world_size, device="cuda") as cluster:
        trainer = rlkit.Trainer(cluster, config)
        history = trainer.fit(3, progress=False)
    assert (history["time/worker/update"] > 0).all()
    # bf16 compute in the actor and a bf16 engine: log-probs agree to bf16 precision, not exactly
    assert history["rollout/logprob_gap/mean"].max() < 0.1


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recompute_logprobs", [True, False])
def test_vllm_engine_follows_the_actor_through_cuda_ipc_syncs(recompute_logprobs):
    """Updates that move the policy; rollouts after a sync match the trainer, one after a skipped sync does not."""
    config = rlkit.GRPOConfig(
        model="tiny",
        prompts_per_step=16,
        group_size=8,
        recompute_logprobs=recompute_logprobs,
        optim=rlkit.OptimConfig(lr=5e-3),
        rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=6),
    )
    with rlkit.launch(world_size=1, device="cuda") as cluster:
        trainer = rlkit.Trainer(cluster, config)
        synced = trainer.fit(3, progress=False)
        cluster.run(skip_syncs, True)  # the engine keeps the weights it has
        stale = trainer.fit(2, progress=False).iloc[-1]  # its rollout used the weights from before the last update
    assert (synced["time/worker/sync"] > 0).all()
    synced_gap, stale_gap = synced["rollout/logprob_gap/mean"].max(), stale["rollout/logprob_gap/mean"]
    print(f"log-prob gap: synced <= {synced_gap:.4f}, after a skipped sync {stale_gap:.4f}")
    # a bf16 engine against bf16-compute training agree to bf16 precision, not exactly
    assert synced_gap < 0.05
    assert stale_gap > 3 * synced_gap


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.timeout(900)
def test_tensor_parallel_engine_agrees_with_the_trainer_as_closely_as_an_engine_per_rank():
    """rollout.tensor_parallel_size=2 on 2 GPUs: one engine spanning both (owned by rank 0, its TP worker on GPU 1
    reading rank 0's shared buffers), synced after every update; its log-prob gap to the trainer is that of TP=1,
    and a skipped sync still shows."""
    synced, stale = {}, {}
    for tp in (1, 2):
        config = rlkit.GRPOConfig(
            model="tiny",
            prompts_per_step=16,
            group_size=8,
            optim=rlkit.OptimConfig(lr=5e-3),
            rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=6, tensor_parallel_size=tp),
        )
        with rlkit.launch(world_size=2, device="cuda") as cluster:
            trainer = rlkit.Trainer(cluster, config)
            synced[tp] = trainer.fit(3, progress=False)["rollout/logprob_gap/mean"].max()
            cluster.run(skip_syncs, True)
            stale[tp] = trainer.fit(2, progress=False).iloc[-1]["rollout/logprob_gap/mean"]
    print(f"log-prob gap after syncs: TP=1 {synced[1]:.4f}, TP=2 {synced[2]:.4f}; skipped sync: {stale}")
    assert synced[2] < 0.05 and synced[2] <= 2 * synced[1] + 0.005
    assert stale[2] > 3 * synced[2]


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("entropy", ["detached", "grad"])
def test_fused_head_compiles_on_the_gpu_and_matches_the_eager_head(entropy):
    """A ResponseHead on a GPU picks the compiled chunk math; it compiles (no fallback) and its log-probs, entropies
    and gradients equal the eager math's within bf16 rounding (both take the softmax in fp32 from bf16 logits)."""
    from rlkit.models.head import EAGER, ResponseHead, linear_logprobs

    torch.manual_seed(0)
    rows, hidden_size, vocab = 3000, 256, 32_768  # 3 chunks of 1,024 rows at V = 32,768, the last one short
    head = ResponseHead(torch.nn.Linear(hidden_size, vocab, bias=False)).cuda().to(torch.bfloat16)
    hidden = torch.randn(rows, hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows,), device="cuda")
    with head.scoring(torch.arange(rows, device="cuda"), tokens, 0.7, entropy):
        head(hidden)
    fused = head.chunk_math
    assert fused is not None and fused.name == "fused"
    weights = torch.randn(rows, 2, device="cuda")
    results = []
    for math in (EAGER, fused, fused):  # the fused math twice: the second call runs the compiled kernels
        out = linear_logprobs(hidden, head.weight, tokens, 0.7, entropy, chunk_rows=1024, math=math)
        results.append((out, *torch.autograd.grad((out * weights).sum(), (hidden, head.weight))))
    assert fused.stats.failure is None and fused.grad.failure is None, (fused.stats.failure, fused.grad.failure)
    for eager, compiled in zip(results[0], results[2], strict=True):
        rel = (compiled.float() - eager.float()).norm() / eager.float().norm()
        assert rel < 1e-2, f"relative difference {rel:.3g}"


def kept_bf16_update(model_dir: str, keep: bool) -> dict[str, float]:
    """On a worker: a bf16-compute update of the small Qwen2 in micro-batches of 2 with FSDP's units kept gathered
    through the step or not; each parameter's gradient sum of squares before clipping, and the global norm."""
    from role_runs import rank_share

    from rlkit.workers import PolicyRows, PolicyWorker

    cfg = rlkit.GRPOConfig(rollout=rlkit.RolloutConfig(max_new_tokens=8), micro_batch_size=2)
    worker = PolicyWorker(cfg, model_dir)
    assert worker.actor.keep_unsharded  # the estimate's choice on a GPU for this small model
    worker.actor.keep_unsharded = keep
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 512, (8, 24), generator=gen), "attention_mask": torch.ones(8, 24).long(),
             "response_mask": torch.ones(8, 8), "advantages": torch.randn(8, 8, generator=gen)}
    result = worker.update(PolicyRows(**rank_share(batch)))
    report = worker.grad_report()
    worker.close()
    return {**{e.name: e.sumsq for e in report.entries}, "global norm": result.metrics["actor/grad_norm"]}


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_units_kept_gathered_give_the_same_bf16_gradients(tmp_path):
    """4 micro-batches in bf16 with fp32 gradient reduction: kept gathered (gradients summed unsharded in fp32) and
    resharded every micro-batch give every parameter the same gradient to within fp32 summation order."""
    model_dir = save_model_dir(small_qwen2(), tmp_path)
    with rlkit.launch(world_size=1, device="cuda") as cluster:
        kept = cluster.run(kept_bf16_update, model_dir, True)[0]
        plain = cluster.run(kept_bf16_update, model_dir, False)[0]
    assert kept.keys() == plain.keys() and plain["global norm"] > 0
    for name, value in plain.items():
        assert kept[name] == pytest.approx(value, rel=1e-3, abs=1e-12), name


def adapter_dtypes() -> dict[str, list[str]]:
    """On a worker: the dtypes of the policy's frozen base, adapters, their gradients and AdamW state."""
    from rlkit.runtime import local_instance
    from rlkit.workers import PolicyWorker

    actor = local_instance(PolicyWorker).actor
    model, optimizer = actor.model, actor.optimizer
    trained = [p for p in model.parameters() if p.requires_grad]
    state = [t for p in trained for t in optimizer.state[p].values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "base": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad}),
        "adapters": sorted({str(p.dtype) for p in trained}),
        "grads": sorted({str(p.grad.dtype) for p in trained if p.grad is not None}),
        "adam": sorted({str(t.dtype) for t in state}),
    }


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("version,checkpointing", [(2, False), (2, True)])
def test_lora_trains_with_the_gpu_dtypes(version, checkpointing):
    """LoRA with a KL reference (the adapters off: the first forward FSDP sees) in bf16 compute: the base stays
    bf16 and frozen, adapters, gradients and AdamW state are fp32, the policy moves and the engine follows it."""
    config = rlkit.GRPOConfig(
        model="tiny", prompts_per_step=16, group_size=8, kl_coef=0.01, optim=rlkit.OptimConfig(lr=5e-3),
        rollout=rlkit.RolloutConfig(max_new_tokens=6),
        fsdp=rlkit.FSDPConfig(version=version, activation_checkpointing=checkpointing),
        lora=rlkit.LoraConfig(rank=8, alpha=16.0),
    )  # fmt: skip
    with rlkit.launch(world_size=1, device="cuda") as cluster:
        trainer = rlkit.Trainer(cluster, config)
        history = trainer.fit(3, progress=False)
        dtypes = cluster.run(adapter_dtypes)[0]
    assert dtypes == {"base": ["torch.bfloat16"], "adapters": ["torch.float32"], "grads": ["torch.float32"],
                      "adam": ["torch.float32"]}  # fmt: skip
    assert history["actor/grad_norm"].iloc[1:].gt(0).all()
    assert history["kl/mean"].iloc[-1] > 0  # the adapters moved the policy away from the base
    assert history["rollout/logprob_gap/mean"].max() < 0.05  # the hf engine follows the merged adapters


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
@pytest.mark.timeout(600)
def test_vllm_adapter_sync_follows_the_adapters_and_a_skipped_sync_shows():
    """rollout.lora_sync="adapter" on vLLM in bf16: the engine's log-probs match the trainer's after each sync, and
    a skipped sync (the engine keeps the old adapter) shows in the gap."""
    config = rlkit.GRPOConfig(
        model="tiny", prompts_per_step=16, group_size=8, optim=rlkit.OptimConfig(lr=5e-3),
        rollout=rlkit.RolloutConfig(engine="vllm", max_new_tokens=6, lora_sync="adapter", engine_logprobs=1.0),
        lora=rlkit.LoraConfig(rank=8, alpha=16.0),
    )  # fmt: skip
    with rlkit.launch(world_size=1, device="cuda") as cluster:
        trainer = rlkit.Trainer(cluster, config)
        synced = trainer.fit(3, progress=False)
        cluster.run(skip_syncs, True)
        stale = trainer.fit(2, progress=False).iloc[-1]
    synced_gap, stale_gap = synced["rollout/logprob_gap/mean"].max(), stale["rollout/logprob_gap/mean"]
    print(f"LoRA adapter sync, log-prob gap: synced <= {synced_gap:.4f}, after a skipped sync {stale_gap:.4f}")
    assert synced_gap < 0.05
    assert stale_gap > 3 * synced_gap


def kernels_bf16_update(model_dir: str, kernels: str) -> dict[str, float]:
    """On a worker: one bf16-compute update of the small Qwen2 (packed rows) with ``fsdp.kernels``; the loss, each
    parameter's gradient sum of squares before clipping and the global norm. Liger patches this process's
    transformers modules for good: one launch per value."""
    from role_runs import rank_share

    from rlkit.workers import PolicyRows, PolicyWorker

    cfg = rlkit.GRPOConfig(rollout=rlkit.RolloutConfig(max_new_tokens=8), micro_batch_size=4,
                           fsdp=rlkit.FSDPConfig(kernels=kernels))
    worker = PolicyWorker(cfg, model_dir)
    swapped = {type(m).__name__ for m in worker.actor.model.modules()} | {
        m._get_name() for m in worker.actor.model.modules()}
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(8, 24).long()
    mask[::2, :5] = 0  # left padding on half the rows: the packed path's position ids restart per row
    batch = {"input_ids": torch.randint(0, 512, (8, 24), generator=gen), "attention_mask": mask,
             "response_mask": torch.ones(8, 8), "advantages": torch.randn(8, 8, generator=gen)}
    result = worker.update(PolicyRows(**rank_share(batch)))
    report = worker.grad_report()
    worker.close()
    return {**{e.name: e.sumsq for e in report.entries}, "global norm": result.metrics["actor/grad_norm"],
            "loss": result.metrics["actor/loss"], "liger": float(any("Liger" in n for n in swapped))}


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
@pytest.mark.timeout(300)
def test_liger_kernels_give_the_bf16_update_of_the_model_code(tmp_path):
    """fsdp.kernels="liger" swaps Liger's RMSNorm, SwiGLU and rotary kernels in; the update's loss and every
    parameter's gradient stay within bf16 rounding of the model's own code."""
    model_dir = save_model_dir(small_qwen2(), tmp_path)
    runs = {}
    for kernels in ("torch", "liger"):
        with rlkit.launch(world_size=1, device="cuda") as cluster:
            runs[kernels] = cluster.run(kernels_bf16_update, model_dir, kernels)[0]
    plain, liger = runs["torch"], runs["liger"]
    assert liger.pop("liger") == 1.0 and plain.pop("liger") == 0.0
    assert liger.keys() == plain.keys() and plain["global norm"] > 0
    for name, value in plain.items():
        assert liger[name] == pytest.approx(value, rel=3e-2, abs=1e-9), name

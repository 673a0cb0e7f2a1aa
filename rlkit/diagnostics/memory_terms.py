"""The terms of the memory estimate: what each part of an rlkit step keeps on one rank's device, in bytes.

Every formula follows what the code keeps (rlkit.fsdp, rlkit.models.logprobs, rlkit.rollout, transformers'
Qwen2/Llama decoder layer with SDPA); :mod:`rlkit.diagnostics.estimate` turns them into phases and fixes.
Margins that cannot be derived are named constants here, to be calibrated against measured peaks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlkit.diagnostics.head_memory import LogitsLayout, fused_head_bytes, logits_bytes
from rlkit.models.packing import PACKABLE_MODEL_TYPES

GiB = 2**30

CUDA_CONTEXT_GIB = 1.0
"""Device memory of the trainer's process outside PyTorch's allocator: CUDA context, cuBLAS workspaces, NCCL."""
FRAGMENTATION = 0.05
"""Caching-allocator slack (reserved blocks too small or split for the next request), as a fraction of allocated."""
VLLM_ASLEEP_GIB = 1.5
"""A sleeping vLLM engine (sleep level 1: weights in host memory, KV cache dropped): its CUDA context and graphs."""
VLLM_WORKSPACE_GIB = 2.0
"""vLLM beside its weights when ``kv_cache_gb`` fixes the KV cache: activations, sampler, CUDA graphs, context."""
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
SHARDINGS = ("full", "hybrid", "no_shard")
SLEEPS = ("always", "auto", "never")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a Qwen2/Llama-style decoder that the estimate needs (from its config.json)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    """Qwen2 has biases on q, k and v; Llama only where ``attention_bias`` says so."""
    fused_head: bool = True
    """rlkit fuses the LM head with the log-softmax (the families of ``PACKABLE_MODEL_TYPES``): no [rows, V] logits."""

    @classmethod
    def from_config(cls, config: Mapping | Any) -> ModelShape:
        """From a config.json dict or a transformers PretrainedConfig (Qwen2, Llama, Mistral and the like).

        Without ``tie_word_embeddings`` the embeddings count as untied (the larger, safer estimate)."""
        def get(key: str, default: Any = None) -> Any:
            return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)

        needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in needed if get(k) is None]
        if missing:
            raise ValueError(f"model config lacks {missing}: the estimate needs a decoder's {list(needed)}")
        heads = int(get("num_attention_heads"))
        bias = get("attention_bias")
        return cls(
            hidden_size=int(get("hidden_size")),
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or get("hidden_size") // heads),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=bool(bias) if bias is not None else get("model_type") == "qwen2",
            fused_head=get("model_type") in PACKABLE_MODEL_TYPES,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """q, k, v, o projections (+ q/k/v biases), gate/up/down projections and two RMSNorm weights."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * q + 2 * h * kv + q * h + bias + 3 * h * i + 2 * h

    @property
    def root_params(self) -> int:
        """The FSDP root unit: embeddings, the final norm and an untied LM head."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tied_embeddings else 2) + self.hidden_size

    @property
    def num_parameters(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    def lora_params(self, rank: int, targets: Sequence[str] | str = "all-linear") -> int:
        """Adapter parameters of rank ``rank`` on ``targets`` ("all-linear" or module names) in every layer:
        rank * (in + out) per adapted projection."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
                 "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}  # fmt: skip
        chosen = sizes if targets == "all-linear" else {k: v for k, v in sizes.items() if k in targets}
        return rank * sum(chosen.values()) * self.num_layers

    @property
    def value_model_params(self) -> int:
        """The critic: the backbone without the LM head plus a linear value head (h weights + 1 bias)."""
        h = self.hidden_size
        return self.num_layers * self.layer_params + self.vocab_size * h + h + (h + 1)


@dataclass(frozen=True, kw_only=True)
class MemorySetting:
    """The knobs the estimate reads (rlkit's config names in brackets); build one from a config with
    :func:`rlkit.diagnostics.memory_setting`."""

    device_memory_gib: float
    """Each device's memory (torch.cuda.get_device_properties(i).total_memory / 2**30; H200: 139.8, H100: 79.6)."""
    world_size: int = 1
    sharding: str = "full"
    """[fsdp.sharding] "full", "hybrid" (shards within groups of hybrid_shard_size) or "no_shard"."""
    hybrid_shard_size: int = 0
    compute_dtype: str = "bf16"
    """[fsdp.param_dtype] "bf16" (GPU) or "fp32"; parameters, gradients and AdamW state stay fp32 either way."""
    reduce_dtype: str = "fp32"
    reshard_after_forward: bool = True
    fsdp_version: int = 2
    """[fsdp.version]"""
    keep_unsharded: bool | None = None
    """Whether the update keeps FSDP's units gathered and its gradients unsharded through the micro-batches of
    an optimizer step (``rlkit.fsdp.accumulate``); None: as rlkit decides, which the estimate resolves
    (:attr:`~rlkit.diagnostics.MemoryEstimate.keep_unsharded`)."""
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    compiled_layers: bool = False
    """[fsdp.compile] Each decoder layer's forward compiled by torch.compile: Inductor saves fewer of the layer's
    intermediates for backward and recomputes the rest (:func:`compiled_layer_bytes`)."""
    prompt_tokens: int = 64
    """[data.max_prompt_tokens] Every row is taken at the longest prompt and response (the worst case)."""
    response_tokens: int = 16
    """[rollout.max_new_tokens]"""
    samples_per_step: int = 128
    """[prompts_per_step * group_size] over all ranks."""
    mini_batches: int = 1
    micro_batch_size: int = 64
    """Rows per forward/backward (capped by a rank's rows per mini-batch)."""
    max_tokens_per_micro_batch: int = 0
    """Real tokens per micro-batch; 0 counts rows (micro_batch_size). It bounds memory only when packed: a
    padded micro-batch is as wide as the batch, and short rows let more of them in."""
    padding_free: bool = False
    """Packed rows: no padding mask, the LM head on response tokens only."""
    padding_mask: bool = True
    """Padded rows of different lengths: transformers builds a [b, 1, S, S] mask and SDPA gets k and v expanded to
    every head. False for padded batches of equal lengths (the fixed-length benchmarks) and for packed ones."""
    reference: bool = False
    """[kl_coef > 0] a frozen fp32 sharded copy of the actor."""
    critic: bool = False
    """[PPOConfig] a value model with its own gradients and AdamW state."""
    recompute_logprobs: bool = True
    entropy_bonus: bool = False
    """[entropy_coef > 0] the plain head's loss takes the fp32 log-softmax path (the fused head: the same memory)."""
    head_math: str = "fused"
    """The fused head's chunk math: "fused" (compiled, a GPU's) or "eager" (a CPU's; larger fp32 chunks)."""
    engine: str = "hf"
    """[rollout.engine] "hf" (a whole compute-dtype copy in the trainer's process) or "vllm" (its own process)."""
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 0.0
    engine_sleep: str = "auto"
    """[rollout.sleep] "always"/"auto": vLLM sleeps through scoring and the update ("auto" stays awake only when
    it fits beside the update); "never": it stays awake."""
    lora_rank: int = 0
    """[lora.rank] LoRA on the policy: a frozen base in the compute dtype, fp32 adapters with their gradients and
    AdamW state, the reference = the base (no copy); 0: full fine-tuning."""
    lora_targets: Sequence[str] | str = "all-linear"
    """[lora.target_modules]"""
    lora_sync: str = "merged"
    """[rollout.lora_sync] "merged" (full weights into vLLM's shared buffers) or "adapter" (the adapters alone)."""
    host_memory_gib: float = 0.0
    """Each host's memory (``psutil.virtual_memory().total / 2**30``); 0: host memory is not checked."""
    ranks_per_host: int = 0
    """The ranks that share one host's memory (0: all ``world_size`` of them, a one-machine run)."""

    @property
    def host_ranks(self) -> int:
        """The ranks on one host (:attr:`ranks_per_host`, 0 meaning all of them)."""
        return self.ranks_per_host or self.world_size

    def lora_params(self, shape: ModelShape) -> int:
        """The adapters' parameters (0 without LoRA)."""
        return shape.lora_params(self.lora_rank, self.lora_targets) if self.lora_rank else 0

    def __post_init__(self) -> None:
        checks = [
            (self.device_memory_gib > 0, f"device_memory_gib={self.device_memory_gib}: must be > 0"),
            (self.world_size >= 1, f"world_size={self.world_size}: must be >= 1"),
            (self.sharding in SHARDINGS, f"sharding={self.sharding!r}: use one of {SHARDINGS}"),
            ({self.compute_dtype, self.reduce_dtype} <= set(DTYPE_BYTES),
             f"compute_dtype={self.compute_dtype!r}, reduce_dtype={self.reduce_dtype!r}: each 'bf16' or 'fp32'"),
            (self.engine in ("hf", "vllm"), f'engine={self.engine!r}: use "hf" or "vllm"'),
            (self.engine_sleep in SLEEPS, f"engine_sleep={self.engine_sleep!r}: use one of {SLEEPS}"),
            (self.fsdp_version in (1, 2), f"fsdp_version={self.fsdp_version}: use 1 or 2"),
            (self.head_math in ("fused", "eager"), f'head_math={self.head_math!r}: use "fused" or "eager"'),
            (min(self.prompt_tokens, self.response_tokens, self.samples_per_step, self.mini_batches,
                 self.micro_batch_size) >= 1, "prompt_tokens, response_tokens, samples_per_step, mini_batches and "
             "micro_batch_size must each be >= 1"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("MemorySetting: " + "; ".join(problems))

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is split over."""
        return {"full": self.world_size, "hybrid": self.hybrid_shard_size or self.world_size, "no_shard": 1}[
            self.sharding]

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of one forward/backward, never more than the rank's rows of one mini-batch: rows x (prompt +
        response); with a token budget, the budget (packed) or the whole rows it holds at maximum lengths
        (padded: the budget counts real tokens, so rows shorter than the maximum pack more padded rows in)."""
        rows = max(1, self.samples_per_step // self.world_size // self.mini_batches)
        seq, budget = self.sequence_tokens, self.max_tokens_per_micro_batch
        if budget > 0 and self.padding_free:
            return min(max(budget, seq), rows * seq)
        per_micro = max(1, budget // seq) if budget > 0 else self.micro_batch_size
        return min(per_micro, rows) * seq

    @property
    def sequences_per_micro_batch(self) -> float:
        return self.tokens_per_micro_batch / self.sequence_tokens

    @property
    def micro_batches_per_step(self) -> int:
        """Forward/backward passes per optimizer step on a rank (rows at their longest)."""
        rows = max(1, self.samples_per_step // self.world_size // self.mini_batches)
        return math.ceil(rows / self.sequences_per_micro_batch)

    @property
    def can_keep_unsharded(self) -> bool:
        """Whether keeping units gathered through an optimizer step is on the table at all: several micro-batches,
        no CPU offload (which is there to save device memory), and with FSDP1 (whose no_sync accumulates in the
        compute dtype) only when that is the reduce dtype."""
        exact = self.fsdp_version == 2 or self.compute_dtype == self.reduce_dtype
        return self.micro_batches_per_step > 1 and not self.cpu_offload and exact


def logits_layout(shape: ModelShape, s: MemorySetting) -> LogitsLayout:
    """Fused or packed: the head runs on the response tokens only, no copy. Plain and padded: on T + 1 positions
    per row (``logits_to_keep``), and sampled_logprobs' reshape copies the non-contiguous [:, :-1] slice."""
    seqs = s.sequences_per_micro_batch
    rows = math.ceil(seqs * s.response_tokens)
    if s.padding_free or shape.fused_head:
        return LogitsLayout(rows, rows, 0)
    return LogitsLayout(rows, rows + math.ceil(seqs), 1)


def head_bytes(shape: ModelShape, s: MemorySetting, e: int, *, grad: bool) -> int:
    """Peak bytes of one micro-batch's LM head and log-softmax beside the saved activations: at the loss and in
    its backward (``grad``) or in a scoring forward."""
    layout = logits_layout(shape, s)
    if shape.fused_head:
        return fused_head_bytes(layout.rows, shape.vocab_size, shape.hidden_size, e, grad=grad, math=s.head_math,
                                weight_grad=not s.lora_rank)  # fmt: skip
    return logits_bytes(layout, shape.vocab_size, e, grad=grad, fp32_path=grad and s.entropy_bonus)


def layer_activation_bytes(shape: ModelShape, e: int, *, expanded_kv: bool) -> int:
    """Bytes one decoder layer saves for backward per token (Qwen2/Llama layer, SDPA, e-byte compute dtype).

    What autograd keeps (checked against saved-tensor hooks in tests/test_estimate.py):
      - two RMSNorms, each: its input upcast to fp32 (4h, kept by pow and mul), the normalised value cast back
        (e*h, kept by the weight's mul), its product with the weight (e*h: the next projections' input) and 1/rms (4);
      - attention: the rotated q (e*q) and k (e*kv), v (e*kv), SDPA's output (e*q; the same storage is o_proj's
        input) and its log-sum-exp (4 per head). With a padding mask transformers expands k and v to every head
        (repeat_kv), so they cost e*q each;
      - MLP: gate's output (kept by SiLU), SiLU's and up's outputs (kept by their product) and the product
        (down's input): 4*e*i.
    Total 2*(4h + 2e*h + 4) + e*(2q + 2kv) + 4H + 4e*i; residual adds and RoPE's products with cos/sin keep none.
    """
    h, q, i = shape.hidden_size, shape.q_dim, shape.intermediate_size
    kv = q if expanded_kv else shape.kv_dim
    return 2 * (4 * h + 2 * e * h + 4) + e * (2 * q + 2 * kv) + 4 * shape.num_heads + 4 * e * i


def compiled_layer_bytes(shape: ModelShape, e: int, *, mask_width: int) -> int:
    """Bytes one decoder layer compiled by torch.compile (``[fsdp.compile]``, default mode) saves for backward per
    token. Inductor's partitioner (min-cut rematerialization) keeps the matmuls' outputs and the attention op's
    tensors and recomputes the pointwise rest in backward (checked against saved-tensor hooks in
    tests/test_estimate.py: packed rows through torch's varlen attention op, as on a GPU; padded rows through
    the CPU's SDPA):
      - two RMSNorms, each: 1/rms (4) and its product with the weight (e*h: the next projections' input); their fp32
        upcasts and normalised values are recomputed from the layer's input and o_proj's output (e*h each), which
        the layer keeps instead of their sum;
      - attention as eager (:func:`layer_activation_bytes`): the rotated q (e*q) and k (e*kv), v (e*kv), the
        output (e*q) and its log-sum-exp (4 per head). With a padding mask (``mask_width`` S > 0: [b, S] rows)
        k and v are expanded to every head (e*q each) and the layer keeps its own copy of the [b, 1, S, S] mask
        in the compute dtype (e*S);
      - MLP: gate's and up's outputs and down's input (the product of SiLU's and up's): 3*e*i; SiLU's is recomputed.
    Total 4e*h + 8 + e*(2q + 2kv) + 4H + 3e*i, + e*S with a padding mask.
    """
    h, q, i = shape.hidden_size, shape.q_dim, shape.intermediate_size
    kv = q if mask_width else shape.kv_dim
    return 4 * e * h + 8 + e * (2 * q + 2 * kv) + 4 * shape.num_heads + 3 * e * i + e * mask_width


def saved_layer_bytes(shape: ModelShape, s: MemorySetting, e: int) -> int:
    """Per token, what one decoder layer's forward saves for backward under ``s``: compiled
    (:func:`compiled_layer_bytes`) or eager (:func:`layer_activation_bytes`); a padding mask only on padded rows."""
    padded = s.padding_mask and not s.padding_free
    if s.compiled_layers:
        return compiled_layer_bytes(shape, e, mask_width=s.sequence_tokens if padded else 0)
    eager = layer_activation_bytes(shape, e, expanded_kv=padded)
    return eager + lora_layer_bytes(shape, s, e) if s.lora_rank else eager


def lora_layer_bytes(shape: ModelShape, s: MemorySetting, e: int) -> int:
    """Per token, what LoRA changes in an eager layer's saved activations (:func:`layer_activation_bytes` is the
    trained layer's; checked against saved-tensor hooks in tests/test_estimate.py, 2026-12-07):
      - the frozen RMSNorm weights keep nothing for their own gradient: less the normalised values (2*e*h);
      - each adapter's A output, kept by B (e*r per adapted projection);
      - a projection group whose base is frozen and has no adapter keeps no input: q/k/v's or gate/up's (e*h),
        down's (e*i);
      - FSDP1 with a compute dtype below fp32: peft casts each adapter's input to the fp32 weight that FSDP1 shows
        outside the unit, and the unit casts it back, so each adapter keeps its own copy of its input: q, k and v
        two more than the one they shared (2*e*h), gate and up one more (e*h), o one beside attention's output
        (e*q); down's copy replaces the product it would have kept.
    All linear layers adapted: -2*e*h + 7*e*r, and + e*(3h + q) on FSDP1 (0.5B bf16: -3,360 and +3,808 of 57,408)."""
    h, q, i = shape.hidden_size, shape.q_dim, shape.intermediate_size
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapted = set(names) if s.lora_targets == "all-linear" else {n for n in names if n in s.lora_targets}
    attention, mlp = len(adapted & {"q_proj", "k_proj", "v_proj"}), len(adapted & {"gate_proj", "up_proj"})
    total = -2 * e * h + e * s.lora_rank * len(adapted)
    total -= e * h * (attention == 0) + e * h * (mlp == 0) + e * i * ("down_proj" not in adapted)
    if s.fsdp_version == 1 and s.compute_dtype != "fp32":
        total += e * h * (max(0, attention - 1) + max(0, mlp - 1)) + e * q * ("o_proj" in adapted)
    return total


def scoring_layer_bytes(shape: ModelShape, e: int) -> int:
    """Peak bytes per token inside one decoder layer's forward without grad: e*(4h + 3i), the residual, the normed
    input, the attention's sum and output in flight (4h) beside the MLP's activated gate, up projection and their
    product (3i; the gate's raw output is freed before up's is made). tests/test_estimate.py measures 6,211 bytes
    per token on CPU (bf16, h 256, i 704) where this gives 6,272."""
    return e * (4 * shape.hidden_size + 3 * shape.intermediate_size)


def head_activation_bytes(shape: ModelShape, s: MemorySetting, e: int) -> int:
    """What the rest of the model saves for one micro-batch: per token the final norm (4h + e*h + 4), the ids (8),
    cos/sin (2*d*e) and, with a padding mask, the [b, 1, S, S] mask as bool and in the compute dtype ((1 + e)*S;
    compiled layers that save their activations keep their own copies instead: :func:`compiled_layer_bytes`);
    per LM-head row its input (e*h)."""
    h, tokens = shape.hidden_size, s.tokens_per_micro_batch
    per_token = 4 * h + e * h + 4 + 8 + 2 * shape.head_dim * e
    masks_in_layers = s.compiled_layers and not s.activation_checkpointing
    if s.padding_mask and not s.padding_free and not masks_in_layers:
        per_token += (1 + e) * s.sequence_tokens
    return tokens * per_token + logits_layout(shape, s).head_rows * e * h


def activation_bytes(shape: ModelShape, s: MemorySetting, e: int, *, phase: str) -> int:
    """Saved activations of one micro-batch at ``phase``: "update" (at the loss: every layer's, or with activation
    checkpointing each layer's input (e*h per token, compiled or not), plus the head's), "backward" (all layers'
    without checkpointing; with it the inputs plus one layer's recompute and its MLP gradients, 3*e*i per token)
    or "scoring" (no grad: one layer's intermediates in flight, :func:`scoring_layer_bytes`). A layer saves
    :func:`saved_layer_bytes` per token, in the update and in its recompute."""
    tokens = s.tokens_per_micro_batch
    layer = saved_layer_bytes(shape, s, e)
    if phase == "scoring":  # no grad: the residual stream, the layer's input and output, the MLP's intermediates
        return tokens * scoring_layer_bytes(shape, e)
    if not s.activation_checkpointing:
        saved = shape.num_layers * layer * tokens
        return saved + (head_activation_bytes(shape, s, e) if phase == "update" else 0)
    inputs = shape.num_layers * e * shape.hidden_size * tokens
    if phase == "update":
        return inputs + head_activation_bytes(shape, s, e)
    return inputs + tokens * (layer + 3 * e * shape.intermediate_size)


def gathered_bytes(shape: ModelShape, s: MemorySetting, e: int, *, backward: bool) -> int:
    """FSDP units unsharded in the compute dtype: the root (kept through forward and backward) and two layers
    (the current and the prefetched one; every layer without reshard_after_forward). In backward also the root's
    unsharded gradient (the LM head's, from the first backward op to the end) and one layer's gradients in the
    compute dtype and in the reduce dtype for the reduce-scatter. With ``keep_unsharded`` (FSDP2) every unit
    stays gathered and every gradient accumulates unsharded in the reduce dtype through the micro-batches,
    beside the root's and one layer's compute-dtype gradients in backward; FSDP1's no_sync keeps its units as
    before but the whole unsharded gradient in the compute dtype. LoRA on FSDP1 that shards nothing (one rank, or
    "no_shard": FSDP1 then runs NO_SHARD) uses its frozen base in place, already in the compute dtype: only the
    adapters' units are cast (all of them counted) (2026-12-07, H200, 0.5B untied: the scoring phase measured 2.84
    GiB, 0.56 below an estimate that gathered the root and two layers)."""
    layers = 2 if s.reshard_after_forward else max(2, shape.num_layers)
    r, total = DTYPE_BYTES[s.reduce_dtype], (shape.root_params + layers * shape.layer_params) * e
    if s.lora_rank and s.fsdp_version == 1 and s.shard_size == 1:
        total = s.lora_params(shape) * e
    # the gradients of the root and of one layer in backward: a frozen base (LoRA) has none, its adapters' are small
    root_grads, layer_grads = (0, s.lora_params(shape) // shape.num_layers) if s.lora_rank else (
        shape.root_params, shape.layer_params)
    if s.keep_unsharded and s.fsdp_version == 2:  # all units gathered, every gradient accumulated unsharded
        total = shape.num_parameters * e + trained_params(shape, s) * r  # LoRA: the adapters' gradients alone
        return total + ((root_grads + layer_grads) * e if backward else 0)
    if s.keep_unsharded:  # FSDP1's no_sync: unsharded gradients in the compute dtype (which is then the reduce one)
        total += trained_params(shape, s) * e
    if backward:
        total += root_grads * e + layer_grads * (e + r)
    return total


def state_bytes(shape: ModelShape, s: MemorySetting) -> dict[str, int]:
    """Sharded fp32 parameters (actor, reference, critic), fp32 gradients and AdamW's two fp32 moments (actor and
    critic) on the device; nothing with cpu_offload (they live in host memory: :func:`host_bytes`)."""
    if s.cpu_offload:
        return {"parameters": 0, "gradients": 0, "optimizer": 0}
    n, actor = s.shard_size, shape.num_parameters
    critic = shape.value_model_params if s.critic else 0
    if s.lora_rank:  # the base frozen in the compute dtype and the reference is that base: only adapters train
        adapters = s.lora_params(shape)
        frozen = actor * DTYPE_BYTES[s.compute_dtype]
        return {"parameters": (frozen + 4 * (adapters + critic)) // n, "gradients": 4 * (adapters + critic) // n,
                "optimizer": 8 * (adapters + critic) // n}
    params = actor * (2 if s.reference else 1) + critic
    trained = actor + critic
    return {"parameters": 4 * params // n, "gradients": 4 * trained // n, "optimizer": 8 * trained // n}


def trained_params(shape: ModelShape, s: MemorySetting) -> int:
    """The parameters the optimizer steps (the actor's, or its adapters with LoRA)."""
    return s.lora_params(shape) or shape.num_parameters


def update_gradient_bytes(shape: ModelShape, s: MemorySetting) -> int:
    """The sharded gradients (:func:`state_bytes`' "gradients") alive at the update's loss. The actor's are set to
    None at each mini-batch's start (rlkit.workers.policy: ``zero_grad(set_to_none=True)``) and made by the first
    micro-batch's backward: with one micro-batch per optimizer step its loss has none, from the second one on they
    are there; with ``keep_unsharded`` none until the last reduce-scatter (the unsharded ones count in "gathered").
    The critic's stay from its own last step. (2026-12-07, H200, 0.5B, one micro-batch, hf engine: the update
    measured 11.11 GiB where the estimate counted 1.84 GiB of fp32 gradients that were not there.)"""
    state = state_bytes(shape, s)["gradients"]
    actor = 0 if s.cpu_offload else 4 * trained_params(shape, s) // s.shard_size
    accumulated = s.micro_batches_per_step > 1 and not s.keep_unsharded
    return state - (0 if accumulated else actor)


def host_bytes(shape: ModelShape, s: MemorySetting) -> int:
    """Host memory per rank that cpu_offload moves there (what :func:`state_bytes` would hold on the device)."""
    if not s.cpu_offload:
        return 0
    return sum(state_bytes(shape, replace(s, cpu_offload=False)).values())


def host_offload_bytes(shape: ModelShape, s: MemorySetting) -> dict[str, int]:
    """Host memory of one host's ranks, by what holds it: "offloaded" fp32 parameters, gradients and AdamW state
    (:func:`host_bytes` per rank, with cpu_offload) and "engine sleeping" (a sleeping vLLM engine keeps a copy of
    its compute-dtype weights in host memory: 14.3 GiB at 7B, measured)."""
    ranks = s.host_ranks
    sleeps = s.engine == "vllm" and s.engine_sleep != "never"
    weights = shape.num_parameters * DTYPE_BYTES[s.compute_dtype]
    return {"offloaded": ranks * host_bytes(shape, s), "engine sleeping": ranks * weights if sleeps else 0}


def engine_bytes(shape: ModelShape, s: MemorySetting, *, awake: bool) -> int:
    """The rollout engine on the device: "hf" a whole copy in the compute dtype (always resident); "vllm" awake
    gpu_memory_utilization of the device (its weights, KV cache, activations and graphs; with kv_cache_gb, the
    weights + kv_cache_gb + VLLM_WORKSPACE_GIB), asleep VLLM_ASLEEP_GIB."""
    weights = shape.num_parameters * DTYPE_BYTES[s.compute_dtype]
    if s.engine == "hf":
        return weights
    if not awake:
        return int(VLLM_ASLEEP_GIB * GiB)
    if s.kv_cache_gib > 0:
        return weights + int((s.kv_cache_gib + VLLM_WORKSPACE_GIB) * GiB)
    return int(s.gpu_memory_utilization * s.device_memory_gib * GiB)


def generate_bytes(shape: ModelShape, s: MemorySetting) -> dict[str, int]:
    """HF generate beyond its weights, for all the rank's rows at once: the KV cache (rows x (P + T) x layers x
    2 x kv x e) and the prefill's intermediates (one layer's, bounded by what it would save) as "activations";
    one step's fp32 scores and log-softmax [rows, V] as "logits". vLLM's are inside its own budget."""
    if s.engine != "hf":
        return {}
    e = DTYPE_BYTES[s.compute_dtype]
    rows = max(1, s.samples_per_step // s.world_size)
    cache = rows * s.sequence_tokens * shape.num_layers * 2 * shape.kv_dim * e
    prefill = rows * s.prompt_tokens * layer_activation_bytes(shape, e, expanded_kv=s.padding_mask)
    return {"activations": cache + prefill, "logits": rows * shape.vocab_size * 4 * 2}


def shared_weights_bytes(shape: ModelShape, s: MemorySetting, *, awake: bool) -> int:
    """vLLM's weight-sync buffers in the trainer's process (rlkit.rollout.vllm_weights.SharedWeights): one
    compute-dtype copy of the model, kept from a sync until the engine next sleeps."""
    adapters_only = s.lora_rank > 0 and s.lora_sync == "adapter"  # they travel as files: no buffers
    kept = s.engine == "vllm" and awake and not adapters_only
    return shape.num_parameters * DTYPE_BYTES[s.compute_dtype] if kept else 0


def sync_bytes(shape: ModelShape, s: MemorySetting) -> dict[str, int]:
    """The weight sync: the actor gathered one full fp32 parameter at a time (the largest counts; LoRA's frozen base
    is gathered in the compute dtype, and a merge holds an adapted weight, its B @ A and their sum in fp32) and, for
    vLLM, the shared compute-dtype buffers the engine reads the weights from, while its weights are awake."""
    e = DTYPE_BYTES[s.compute_dtype]
    embedding, mlp = shape.vocab_size * shape.hidden_size, shape.hidden_size * shape.intermediate_size
    largest = max(e * embedding, 3 * 4 * mlp) if s.lora_rank else 4 * max(embedding, mlp)
    if s.engine == "hf":
        return {"gathered": largest, "engine": engine_bytes(shape, s, awake=True)}
    weights = shape.num_parameters * e
    if s.lora_rank and s.lora_sync == "adapter":  # the adapters gathered whole, written for the engine
        return {"gathered": 4 * s.lora_params(shape), "engine": weights + int(VLLM_ASLEEP_GIB * GiB)}
    return {"gathered": largest + weights, "engine": weights + int(VLLM_ASLEEP_GIB * GiB)}

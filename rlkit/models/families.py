"""Can rlkit train this model's family with FSDP and roll it out with the chosen engine? Checked before launch.

:func:`check_model_family` reads a local model directory's config (never its weights) and builds the model on
the meta device (no memory, well under a second even for 70B) to find what FSDP and the engines need: a class
transformers can build for a causal LM, decoder layers to shard one by one, an attention implementation that
runs on the device, and, for vLLM, an implementation of the architecture that can load these weights.
The vLLM part imports vLLM in the calling process (a few seconds, once), and only when the engine is vLLM;
the variables vLLM's import puts into ``os.environ`` are taken out again, so workers launched later do not
inherit them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlkit.models.kernels import liger_family_problem
from rlkit.models.tiny import BUNDLED_MODELS

if TYPE_CHECKING:
    from rlkit.config import LoraConfig, PreferenceConfig, RLConfig

logger = logging.getLogger(__name__)

VLLM_HEAD_IS_EMBEDDING = frozenset(
    {"Gemma2ForCausalLM", "Gemma3nForCausalLM", "CohereForCausalLM", "Cohere2MoeForCausalLM"}
)
"""vLLM (0.32) classes that compute logits with the input embedding and have no output layer of their own:
they cannot load a separate ``lm_head.weight`` (untied embeddings)."""
FLASH_ATTENTION = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
}
"""Attention implementations that need CUDA: (the module they import, the package that provides it)."""


def model_family_problems(config: RLConfig | PreferenceConfig, device: str, world_size: int = 1) -> list[str]:
    """:func:`check_model_family` of a run config's model: its rollout engine and tensor-parallel size (a
    preference config rolls nothing out: FSDP's needs only); with LoRA on FSDP1, :func:`_fsdp1_lora_problems`."""
    rollout = getattr(config, "rollout", None)
    model_dir = BUNDLED_MODELS.get(config.model, Path(config.model))
    problems = check_model_family(
        model_dir,
        engine=rollout.engine if rollout is not None else "hf",
        device=device,
        trust_remote_code=config.trust_remote_code,
        tensor_parallel_size=rollout.tensor_parallel_size if rollout is not None else 1,
        lora=getattr(config, "lora", None),
        kernels=config.fsdp.kernels,
    )
    return problems + _fsdp1_lora_problems(config, model_dir, world_size)


def describe_lora(config: RLConfig | PreferenceConfig) -> str | None:
    """The run's LoRA in one line (rank, scale, adapted modules and layers, trainable parameters), from the model
    built on the meta device before anything loads; None without LoRA or where the model cannot be built."""
    from rlkit.models.lora import bind

    lora = getattr(config, "lora", None)
    if lora is None or not lora.enabled:
        return None
    hf_config, _ = _read_config(BUNDLED_MODELS.get(config.model, Path(config.model)), config.trust_remote_code, "")
    model = None if hf_config is None else _meta_model(hf_config, config.trust_remote_code, None, "")[0]
    try:
        return None if model is None else bind(model, lora).describe()
    except ValueError:  # reported by check_model_family
        return None


def _fsdp1_lora_problems(config: RLConfig | PreferenceConfig, model_dir: Path, world_size: int) -> list[str]:
    """LoRA on FSDP1 that does not shard (one rank, no_shard, or hybrid groups of one) with an output head tied to
    the input embedding. A training forward sets a unit's parameters to plain tensor views; FSDP1 turns them back
    into parameters in the unit's post-backward hook, which a unit that trains nothing (the frozen root, holding
    the embedding) never runs when it does not shard. FSDP1 then takes the tensors for parameters the user
    replaced, and the next gather of the full weights (the engine's sync) fails on the tied pair
    ("as_params=True type(prim_param)=Tensor"; torch 2.11 on the H200 and 2.13 on CPU alike)."""
    fsdp, lora = config.fsdp, getattr(config, "lora", None)
    if fsdp.version != 1 or lora is None or not lora.enabled:
        return []
    shards = {"no_shard": 1, "hybrid": fsdp.hybrid_shard_size or world_size}.get(fsdp.sharding, world_size)
    hf_config, _ = _read_config(model_dir, config.trust_remote_code, "")
    text = getattr(hf_config, "get_text_config", lambda: hf_config)() if hf_config is not None else None
    if shards > 1 or not getattr(text, "tie_word_embeddings", False):
        return []
    return [
        f"fsdp.version=1 with lora.rank={lora.rank} on {world_size} rank(s) that do not shard (fsdp.sharding="
        f'"{fsdp.sharding}"): {config.model} ties its output head to its input embedding, and torch\'s FSDP1 '
        "loses the frozen tied weight after the first backward when it does not shard; use fsdp.version=2 (the "
        "default) or shard over 2 or more ranks"
    ]


def _lora_problems(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Why ``lora.target_modules`` cannot bind to the (meta-device) ``model``: matches nothing or only some layers."""
    from rlkit.models.lora import bind

    try:
        bind(model, lora)
    except ValueError as err:
        return [str(err)]
    return []


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a Hugging Face model declares unsplittable (its decoder layers), in order: FSDP's units."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules, so there is nothing to wrap per layer; "
            "one giant FSDP unit would gather the whole model at once"
        )
    return layers


def check_model_family(
    model_dir: str | Path,
    *,
    engine: str,
    device: str = "cpu",
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
    lora: LoraConfig | None = None,
    kernels: str = "torch",
) -> list[str]:
    """What would stop rlkit from training ``model_dir`` with FSDP and rolling out with ``engine`` on ``device``
    (with ``lora`` on: its target modules must bind to every decoder layer, :func:`rlkit.models.lora.bind`; with
    ``kernels="liger"`` (fsdp.kernels): Liger's kernels must exist for its family).

    Args:
        model_dir: a local Hugging Face model directory.
        engine: "hf" or "vllm" (rollout.engine).
        device: "cpu" or "cuda", where the workers run.
        trust_remote_code: whether the directory's own modelling code may run (it does, here, if so).
        tensor_parallel_size: the devices one engine spans (rollout.tensor_parallel_size).
    Returns:
        one message per problem, each naming what is missing and the fix; [] when the family fits.
    """
    where = f'model="{model_dir}"'
    config, problem = _read_config(Path(model_dir), trust_remote_code, where)
    if config is None:
        return [problem]
    problems = _attention_problems(config, device, where) + _tensor_parallel_problems(config, tensor_parallel_size)
    liger = liger_family_problem(config.model_type) if kernels == "liger" else None
    problems += [liger] if liger else []
    # with the attention reported, check the rest as transformers' default (sdpa or eager) would build it
    model, problem = _meta_model(config, trust_remote_code, "eager" if problems else None, where)
    problems += [problem] if model is None else _decoder_layer_problems(model, where)
    if model is not None and lora is not None and lora.enabled:
        problems += _lora_problems(model, lora)
    if engine == "vllm" and importlib.util.find_spec("vllm") is not None:  # rollout.engine reports it missing
        problems += _vllm_problems(config, device, where)
    return problems


def _read_config(model_dir: Path, trust_remote_code: bool, where: str) -> tuple[Any, str]:
    """(the directory's transformers config, "") or (None, the problem)."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        return None, f"{where}: no config.json there; give a local Hugging Face model directory"
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        return None, (
            f"{where}: transformers cannot read its config.json ({_first_line(exc)}); a newer transformers may "
            "know this model_type, and a directory that ships its own code needs trust_remote_code=True"
        )
    return config, ""


def _meta_model(
    config: Any, trust_remote_code: bool, attention: str | None, where: str
) -> tuple[torch.nn.Module | None, str]:
    """(the causal LM rlkit would load, built on the meta device, "") or (None, the problem)."""
    from transformers import AutoModelForCausalLM

    override = {"attn_implementation": attention} if attention else {}
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **override)
        return model, ""
    except ImportError as exc:  # e.g. a package the directory's own modelling code imports
        return None, f"{where}: building the model needs what is not installed ({_first_line(exc)}); install it"
    except (ValueError, KeyError) as exc:
        return None, (
            f"{where}: AutoModelForCausalLM cannot build model_type={config.model_type!r} ({_first_line(exc)}); "
            "rlkit trains causal language models that transformers (or the directory's own code, with "
            "trust_remote_code=True) can build"
        )


def _decoder_layer_problems(model: torch.nn.Module, where: str) -> list[str]:
    """FSDP wraps each module of a class named in ``_no_split_modules`` (:func:`decoder_layers`)."""
    try:
        decoder_layers(model)
    except ValueError:
        declared = sorted(getattr(model, "_no_split_modules", None) or ())
        if declared:
            what = f"names {declared} in _no_split_modules but has no such module"
        else:
            what = "declares no _no_split_modules"
        return [
            f"{where}: {type(model).__name__} {what}, so FSDP finds no decoder layers to shard one unit each; "
            "set _no_split_modules = ['<its decoder layer class>'] on the model class (in the directory's "
            "modelling code) or use an architecture that transformers implements"
        ]
    return []


def _tensor_parallel_problems(config: Any, tp: int) -> list[str]:
    """vLLM splits the attention heads, the key/value heads (or replicates them when there are fewer than ``tp``)
    and the MLP's intermediate size into ``tp`` equal shards."""
    if tp <= 1:
        return []
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    sizes = {"num_attention_heads": heads, "intermediate_size": getattr(text, "intermediate_size", tp)}
    fix = "use a divisor of it for rollout.tensor_parallel_size"
    problems = [
        f"rollout.tensor_parallel_size={tp}: the model's {name}={size} does not split into {tp} shards; {fix}"
        for name, size in sizes.items()
        if size % tp
    ]
    if kv_heads % tp and tp % kv_heads:
        problems.append(
            f"rollout.tensor_parallel_size={tp}: the model's num_key_value_heads={kv_heads} neither splits into "
            f"{tp} shards nor divides {tp} (vLLM then replicates them); use a divisor or a multiple of it"
        )
    return problems


def _attention_problems(config: Any, device: str, where: str) -> list[str]:
    """The config's requested attention implementation must run on ``device`` (the training side and hf engine)."""
    wanted = getattr(config, "_attn_implementation", None)
    if wanted not in FLASH_ATTENTION:
        return []
    module, package = FLASH_ATTENTION[wanted]
    if device == "cpu":
        return [
            f'{where}: its config asks for attn_implementation="{wanted}", which needs CUDA; remove '
            '"attn_implementation" from config.json (transformers then picks "sdpa") to run on CPU'
        ]
    if importlib.util.find_spec(module) is None:
        return [
            f'{where}: its config asks for attn_implementation="{wanted}" but {package} is not installed; '
            f'pip install {package}, or remove "attn_implementation" from config.json (transformers then picks "sdpa")'
        ]
    return []


def _vllm_problems(config: Any, device: str, where: str) -> list[str]:
    """vLLM must implement the architecture (natively or through its Transformers backend), load its head, and,
    on CPU, support its attention head size."""
    architectures = list(getattr(config, "architectures", None) or ())
    if not architectures:
        return [
            f'{where}: config.json names no "architectures", so vLLM cannot pick a model class; add '
            '"architectures": ["<its class, e.g. LlamaForCausalLM>"] or use rollout.engine="hf"'
        ]
    problems: list[str] = []
    supported, head_sizes = _vllm_support(device)
    native = [a for a in architectures if a in supported]
    if not native and not _vllm_transformers_backend_runs(architectures[0]):
        problems.append(
            f"{where}: vLLM implements none of its architectures {architectures}, and its Transformers backend "
            'cannot run them; use rollout.engine="hf", or a vLLM that supports the architecture'
        )
    text = config.get_text_config()
    if set(native) & VLLM_HEAD_IS_EMBEDDING and not getattr(text, "tie_word_embeddings", True):
        problems.append(
            f"{where}: vLLM's {native[0]} takes its output layer from the input embedding, but this model's "
            'embeddings are untied (tie_word_embeddings=false, its own lm_head); use rollout.engine="hf"'
        )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_sizes is not None and head_dim not in head_sizes:
        problems.append(
            f"{where}: attention head size {head_dim} has no vLLM CPU kernel (it supports {head_sizes}); "
            'use rollout.engine="hf" on CPU, or a GPU'
        )
    return problems


def _vllm_support(device: str) -> tuple[set[str], list[int] | None]:
    """The architectures vLLM implements, and on CPU the head sizes its attention kernels take (None elsewhere).

    vLLM's import sets variables in ``os.environ`` (LD_LIBRARY_PATH, TORCHINDUCTOR_COMPILE_THREADS, ...) for
    its own processes; they are restored here so that workers launched after this check start as they would
    without it.
    """
    saved = dict(os.environ)
    try:
        from vllm import ModelRegistry

        supported = set(ModelRegistry.get_supported_archs())
        head_sizes = None
        if device == "cpu":
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            head_sizes = CPUAttentionBackend.get_supported_head_sizes()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return supported, head_sizes


def _vllm_transformers_backend_runs(architecture: str) -> bool:
    """Whether vLLM would run ``architecture`` through its Transformers backend (as vLLM itself decides)."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        return False
    runs = bool(cls.is_backend_compatible() or cls._can_set_attn_implementation())
    if runs:
        logger.info("vLLM has no %s of its own: it runs transformers' through its Transformers backend", architecture)
    return runs


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

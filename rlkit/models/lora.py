"""LoRA adapters on a Hugging Face model with peft: which linear layers they bind to, injecting them in place,
switching them off (the KL reference), and the weights a rollout engine gets from them.

Adapters are injected into the model itself (``peft.inject_adapter_in_model``), not wrapped in a PeftModel, so
the model keeps its class, config, decoder layers and head; parameter paths change only below the adapted
layers: ``...q_proj.weight`` becomes ``...q_proj.base_layer.weight`` beside ``...q_proj.lora_A.default.weight``
([r, in]) and ``...q_proj.lora_B.default.weight`` ([out, r]). The adapted layer computes
``W x + (alpha / r) * B (A x)``; B starts at zero, so a fresh adapter leaves the model unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from rlkit.config import LoraConfig

ADAPTER = "default"
"""The one adapter's name in peft's module dicts."""
LORA_PART = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")
"""A LoRA parameter's path: ``<module>.lora_A.<adapter>.weight``."""


@dataclass(kw_only=True)
class LoraBinding:
    """The linear layers a target list binds adapters to: plain data, per decoder layer."""

    modules: list[str]
    """Module paths that get adapters, in model order."""
    per_layer: dict[str, list[str]] = field(default_factory=dict)
    """Decoder layer path -> the relative names of its adapted modules (e.g. "self_attn.q_proj")."""
    outside_layers: list[str] = field(default_factory=list)
    """Adapted modules outside the decoder layers (e.g. the output head, when named)."""
    rank: int = 0
    alpha: float = 0.0
    trainable: int = 0
    """Parameters that train: the adapters' r * (in + out) per module, and modules_to_save whole."""
    total: int = 0
    """The base model's parameters (tied ones once)."""

    def describe(self) -> str:
        """One line: the rank and scale, the adapted modules and layers, the trainable parameters."""
        names = ", ".join(n.rsplit(".", 1)[-1] for n in self.summary()) or "no decoder-layer module"
        layers = sum(bool(names) for names in self.per_layer.values())
        outside = f" and {', '.join(self.outside_layers)}" if self.outside_layers else ""
        share = 100 * self.trainable / max(self.total, 1)
        return (f"LoRA r={self.rank}, alpha {self.alpha:g} (scale {self.alpha / max(self.rank, 1):g}) on {names} in "
                f"{layers} of {len(self.per_layer)} decoder layers{outside}: {_count(self.trainable)} trainable "
                f"parameters of {_count(self.total)} ({share:.2f}%); the rest frozen")

    def summary(self) -> dict[str, int]:
        """Relative module name -> how many decoder layers adapt it."""
        counts: dict[str, int] = {}
        for names in self.per_layer.values():
            for name in names:
                counts[name] = counts.get(name, 0) + 1
        return counts


def decoder_layer_paths(model: torch.nn.Module) -> list[str]:
    """Paths of the modules the model declares unsplittable (its decoder layers), in order."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    return [name for name, module in model.named_modules() if type(module).__name__ in kinds]


def linear_modules(model: torch.nn.Module) -> list[str]:
    """Paths of the model's linear layers, the output head excluded (what "all-linear" adapts)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def bind(model: torch.nn.Module, config: LoraConfig, head: str | None = None) -> LoraBinding:
    """The modules ``config.target_modules`` matches in ``model`` (a real one or one on the meta device); ``head``:
    a module that trains whole instead (a critic's value head), never adapted.

    Raises ValueError naming what matched when the targets match nothing, match a module that is not a linear
    layer, or adapt only some decoder layers (or different modules in different layers)."""
    linear = [n for n in linear_modules(model) if n != head]
    names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    if config.target_modules == "all-linear":
        chosen = linear
    else:
        targets = list(config.target_modules)
        chosen = _matches(model, targets)
        wrong = [n for n in chosen if n not in linear]
        if wrong:
            raise ValueError(
                f"lora.target_modules={targets} matches modules that are not linear layers (or the output head), "
                f"e.g. {wrong[:3]}: adapters go on linear layers only"
            )
        unmatched = [t for t in targets if not _matches(model, [t])]
        if chosen and unmatched:
            raise ValueError(
                f"lora.target_modules: {unmatched} match no module of {type(model).__name__} (the others do); "
                f"its linear layers are named {names}"
            )
    if not chosen:
        raise ValueError(
            f"lora.target_modules={config.target_modules!r} matches no module of {type(model).__name__}; "
            f"its linear layers are named {names}"
        )
    _check_modules_to_save(model, config)
    binding = _per_layer(chosen, decoder_layer_paths(model), config)
    saved_names = set(_matches(model, list(config.modules_to_save)))
    saved = [m for name, m in model.named_modules() if name in saved_names]
    linears = [cast(torch.nn.Linear, model.get_submodule(name)) for name in chosen]
    binding.rank, binding.alpha = config.rank, config.alpha
    adapters = sum(config.rank * (m.in_features + m.out_features) for m in linears)
    binding.trainable = adapters + sum(p.numel() for m in saved for p in m.parameters())
    binding.total = sum(p.numel() for p in model.parameters())
    return binding


def _count(n: int) -> str:
    """A parameter count in words: 8.80M, 7.62B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _matches(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """Module paths equal to a target or ending in ``.<target>``, in model order."""
    return [n for n, _ in model.named_modules() if n and any(n == t or n.endswith("." + t) for t in targets)]


def _check_modules_to_save(model: torch.nn.Module, config: LoraConfig) -> None:
    """Raise ValueError for a ``modules_to_save`` entry that names no module, or names the output head or the input
    embedding: rlkit's fused head computes log-probs from the head's weight itself (peft's trained copy would be
    bypassed), and where the two are tied a trained copy of one silently unties them in the engine and the export."""
    unmatched = [m for m in config.modules_to_save if not _matches(model, [m])]
    if unmatched:
        raise ValueError(f"lora.modules_to_save: {unmatched} match no module of {type(model).__name__}")
    ends = {what: getattr(model, getter, lambda: None)() for what, getter in
            (("output head", "get_output_embeddings"), ("input embedding", "get_input_embeddings"))}  # fmt: skip
    for entry in config.modules_to_save:
        names = set(_matches(model, [entry]))
        hit = {id(module) for name, module in model.named_modules() if name in names}
        for what, module in ends.items():
            if module is not None and id(module) in hit:
                raise ValueError(
                    f"lora.modules_to_save={config.modules_to_save}: {entry!r} is the model's {what}, which LoRA "
                    "cannot train here (rlkit's fused log-prob head reads its weight directly, and a tied embedding "
                    "would be trained on one side only); train it with full fine-tuning (lora.rank=0)"
                )


def _per_layer(chosen: list[str], layers: list[str], config: LoraConfig) -> LoraBinding:
    """Group ``chosen`` module paths by decoder layer; every layer must adapt the same relative names."""
    per_layer: dict[str, list[str]] = {layer: [] for layer in layers}
    outside = []
    for name in chosen:
        layer = next((path for path in layers if name.startswith(path + ".")), None)
        if layer is None:
            outside.append(name)
        else:
            per_layer[layer].append(name[len(layer) + 1 :])
    shapes = {tuple(names) for names in per_layer.values()}
    if len(shapes) > 1:
        seen = {layer: names for layer, names in per_layer.items()}
        bare = [layer for layer, names in seen.items() if not names]
        raise ValueError(
            f"lora.target_modules={config.target_modules!r} adapts the decoder layers unevenly "
            f"({len(layers) - len(bare)} of {len(layers)} layers get adapters; per layer: "
            f"{ {k: v for k, v in list(seen.items())[:4]} }): name modules that every layer has"
        )
    return LoraBinding(modules=chosen, per_layer=per_layer, outside_layers=outside)


def peft_config(config: LoraConfig, binding: LoraBinding, head: str | None = None):
    """peft's LoraConfig for exactly the modules of ``binding`` (full paths, so peft binds what was checked);
    ``head`` joins modules_to_save."""
    import peft

    saved = list(config.modules_to_save) + ([head] if head else [])
    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,  # type: ignore[arg-type]  # typed int; any number scales
        lora_dropout=config.dropout,
        target_modules=binding.modules,
        modules_to_save=saved or None,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, config: LoraConfig, head: str | None = None) -> LoraBinding:
    """Inject adapters into ``model`` in place (before FSDP wraps it): the base is frozen, the adapters (fp32,
    whatever the base's dtype), ``modules_to_save`` and ``head`` (a critic's new value head) train. Returns what
    the adapters bound to."""
    from peft import inject_adapter_in_model
    from peft.functional import cast_adapter_dtype

    binding = bind(model, config, head)
    inject_adapter_in_model(peft_config(config, binding, head), model, adapter_name=ADAPTER)
    cast_adapter_dtype(model, ADAPTER, autocast_adapter_dtype=True)  # bf16/fp16 adapters -> fp32
    return binding


def has_adapters(model: torch.nn.Module) -> bool:
    return any(LORA_PART.match(name) for name, _ in model.named_parameters())


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model, adapters off (and modules_to_save on their originals), for the ``with`` block.

    Which parameters train does not change: peft's switch also clears the adapters' ``requires_grad``, and FSDP2
    takes its units' gradient dtypes from the parameters that train at its first forward, which is often this
    block's (the KL reference's). Seeing none, it would reduce the adapters' bf16 gradients without casting them
    back to fp32, and the backward fails."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]
    trained = [p for p in model.parameters() if p.requires_grad]
    for layer in layers:
        layer.enable_adapters(False)
    for param in trained:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def is_adapter_param(name: str) -> bool:
    """Whether a parameter path is a LoRA matrix or a modules_to_save copy (what trains and what a sync of the
    adapters carries)."""
    return LORA_PART.match(name) is not None or f".modules_to_save.{ADAPTER}." in name


def merged_weights(weights: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's (name, tensor) pairs from an adapted model's full parameters, in one pass.

    Each adapted weight comes out as ``W + scaling * B @ A``, computed in fp32 and cast back to W's dtype, under
    the base's name; a modules_to_save copy comes out under the original's name (the original is dropped). Holds
    at most one layer's W and A while waiting for its B (parameters come in module order)."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if ".base_layer." in name:
            base = name.replace(".base_layer.", ".")
            if name.endswith(".base_layer.weight"):
                held[base] = tensor
            else:
                yield base, tensor
        elif (part := LORA_PART.match(name)) is not None:
            module = part["module"]
            if part["which"] == "A":
                held[module + ".A"] = tensor
                continue
            w, a = held.pop(module + ".weight"), held.pop(module + ".A")
            merged = w.float() + scaling * (tensor.float() @ a.float())
            yield module + ".weight", merged.to(w.dtype)
        elif ".original_module." in name:
            continue
        else:
            yield name.replace(f".modules_to_save.{ADAPTER}.", "."), tensor
    if held:
        raise ValueError(f"adapted weights without their LoRA matrices: {sorted(held)[:3]}")


def peft_file_name(name: str) -> str:
    """A parameter path in peft's saved-adapter form: ``base_model.model.<module>.lora_A.weight``."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".").replace(".modules_to_save.", ".")


def save_adapter(
    directory: Path, weights: Iterable[tuple[str, torch.Tensor]], config: LoraConfig, base_model: str
) -> None:
    """A peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) from the adapters' full
    tensors (other tensors are skipped): ``peft.PeftModel.from_pretrained(base, directory)`` and vLLM load it."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    kept = {n: t for n, t in weights if is_adapter_param(n)}
    tensors = {peft_file_name(n): t.detach().cpu().contiguous() for n, t in kept.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = list(dict.fromkeys(part["module"] for n in kept if (part := LORA_PART.match(n)) is not None))
    settings = peft_config(config, LoraBinding(modules=modules))
    settings.base_model_name_or_path = base_model
    settings.save_pretrained(str(directory))

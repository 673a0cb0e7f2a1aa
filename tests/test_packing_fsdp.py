"""Padded and padding-free updates on 2 gloo workers (FSDP2 and FSDP1, with and without activation
checkpointing) against one unsharded padded process: loss, gradient norm, gradients, weights after AdamW."""

import pytest
import torch
from packing_cases import LENGTHS, TEMPERATURE, WIDTH, reference_logprobs, rows, weighted_loss
from role_runs import assert_adam_step_matches

import rlkit
from rlkit.models import load_causal_lm, resolve_model_dir

LR = 1e-3


def tiny_model():
    return load_causal_lm(resolve_model_dir("tiny"), dtype=torch.float32, device=torch.device("cpu"))


def reference_step() -> dict:
    """The whole batch in one process on padded rows through the plain path, one AdamW step."""
    model = tiny_model()
    ids, mask = rows(model.config.vocab_size)
    logprobs, entropy = reference_logprobs(model, ids, mask)
    loss = weighted_loss(logprobs, entropy, mask)
    loss.backward()
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    weights = {k: v.detach() for k, v in model.named_parameters()}
    return {"loss": loss.item(), "norm": norm, "grads": grads, "weights": weights}


def sharded_step(fsdp: dict, padding_free: bool) -> dict:
    """On a worker: this rank's half of the rows through rlkit's forward, FSDP-wrapped, one AdamW step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlkit.fsdp import apply_fsdp, build_mesh, clip_grad_norm, iter_full_params
    from rlkit.models.logprobs import response_logprobs
    from rlkit.runtime import context

    ctx = context()
    config = rlkit.FSDPConfig(**fsdp)
    model = tiny_model()
    calls = []  # forwards started by a module inside layer 0: checkpointing runs it again in backward
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    model = apply_fsdp(model, build_mesh("cpu", ctx.world_size, config), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids, mask = rows(model.config.vocab_size)
    half = slice(ctx.rank * len(LENGTHS) // 2, (ctx.rank + 1) * len(LENGTHS) // 2)
    logprobs, entropy = response_logprobs(
        model, ids[half], mask[half], response_width=WIDTH, temperature=TEMPERATURE,
        padding_free=padding_free, entropy="grad",
    )
    loss = weighted_loss(logprobs, entropy, mask, half)
    loss.backward()  # apply_fsdp sums gradients over ranks, as the ranks' losses add up
    grads = {k: v.grad.full_tensor() for k, v in model.named_parameters() if isinstance(v.grad, DTensor)}
    norm = clip_grad_norm(model, max_norm=0.0)
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    weights = dict(iter_full_params(model))
    return {"loss": total.item(), "norm": float(norm), "grads": grads, "weights": weights, "calls": len(calls)}


@pytest.fixture(scope="module")
def reference():
    return reference_step()


CASES = [
    ({"version": 2}, True),
    ({"version": 2, "activation_checkpointing": True}, True),
    ({"version": 2, "activation_checkpointing": True}, False),
    ({"version": 1}, True),
    ({"version": 1, "activation_checkpointing": True}, True),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("fsdp", "padding_free"), CASES, ids=[f"{f}-packed={p}" for f, p in CASES])
def test_sharded_update_matches_the_padded_reference(cluster, reference, fsdp, padding_free):
    for rank, result in enumerate(cluster.run(sharded_step, fsdp, padding_free)):
        label = f"{fsdp} padding_free={padding_free} rank {rank}"
        assert result["calls"] == (2 if fsdp.get("activation_checkpointing") else 1), label
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5), label
        assert result["norm"] == pytest.approx(reference["norm"], rel=1e-5), label
        assert len(result["grads"]) == (len(reference["grads"]) if fsdp["version"] == 2 else 0)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], atol=2e-6, rtol=1e-4, msg=f"{label}: {name}")
        assert_adam_step_matches(result["weights"], reference["weights"], reference["grads"], LR, label)


def compiled_layout() -> dict:
    """On a worker: FSDP2 with checkpointing and compiled layers; parameter names and what each layer became."""
    from torch.distributed._composable import checkpoint

    from rlkit.fsdp import apply_fsdp, build_mesh
    from rlkit.runtime import context

    config = rlkit.FSDPConfig(activation_checkpointing=True, compile=True)
    model = tiny_model()
    names = [name for name, _ in model.named_parameters()]
    model = apply_fsdp(model, build_mesh("cpu", context().world_size, config), config)
    layers = model.model.layers
    return {
        "names": [name for name, _ in model.named_parameters()],
        "before": names,
        "compiled": [hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers],
        "checkpointed": [checkpoint.state(layer).enable_hook for layer in layers],
        "head": model.lm_head.chunk_math.name == "fused",
    }


@pytest.mark.timeout(120)
def test_checkpointing_and_compile_wrap_each_layer_and_keep_names(cluster):
    """Wiring only (compiling on CPU takes minutes; tests/test_packing_gpu.py runs compiled layers)."""
    for result in cluster.run(compiled_layout):
        assert result["names"] == result["before"]
        assert result["compiled"] == [True, True] and result["checkpointed"] == [True, True] and result["head"]

"""Running rlkit's roles inside one test's worker function (importable on workers).

The sharded-vs-reference tests build a PolicyWorker or CriticWorker on each rank from a model
directory, feed it this rank's share of a hand-made batch, and return what the role returned.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_GRAD = 1e-6
"""Gradient entries below this, as AdamW takes them (after clipping: a loss that sums tokens has a
large norm that the clip scales down by orders of magnitude), are within a few hundred float-noise
units of AdamW's eps = 1e-8, where its first step (about lr * g / (|g| + eps)) turns a change in the
order of a reduction (packed vs padded rows, micro-batch splits) into a visible change of the weight,
or of its sign: such entries are held to within 2 * lr."""


def assert_adam_step_matches(
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    lr: float,
    label: str,
) -> None:
    """Weights after one AdamW step equal the reference's (entries whose gradient was float noise: within 2 lr).

    ``grads``: the reference's gradients as its AdamW took them (after clipping)."""
    from tests.numerics import assert_close

    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        atol = torch.where(grads[name].abs() < TINY_GRAD, 2 * lr, 1e-6)
        assert_close(got[name], ref, atol=atol, rtol=1e-5, name=f"{label}: {name}")


def save_model_dir(model: torch.nn.Module, directory: str | Path) -> str:
    """``model`` saved with the bundled tiny tokenizer (the roles read eos/pad ids from it); returns the path."""
    from rlkit.models.tiny import TINY_MODEL_DIR

    directory = Path(directory)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy2(TINY_MODEL_DIR / name, directory / name)
    return str(directory)


def rank_share(batch: dict[str, torch.Tensor], rows: int | None = None) -> dict[str, torch.Tensor]:
    """This rank's consecutive ``rows`` (default: an equal share) of every tensor in ``batch``."""
    from rlkit.runtime import context

    ctx = context()
    n = rows or next(iter(batch.values())).shape[0] // ctx.world_size
    return {k: v[ctx.rank * n : (ctx.rank + 1) * n] for k, v in batch.items()}


def policy_update(model_dir: str, config, batch: dict[str, torch.Tensor], policy_loss_fn=None) -> dict:
    """On a worker: a PolicyWorker's update on this rank's share; its metrics and the gathered weights."""
    from rlkit.fsdp import iter_full_params
    from rlkit.workers import PolicyRows, PolicyWorker

    worker = PolicyWorker(config, model_dir, policy_loss_fn)
    share = rank_share(batch)
    rows = PolicyRows(
        input_ids=share["input_ids"],
        attention_mask=share["attention_mask"],
        response_mask=share["response_mask"],
        advantages=share["advantages"],
        old_logprobs=share.get("old_logprobs"),
        ref_logprobs=share.get("ref_logprobs"),
        rollout_logprobs=share.get("rollout_logprobs"),
    )
    result = worker.update(rows)
    weights = dict(iter_full_params(worker.actor.model))
    worker.close()
    return {"metrics": result.metrics, "weights": weights, "old_logprobs": result.old_logprobs}


def critic_run(model_dir: str, config, batch: dict[str, torch.Tensor]) -> dict:
    """On a worker: a CriticWorker's values and one update on this rank's share, and the gathered weights."""
    from rlkit.fsdp import iter_full_params
    from rlkit.workers import CriticRows, CriticWorker

    worker = CriticWorker(config, model_dir)
    share = rank_share(batch)
    values = worker.values(share["input_ids"], share["attention_mask"]).values
    rows = CriticRows(
        input_ids=share["input_ids"],
        attention_mask=share["attention_mask"],
        response_mask=share["response_mask"],
        old_values=share["values"],
        returns=share["returns"],
    )
    result = worker.update(rows)
    return {"values": values, "metrics": result.metrics, "weights": dict(iter_full_params(worker.critic.model))}

"""The controller's side of the rank calls: prompts into token ids, the ranks' rollouts into one Batch, and a
Batch into each rank's rows for the updates."""

from __future__ import annotations

from typing import Any

import torch

from rlkit.algos import mask_finished
from rlkit.data.batch import Batch
from rlkit.data.loading import PROMPT_MESSAGES
from rlkit.data.trajectories import Trajectory
from rlkit.workers import CriticRows, PolicyRows, PreferenceRows, RolloutResult


def tokenize_prompts(
    tokenizer: Any, texts: list[str], limit: int, add_special_tokens: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, P] left-padded ids and mask; raises ValueError naming every prompt that is empty or over ``limit`` tokens.

    ``add_special_tokens`` is False for prompts a chat template rendered (they carry their own BOS).
    """
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
    bad = [f"prompt {i} ({n} tokens): {texts[i][:60]!r}" for i, n in enumerate(lengths) if n > limit or n == 0]
    if bad:
        raise ValueError(
            f"{len(bad)} prompt(s) are empty or longer than data.max_prompt_tokens={limit}; "
            "shorten them or raise the limit:\n" + "\n".join(f"  - {b}" for b in bad)
        )
    enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=add_special_tokens)
    return enc["input_ids"], enc["attention_mask"]


def assemble_batch(
    tokenizer: Any,
    items: list[dict[str, Any]],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    results: list[RolloutResult],
    group_size: int,
) -> Batch:
    """One Batch from the prompts ([N, P]) and each rank's RolloutResult (rank r holds prompts r*N/R ..)."""
    g = group_size
    response_ids = torch.cat([r.response_ids for r in results])
    response_mask = torch.cat([r.response_mask for r in results])
    attended = torch.cat([r.response_mask.long() if r.response_attention is None else r.response_attention
                          for r in results])  # fmt: skip
    old = [r.old_logprobs for r in results]
    ref = [r.ref_logprobs for r in results]
    keys = [k for k in items[0] if k not in ("prompt", PROMPT_MESSAGES)]
    fields = {k: [item[k] for item in items for _ in range(g)] for k in keys}
    trajectories = None if results[0].trajectories is None else [t for r in results for t in r.trajectories or []]
    return Batch(
        prompts=[item["prompt"] for item in items for _ in range(g)],
        completions=_completions(tokenizer, response_ids, trajectories),
        input_ids=torch.cat([prompt_ids.repeat_interleave(g, dim=0), response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask.repeat_interleave(g, dim=0), attended], dim=1),
        response_mask=response_mask,
        rollout_logprobs=torch.cat([r.rollout_logprobs for r in results]),
        rollout_logprob_rows=torch.cat([r.rollout_logprob_rows for r in results]),
        old_logprobs=None if old[0] is None else torch.cat([t for t in old if t is not None]),
        ref_logprobs=None if ref[0] is None else torch.cat([t for t in ref if t is not None]),
        group=torch.arange(len(items)).repeat_interleave(g),
        rank=torch.cat([torch.full((len(r.response_ids),), i) for i, r in enumerate(results)]),
        finish_reason=[reason for r in results for reason in r.finish_reason],
        fields=fields,
        turn_index=None if trajectories is None else torch.cat([t for r in results if (t := r.turn_index) is not None]),
        trajectories=trajectories,
    )


def _completions(tokenizer: Any, response_ids: torch.Tensor, trajectories: list[Trajectory] | None) -> list[str]:
    """Each completion's text, or each trajectory's last model turn (what its reward functions judge), both without
    special tokens."""
    if trajectories is None:
        return tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    last = [response_ids[i, t.turns[-1].start : t.turns[-1].end].tolist() if t.turns else []
            for i, t in enumerate(trajectories)]  # fmt: skip
    return tokenizer.batch_decode(last, skip_special_tokens=True)


def policy_rows(shard: Batch, dropped: tuple[str, ...] = (), engine_logprobs: bool = True) -> PolicyRows:
    """The rows of the policy update; the samples whose finish reason is in ``dropped`` leave the loss (truncated
    ones with DAPO's mask_truncated, failed environments); ``engine_logprobs``: the engine's log-probs go along
    (none were asked for when False)."""
    assert shard.advantages is not None
    return PolicyRows(
        input_ids=shard.input_ids,
        attention_mask=shard.attention_mask,
        response_mask=mask_finished(shard.response_mask, shard.finish_reason, dropped),
        advantages=shard.advantages,
        old_logprobs=shard.old_logprobs,
        ref_logprobs=shard.ref_logprobs,
        rollout_logprobs=shard.rollout_logprobs if engine_logprobs else None,
    )


def critic_rows(shard: Batch, dropped: tuple[str, ...] = ()) -> CriticRows:
    """The rows of the critic update; the samples whose finish reason is in ``dropped`` leave the value loss."""
    assert shard.values is not None and shard.returns is not None
    return CriticRows(
        input_ids=shard.input_ids,
        attention_mask=shard.attention_mask,
        response_mask=mask_finished(shard.response_mask, shard.finish_reason, dropped),
        old_values=shard.values,
        returns=shard.returns,
    )


def preference_rows(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, desirable: list[bool] | None = None
) -> PreferenceRows:
    """One row per (prompt ids, completion ids): [n, P + T], each prompt left-padded to the longest P and each
    completion right-padded to the longest T; ``desirable`` gives KTO's labels."""
    width_p, width_t = max(map(len, prompts)), max(map(len, completions))
    input_ids = torch.full((len(prompts), width_p + width_t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, end = width_p - len(prompt), width_p + len(completion)
        input_ids[i, start:end] = torch.tensor(prompt + completion)
        attention_mask[i, start:end] = 1
    return PreferenceRows(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=attention_mask[:, width_p:].float(),
        desirable=None if desirable is None else torch.tensor(desirable, dtype=torch.bool),
    )

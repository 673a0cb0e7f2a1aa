"""Tinker's training example: one sequence and the per-token inputs of its loss, and the padded rows of a batch.

Example:
    full = prompt + completion                        # token ids
    Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": [0] * (len(prompt) - 1)
                                            + [1] * len(completion)})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rlkit.algos.tinker_losses import TINKER_LOSS_INPUTS


@dataclass(frozen=True)
class Datum:
    """One sequence: ``tokens`` [N] is the model input; position i predicts ``loss_fn_inputs["target_tokens"][i]``.

    ``loss_fn_inputs``: [N] tensors (or lists) by Tinker's names: ``target_tokens`` (int), ``weights``,
    ``logprobs`` (the sampler's), ``advantages`` (float).
    """

    tokens: Sequence[int] | torch.Tensor
    loss_fn_inputs: Mapping[str, Sequence[float] | torch.Tensor] = field(default_factory=dict)


@dataclass
class DatumRows:
    """Data padded on the right into rows (padding has ``mask`` 0 and every input 0).

    Attributes:
        input_ids: [B, N] int64 model input.
        mask: [B, N] float32, 1 on each datum's real positions.
        target_tokens: [B, N] int64.
        inputs: the loss's float inputs by name, [B, N] float32 each.
        lengths: each datum's N (rows beyond the data, added to even out ranks, have length 0).
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    target_tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]
    lengths: list[int]

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, start: int, stop: int) -> DatumRows:
        """Rows ``start:stop`` (a rank's share)."""
        return DatumRows(self.input_ids[start:stop], self.mask[start:stop], self.target_tokens[start:stop],
                         {k: v[start:stop] for k, v in self.inputs.items()}, self.lengths[start:stop])  # fmt: skip

    def to(self, device: torch.device) -> DatumRows:
        return DatumRows(self.input_ids.to(device), self.mask.to(device), self.target_tokens.to(device),
                         {k: v.to(device) for k, v in self.inputs.items()}, self.lengths)  # fmt: skip


MAX_LISTED = 20
"""Problems listed one by one before the rest are counted (a huge bad batch still gets a short answer)."""


def datum_problems(data: Sequence[Datum], loss_fn: str, vocab_size: int, context: int) -> list[str]:
    """Every problem of ``data`` for ``loss_fn`` on a model of ``vocab_size`` tokens and ``context`` positions
    (empty: fine), each naming the datum, the field and the fix: token ids outside the vocabulary (target ids
    included), sequences longer than the context, lengths that disagree, and non-finite float inputs."""
    if loss_fn not in TINKER_LOSS_INPUTS:
        return [f"loss_fn={loss_fn!r}: not supported; use one of {', '.join(TINKER_LOSS_INPUTS)}"]
    if len(data) == 0:
        return ["no data: give at least one Datum"]
    problems = [p for i, datum in enumerate(data) for p in _problems_of(i, datum, loss_fn, vocab_size, context)]
    if len(problems) > MAX_LISTED:
        problems = problems[:MAX_LISTED] + [f"... and {len(problems) - MAX_LISTED} more"]
    return problems


def _problems_of(i: int, datum: Datum, loss_fn: str, vocab_size: int, context: int) -> list[str]:
    fields = {"tokens": datum.tokens, **{f"loss_fn_inputs[{k!r}]": v for k, v in datum.loss_fn_inputs.items()}}
    tensors, problems = {}, []
    for name, values in fields.items():
        try:
            tensors[name] = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as exc:
            problems.append(f"datum {i}: {name} is not a list of numbers ({type(exc).__name__})")
    n = len(tensors["tokens"]) if "tokens" in tensors and tensors["tokens"].dim() == 1 else None
    if n == 0:
        problems.append(f"datum {i}: no tokens")
    elif n is not None and n > context:
        problems.append(f"datum {i}: {n} tokens, more than the model's context of {context} positions; shorten it")
    missing = [k for k in TINKER_LOSS_INPUTS[loss_fn] if k not in datum.loss_fn_inputs]
    if missing:
        problems.append(f"datum {i}: loss_fn={loss_fn!r} needs loss_fn_inputs {', '.join(missing)}")
    wrong = {k: tuple(t.shape) for k, t in tensors.items() if t.dim() != 1 or (n is not None and len(t) != n)}
    if wrong:
        problems.append(f"datum {i}: {n} tokens but fields of shapes {wrong}: each must be a flat list with one "
                        "value per input token (targets are the sequence shifted by one)")  # fmt: skip
    for name, t in tensors.items():
        if name in wrong:
            continue
        if name in ("tokens", "loss_fn_inputs['target_tokens']"):
            problems += _id_problems(i, name, t, vocab_size)
        elif t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):  # as float32, as they are used
            first = int((~torch.isfinite(t.float())).nonzero()[0, 0])
            problems.append(f"datum {i}: {name}[{first}] = {t[first].item()}: every value must be finite (in "
                            "float32)")  # fmt: skip
    return problems


def _id_problems(i: int, name: str, ids: torch.Tensor, vocab_size: int) -> list[str]:
    """Token ids must be integers in [0, vocab_size)."""
    integral = _is_integer(ids) or ids.is_floating_point() and bool((ids == ids.round()).all())
    if not integral:
        return [f"datum {i}: {name} holds non-integer values; token ids are integers"]
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if len(bad) == 0:
        return []
    first = int(bad[0, 0])
    return [
        f"datum {i}: {name}[{first}] = {ids[first].item()} is outside the vocabulary (0 to {vocab_size - 1})"
        + (f", and {len(bad) - 1} more ids" if len(bad) > 1 else "")
    ]


def rows_problems(rows: DatumRows, vocab_size: int, context: int) -> list[str]:
    """:func:`datum_problems`' limits on padded rows (what a rank checks before its forward), naming the row."""
    problems = []
    if rows.input_ids.shape[1] > context:
        problems.append(f"rows of {rows.input_ids.shape[1]} tokens: more than the context of {context} positions")
    for name, ids in (("tokens", rows.input_ids), ("target_tokens", rows.target_tokens)):
        bad = ((ids < 0) | (ids >= vocab_size)).any(dim=1).nonzero()
        if len(bad):
            problems.append(f"row {int(bad[0, 0])}: {name} outside the vocabulary (0 to {vocab_size - 1})")
    for name, values in rows.inputs.items():
        bad = (~torch.isfinite(values)).any(dim=1).nonzero()
        if len(bad):
            problems.append(f"row {int(bad[0, 0])}: {name} not finite")
    return problems


def _is_integer(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def pad_data(data: Sequence[Datum], loss_fn: str, rows: int) -> DatumRows:
    """``data`` as ``rows`` >= len(data) padded rows (the extra rows are all padding). Call
    :func:`datum_problems` first."""
    width = max(len(d.tokens) for d in data)
    names = [k for k in TINKER_LOSS_INPUTS[loss_fn] if k != "target_tokens"]
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width)
    inputs = {k: torch.zeros(rows, width) for k in names}
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        input_ids[i, :n] = torch.as_tensor(datum.tokens, dtype=torch.long)
        targets[i, :n] = torch.as_tensor(datum.loss_fn_inputs["target_tokens"], dtype=torch.long)
        mask[i, :n] = 1.0
        for k in names:
            inputs[k][i, :n] = torch.as_tensor(datum.loss_fn_inputs[k], dtype=torch.float32)
    lengths = [len(d.tokens) for d in data] + [0] * (rows - len(data))
    return DatumRows(input_ids, mask, targets, inputs, lengths)

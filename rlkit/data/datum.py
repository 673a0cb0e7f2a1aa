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


def datum_problems(data: Sequence[Datum], loss_fn: str) -> list[str]:
    """Every problem of ``data`` for ``loss_fn`` (empty: fine), each naming the datum and the fix."""
    if loss_fn not in TINKER_LOSS_INPUTS:
        return [f"loss_fn={loss_fn!r}: not supported; use one of {', '.join(TINKER_LOSS_INPUTS)}"]
    if len(data) == 0:
        return ["no data: give at least one Datum"]
    problems = []
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            problems.append(f"datum {i}: no tokens")
        missing = [k for k in TINKER_LOSS_INPUTS[loss_fn] if k not in datum.loss_fn_inputs]
        if missing:
            problems.append(f"datum {i}: loss_fn={loss_fn!r} needs loss_fn_inputs {', '.join(missing)}")
        wrong = {k: len(v) for k, v in datum.loss_fn_inputs.items() if len(v) != n}
        if wrong:
            problems.append(f"datum {i}: {n} tokens but loss_fn_inputs of lengths {wrong}: each must have one "
                            "value per input token (targets are the sequence shifted by one)")  # fmt: skip
    return problems


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

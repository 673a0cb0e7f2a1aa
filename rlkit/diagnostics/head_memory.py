"""The memory estimate's "logits" term: one micro-batch's LM head and log-softmax at the loss, in bytes.

Two paths, as :func:`rlkit.models.logprobs.response_logprobs` takes them:

- fused (:mod:`rlkit.models.head`, the families of ``PACKABLE_MODEL_TYPES``): the head runs chunk by chunk on the
  response tokens and never holds the [rows, V] logits; what it adds is a chunk's logits, the fp32 [V, H]
  weight-gradient accumulator and the hidden states' gradient (:func:`fused_head_bytes`);
- plain (other families): [rows, V] logits, their copies and fp32 chunks of the log-softmax (:func:`logits_bytes`).

Until 2026-12-04 the estimate counted the plain path for every model: 9.8 GiB at 0.5B and 36.5 GiB at 3B x 65,536
tokens where the fused head keeps 1.5 and 2.7, which made the update's estimate 1.25x and 1.57x the H200's
measured peaks (bench/results, issue 34).
"""

from __future__ import annotations

from typing import NamedTuple

from rlkit.models.head import CHUNK_ELEMENTS as HEAD_CHUNK_ELEMENTS
from rlkit.models.head import FUSED_CHUNK_ELEMENTS
from rlkit.models.logprobs import CHUNK_ELEMENTS

FORWARD_CHUNKS = 3
"""Plain path: fp32 [chunk, V] tensors alive at once in sampled_logprobs' forward: the scaled chunk, its
probabilities and their product (for the entropy)."""
BACKWARD_CHUNKS = 1
"""Plain path: fp32 [chunk, V] tensors alive at once in its backward (one, updated in place)."""
FP32_PATH_BYTES = 24
"""Plain path, bytes per logit at the loss with an entropy bonus (plain autograd over fp32 logits): the scaled
copy, two log-softmax outputs, exp and product (about five fp32 copies), and gradients of as many in backward."""
HEAD_MATHS = {"fused": FUSED_CHUNK_ELEMENTS, "eager": HEAD_CHUNK_ELEMENTS}
"""The fused head's chunk math (``MemorySetting.head_math``) -> logit entries per chunk."""
FORWARD_FP32_BYTES = {"eager": {False: 8, True: 12}, "fused": {False: 0, True: 4}}
"""Fused head, fp32 bytes per chunk entry in a forward beside the chunk's logits, by chunk math and by whether the
forward takes the entropy (the update does, for its metric; scoring does not). Eager: the scaled fp32 copy and the
log-sum-exp's temporary, or the copy, the softmax and their product. Compiled: the softmax, which inductor keeps
as one fp32 buffer (its generated code, torch 2.13 on CPU), and nothing without the entropy."""
BACKWARD_FP32_BYTES = {"eager": 8, "fused": 4}
"""Fused head, fp32 bytes per chunk entry in the backward beside the chunk's logits and gradient: eager, the log-probs'
copy and the probabilities (the gradient is written into the latter); compiled, one fp32 buffer. The H100's probe
(bench/head_memory_probe.py, 2026-12-06) measured 8 bytes per entry in all (e = 2) on its one-chunk-and-a-bit row
(2.511 GiB = the 0.507 GiB accumulator + 2^28 x 8 bytes) and 10 on its rows of many full chunks, where the previous
chunk's gradient (2 more) is alive while the next one's are made (:func:`fused_head_bytes`)."""


class LogitsLayout(NamedTuple):
    """Which [*, V] rows one micro-batch's LM head makes."""

    rows: int
    """Log-probs taken: response tokens."""
    head_rows: int
    """Rows the LM head outputs (the fused head: the response tokens; plain: T + 1 positions per row)."""
    copies: int
    """Further compute-dtype [rows, V] copies beside the head's output (plain path)."""


def fused_head_bytes(
    rows: int, vocab: int, hidden: int, e: int, *, grad: bool, math: str, weight_grad: bool = True,
    chunk_entries: int = 0,
) -> int:
    """Peak bytes of :func:`rlkit.models.head.linear_logprobs` on ``rows`` tokens, C = min(rows, chunk entries // V)
    rows per chunk (``chunk_entries``, default the ``math``'s: :data:`HEAD_MATHS`), ``math`` "fused" (compiled, a
    GPU's) or "eager" (a CPU's).

    Forward: a chunk's [C, V] logits (e bytes each) and :data:`FORWARD_FP32_BYTES` per entry (the update's forward
    takes the entropy), and 16 bytes per row (the [rows, 2] output, log-sum-exps, entropies). Backward (``grad``),
    beside those 16 bytes per row: the [rows, H] hidden gradient, the fp32 [V, H] weight-gradient accumulator (made
    whether or not the weight trains: LoRA's frozen head has one too) and a chunk's logits and gradient (2e) with
    :data:`BACKWARD_FP32_BYTES` per entry; from the second chunk on, the previous chunk's gradient (e per entry)
    is still alive while the next one's are made; with ``weight_grad`` (a trained head) a chunk's gradient sits
    beside its [V, H] product with the hidden states (e each) when that is added into the accumulator.

    Example: Qwen2.5-0.5B (V 151,936, H 896), 16,384 response tokens, bf16, compiled: chunks of 1,766 rows (2^28
    entries); forward 1.5 GiB; backward 0.03 GiB hidden gradient + 0.51 GiB accumulator + 2^28 x (8 + 2) bytes
    (2.5 GiB) for a chunk after the first: 3.03 GiB, trained or frozen (measured 3.036 both).
    """
    chunk_rows = min(rows, max(1, (chunk_entries or HEAD_MATHS[math]) // vocab))
    chunk = chunk_rows * vocab
    forward = chunk * (e + FORWARD_FP32_BYTES[math][grad]) + 16 * rows
    if not grad:
        return forward
    per_entry = 2 * e + BACKWARD_FP32_BYTES[math]
    elementwise = chunk * per_entry
    if rows > chunk_rows:  # the next chunk's (the last may be partial) beside the previous one's gradient
        elementwise = max(elementwise, e * chunk + min(chunk_rows, rows - chunk_rows) * vocab * per_entry)
    if weight_grad:
        elementwise = max(elementwise, e * (chunk + vocab * hidden))
    return max(forward, 16 * rows + e * rows * hidden + 4 * vocab * hidden + elementwise)


def logits_bytes(layout: LogitsLayout, vocab: int, e: int, *, grad: bool, fp32_path: bool = False) -> int:
    """Plain path: peak bytes of one micro-batch's logits and log-softmax (rlkit.models.logprobs.sampled_logprobs).

    Forward at the loss: the head's output, the copies and FORWARD_CHUNKS fp32 chunks of
    min(rows, CHUNK_ELEMENTS // V) rows. Backward: the saved logits, their gradient and BACKWARD_CHUNKS chunks;
    then, padded, the slice's backward writes the gradient into a zero [head_rows, V] tensor while the [rows, V]
    gradient is alive. ``fp32_path`` (entropy bonus): FP32_PATH_BYTES per logit beside the head's output.
    """
    rows, head = layout.rows * vocab, layout.head_rows * vocab
    if fp32_path:
        return head * e + rows * FP32_PATH_BYTES
    chunk = min(layout.rows, max(1, CHUNK_ELEMENTS // vocab)) * vocab * 4
    forward = (head + layout.copies * rows) * e + FORWARD_CHUNKS * chunk
    if not grad:
        return forward
    saved = rows if layout.copies else head
    backward = (saved + rows) * e + BACKWARD_CHUNKS * chunk
    unslice = (rows + head) * e if layout.copies else 0
    return max(forward, backward, unslice)

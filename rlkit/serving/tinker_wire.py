"""The Tinker SDK's protobuf messages <-> rlkit's data: the ``forward_backward`` request in, the
``ForwardBackwardOutput`` and ``SampleResponse`` results out (the SDK reads those two only as protobuf).

Imports the SDK's generated proto module (the ``tinker`` extra) when called, never at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlkit.data.datum import Datum
from rlkit.serving.futures import Refused

PROTO = "application/x-protobuf"
MAX_BODY_BYTES = 64 << 20
"""The most a request body may hold, as sent and after zstd decompression (413 beyond it); the SDK sends
``forward_backward`` in chunks of about 5 MB at most."""
_NUMPY_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}  # tinker_public.DType: FLOAT32, INT64, INT32


@dataclass
class ForwardBackwardCall:
    """One decoded ``/api/v1/forward_backward`` request."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool


def decode_forward_backward(body: bytes, content_encoding: str | None) -> ForwardBackwardCall:
    """The SDK's ``ForwardBackwardRequest`` protobuf (zstd-compressed when ``content_encoding`` is "zstd").
    Raises ValueError for a body that is not one, naming every chunk or tensor kind rlkit does not take (images,
    audio, sparse tensors); Refused (413) for one that decompresses beyond :data:`MAX_BODY_BYTES`."""
    from google.protobuf.message import DecodeError
    from tinker.proto import tinker_public_pb2 as pb

    if content_encoding not in (None, "", "identity", "zstd"):
        raise ValueError(f"Content-Encoding {content_encoding!r}: send the body as is or zstd-compressed")
    if content_encoding == "zstd":
        body = _unzstd(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise ValueError(f"the body is not a ForwardBackwardRequest protobuf ({exc})") from None
    problems: list[str] = []
    data = [_datum(i, d, problems) for i, d in enumerate(msg.data)]
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items()} or dict(msg.loss_fn_config) or None
    if any(v.WhichOneof("value") == "text" for v in msg.loss_fn_config_v2.values()):
        problems.append("loss_fn_config: text values are not supported; give numbers")
    if problems:
        raise ValueError("forward_backward: " + "; ".join(problems))
    return ForwardBackwardCall(msg.model_id, msg.seq_id, data, msg.loss_fn, config, msg.forward_only)


def _unzstd(body: bytes) -> bytes:
    """``body``'s one zstd frame decompressed, fed in small slices so that a small body announcing a huge output
    never allocates it (a slice of 256 bytes decompresses to a few MiB at most)."""
    import zstandard

    decompressor, out, size = zstandard.ZstdDecompressor().decompressobj(), [], 0
    try:
        for start in range(0, len(body), 256):
            block = decompressor.decompress(body[start : start + 256])
            size += len(block)
            if size > MAX_BODY_BYTES:
                raise Refused(413, f"the zstd body decompresses beyond {MAX_BODY_BYTES >> 20} MiB: send smaller "
                              "forward_backward chunks")  # fmt: skip
            out.append(block)
    except zstandard.ZstdError as exc:
        raise ValueError(f"the body is not valid zstd ({exc})") from None
    if not decompressor.eof or decompressor.unused_data:
        raise ValueError("the body is not one complete zstd frame (truncated, or data after it)")
    return b"".join(out)


def _datum(index: int, msg, problems: list[str]) -> Datum:  # noqa: ANN001 (a tinker_public_pb2.Datum)
    tokens: list[int] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            problems.append(f"datum {index}: a {kind} chunk; rlkit trains on token chunks (EncodedTextChunk) only")
            continue
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    inputs = {}
    for name, tensor in msg.loss_fn_inputs.items():
        dtype = _NUMPY_DTYPES.get(tensor.dtype)
        if tensor.WhichOneof("encoding") != "dense" or dtype is None:
            problems.append(f"datum {index}: loss_fn_inputs[{name!r}] is sparse or of dtype {tensor.dtype}; "
                            "send dense float32/int64 tensors")  # fmt: skip
            continue
        inputs[name] = torch.from_numpy(np.frombuffer(tensor.dense, dtype=dtype).copy())
    return Datum(tokens=tokens, loss_fn_inputs=inputs)


def encode_forward_backward_output(logprobs: Sequence[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """Tinker's ``ForwardBackwardOutput``: per datum ``loss_fn_outputs[i]["logprobs"]`` ([N_i] float32) and
    the metrics, as the SDK's protobuf (one batched ArrayRecord)."""
    from tinker.proto import tinker_public_pb2 as pb

    arrays = [lp.detach().to(torch.float32).numpy() for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    batched = pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                               dtype=pb.DTYPE_FLOAT32)  # fmt: skip
    record = pb.ArrayRecord(type_tag="ArrayRecord", fields={"logprobs": batched}, num_datums=len(arrays))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics)
    return out.SerializeToString()


def encode_sample_response(sequences: Sequence[tuple[list[int], list[float], str]],
                           prompt_logprobs: Sequence[float] | None = None) -> bytes:  # fmt: skip
    """Tinker's ``SampleResponse`` protobuf from (tokens, log-probs, stop reason "stop"/"length") per sequence, and
    the prompt's log-probs when asked (NaN where none: the first token, and those before ``prompt_logprobs_last_n``)."""
    from tinker.proto import tinker_public_pb2 as pb

    stop = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse(sequences=[
        pb.SampledSequence(stop_reason=stop[reason], tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                           logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
        for tokens, logprobs, reason in sequences])  # fmt: skip
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()

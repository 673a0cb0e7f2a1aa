"""The trainer's side of a weight sync into a vLLM engine of another process: shared CUDA buffers or files.

On GPU the weights travel in :class:`SharedWeights`: flat device buffers in the engine's dtype whose CUDA
IPC handles the engine opens once, so a sync is one cast-and-copy per parameter into them and one RPC. On
CPU (no IPC) they are written as safetensors files the engine reloads from (:func:`write_files`).
"""

from __future__ import annotations

import itertools
import math
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

BUCKET_BYTES = 512 * 2**20
"""Weights per safetensors file or shared buffer (bounds the host memory a file sync holds)."""

Layout = list[tuple[str, tuple[int, ...], int]]
"""(name, shape, start element) of each tensor packed in one flat buffer."""


def buckets(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, max_bytes: int, *, device: str | None
) -> Iterator[dict[str, torch.Tensor]]:
    """Group (name, full tensor) pairs into dicts of about ``max_bytes``, cast to ``dtype`` and moved to
    ``device`` (None: each stays where it is)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights:
        moved = tensor.detach().to(device=device, dtype=dtype).contiguous()
        bucket[name] = moved
        size += moved.numel() * moved.element_size()
        if size >= max_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


def flat_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, max_bytes: int
) -> Iterator[tuple[torch.Tensor, Layout]]:
    """:func:`buckets` on the tensors' own device, each packed into one 1-D buffer; yields (buffer, layout)."""
    for bucket in buckets(weights, dtype, max_bytes, device=None):
        starts = list(itertools.accumulate((t.numel() for t in bucket.values()), initial=0))[:-1]
        layout = [(name, tuple(t.shape), start) for (name, t), start in zip(bucket.items(), starts, strict=True)]
        yield torch.cat([t.reshape(-1) for t in bucket.values()]), layout


def layout_views(buffer: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """(name, view of ``buffer`` with the tensor's shape) for each entry of ``layout``."""
    return [(name, buffer[start : start + math.prod(shape)].view(shape)) for name, shape, start in layout]


class SharedWeights:
    """The weights in the engine's dtype, packed into flat buffers on the actor's device at the first sync.

    :meth:`handles` is what the engine needs to open the buffers (once); :meth:`fill` copies a later sync's
    weights into them in place (the cast to the engine's dtype happens in the copy). Costs one engine-dtype
    copy of the model on the device for as long as it is kept.
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype):
        packed = list(flat_buckets(weights, dtype, BUCKET_BYTES))
        self.buffers = [buffer for buffer, _ in packed]
        self.layouts = [layout for _, layout in packed]
        self.views = [view for buffer, layout in packed for view in layout_views(buffer, layout)]

    def __len__(self) -> int:
        return len(self.views)

    def handles(self) -> bytes:
        """Pickled (CUDA IPC handle, layout) of each buffer, for the engine's ``rlkit_attach``."""
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps([(reduce_tensor(b), layout) for b, layout in zip(self.buffers, self.layouts, strict=True)])

    @torch.no_grad()
    def fill(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, full tensor) pairs, in the order of the first sync, into the buffers."""
        count = 0
        for got, tensor in weights:
            name, view = self.views[count] if count < len(self.views) else ("nothing", torch.empty(0))
            if got != name or tensor.shape != view.shape:
                raise RuntimeError(
                    f"weight {count} is {got} {tuple(tensor.shape)}, but the engine's buffers hold {name} "
                    f"{tuple(view.shape)} there: the actor's parameters changed since the first sync"
                )
            view.copy_(tensor)
            count += 1
        if count != len(self.views):
            raise RuntimeError(f"{count} weights arrived where the engine's buffers hold {len(self.views)}")


def write_files(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, folder: Path) -> int:
    """Replace the safetensors files in ``folder`` with the weights, bucket by bucket; returns how many."""
    from safetensors.torch import save_file

    for old in folder.glob("*.safetensors"):
        old.unlink()
    count = 0
    for i, bucket in enumerate(buckets(weights, dtype, BUCKET_BYTES, device="cpu")):
        save_file(bucket, str(folder / f"part-{i:05d}.safetensors"), metadata={"format": "pt"})
        count += len(bucket)
    return count

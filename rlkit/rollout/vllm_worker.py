"""What runs inside the vLLM engine's worker process: rlkit's methods on vLLM's worker, called by ``collective_rpc``.

Weights arrive either as safetensors files (:meth:`WorkerExtension.rlkit_reload`) or in the trainer's shared
CUDA buffers (:meth:`~WorkerExtension.rlkit_attach` once, then :meth:`~WorkerExtension.rlkit_reload_attached`
per sync). The first reload from shared buffers goes through vLLM's ``reload_weights`` (the model's own
loader: fused q/k/v and gate/up, renames, post-processing); it then checks whether each of the engine's
parameters is nothing but its checkpoint tensors stacked along dim 0 (``packed_modules_mapping``, one GPU).
Where that holds, later syncs copy the buffers straight into the parameters, skipping the loader.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from rlkit.models.fingerprint import fingerprint
from rlkit.rollout.vllm_weights import layout_views

Plan = list[tuple[str, list[tuple[str, int, int]]]]
"""Per engine parameter: (name, [(checkpoint tensor name, first row, rows)]) that fill it along dim 0."""


def stacking_plan(
    params: dict[str, tuple[int, ...]], packed: dict[str, list[str]], sources: dict[str, tuple[int, ...]]
) -> Plan | None:
    """How each engine parameter is its checkpoint tensors stacked along dim 0, or None where one is not.

    Args:
        params: the engine model's parameter shapes by name.
        packed: the model's ``packed_modules_mapping`` (fused module -> the checkpoint modules it stacks,
            e.g. ``qkv_proj -> [q_proj, k_proj, v_proj]``).
        sources: the checkpoint tensors' shapes by name (what the trainer sends).
    """
    plan: Plan = []
    for name, shape in params.items():
        module, _, attr = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        names = [f"{parent}.{part}.{attr}" if parent else f"{part}.{attr}" for part in packed.get(leaf, [])] or [name]
        if not shape or any(n not in sources or not sources[n] or sources[n][1:] != shape[1:] for n in names):
            return None
        rows = [sources[n][0] for n in names]
        if sum(rows) != shape[0]:
            return None
        starts = [sum(rows[:i]) for i in range(len(rows))]
        plan.append((name, [(n, start, r) for n, start, r in zip(names, starts, rows, strict=True)]))
    return plan


class WorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    reload_weights: Any
    model_runner: Any

    def rlkit_reseed(self, seed: int) -> None:
        """Seed the sampler's generator (on CPU and every CUDA device) for the next generate call."""
        torch.manual_seed(seed)

    def rlkit_reload(self, weights_path: str) -> None:
        """Reload every weight in place from the safetensors files in ``weights_path``."""
        self.reload_weights(weights_path=weights_path)
        self._rlkit_refresh_tied_head()

    def rlkit_attach(self, payload: bytes) -> None:
        """Open the trainer's shared buffers (pickled IPC handles and layouts from ``SharedWeights.handles``)."""
        views = []
        for (rebuild, args), layout in pickle.loads(payload):
            args = list(args)
            args[6] = 0  # the storage's device, as this process numbers it: the trainer's GPU is its first visible one
            views += layout_views(rebuild(*args), layout)
        self._rlkit_views = views
        self._rlkit_copies = self._rlkit_bind(getattr(self, "_rlkit_plan", None))

    def rlkit_detach(self) -> None:
        """Drop the shared buffers (the trainer frees them while the engine sleeps); a verified plan is kept."""
        self._rlkit_views, self._rlkit_copies = [], None

    def rlkit_reload_attached(self) -> str:
        """Reload every weight from the attached buffers; returns "direct" (straight copies) or "loader"."""
        copies = self._rlkit_copies
        if copies is not None:
            for param, start, rows, view in copies:
                param[start : start + rows].copy_(view.reshape(rows, *param.shape[1:]))
            mode = "direct"
        else:
            self.reload_weights(weights_iterator=iter(self._rlkit_views))
            self._rlkit_refresh_tied_head()
            if not hasattr(self, "_rlkit_plan"):
                self._rlkit_plan = self._rlkit_checked_plan()
                self._rlkit_copies = self._rlkit_bind(self._rlkit_plan)
            mode = "loader"
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # done reading before the sender overwrites or frees its buffers
        return mode

    def rlkit_fingerprints(self, shapes: dict[str, list[int]]) -> tuple[dict[str, tuple], int]:
        """{checkpoint tensor: (engine parameter, fingerprint of the rows where it sits)} (rlkit.models.fingerprint)
        for every engine parameter whose values are readable, and how many are not (vLLM's CPU backend repacks
        linear weights into empty parameters). A fused parameter holds its checkpoint tensors stacked along dim 0
        in ``packed_modules_mapping``'s order; rows past theirs (padding) are left out. ``shapes``: the trainer's
        tensors' shapes by name. Tensor parallelism: nothing (each worker holds shards)."""
        model = self.model_runner.get_model()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            return {}, -1
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        prints, unreadable = {}, 0
        for name, param in model.named_parameters():
            module, _, attr = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            parts = [f"{parent}.{part}.{attr}" for part in packed.get(leaf, [])] or [name]
            rows = sum(shapes[part][0] for part in parts if shapes.get(part)) if all(p in shapes for p in parts) else 0
            if param.numel() == 0 or rows == 0 or param.shape[0] < rows:
                unreadable += 1
                continue
            start = 0
            for part in parts:
                block = param.detach()[start : start + shapes[part][0]]
                prints[part] = (name, fingerprint(block).tolist())  # plain floats: RPC results are msgpacked
                start += shapes[part][0]
        return prints, unreadable

    def _rlkit_checked_plan(self) -> Plan | None:
        """A stacking plan whose copies reproduce exactly what the loader just put in every parameter."""
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        sources = dict(self._rlkit_views)
        plan = stacking_plan(
            {n: tuple(p.shape) for n, p in params.items()},
            getattr(model, "packed_modules_mapping", {}) or {},
            {n: tuple(v.shape) for n, v in sources.items()},
        )
        if plan is None or torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            return None
        for name, parts in plan:
            param = params[name]
            for source, start, rows in parts:
                if not torch.equal(param[start : start + rows], sources[source].reshape(rows, *param.shape[1:])):
                    return None
        return plan

    def _rlkit_bind(self, plan: Plan | None) -> list[tuple[torch.Tensor, int, int, torch.Tensor]] | None:
        """(parameter data, first row, rows, buffer view) copies for ``plan`` on the attached buffers."""
        if not plan:
            return None
        params = dict(self.model_runner.get_model().named_parameters())
        sources = dict(self._rlkit_views)
        return [(params[name].data, start, rows, sources[src]) for name, parts in plan for src, start, rows in parts]

    def _rlkit_refresh_tied_head(self) -> None:
        """An output head tied to the input embedding is loaded through the embedding only, so what the head
        derived from it at load time (vLLM's CPU backend packs it for its matmul) is rebuilt here."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        tied = any(
            p is weight for n, p in model.named_parameters(remove_duplicate=False) if not n.startswith("lm_head.")
        )
        if head is not None and tied:
            head.quant_method.process_weights_after_loading(head)

"""Rollout with vLLM, colocated with this rank's trainer on its device (the hybrid engine).

``vllm`` is an optional dependency (``pip install 'rlkit[vllm]'``) imported here only, when an
engine is built. The engine runs in its own processes (vLLM's default mode): vLLM's in-process
mode would join the worker's torch.distributed group and hang. So the actor's weights cross the
process boundary: on GPU as CUDA IPC handles to a few flat device buffers (no host copy), on CPU
as safetensors files in a per-rank scratch folder (tmpfs when it has room), written bucket by
bucket as the FSDP gather yields them. Either way vLLM's own in-place reload
(``reload_weights``) takes them without restarting the engine. Whether they arrived shows in the
trainer's log-prob gap metric (rollout vs trainer log-probs of the same tokens).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from rlkit.rollout.base import Generation, SamplingParams

log = logging.getLogger(__name__)

BUCKET_BYTES = 512 * 2**20
"""Weights written per safetensors file during a sync (bounds the host memory a sync holds)."""
CPU_KV_CACHE_GB = 1.0
"""KV cache on CPU when the config leaves it to rlkit (vLLM's CPU backend wants an explicit size)."""
SHUTDOWN_S = 2.0
"""How long close() lets the engine's processes exit before vLLM kills them (a worker gets 5 s to
exit when the cluster shuts down; after that its whole process group is killed)."""
EXIT_WAIT_S = 10.0
"""How long close() then waits for the killed processes to be gone (their memory freed)."""
TORCH_DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class VLLMEngine:
    """A vLLM engine on this rank's device that generates with per-token log-probs and takes new weights in place.

    Each call reseeds the engine's sampler with ``params.seed``, so a run (the same calls in the same
    order) repeats; repeating one call on a used engine may not, because vLLM hands out batch rows,
    and with them random streams, by free slot (per-request seeds would fix that at ~3x the sampling
    cost on GPU). Prefix caching is off: RL rollouts rarely repeat a prompt across calls, and a cache
    would hold KV computed with the old weights after a sync. Log-probs are vLLM's "processed" ones,
    log softmax(logits / temperature), like the trainer's (with top_p < 1 they are renormalised over
    the nucleus). On GPU, :meth:`sleep` frees the weights and KV cache while the actor trains;
    vLLM has no sleep mode on CPU, where it is a no-op.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        eos_token_id: int,
        pad_token_id: int,
        max_num_seqs: int,
        max_model_len: int,
        gpu_memory_utilization: float,
        kv_cache_gb: float,
        seed: int,
        trust_remote_code: bool = False,
    ):
        from vllm import LLM

        self.dtype = dtype
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.can_sleep = device.type == "cuda"
        self._asleep: set[str] = set()
        if device.type == "cpu" and kv_cache_gb == 0:
            kv_cache_gb = CPU_KV_CACHE_GB
        self._scratch = Path(tempfile.mkdtemp(prefix="rlkit-vllm-weights-", dir=_scratch_root(model_dir)))
        others = _vllm_processes()
        with _engine_environment(device), _removed_on_error(self._scratch):
            self.llm = LLM(
                model=str(model_dir),
                dtype=str(dtype).removeprefix("torch."),
                seed=seed,
                trust_remote_code=trust_remote_code,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=int(kv_cache_gb * 2**30) or None,
                enable_sleep_mode=self.can_sleep,
                enable_prefix_caching=False,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                worker_extension_cls=f"{__name__}.WorkerExtension",
            )
        self._processes = [p for p in _vllm_processes() if p not in others]
        if not self.can_sleep:
            log.info(
                "vLLM has no sleep mode on %s: the engine keeps its weights and KV cache while the actor trains", device
            )

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generation:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self._wake("weights", "kv_cache")
        self.llm.collective_rpc("rlkit_reseed", args=(params.seed,))
        prompts = [
            TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
            for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)
        ]
        sampling = VLLMSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop_token_ids=[self.eos_token_id],
            logprobs=0,  # the sampled token's only
            flat_logprobs=True,  # plain float lists, not a dict of objects per token
            detokenize=False,
        )
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        return _to_generation(completions, params.max_new_tokens, self.pad_token_id, prompt_ids.device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload the engine's weights in place from (name, full tensor) pairs; returns how many.

        On GPU the engine reads them from this process's memory through CUDA IPC; on CPU they go
        through safetensors files in the scratch folder.
        """
        self._wake("weights")
        if self.can_sleep:  # CUDA
            count = self._load_shared(weights)
        else:
            count = self._load_from_files(weights)
        self._wake("kv_cache")
        return count

    def _load_shared(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Pack the weights into flat ``self.dtype`` device buffers and send the engine their IPC handles."""
        from torch.multiprocessing.reductions import reduce_tensor

        buckets = list(_flat_buckets(weights, self.dtype, BUCKET_BYTES))
        torch.cuda.synchronize()  # the engine reads the buffers from another process
        payload = pickle.dumps([(reduce_tensor(buffer), layout) for buffer, layout in buckets])
        self.llm.collective_rpc("rlkit_reload_shared", args=(payload,))
        return sum(len(layout) for _, layout in buckets)

    def _load_from_files(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write the weights bucket by bucket into the scratch folder, then have the engine reload them."""
        for old in self._scratch.glob("*.safetensors"):
            old.unlink()
        count = 0
        for i, bucket in enumerate(_buckets(weights, self.dtype, BUCKET_BYTES, device="cpu")):
            _save(bucket, self._scratch / f"part-{i:05d}.safetensors")
            count += len(bucket)
        self.llm.collective_rpc("rlkit_reload", args=(str(self._scratch),))
        return count

    def sleep(self) -> None:
        """Free the weights (kept in host memory) and the KV cache on GPU; a no-op on CPU."""
        if self.can_sleep and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def close(self) -> None:
        """Shut the engine's processes down (``LLM`` has no method for it), wait until they are gone
        (so their memory is free), and delete the scratch folder."""
        shutil.rmtree(self._scratch, ignore_errors=True)
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
            self.llm = None
            _, alive = psutil.wait_procs(self._processes, timeout=EXIT_WAIT_S)
            if alive:
                log.warning("vLLM engine processes %s still run after shutdown", [p.pid for p in alive])

    def _wake(self, *tags: str) -> None:
        """Wake the named memory pools; weights are woken before the KV cache. Blocks this process's
        allocator caches but does not use (the update's activations) go back to the device first, or
        the engine may not find the memory it slept with."""
        for tag in tags:
            if tag in self._asleep:
                torch.cuda.empty_cache()
                self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)


class WorkerExtension:
    """Methods vLLM adds to its worker class (they run in the engine's process), called by ``collective_rpc``."""

    def rlkit_reseed(self, seed: int) -> None:
        """Seed the sampler's generator (on CPU and every CUDA device) for the next generate call."""
        torch.manual_seed(seed)

    def rlkit_reload(self, weights_path: str) -> None:
        """Reload every weight in place from the safetensors files in ``weights_path``.

        An output head tied to the input embedding is loaded through the embedding only, so what the
        head derived from it at load time (vLLM's CPU backend packs it for its matmul) is rebuilt here.
        """
        self.reload_weights(weights_path=weights_path)
        self._rlkit_refresh_tied_head()

    def rlkit_reload_shared(self, payload: bytes) -> None:
        """Reload every weight in place from another process's CUDA buffers (pickled IPC handles and
        layouts from :func:`_flat_buckets`), on this engine's GPU."""
        weights = []
        for (rebuild, args), layout in pickle.loads(payload):
            args = list(args)
            args[6] = torch.cuda.current_device()  # the storage's device, as numbered in the sender
            buffer = rebuild(*args)
            weights += [(name, buffer[start : start + math.prod(shape)].view(shape)) for name, shape, start in layout]
        self.reload_weights(weights_iterator=iter(weights))
        self._rlkit_refresh_tied_head()
        torch.cuda.synchronize()  # done reading before the sender frees its buffers

    def _rlkit_refresh_tied_head(self) -> None:
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        tied = any(
            p is weight for n, p in model.named_parameters(remove_duplicate=False) if not n.startswith("lm_head.")
        )
        if tied:
            head.quant_method.process_weights_after_loading(head)


def _to_generation(completions: list, width: int, pad_token_id: int, device: torch.device) -> Generation:
    """vLLM CompletionOutputs (token ids through the end-of-text token, flat log-probs of the sampled
    tokens) -> padded [len, width] tensors."""
    rows = len(completions)
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(rows, width)
    logprobs = torch.zeros(rows, width)
    for i, c in enumerate(completions):
        k = len(c.token_ids)
        ids[i, :k] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[i, :k] = 1.0
        logprobs[i, :k] = torch.tensor(c.logprobs.logprobs)  # FlatLogprobs: one entry per position
    reasons = [c.finish_reason for c in completions]
    if not set(reasons) <= {"stop", "length"}:
        raise RuntimeError(f"vLLM finished requests with {sorted(set(reasons))}; expected 'stop' or 'length'")
    return Generation(
        response_ids=ids.to(device), response_mask=mask.to(device), logprobs=logprobs.to(device), finish_reason=reasons
    )


def _vllm_processes() -> list[psutil.Process]:
    """This process's descendants that vLLM started (it titles them ``VLLM::EngineCore``, ``VLLM::Worker``...)."""
    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]


def _buckets(
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


def _flat_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, max_bytes: int
) -> Iterator[tuple[torch.Tensor, list[tuple[str, tuple[int, ...], int]]]]:
    """:func:`_buckets` on the tensors' own device, each packed into one 1-D buffer; yields
    (buffer, [(name, shape, start element)])."""
    for bucket in _buckets(weights, dtype, max_bytes, device=None):
        starts = itertools.accumulate((t.numel() for t in bucket.values()), initial=0)
        # starts holds one more entry than the bucket (the end): zip stops at the bucket's last tensor
        layout = [(name, tuple(t.shape), start) for (name, t), start in zip(bucket.items(), starts, strict=False)]
        yield torch.cat([t.reshape(-1) for t in bucket.values()]), layout


def _save(bucket: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(bucket, str(path), metadata={"format": "pt"})


def _scratch_root(model_dir: Path) -> str | None:
    """/dev/shm when it has room for two copies of the model's files (tmpfs: no disk I/O), else the temp dir."""
    shm = Path("/dev/shm")
    need = 2 * sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need:
        return str(shm)
    return None


@contextmanager
def _removed_on_error(folder: Path):
    """Delete ``folder`` if the block raises."""
    try:
        yield
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


@contextmanager
def _engine_environment(device: torch.device):
    """The environment the engine's processes (spawned in this block) inherit: only ``device`` visible
    (vLLM uses its first GPU) and none of the trainer's torch.distributed variables (the engine is a
    world of its own)."""
    changes: dict[str, str | None] = dict.fromkeys(TORCH_DISTRIBUTED_VARIABLES)
    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        changes["CUDA_VISIBLE_DEVICES"] = ids[device.index if device.index is not None else torch.cuda.current_device()]
    saved = {name: os.environ.get(name) for name in changes}
    _set_environment(changes)
    try:
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

"""Rollout with vLLM, colocated with this rank's trainer on its device (the hybrid engine).

``vllm`` is an optional dependency (``pip install 'rlkit[vllm]'``) imported here only, when an
engine is built. The engine runs in its own processes (vLLM's default mode): vLLM's in-process
mode would join the worker's torch.distributed group and hang. So the actor's weights cross the
process boundary (:mod:`rlkit.rollout.vllm_weights`): on GPU through flat device buffers shared
once by CUDA IPC, on CPU as safetensors files in a per-rank scratch folder (tmpfs when it has
room). Either way the engine's worker (:mod:`rlkit.rollout.vllm_worker`) loads them in place
without restarting. The engine's processes, the scratch folder and vLLM's shared memory go with the worker
however it ends (:mod:`rlkit.rollout.reaper`). Whether they arrived shows in the trainer's log-prob gap
metric (rollout vs trainer log-probs of the same tokens), on the rows ``rollout.engine_logprobs`` picks. With
``rollout.tensor_parallel_size`` > 1 one engine spans a group of ranks' devices
(:mod:`rlkit.rollout.tp_group`): its workers each load their shard of every weight from the same
files or buffers.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch

from rlkit.config import LoraConfig
from rlkit.models.lora import save_adapter
from rlkit.rollout.base import LOGIT_SETTINGS, Generation, SamplingParams, logprob_prompts
from rlkit.rollout.reaper import Reaper
from rlkit.rollout.sleep import SleepPolicy
from rlkit.rollout.vllm_weights import SharedWeights, write_files

logger = logging.getLogger(__name__)

CPU_KV_CACHE_GB = 1.0
"""KV cache on CPU when the config leaves it to rlkit (vLLM's CPU backend wants an explicit size)."""
SHUTDOWN_S = 2.0
"""How long close() lets the engine's processes exit before vLLM kills them (a worker gets 5 s to
exit when the cluster shuts down; after that its whole process group is killed)."""
EXIT_WAIT_S = 10.0
"""How long close() then waits for the killed processes to be gone (their memory freed)."""
TORCH_DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class VLLMEngine:
    """A vLLM engine on this rank's device that generates (log-probs on chosen rows) and takes new weights in place.

    Each call reseeds the engine's sampler with ``params.seed``, so a run (the same calls in the same
    order) repeats; repeating one call on a used engine may not, because vLLM hands out batch rows,
    and with them random streams, by free slot (per-request seeds would fix that at ~3x the sampling
    cost on GPU). Prefix caching is off: RL rollouts rarely repeat a prompt across calls, and a cache
    would hold KV computed with the old weights after a sync. Log-probs are vLLM's "processed" ones,
    log softmax(logits / temperature), like the trainer's (with top_p < 1 they are renormalised over
    the nucleus), for the prompts :func:`~rlkit.rollout.base.logprob_prompts` picks with
    ``logprob_fraction``. CUDA graphs and vLLM's compilation stay on (its defaults). On GPU,
    :meth:`sleep` frees the weights and KV cache while the actor trains, as :class:`SleepPolicy`
    decides; vLLM has no sleep mode on CPU, where it is a no-op.
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
        logprob_fraction: float,
        sleep: str,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        gpus: Sequence[str] = (),
        adapters: LoraConfig | None = None,
    ):
        """``tensor_parallel_size`` > 1: the engine spans that many devices; on GPU ``gpus`` names them (entries of
        CUDA_VISIBLE_DEVICES, this rank's first); its workers then each hold a shard of every layer. Other
        arguments: see :func:`rlkit.rollout.build_engine`."""
        from vllm import LLM

        self.device, self.dtype, self.model_dir = device, dtype, model_dir
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.logprob_fraction = logprob_fraction
        self.can_sleep = device.type == "cuda" and sleep != "never"
        self.sleep_policy = SleepPolicy(sleep)
        self.last_sync = ""
        """How the last sync reached the engine's parameters: "files", "loader" (vLLM's reload_weights) or "direct"."""
        self._asleep: set[str] = set()
        self._shared: SharedWeights | None = None
        self.adapters = adapters
        self._lora_request: Any = None
        """The LoRA adapter every generate call uses (with ``adapters``, from the first sync on)."""
        lora: dict[str, Any] = {}
        if adapters is not None:
            lora = dict(enable_lora=True, max_loras=1, max_lora_rank=_max_lora_rank(adapters.rank))
        if device.type == "cpu" and kv_cache_gb == 0:
            kv_cache_gb = CPU_KV_CACHE_GB
        self._scratch = Path(tempfile.mkdtemp(prefix="rlkit-vllm-weights-", dir=_scratch_root(model_dir)))
        self._reaper = Reaper()  # removes the engine's processes and files if this worker dies without close()
        self._reaper.watch(paths=[self._scratch])
        others = _descendants()
        with _engine_environment(device, gpus, tensor_parallel_size), _removed_on_error(self._scratch, self._reaper):
            self.llm: Any = LLM(
                model=str(model_dir),
                tensor_parallel_size=tensor_parallel_size,
                dtype=str(dtype).removeprefix("torch."),  # type: ignore[arg-type]
                seed=seed,
                trust_remote_code=trust_remote_code,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=int(kv_cache_gb * 2**30) or None,
                enable_sleep_mode=self.can_sleep,
                enable_prefix_caching=False,
                # CPU: no torch.compile of the model (it doubles the engine's start, 24 -> 42-50 s for the tiny
                # model on 2 cores, for nothing at the sizes a CPU runs); GPU: compiled, with CUDA graphs
                enforce_eager=device.type == "cpu",
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                worker_extension_cls="rlkit.rollout.vllm_worker.WorkerExtension",
                **lora,
            )
        self._processes = [p for p in _descendants() if p not in others]  # pid and start time: no reused pid
        self._reaper.watch(self._processes, _shared_memory_files(self._processes))
        if device.type == "cpu":
            logger.info(
                "vLLM has no sleep mode on %s: the engine keeps its weights and KV cache while the actor trains", device
            )

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generation:
        return self.generate_shards([(prompt_ids, prompt_mask)], params)[0]

    def generate_shards(
        self, shards: Sequence[tuple[torch.Tensor, torch.Tensor]], params: SamplingParams
    ) -> list[Generation]:
        """Completions of several ranks' prompts in one engine call (a tensor-parallel group's), one Generation
        per shard, each with engine log-probs on ``logprob_fraction`` of its own prompts, as if it were alone.

        Args:
            shards: (prompt_ids, prompt_mask) of each rank, [N_i, P_i] left-padded; N_i may be 0.
        """
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self._wake("weights", "kv_cache")
        self.llm.collective_rpc("rlkit_reseed", args=(params.seed,))
        prompts = [
            TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
            for prompt_ids, prompt_mask in shards
            for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)
        ]
        common = self._sampling_settings(params)
        # the sampled token's log-prob only, as plain float lists (not a dict of objects per token)
        with_logprobs = VLLMSamplingParams(**common, logprobs=0, flat_logprobs=True)
        plain = VLLMSamplingParams(**common)
        chosen = self._logprob_prompts(shards, params.logprob_rows)
        sampling = [with_logprobs if c else plain for c in torch.cat(chosen).tolist()]
        lora_request = self._lora_request
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=lora_request) if prompts else []
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        generations, start = [], 0
        for (prompt_ids, _), rows in zip(shards, chosen, strict=True):
            end = start + len(prompt_ids) * params.n
            rows = rows.repeat_interleave(params.n)
            width, pad = params.max_new_tokens, self.pad_token_id
            generations.append(_to_generation(completions[start:end], rows, width, pad, prompt_ids.device))
            start = end
        return generations

    def _logprob_prompts(
        self, shards: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: tuple[bool, ...] | None
    ) -> list[torch.Tensor]:
        """[N_i] bool per shard: the prompts whose completions carry log-probs, ``rows`` (the shards' prompts in
        order) where given, none for ``()``, else ``logprob_fraction`` of each shard's own."""
        sizes = [len(prompt_ids) for prompt_ids, _ in shards]
        if rows is None:
            return [logprob_prompts(size, self.logprob_fraction) for size in sizes]
        if rows == ():
            return [torch.zeros(size, dtype=torch.bool) for size in sizes]
        if len(rows) != sum(sizes):
            raise ValueError(f"SamplingParams.logprob_rows has {len(rows)} values for {sum(sizes)} prompts")
        return list(torch.tensor(rows, dtype=torch.bool).split(sizes))

    def _sampling_settings(self, params: SamplingParams) -> dict[str, Any]:
        return dict(n=params.n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
                    min_tokens=params.min_new_tokens, stop_token_ids=[self.eos_token_id] if params.stop_at_eos else [],
                    ignore_eos=not params.stop_at_eos, detokenize=False)

    def effective_sampling(self, params: SamplingParams) -> dict[str, object]:
        """The settings of :data:`~rlkit.rollout.base.LOGIT_SETTINGS` in the SamplingParams generate builds for
        ``params``, as vLLM holds them (its defaults and anything else that changes the object included)."""
        from vllm import SamplingParams as VLLMSamplingParams

        built = VLLMSamplingParams(**self._sampling_settings(params))
        return {k: getattr(built, k) for k in LOGIT_SETTINGS if hasattr(built, k)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload the engine's weights in place from (name, full tensor) pairs; returns how many.

        On GPU they are cast into the shared buffers (packed and handed to the engine at the first sync
        after a sleep, copied into in place otherwise), then the engine copies them into its parameters;
        on CPU they go through safetensors files in the scratch folder.
        """
        if self.adapters is not None:
            return self._load_adapter(weights)
        if self.device.type != "cuda":
            count = write_files(weights, self.dtype, self._scratch)
            self._wake("weights", "kv_cache")
            self.llm.collective_rpc("rlkit_reload", args=(str(self._scratch),))
            self.last_sync = "files"
            return count
        if self._shared is None:
            self._shared = SharedWeights(weights, self.dtype)
            torch.cuda.synchronize(self.device)  # the engine reads the buffers from another process
            self.llm.collective_rpc("rlkit_attach", args=(self._shared.handles(),))
        else:
            self._shared.fill(weights)
            torch.cuda.synchronize(self.device)
        if self._asleep or self.sleep_policy.awake_last:  # an update ran since the last rollout (not a resume)
            self.sleep_policy.record_update(torch.cuda.memory_reserved(self.device))
        self._wake("weights")
        self.last_sync = self.llm.collective_rpc("rlkit_reload_attached")[0]
        self._wake("kv_cache")
        return len(self._shared)

    def _load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write the adapters' tensors as a peft directory in the scratch folder and load it in place of the
        engine's adapter (``load_inplace``: the same id would otherwise keep the old one); returns how many."""
        from vllm.lora.request import LoRARequest

        assert self.adapters is not None
        tensors = list(weights)
        path = self._scratch / "adapter"
        save_adapter(path, tensors, self.adapters, str(self.model_dir))
        self._wake("weights", "kv_cache")
        request = LoRARequest(lora_name="rlkit", lora_int_id=1, lora_path=str(path), load_inplace=True)
        self.llm.llm_engine.add_lora(request)
        self._lora_request = LoRARequest(lora_name="rlkit", lora_int_id=1, lora_path=str(path))
        self.last_sync = "adapter"
        return len(tensors)

    def sleep(self) -> None:
        """Free the weights (kept in host memory), the KV cache and the shared buffers on GPU, unless
        ``rollout.sleep`` keeps the engine awake; a no-op on CPU."""
        if not self.can_sleep or self._asleep:
            return
        free, total = torch.cuda.mem_get_info(self.device)
        if not self.sleep_policy.should_sleep(free=free, held=torch.cuda.memory_reserved(self.device), total=total):
            return
        self._sleep_now()

    @contextmanager
    def weights_awake(self) -> Iterator[None]:
        """The engine's weights mapped (and so readable) in this block; an engine that slept sleeps again after it.
        Asleep, vLLM's weights are unmapped (cuMem sleep mode): a read of them faults the device (CUDA illegal
        memory access) and kills the engine. The KV cache wakes too, restoring the state sleep left from."""
        asleep = bool(self._asleep)
        self._wake("weights", "kv_cache")
        try:
            yield
        finally:
            if asleep:
                self._sleep_now()

    def _sleep_now(self) -> None:
        """Detach the shared buffers and put the weights and KV cache to sleep (level 1: weights kept on the host)."""
        if self._shared is not None:
            self.llm.collective_rpc("rlkit_detach")
            self._shared = None
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def close(self) -> None:
        """Shut the engine's processes down (``LLM`` has no method for it), wait until they are gone
        (so their memory is free), and delete the scratch folder and the shared-memory files they left."""
        shutil.rmtree(self._scratch, ignore_errors=True)
        if getattr(self, "llm", None) is not None:
            mapped = _shared_memory_files(self._processes)
            self.llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
            self.llm = None
            self._shared = None
            _, alive = psutil.wait_procs(self._processes, timeout=EXIT_WAIT_S)
            if alive:
                logger.warning("vLLM engine processes %s still run after shutdown", [p.pid for p in alive])
                return
            left = [path for path in mapped if os.path.exists(path)]
            for path in left:  # vLLM's message queues and CPU tensor-parallel buffers, when it had to kill
                Path(path).unlink(missing_ok=True)
            if left:
                logger.info("removed %d shared-memory files the engine's processes left", len(left))
        self._reaper.release()

    def _wake(self, *tags: str) -> None:
        """Wake the named memory pools; weights are woken before the KV cache. Blocks this process's
        allocator caches but does not use (the update's activations) go back to the device first, or
        the engine may not find the memory it slept with."""
        for tag in tags:
            if tag in self._asleep:
                torch.cuda.empty_cache()
                self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)


def _to_generation(
    completions: list, rows: torch.Tensor, width: int, pad_token_id: int, device: torch.device
) -> Generation:
    """vLLM CompletionOutputs (token ids through the end-of-text token; flat log-probs of the sampled
    tokens where ``rows`` [len] is True) -> padded [len, width] tensors, filled in one scatter each."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    ids[mask] = torch.tensor(list(itertools.chain.from_iterable(c.token_ids for c in completions)), dtype=torch.long)
    logprobs = torch.zeros(len(completions), width)
    logprobs[~rows] = float("nan")
    kept = [c.logprobs.logprobs for c, r in zip(completions, rows.tolist(), strict=True) if r]
    flat = torch.tensor(list(itertools.chain.from_iterable(kept)), dtype=torch.float32)
    if flat.numel() != int(lengths[rows].sum()):
        raise RuntimeError(f"vLLM returned {flat.numel()} log-probs for {int(lengths[rows].sum())} sampled tokens")
    logprobs[mask & rows.unsqueeze(1)] = flat  # FlatLogprobs: one entry per position with logprobs=0
    reasons = [c.finish_reason for c in completions]
    if not set(reasons) <= {"stop", "length"}:
        raise RuntimeError(f"vLLM finished requests with {sorted(set(reasons))}; expected 'stop' or 'length'")
    return Generation(
        response_ids=ids.to(device),
        response_mask=mask.float().to(device),
        logprobs=logprobs.to(device),
        logprob_rows=rows.to(device),
        finish_reason=reasons,
    )


def _max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    return next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)


def _descendants() -> list[psutil.Process]:
    """This process's descendants, less multiprocessing's own helpers (its resource tracker lives as long as this
    process and unlinks what it leaked when it exits: not the engine's to wait for or kill). Those that appear while
    the engine starts are its processes: vLLM titles them ``VLLM::EngineCore``, ``VLLM::Worker``... only where the
    optional setproctitle is installed (on a GPU image without it they read ``python3 -B -c from
    multiprocessing.spawn import spawn_main ...``)."""
    return [p for p in psutil.Process().children(recursive=True) if not _is_multiprocessing_helper(p)]


def _is_multiprocessing_helper(process: psutil.Process) -> bool:
    """Whether ``process`` is multiprocessing's resource tracker or fork server (a child of whichever process used
    shared memory or semaphores first, alive until that process exits)."""
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.resource_tracker" in command or "multiprocessing.forkserver" in command


def _shared_memory_files(processes: list[psutil.Process]) -> set[str]:
    """The files under /dev/shm that ``processes`` map."""
    files: set[str] = set()
    for process in processes:
        try:
            files |= {m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/")}
        except psutil.Error:
            continue
    return files


def _scratch_root(model_dir: Path) -> str | None:
    """/dev/shm when it has room for two copies of the model's files (tmpfs: no disk I/O), else the temp dir."""
    shm = Path("/dev/shm")
    need = 2 * sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need:
        return str(shm)
    return None


@contextmanager
def _removed_on_error(folder: Path, reaper: Reaper):
    """Delete ``folder`` (and release ``reaper``: nothing left to watch) if the block raises."""
    try:
        yield
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        reaper.release()
        raise


def visible_gpu_id(device: torch.device) -> str:
    """``device``'s entry in CUDA_VISIBLE_DEVICES (its index where that is unset): how another process names it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ids[device.index if device.index is not None else torch.cuda.current_device()]


@contextmanager
def _engine_environment(device: torch.device, gpus: Sequence[str], tensor_parallel_size: int):
    """The environment the engine's processes (spawned in this block) inherit: on GPU only ``gpus`` visible
    (default: ``device``; vLLM's first is this rank's), on CPU with tensor parallelism no thread binding unless
    asked for (vLLM's automatic binding wants a NUMA node per worker), and none of the trainer's torch.distributed
    variables (the engine is a world of its own)."""
    changes: dict[str, str | None] = dict.fromkeys(TORCH_DISTRIBUTED_VARIABLES)
    if device.type == "cuda":
        changes["CUDA_VISIBLE_DEVICES"] = ",".join(gpus or [visible_gpu_id(device)])
    elif tensor_parallel_size > 1:
        changes["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
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

"""The controller of Tinker's primitives on a launched cluster: a LoRA training client whose calls return futures.

Example:
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(model="tiny"))
    fb = client.forward_backward(data, "cross_entropy")       # a Future, at once
    step = client.optim_step(rlkit.AdamStep(learning_rate=1e-4))
    fb.result().loss, step.result().grad_norm
    client.save_weights_for_sampler().result()
    client.sample(prompt_tokens, num_samples=4, max_tokens=16).result()[0].tokens
    client.memory(), client.grad_norms(), client.rollouts()

One thread runs the calls in the order they were made (Tinker's ``seq_id`` order), so ``forward_backward`` and
``optim_step`` can be queued without waiting and ``sample`` sees the weights of the last
``save_weights_for_sampler`` queued before it.

A call that leaves the ranks unable to go on together (one raised inside a forward's or backward's collectives, a
rank died, ranks hung past cancelling) fails with one message naming the rank; the cluster's workers are stopped,
and the next call first restarts them (``Cluster.restart``) and restores the client's last state: the folder of its
last ``save_state`` or ``load_state``, else its initial adapters.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pandas as pd
import torch

from rlkit import diagnostics
from rlkit.config.primitives import PrimitivesConfig
from rlkit.data.datum import Datum, datum_problems, pad_data
from rlkit.models import load_tokenizer, resolve_model_dir
from rlkit.models.loading import model_limits
from rlkit.rollout import SamplingParams
from rlkit.rollout.stops import StopSequences
from rlkit.runtime import PerRank, RoleGroup, RoleOwner
from rlkit.runtime.cluster import Cluster
from rlkit.runtime.errors import ClusterBroken, CollectiveAbandoned, RemoteError, WorkerDied, WorkerHung
from rlkit.trainer.checkpoints import written_in_place
from rlkit.workers.primitives import AdamStep, DataRefused, OptimResult, PeerFailed, PeerRefused, PrimitivesWorker

logger = logging.getLogger(__name__)

T = TypeVar("T")
STATE_META = "client.json"
"""In a save_state folder: the model directory, the LoRA settings and the optimizer steps taken."""
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_modules_to_save")
"""The LoRA settings a save_state folder records and load_state compares (the adapters' shapes and scale)."""


@dataclass
class ForwardBackwardOutput:
    """A ``forward``/``forward_backward`` over all ranks (Tinker's ForwardBackwardOutput)."""

    logprobs: list[torch.Tensor]
    """One [N] float32 tensor per datum, in the order given: the learner's log-probs of its target tokens."""
    metrics: dict[str, float]
    """``loss:sum``: the loss, a sum over every token of every datum."""

    @property
    def loss(self) -> float:
        return self.metrics["loss:sum"]


@dataclass
class SampledSequence:
    """One completion (Tinker's SampledSequence)."""

    tokens: list[int]
    logprobs: list[float]
    """The sampler's log-probs of ``tokens``."""
    stop_reason: str
    """"stop" (end-of-text or a stop sequence) or "length"."""


@dataclass
class _SampleRecord:
    prompt: list[int]
    sequences: list[SampledSequence]
    trainer_logprobs: list[torch.Tensor] = field(default_factory=list)
    sampler_step: int = 0
    trainer_step: int = 0


class TrainingClient:
    """A LoRA training client on ``cluster``: a ``PrimitivesWorker`` (``rlkit.workers.primitives``) on every rank."""

    def __init__(self, cluster: Cluster, config: PrimitivesConfig | None = None):
        self.config = config if config is not None else PrimitivesConfig()
        self.cluster = cluster
        self.model_dir = resolve_model_dir(self.config.model)
        self.tokenizer = load_tokenizer(self.model_dir, trust_remote_code=self.config.trust_remote_code)
        self.limits = model_limits(self.model_dir)
        self.owner = RoleOwner("TrainingClient", hint="Build a new rlkit.TrainingClient to train again.")
        self._role = RoleGroup(cluster, PrimitivesWorker, self.config, str(self.model_dir), owner=self.owner)
        self._queue = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlkit-primitives")
        self._samples: list[_SampleRecord] = []
        self._step = 0
        self._sampler_step = 0
        self._trainer_is_sampler = True
        """No optimizer step or load_state since the sampler's weights were last synced (the engine starts with the
        actor's)."""
        self._last_state: Path | None = None
        """The folder of the last save_state or load_state: what a restart restores."""
        self._lost: str | None = None
        """Why the ranks could not go on together (the next call restarts them), or None."""

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        return self._queue.submit(self._restored_then, fn)

    def _restored_then(self, fn: Callable[[], T]) -> T:
        if self._lost is not None:
            self._restore()
        return fn()

    # -- the primitives ---------------------------------------------------------------------------

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]:
        """Queue the loss of ``data`` (Tinker's ``loss_fn``: a sum over tokens) and its backward; gradients add up
        until :meth:`optim_step`. Bad data is refused here, every problem at once."""
        self._check(data, loss_fn)
        return self._submit(lambda: self._forward(data, loss_fn, loss_fn_config, backward=True))

    def forward(self, data: Sequence[Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]:  # fmt: skip
        """As :meth:`forward_backward`, without the backward."""
        self._check(data, loss_fn)
        return self._submit(lambda: self._forward(data, loss_fn, loss_fn_config, backward=False))

    def optim_step(self, adam: AdamStep | None = None) -> Future[OptimResult]:
        """Queue one AdamW step on the gradients accumulated since the last one."""
        adam = adam if adam is not None else AdamStep()
        return self._submit(lambda: self._optim_step(adam))

    def save_weights_for_sampler(self) -> Future[int]:
        """Queue the sync of the actor's weights into the sampler: every later :meth:`sample` uses the weights of
        all optimizer steps queued before this call. The result: tensors each engine loaded."""
        return self._submit(self._sync)

    def sample(self, prompt: Sequence[int], num_samples: int = 1, *, max_tokens: int = 16, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None,
               stop: str | Sequence[str] | Sequence[int] | None = None) -> Future[list[SampledSequence]]:  # fmt: skip
        """Queue ``num_samples`` completions of ``prompt`` (token ids) with the sampler's weights (those of the last
        :meth:`save_weights_for_sampler`). The trainer's log-probs of each completion are kept for :meth:`rollouts`.

        ``stop``: token ids or strings that end a completion besides end-of-text; it ends with the first one, which
        it keeps (:class:`rlkit.rollout.stops.StopSequences`). An empty list: nothing but ``max_tokens`` ends it,
        end-of-text included (Tinker's ``stop=[]``). ``max_tokens`` may use what the model's context leaves after
        the prompt."""
        problems = []
        try:
            stops = StopSequences.parse(stop, len(self.tokenizer))
        except ValueError as exc:
            problems.append(str(exc))
        if not 1 <= len(prompt) <= self.config.max_prompt_tokens:
            problems.append(f"prompt of {len(prompt)} tokens: give 1 to max_prompt_tokens="
                            f"{self.config.max_prompt_tokens}")  # fmt: skip
        bad = [i for i, t in enumerate(prompt) if not 0 <= t < self.limits.vocab_size]
        if bad:
            problems.append(f"prompt[{bad[0]}] = {prompt[bad[0]]} is outside the vocabulary (0 to "
                            f"{self.limits.vocab_size - 1})")  # fmt: skip
        if not 1 <= num_samples <= self.config.max_samples:
            problems.append(f"num_samples={num_samples}: give 1 to max_samples={self.config.max_samples}")
        room = self.limits.context - len(prompt)
        if not 1 <= max_tokens <= room:
            problems.append(f"max_tokens={max_tokens}: give 1 to {room} (the model's context of "
                            f"{self.limits.context} positions less the prompt's {len(prompt)} tokens)")  # fmt: skip
        if not (temperature > 0 and 0 < top_p <= 1):
            problems.append(f"temperature={temperature}, top_p={top_p}: need temperature > 0, 0 < top_p <= 1")
        if problems:
            raise ValueError("sample: " + "; ".join(problems))
        params = SamplingParams(n=num_samples, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=self.config.seed if seed is None else seed,
                                stop_at_eos=stop is None or isinstance(stop, str) or len(stop) > 0,
                                stops=stops)  # fmt: skip
        return self._submit(lambda: self._sample(list(prompt), params, stops))

    def prompt_logprobs(self, prompt: Sequence[int]) -> Future[list[float]]:
        """Queue the log-prob of each token of ``prompt`` after the first, given the tokens before it, under the
        sampler's weights ([len(prompt) - 1] floats; Tinker's ``compute_logprobs`` less its leading None). The trainer
        computes them, so they fail with a ValueError when the trainer's weights are no longer the sampler's (an
        optimizer step or a load_state since the last :meth:`save_weights_for_sampler`)."""
        problems = []
        if not 2 <= len(prompt) <= self.limits.context:
            problems.append(f"prompt of {len(prompt)} tokens: give 2 to the model's context of {self.limits.context}")
        bad = [i for i, t in enumerate(prompt) if not 0 <= t < self.limits.vocab_size]
        if bad:
            problems.append(f"prompt[{bad[0]}] = {prompt[bad[0]]} is outside the vocabulary (0 to "
                            f"{self.limits.vocab_size - 1})")  # fmt: skip
        if problems:
            raise ValueError("prompt_logprobs: " + "; ".join(problems))
        return self._submit(lambda: self._prompt_logprobs(list(prompt)))

    def save_state(self, path: str | Path) -> Future[Path]:
        """Queue a checkpoint of the adapters and AdamW's moments (Tinker's ``save_state``) into the folder ``path``,
        written atomically (a folder already there is replaced only once the new one is complete). Every rank writes
        its own shards, so ``path`` must be on a filesystem all ranks see. The result: the folder."""
        return self._submit(lambda: self._save_state(Path(path).resolve()))

    def load_state(self, path: str | Path, *, optimizer: bool = True) -> Future[None]:
        """Queue the restore of a :meth:`save_state` folder: the adapters and, with ``optimizer``, AdamW's moments
        (Tinker's ``load_state_with_optimizer``; without: ``load_state``, a fresh AdamW). Gradients accumulated
        since the last :meth:`optim_step` are dropped. A folder of another model or LoRA rank fails the future."""
        return self._submit(lambda: self._load_state(Path(path).resolve(), optimizer))

    # -- diagnostics (after the queued calls) -----------------------------------------------------

    def memory(self) -> pd.DataFrame:
        """Each rank's memory at the marks since the last optimizer step began (forward_backward, optimizer_step,
        weight_sync, rollout), broken down by what holds it."""
        return self._submit(lambda: diagnostics.memory_table(self._role.call(PrimitivesWorker.memory_marks))).result()

    def grad_norms(self) -> diagnostics.GradNorms:
        """The last optimizer step's per-rank, per-unit gradient norms, the true global norm and disagreements."""
        reports = self._submit(lambda: self._role.call(PrimitivesWorker.grad_report)).result()
        if any(r is None for r in reports):
            raise RuntimeError("no optimizer step has run yet: call client.optim_step() first")
        return diagnostics.grad_norms([r for r in reports if r is not None])

    def rollouts(self) -> pd.DataFrame:
        """Every sampled completion: prompt and completion text, stop reason, length, and the mean gap between the
        sampler's and the trainer's log-probs of its tokens (near 0 when the trainer is at the sampler's step)."""
        rows = []
        for record in self._submit(lambda: list(self._samples)).result():
            for seq, trainer in zip(record.sequences, record.trainer_logprobs, strict=True):
                gap = (torch.tensor(seq.logprobs) - trainer).abs()
                rows.append({"prompt": self.tokenizer.decode(record.prompt), "completion": self.tokenizer.decode(
                    seq.tokens), "stop_reason": seq.stop_reason, "length": len(seq.tokens),
                    "logprob_gap/mean": float(gap.mean()) if len(gap) else 0.0, "sampler_step": record.sampler_step,
                    "trainer_step": record.trainer_step})  # fmt: skip
        return pd.DataFrame(rows)

    def close(self) -> None:
        """Finish the queued calls; the roles stay on the cluster until another owner replaces them."""
        self._queue.shutdown(wait=True)

    # -- on the queue's thread --------------------------------------------------------------------

    def _check(self, data: Sequence[Datum], loss_fn: str) -> None:
        problems = datum_problems(data, loss_fn, self.limits.vocab_size, self.limits.context)
        if problems:
            raise ValueError(f"{len(problems)} problem(s) in the data:\n" + "\n".join(f"  - {p}" for p in problems))

    def _forward(self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
                 backward: bool) -> ForwardBackwardOutput:  # fmt: skip
        """Equal consecutive shares of the data on the ranks (the last ones padded with empty rows)."""
        world = self.cluster.world_size
        share = -(-len(data) // world)
        rows = pad_data(data, loss_fn, share * world)
        shares = [rows.rows(r * share, (r + 1) * share) for r in range(world)]
        config = dict(loss_fn_config) if loss_fn_config is not None else None
        dropped = " (the gradients accumulated since the last optim_step were dropped)" if backward else ""
        results = self._call(PrimitivesWorker.forward_backward, PerRank(shares), loss_fn, config, backward,
                             note=dropped)  # fmt: skip
        logprobs = [lp for result in results for lp in result.logprobs]
        return ForwardBackwardOutput(logprobs=logprobs, metrics={"loss:sum": sum(r.loss_sum for r in results)})

    def _optim_step(self, adam: AdamStep) -> OptimResult:
        self._trainer_is_sampler = False
        result = self._call(PrimitivesWorker.optim_step, adam)[0]
        self._step = result.step
        return result

    def _sync(self) -> int:
        loaded = self._call(PrimitivesWorker.sync_engine)[0]
        self._sampler_step, self._trainer_is_sampler = self._step, True
        return loaded

    def _save_state(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_in_place(path) as partial:
            self._call(PrimitivesWorker.save_state, str(partial))
            meta = {"model": str(self.model_dir), **self._lora_meta(), "step": self._step}
            (partial / STATE_META).write_text(json.dumps(meta))
        self._last_state = path
        return path

    def _load_state(self, path: Path, optimizer: bool) -> None:
        if not (path / STATE_META).is_file():
            raise ValueError(f"{path.name}: not a folder written by save_state (no {STATE_META})")
        meta = json.loads((path / STATE_META).read_text())
        mine = {"model": str(self.model_dir), **self._lora_meta()}
        _check_recorded(path, meta, mine)
        problems = [f"{key}={meta.get(key)!r} there, {value!r} here" for key, value in mine.items()
                    if meta.get(key) != value]  # fmt: skip
        if problems:
            raise ValueError(f"load_state {path.name}: a checkpoint of another client (" + "; ".join(problems) +
                             "); load it into a TrainingClient with that model and those LoRA settings")  # fmt: skip
        self._trainer_is_sampler = False
        self._call(PrimitivesWorker.load_state, str(path), optimizer, int(meta["step"]))
        self._step = int(meta["step"])
        self._last_state = path

    def _call(self, method: Callable[..., T], *args: object, note: str = "") -> list[T]:
        """``method`` on every rank (:meth:`RoleGroup.call`); a failure on the ranks raises one error: the data's
        refusal (a ValueError), or a RuntimeError naming the ranks' errors and what became of the cluster
        (``note`` added when the ranks ended the call together)."""
        try:
            return self._role.call(method, *args)
        except RemoteError as err:
            refusal = _refusal(err, self.cluster.world_size)
            if refusal is not None:
                raise refusal from None
            raise self._failure(method.__name__, err, note) from err
        except (ClusterBroken, WorkerDied, WorkerHung) as err:
            raise self._failure(method.__name__, err, note) from err

    def _failure(self, name: str, err: Exception, note: str) -> Exception:
        """The error of a call that failed on the ranks; when they cannot go on together, the next call restarts
        them (:meth:`_restore`)."""
        kinds = [_kind(f.exc_type) for f in err.failures] if isinstance(err, RemoteError) else []
        # A CollectiveAbandoned, even on every rank: they may have left FSDP's collectives at different points (an
        # all-gather issued on one rank only), so the process group is not trusted any more.
        if CollectiveAbandoned.__name__ in kinds or self.cluster.broken is not None:
            self._lost = _cause(err)
            return RuntimeError(f"{name} failed: {self._lost}; the ranks could not finish the call together, so "
                                "the cluster's workers were stopped: the next call restarts them and restores "
                                f"{self._restore_point()}")  # fmt: skip
        if PeerFailed.__name__ in kinds:
            return RuntimeError(f"{name} failed: {_cause(err)}; every rank ended the call together and the "
                                f"cluster serves on{note}")  # fmt: skip
        return err

    def _restore_point(self) -> str:
        state = self._last_state
        if state is None:
            return f"the initial adapters (seed {self.config.seed}, optimizer step 0)"
        return f"the state saved in {state.name} (save_state or load_state)"

    def _restore(self) -> None:
        """Restart the cluster's workers, build the roles anew and load the last state (its adapters, AdamW's
        moments and step) into the trainer and the sampler."""
        self.owner.check(self.cluster)  # no other owner's roles are stopped
        logger.warning("restarting the cluster's workers (%s); restoring %s", self._lost, self._restore_point())
        self.cluster.restart()
        self._role = RoleGroup(self.cluster, PrimitivesWorker, self.config, str(self.model_dir), owner=self.owner)
        self._step = self._sampler_step = 0
        self._trainer_is_sampler = True
        if self._last_state is not None:
            self._load_state(self._last_state, optimizer=True)
            self._sync()
        self._lost = None

    def _prompt_logprobs(self, prompt: list[int]) -> list[float]:
        if not self._trainer_is_sampler:
            raise ValueError("prompt log-probs: the trainer's weights have moved since the last "
                             "save_weights_for_sampler, and rlkit computes them with the trainer; save the weights "
                             "for the sampler (save_weights_and_get_sampling_client) and ask that sampler")  # fmt: skip
        datum = Datum(tokens=prompt[:-1], loss_fn_inputs={"target_tokens": prompt[1:], "weights": [0.0] *
                                                          (len(prompt) - 1)})  # fmt: skip
        return self._forward([datum], "cross_entropy", None, backward=False).logprobs[0].tolist()

    def _lora_meta(self) -> dict[str, object]:
        """This client's LoRA settings as a save_state folder records them (:data:`LORA_KEYS`)."""
        lora = self.config.lora
        return dict(zip(LORA_KEYS, (lora.rank, float(lora.alpha), lora.target_modules, list(lora.modules_to_save)),
                        strict=True))  # fmt: skip

    def _sample(self, prompt: list[int], params: SamplingParams, stops: StopSequences) -> list[SampledSequence]:
        world = self.cluster.world_size
        prompts = [torch.tensor([prompt])] + [torch.zeros(0, len(prompt), dtype=torch.long)] * (world - 1)
        rows = self._call(PrimitivesWorker.sample, PerRank(prompts), params)[0]
        sequences = []
        for i, reason in enumerate(rows.finish_reason):
            n = int(rows.response_mask[i].sum())
            cut = stops.cut(rows.response_ids[i, :n].tolist(), self.tokenizer.decode) if stops else None
            n, reason = (n, reason) if cut is None else (cut, "stop")
            sequences.append(SampledSequence(tokens=rows.response_ids[i, :n].tolist(),
                                             logprobs=rows.logprobs[i, :n].tolist(), stop_reason=reason))  # fmt: skip
        scored = self._forward([_scoring_datum(prompt, s.tokens) for s in sequences], "cross_entropy", None, False)
        trainer = [lp[len(prompt) - 1:] for lp in scored.logprobs]
        self._samples.append(_SampleRecord(prompt, sequences, trainer, self._sampler_step, self._step))
        return sequences


def saved_lora(path: Path) -> dict[str, object]:
    """The LoRA settings a :meth:`TrainingClient.save_state` folder was saved with, as LoraConfig fields (ValueError
    for a folder save_state did not write)."""
    meta_file = path / STATE_META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    if "model" not in meta or "step" not in meta:
        raise ValueError(f"{path.name}: not a folder written by save_state (no {STATE_META} with its model and step)")
    _check_recorded(path, meta, None)
    return {key.removeprefix("lora_"): meta[key] for key in LORA_KEYS}


def _check_recorded(path: Path, meta: dict[str, object], mine: dict[str, object] | None) -> None:
    """ValueError naming the cause and the fix when the folder's :data:`STATE_META` lacks LoRA settings that
    :data:`LORA_KEYS` names: an rlkit before they were recorded saved it (it recorded the rank only). ``mine``: the
    loading client's settings, offered as the values to add if they are the ones it was saved with."""
    missing = [key for key in LORA_KEYS if key not in meta]
    if not missing:
        return
    fix = ("" if mine is None else f" ({', '.join(f'{k}: {json.dumps(mine[k])}' for k in missing)} are this "
           "client's)")  # fmt: skip
    raise ValueError(f"{path.name}: its {STATE_META} records no {', '.join(missing)}: an rlkit from before states "
                     "recorded their LoRA settings (issue 42) saved it, so nothing says which adapters it holds. If "
                     f"you know the settings it was saved with, add them to its {STATE_META}{fix} and load it again; "
                     "once loaded, save_state writes a state this version loads")  # fmt: skip


def _kind(exc_type: str) -> str:
    """A rank's exception class without its module (the workers name the class with it)."""
    return exc_type.rsplit(".", 1)[-1]


def _cause(err: Exception) -> str:
    """One line on what failed: each rank's exception and its first line (no traceback), ranks that only followed
    another's failure left out."""
    if not isinstance(err, RemoteError):
        return str(err).splitlines()[0].rstrip(".")
    lines = []
    for f in err.failures:
        kind, first = _kind(f.exc_type), (f.message.splitlines() or [""])[0]
        if kind == CollectiveAbandoned.__name__:
            lines.append(f"rank {f.rank} raised {first}")
        elif kind != PeerFailed.__name__:
            lines.append(f"rank {f.rank} raised {kind}: {first}")
    return "; ".join(lines)


def _refusal(err: RemoteError, world_size: int) -> ValueError | None:
    """The ranks' refusal of their data as one ValueError (their reasons, no remote traceback), when that is what
    ``err`` is: every rank raised before its first forward (see ``PrimitivesWorker._agree``)."""
    kinds = [_kind(f.exc_type) for f in err.failures]
    if len(err.failures) != world_size or not set(kinds) <= {DataRefused.__name__, PeerRefused.__name__}:
        return None
    return ValueError("forward_backward: the data breaks the model's limits: " + "; ".join(
        f.message for f, kind in zip(err.failures, kinds, strict=True) if kind == DataRefused.__name__))


def _scoring_datum(prompt: list[int], completion: list[int]) -> Datum:
    """The datum whose log-probs from position len(prompt) - 1 on are those of ``completion`` after ``prompt``."""
    full = prompt + completion
    return Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})

"""What rlkit's Tinker server answers, endpoint by endpoint (no HTTP here: path + body in, :class:`Reply` out).

Calls that queue work (create_model, forward_backward, optim_step, save_weights_for_sampler, save_weights,
load_weights, asample) answer at
once with a request id; the client polls ``retrieve_future``, which waits up to ``poll_s`` for the result. Any
other path is refused at once, naming it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import secrets
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from rlkit.config.primitives import PrimitivesConfig
from rlkit.runtime.cluster import Cluster
from rlkit.runtime.errors import RemoteError
from rlkit.serving import tinker_states, tinker_wire
from rlkit.serving.futures import (
    KEEP_DELIVERED_S,
    KEEP_UNCOLLECTED_S,
    IdempotentReplies,
    PendingRequests,
    Refused,
    Reply,
    failed,
    then,
)
from rlkit.serving.sessions import Sessions
from rlkit.serving.tinker_models import SamplingSession, ServedModel, ServedModels
from rlkit.serving.tinker_requests import json_object, shape_problems
from rlkit.trainer.primitives import SampledSequence, TrainingClient, saved_lora
from rlkit.workers.primitives import AdamStep

logger = logging.getLogger(__name__)

API = "/api/v1/"
UNSERVED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs",
                          "prompt_alt_tokens_k")  # fmt: skip
"""SampleRequest fields rlkit refuses by name when set."""
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # the per-run API key is checked on every request; no JWT exchange
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,  # samples are polled with retrieve_future
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}
_UNREPLAYED = ("retrieve_future", "session_heartbeat", "telemetry")
"""Requests answered afresh each time, idempotency key or not: a poll's answer changes as the call runs."""


def json_reply(payload: dict[str, Any], status: int = 200) -> Reply:
    return Reply(status, json.dumps(payload).encode())


def error_reply(status: int, message: str) -> Reply:
    return json_reply({"error": message, "detail": message}, status)


class TinkerService:
    """The Tinker API over rlkit.TrainingClient (see the module docstring)."""

    def __init__(self, target: Cluster | TrainingClient, config: PrimitivesConfig, state_dir: Path,
                 poll_s: float = 10.0):  # fmt: skip
        self.models = ServedModels(target, config, state_dir)
        self.sessions = Sessions()
        self.pending = PendingRequests()
        self.replies = IdempotentReplies()
        self.poll_s = poll_s
        self._ids = itertools.count(1)
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlkit-tinker-create")
        self._routes: dict[tuple[str, str], Callable[[dict[str, Any]], Reply]] = {
            ("POST", "client/config"): lambda body: json_reply(CLIENT_CONFIG),
            ("POST", "client/dynamic_config"): lambda body: json_reply({}),
            ("GET", "get_server_capabilities"): self._capabilities,
            ("GET", "healthz"): lambda body: json_reply({"status": "ok"}),
            ("POST", "create_session"): lambda body: json_reply({"session_id": self.sessions.create()}),
            ("POST", "session_heartbeat"): self._heartbeat,
            ("POST", "telemetry"): lambda body: json_reply({"status": "accepted"}),
            ("POST", "create_model"): self._create_model,
            ("POST", "get_info"): self._get_info,
            ("POST", "optim_step"): self._optim_step,
            ("POST", "save_weights_for_sampler"): self._save_weights_for_sampler,
            ("POST", "save_weights"): self._save_weights,
            ("POST", "load_weights"): self._load_weights,
            ("POST", "create_sampling_session"): self._create_sampling_session,
            ("POST", "asample"): self._asample,
            ("POST", "retrieve_future"): self._retrieve_future,
        }

    @property
    def served(self) -> list[str]:
        """The endpoints served, as "METHOD /api/v1/name"."""
        return [f"{m} {API}{p}" for m, p in self._routes] + [f"POST {API}forward_backward",
                f"GET {API}samplers/<id>", f"POST {API}sessions/<id>/finish"]  # fmt: skip

    def answer(self, method: str, path: str, body: bytes, content_encoding: str | None,
               idempotency_key: str | None = None) -> Reply:  # fmt: skip
        """:meth:`handle`; a request carrying an ``X-Idempotency-Key`` already answered (the SDK retries with the
        same key) gets the first answer, so a retried call does not run twice (polls and heartbeats excepted)."""
        if idempotency_key and method == "POST" and not path.startswith(tuple(API + p for p in _UNREPLAYED)):
            return self.replies.answer(idempotency_key, path, lambda: self.handle(method, path, body, content_encoding))
        return self.handle(method, path, body, content_encoding)

    def handle(self, method: str, path: str, body: bytes, content_encoding: str | None) -> Reply:
        """The answer to one authenticated request: a malformed one gets a 4xx naming what is wrong."""
        name = path.split("?")[0].removeprefix(API) if path.startswith(API) else None
        payload: dict[str, Any] = {}
        try:
            if name == "forward_backward" and method == "POST":
                return self._forward_backward(body, content_encoding)
            payload = json_object(body)
            problems = shape_problems(name or "", payload)
            if problems:
                raise ValueError("; ".join(problems))
            if name is not None and name.startswith("samplers/") and method == "GET":
                return self._sampler(name.removeprefix("samplers/"))
            if name is not None and name.startswith("sessions/") and name.endswith("/finish"):
                self.sessions.finish(name.removeprefix("sessions/").removesuffix("/finish"))
                return json_reply({})
            route = self._routes.get((method, name or ""))
            if route is None:
                return self._unsupported(method, path, payload)
            return route(payload)
        except (ValueError, KeyError, TypeError) as exc:
            logger.info("Tinker %s %s refused: %s", method, path, exc)
            message = f"{path}: {self._public(exc)}"
            self._give_up_turn(payload, message)
            return error_reply(exc.status if isinstance(exc, Refused) else 400, message)
        except Exception:  # noqa: BLE001 - a server bug must answer too, and the server keep serving
            logger.exception("Tinker %s %s failed", method, path)
            return error_reply(500, f"{path}: the server failed on this request (its log has the traceback)")

    def _public(self, text: object) -> str:
        """``text`` (an exception, a message) without this machine's state folder."""
        return str(text).replace(str(self.models.states.root), "<state_dir>")

    def _unsupported(self, method: str, path: str, payload: Any) -> Reply:
        """A named refusal; a refused training call still takes its ``seq_id`` turn so later calls do not wait."""
        message = (f"rlkit's Tinker server does not serve {method} {path}; it serves a LoRA train + sample flow: "
                   + ", ".join(self.served) + " (see docs/ARCHITECTURE.md, Tinker API)")  # fmt: skip
        self._give_up_turn(payload, message)
        return error_reply(404, message)

    def _give_up_turn(self, payload: dict[str, Any], message: str) -> None:
        """A refused training call still takes its ``seq_id`` turn (failing), so that the calls behind it run."""
        model_id, seq_id = payload.get("model_id"), payload.get("seq_id")
        if isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool):
            with contextlib.suppress(ValueError):
                self.models.model(model_id).order.submit(seq_id, lambda: failed(ValueError(message)))

    def _heartbeat(self, body: dict[str, Any]) -> Reply:
        self.sessions.heartbeat(body["session_id"])
        return json_reply({"type": "session_heartbeat"})

    # -- queued calls ---------------------------------------------------------------------------

    def _queued(self, future: Future[Reply], **extra: Any) -> Reply:
        return json_reply({"request_id": self.pending.add(future), **extra})

    def _create_model(self, body: dict[str, Any]) -> Reply:
        lora = body.get("lora_config")
        if not lora:
            raise ValueError("create_model without lora_config: rlkit serves LoRA training clients only")
        if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise ValueError(f"optimizer_config={body['optimizer_config']}: rlkit serves AdamW only")
        model_id = tinker_states.model_id(body["session_id"], body["model_seq_id"])
        self.sessions.claim_training(body["session_id"])
        created = self._builder.submit(self.models.create, model_id, body["base_model"], {"rank": int(lora["rank"])},
                                       lora.get("seed"))  # fmt: skip
        return self._queued(then(created, lambda m: json_reply({"model_id": m.model_id, "type": "create_model"})),
                            model_id=model_id)  # fmt: skip

    def _forward_backward(self, body: bytes, content_encoding: str | None) -> Reply:
        call = tinker_wire.decode_forward_backward(body, content_encoding)
        model = self.models.model(call.model_id)
        run = model.client.forward if call.forward_only else model.client.forward_backward

        def start() -> Future[Reply]:
            result = run(call.data, call.loss_fn, call.loss_fn_config)
            return then(result, lambda out: Reply(200, tinker_wire.encode_forward_backward_output(
                out.logprobs, out.metrics), tinker_wire.PROTO))  # fmt: skip

        return self._queued(model.order.submit(call.seq_id, start), model_id=model.model_id)

    def _optim_step(self, body: dict[str, Any]) -> Reply:
        model = self.models.model(body["model_id"])

        def start() -> Future[Reply]:  # checked in its turn, so a refusal still gives the turn up
            params = body.get("adam_params")
            if params is None:
                raise ValueError(f"optimizer_params={body.get('optimizer_params')}: rlkit's optim_step is AdamW; send "
                                 "AdamParams")  # fmt: skip
            adam = AdamStep(**{k: float(v) for k, v in params.items() if k != "type"})
            return then(model.client.optim_step(adam),
                        lambda r: json_reply({"metrics": {"grad_norm": r.grad_norm, "step": float(r.step)}}))

        return self._queued(model.order.submit(int(body["seq_id"]), start), model_id=model.model_id)

    def _save_weights_for_sampler(self, body: dict[str, Any]) -> Reply:
        model = self.models.model(body["model_id"])
        if body.get("kind", "snapshot") != "snapshot":
            raise ValueError(f"kind={body['kind']!r}: rlkit serves snapshot sampling clients only")
        path = f"tinker://{model.model_id}/sampler_weights/{body['path']}" if body.get("path") else None
        session_id = f"{model.model_id}:sample:{next(self._ids)}"

        def start() -> Future[Reply]:
            done = model.client.save_weights_for_sampler()
            model.saves += 1
            self.models.add_session(session_id, SamplingSession(model.model_id, model.saves, path))
            answer = {"path": path} if path else {"sampling_session_id": session_id}
            return then(done, lambda _: json_reply({**answer, "type": "save_weights_for_sampler"}))

        return self._queued(model.order.submit(int(body["seq_id"]), start), model_id=model.model_id)

    def _save_weights(self, body: dict[str, Any]) -> Reply:
        """Tinker's ``save_state``: the client's :meth:`~rlkit.TrainingClient.save_state` into the server's folder."""
        model = self.models.model(body["model_id"])

        def start() -> Future[Reply]:  # checked in its turn, so a refusal still gives the turn up
            path, folder = self.models.state_path(model.model_id, body.get("path"))
            if folder.exists() and not body.get("overwrite"):
                raise ValueError(f"{path} exists: save under another name, or pass overwrite=True")

            def signed(saved: Path) -> Reply:
                self.models.states.sign(path, saved)
                return json_reply({"path": path, "type": "save_weights"})

            return then(model.client.save_state(folder), signed)

        return self._queued(model.order.submit(int(body["seq_id"]), start), model_id=model.model_id)

    def _load_weights(self, body: dict[str, Any]) -> Reply:
        """Tinker's ``load_state`` (``optimizer``: ``load_state_with_optimizer``) onto an existing model; without a
        ``model_id``, ``create_training_client_from_state[_with_optimizer]``: a new model with the state's LoRA
        settings, then the load."""
        if not body.get("model_id"):
            return self._create_from_state(body)
        model = self.models.model(body["model_id"])

        def start() -> Future[Reply]:
            folder = self.models.state_folder(body["path"])
            return then(model.client.load_state(folder, optimizer=bool(body["optimizer"])), lambda _: json_reply(
                {"path": body["path"], "model_id": model.model_id, "type": "load_weights"}))  # fmt: skip

        return self._queued(model.order.submit(int(body["seq_id"]), start), model_id=model.model_id)

    def _create_from_state(self, body: dict[str, Any]) -> Reply:
        """A training client built from a ``save_state`` folder (the load is its first call, before seq_id 1)."""
        if body.get("session_id") is None or body.get("model_seq_id") is None:
            raise ValueError("load_weights: give model_id and seq_id (load_state), or session_id and model_seq_id "
                             "(create_training_client_from_state)")  # fmt: skip
        if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise ValueError(f"optimizer_config={body['optimizer_config']}: rlkit serves AdamW only")
        model_id = tinker_states.model_id(body["session_id"], body["model_seq_id"])
        folder = self.models.state_folder(body["path"])  # confined to state_dir and signed by this server
        lora = saved_lora(folder)
        base_model = body.get("base_model") or self.models.base_model
        self.sessions.claim_training(body["session_id"])

        def build() -> ServedModel:
            model = self.models.create(model_id, base_model, lora, None)
            model.client.load_state(folder, optimizer=bool(body.get("optimizer"))).result()
            return model

        answer = {"path": body["path"], "model_id": model_id, "type": "load_weights"}
        return self._queued(then(self._builder.submit(build), lambda _: json_reply(answer)), model_id=model_id)

    def _asample(self, body: dict[str, Any]) -> Reply:
        session = self.models.session(body["sampling_session_id"])
        model = self.models.model(session.model_id)
        if session.save != model.saves:
            raise ValueError(f"sampling session {body['sampling_session_id']} samples the weights of save "
                             f"{session.save}, but save {model.saves} has been queued since: rlkit's sampler holds "
                             "only the latest saved weights; sample with the newest sampling client")  # fmt: skip
        unserved = [k for k in UNSERVED_SAMPLE_FIELDS if body.get(k)]
        if unserved:
            raise ValueError(f"{', '.join(unserved)}: not served; rlkit returns the sampled tokens' log-probs and, "
                             "with prompt_logprobs (compute_logprobs), the prompt's")  # fmt: skip
        prompt, num = _prompt_tokens(body["prompt"]), int(body.get("num_samples", 1))
        kwargs = _sampling_kwargs(body.get("sampling_params", {}))
        sampled = model.client.sample(prompt, num, **kwargs)
        reply = then(sampled, lambda seqs: _sample_reply(seqs, None))
        if body.get("prompt_logprobs") and len(prompt) == 1:  # nothing before the one token: no log-prob
            reply = then(sampled, lambda seqs: _sample_reply(seqs, [math.nan]))
        elif body.get("prompt_logprobs"):
            last_n = body.get("prompt_logprobs_last_n")
            scored = model.client.prompt_logprobs(prompt)  # queued after the sample: ``sampled`` is done first
            reply = then(scored, lambda lps: _sample_reply(sampled.result(), _prompt_row(lps, last_n)))
        request_id = self.pending.add(reply)
        return json_reply({"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(num)]})

    def _retrieve_future(self, body: dict[str, Any]) -> Reply:
        request_id = body["request_id"]
        future = self.pending.get(request_id)
        if future is None:
            return error_reply(404, f"request_id={request_id!r}: unknown, or expired ({KEEP_DELIVERED_S:.0f} s "
                               f"after its answer, {KEEP_UNCOLLECTED_S:.0f} s after it finished if never collected)")
        try:
            reply = future.result(timeout=self.poll_s)
        except FutureTimeout:
            return json_reply({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        except CancelledError:
            reply = json_reply({"error": "cancelled: the server is stopping", "category": "server"})
        except Exception as exc:  # noqa: BLE001 - the request's failure, handed to the client
            category = "user" if isinstance(exc, ValueError) else "server"
            if category == "user":
                logger.info("Tinker request %s refused: %s", request_id, exc)
            else:  # the whole story (remote tracebacks, log folders) stays in the server's log
                logger.error("Tinker request %s failed", request_id, exc_info=exc)
            reply = json_reply({"error": self._public(client_message(exc)), "category": category})
        self.pending.delivered(request_id)
        return reply

    # -- immediate answers ----------------------------------------------------------------------

    def _capabilities(self, body: dict[str, Any]) -> Reply:
        model = {"model_name": self.models.base_model, "trainable": True, "sampleable": True}
        return json_reply({"supported_models": [model]})

    def _get_info(self, body: dict[str, Any]) -> Reply:
        model = self.models.model(body["model_id"])
        return json_reply({"type": "get_info", "model_id": model.model_id, "is_lora": True,
                           "lora_rank": model.client.config.lora.rank, "model_name": model.base_model,
                           "model_data": {"model_name": model.base_model, "arch": None,
                                          "tokenizer_id": model.base_model}})  # fmt: skip

    def _create_sampling_session(self, body: dict[str, Any]) -> Reply:
        if body.get("model_path"):
            session = self.models.session_for_path(body["model_path"])
        else:
            model = self.models.current()
            if body.get("base_model") not in (None, model.base_model):
                raise ValueError(f"base_model={body['base_model']!r}: this server serves {model.base_model!r}")
            session = SamplingSession(model.model_id, 0)
        self.sessions.heartbeat(body["session_id"])  # a live session of this server
        session_id = f"{body['session_id']}:sample:{body['sampling_session_seq_id']}"
        self.models.add_session(session_id, session)
        return json_reply({"type": "create_sampling_session", "sampling_session_id": session_id})

    def _sampler(self, session_id: str) -> Reply:
        session = self.models.session(session_id)
        base = self.models.model(session.model_id).base_model
        return json_reply({"sampler_id": session_id, "base_model": base, "model_path": session.model_path})

    def close(self) -> None:
        """Cancel the calls that have not started; finish the running ones."""
        self.pending.cancel_all()
        self._builder.shutdown(wait=True, cancel_futures=True)
        self.models.close()


def client_message(exc: Exception) -> str:
    """What a client is told of a failed call: the user's own error in full; of a server-side failure the exception
    and its first line (each rank's, for a worker error), no remote traceback, stacks or server paths."""
    if isinstance(exc, ValueError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, RemoteError):
        return "; ".join(f"rank {f.rank} raised {f.exc_type}: {f.message.splitlines()[0] if f.message else ''}"
                         for f in exc.failures)  # fmt: skip
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first} (details in the server's log)"


def _sample_reply(sequences: list[SampledSequence], prompt_logprobs: list[float] | None) -> Reply:
    body = tinker_wire.encode_sample_response([(s.tokens, s.logprobs, s.stop_reason) for s in sequences],
                                              prompt_logprobs)  # fmt: skip
    return Reply(200, body, tinker_wire.PROTO)


def _prompt_row(logprobs: list[float], last_n: int | None) -> list[float]:
    """Tinker's prompt log-probs: NaN (the SDK's None) for the first token and, with ``last_n``, every token before
    the last ``last_n``."""
    row = [math.nan] + logprobs
    if last_n is not None:
        if not 1 <= int(last_n) < len(row):
            raise ValueError(f"prompt_logprobs_last_n={last_n}: give 1 to len(prompt) - 1 = {len(row) - 1}")
        row[: len(row) - int(last_n)] = [math.nan] * (len(row) - int(last_n))
    return row


def _prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    kinds = [c.get("type", "encoded_text") for c in prompt["chunks"]]
    if any(k != "encoded_text" for k in kinds):
        raise ValueError(f"prompt chunks {kinds}: rlkit samples from token chunks (encoded_text) only")
    return [int(t) for c in prompt["chunks"] for t in c["tokens"]]


def _sampling_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """rlkit's sample() arguments from Tinker's SamplingParams; every unsupported setting is named at once (``stop``,
    token ids or strings, is checked by sample())."""
    problems = []
    if params.get("max_tokens") is None:
        problems.append("max_tokens is required")
    if params.get("top_k", -1) not in (-1, 0):
        problems.append(f"top_k={params['top_k']}: not supported (use top_p)")
    if problems:
        raise ValueError("sampling_params: " + "; ".join(problems))
    seed = params.get("seed")
    return {"max_tokens": int(params["max_tokens"]), "temperature": float(params.get("temperature", 1.0)),
            "top_p": float(params.get("top_p", 1.0)), "seed": secrets.randbits(31) if seed is None else int(seed),
            "stop": params.get("stop")}

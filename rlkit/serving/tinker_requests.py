"""The JSON shapes of the Tinker SDK's requests, checked before an endpoint reads them: every field of the wrong
type, and every required field missing, is named at once (the endpoints then check the values)."""

from __future__ import annotations

import json
from typing import Any

_STR, _INT, _NUM, _BOOL, _OBJ, _LIST = (str,), (int,), (int, float), (bool,), (dict,), (list,)
_STOP = (str, list)

Fields = dict[str, tuple[tuple[type, ...], bool]]
"""field -> (the types it may have, whether it is required); None is allowed for a field that is not required."""

_ADAM: Fields = {k: (_NUM, False) for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                             "grad_clip_norm")} | {"type": (_STR, False)}  # fmt: skip
_SAMPLING: Fields = {"max_tokens": (_INT, False), "temperature": (_NUM, False), "top_p": (_NUM, False),
                     "top_k": (_INT, False), "seed": (_INT, False), "stop": (_STOP, False)}  # fmt: skip

REQUESTS: dict[str, Fields] = {
    "session_heartbeat": {"session_id": (_STR, True)},
    "create_model": {"session_id": (_STR, True), "model_seq_id": (_INT, True), "base_model": (_STR, True),
                     "lora_config": (_OBJ, False), "optimizer_config": (_OBJ, False)},
    "get_info": {"model_id": (_STR, True)},
    "optim_step": {"model_id": (_STR, True), "seq_id": (_INT, True), "adam_params": (_OBJ, False)},
    "save_weights_for_sampler": {"model_id": (_STR, True), "seq_id": (_INT, True), "path": (_STR, False),
                                 "kind": (_STR, False)},
    "save_weights": {"model_id": (_STR, True), "seq_id": (_INT, True), "path": (_STR, False),
                     "overwrite": (_BOOL, False)},
    "load_weights": {"model_id": (_STR, False), "seq_id": (_INT, False), "path": (_STR, True),
                     "optimizer": (_BOOL, False), "session_id": (_STR, False), "model_seq_id": (_INT, False),
                     "base_model": (_STR, False), "optimizer_config": (_OBJ, False)},
    "create_sampling_session": {"session_id": (_STR, True), "sampling_session_seq_id": (_INT, True),
                                "model_path": (_STR, False), "base_model": (_STR, False)},
    "asample": {"sampling_session_id": (_STR, True), "prompt": (_OBJ, True), "num_samples": (_INT, False),
                "sampling_params": (_OBJ, False), "prompt_logprobs": (_BOOL, False),
                "prompt_logprobs_last_n": (_INT, False)},
    "retrieve_future": {"request_id": (_STR, True)},
}  # fmt: skip
NESTED: dict[tuple[str, str], Fields] = {
    ("create_model", "lora_config"): {"rank": (_INT, True), "seed": (_INT, False)},
    ("create_model", "optimizer_config"): {"type": (_STR, False)},
    ("load_weights", "optimizer_config"): {"type": (_STR, False)},
    ("optim_step", "adam_params"): _ADAM,
    ("asample", "sampling_params"): _SAMPLING,
    ("asample", "prompt"): {"chunks": (_LIST, True)},
}


def json_object(body: bytes) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); ValueError for anything else."""
    if not body:
        return {}
    try:
        payload = json.loads(body)
    except RecursionError:
        raise ValueError("the JSON body nests too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the body is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"the body is a JSON {type(payload).__name__}; send a JSON object")
    return payload


def shape_problems(endpoint: str, payload: dict[str, Any]) -> list[str]:
    """Every field of ``payload`` (a request to ``endpoint``) that is missing or of the wrong type."""
    problems = _problems("", REQUESTS.get(endpoint, {}), payload)
    for (name, field), fields in NESTED.items():
        if name == endpoint and isinstance(payload.get(field), dict):
            problems += _problems(f"{field}.", fields, payload[field])
    if endpoint == "asample" and isinstance(payload.get("prompt"), dict):
        problems += _chunk_problems(payload["prompt"].get("chunks"))
    return problems


def _problems(prefix: str, fields: Fields, payload: dict[str, Any]) -> list[str]:
    problems = []
    for name, (types, required) in fields.items():
        value = payload.get(name)
        if value is None:
            if required:
                problems.append(f"{prefix}{name} is required")
        elif not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join(_JSON_NAMES[t] for t in types)
            problems.append(f"{prefix}{name}={_short(value)}: give a {wanted}")
    return problems


def _chunk_problems(chunks: Any) -> list[str]:
    if not isinstance(chunks, list):
        return []
    for i, chunk in enumerate(chunks):
        if isinstance(chunk, dict) and chunk.get("type", "encoded_text") != "encoded_text":
            continue  # refused by name by the endpoint
        tokens = chunk.get("tokens") if isinstance(chunk, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return [f"prompt.chunks[{i}]: give an object with a list of integer tokens"]
    return []


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_JSON_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "list"}

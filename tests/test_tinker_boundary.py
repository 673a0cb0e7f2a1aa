"""rlkit.serve_tinker as a network boundary, on a server whose cluster calls are stubbed (the TrainingClient's queue
runs, its ranks do not): the key is checked before the body is read, bodies are bounded and framed exactly, every
malformed request to every endpoint gets a 4xx JSON answer and the server keeps serving, state folders stay inside
state_dir and only signed ones load, results survive a lost answer, a retried call runs once, a second session
cannot take the training client, and close() ends connections and cancels what has not started."""

import http.client
import importlib
import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import rlkit
from rlkit.models.loading import model_limits
from rlkit.serving import futures, sessions, tinker_http, tinker_models, tinker_states
from rlkit.trainer.primitives import ForwardBackwardOutput, SampledSequence, TrainingClient
from rlkit.workers.primitives import OptimResult

tinker = pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

API = "/api/v1/"


class StubRole:
    """The ranks' side of save_state/load_state: a shard file written, nothing loaded."""

    def call(self, fn, *args):  # noqa: ANN001, ANN201
        if fn.__name__ == "save_state":
            (Path(args[0]) / "shard.distcp").write_bytes(b"weights")
        return [None, None]


class StubClient(TrainingClient):
    """A TrainingClient whose queue runs but whose rank calls are stubbed; ``gate`` holds each forward."""

    def __init__(self, cluster, config):  # noqa: ANN001 - the signature ServedModels calls
        self.config, self.cluster = config, cluster
        self.model_dir = rlkit.models.resolve_model_dir(config.model)
        self.tokenizer = rlkit.models.load_tokenizer(self.model_dir)
        self.limits = model_limits(self.model_dir)
        self._trainer_is_sampler, self._lost, self._last_state = True, None, None
        self._role = StubRole()
        self._queue = ThreadPoolExecutor(max_workers=1)
        self._samples, self._step, self._sampler_step = [], 0, 0
        self.gate, self.entered, self.forwards = threading.Event(), threading.Event(), 0
        self.gate.set()

    def _forward(self, data, loss_fn, loss_fn_config, backward):  # noqa: ANN001, ANN202
        self.entered.set()
        self.gate.wait(30)
        self.forwards += 1
        return ForwardBackwardOutput(logprobs=[torch.zeros(len(d.tokens)) for d in data],
                                     metrics={"loss:sum": float(len(data))})  # fmt: skip

    def _optim_step(self, adam):  # noqa: ANN001, ANN202
        self._step += 1
        return OptimResult(grad_norm=0.5, step=self._step)

    def _sync(self) -> int:
        return 0

    def _sample(self, prompt, params, stops):  # noqa: ANN001, ANN202
        return [SampledSequence(tokens=[7], logprobs=[-1.0], stop_reason="length") for _ in range(params.n)]


@pytest.fixture()
def server(monkeypatch, tmp_path):
    monkeypatch.setattr(tinker_models, "TrainingClient", StubClient)
    monkeypatch.setattr(tinker_http, "IO_TIMEOUT_S", 1.0)
    cluster = type("StubCluster", (), {"world_size": 2})()
    config = rlkit.PrimitivesConfig(lora=rlkit.LoraConfig(rank=4))
    with rlkit.serve_tinker(cluster, config=config, poll_s=1.0, state_dir=tmp_path / "states") as server:
        yield server


def request(server, path: str, body: bytes | dict | list | str = b"", *, key: str | None = None,
            headers: dict | None = None, method: str = "POST") -> tuple[int, dict, dict]:  # fmt: skip
    """(status, JSON answer, headers) of one request on a new connection."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=10)
    try:
        conn.request(method, API + path, body=raw, headers={"X-API-Key": key or server.api_key, **(headers or {})})
        answer = conn.getresponse()
        data = answer.read()
        is_json = answer.getheader("Content-Type") == "application/json"
        return answer.status, json.loads(data) if is_json else {"protobuf": data}, dict(answer.getheaders())
    finally:
        conn.close()


def result(server, request_id: str) -> dict:
    """A queued call's answer (its failure: {"error": ...}), polled until it is there."""
    for _ in range(20):
        status, body, _ = request(server, "retrieve_future", {"request_id": request_id})
        if body.get("type") != "try_again":
            assert status == 200, body
            return body
    raise AssertionError(f"{request_id} never finished")


def session(server) -> str:
    return request(server, "create_session", {})[1]["session_id"]


def model(server, session_id: str, seq: int = 0) -> str:
    status, body, _ = request(server, "create_model", {"session_id": session_id, "model_seq_id": seq,
                              "base_model": "tiny", "lora_config": {"rank": 4}})  # fmt: skip
    assert status == 200, body
    return result(server, body["request_id"])["model_id"]


def forward_request(model_id: str, seq_id: int) -> bytes:
    """The SDK's protobuf ``forward`` of one 3-token datum."""
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={
        "target_tokens": torch.tensor([6, 7, 8]), "weights": torch.ones(3)})  # fmt: skip
    call = tinker.types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    request = tinker.types.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_backward_input=call)
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = True
    return msg.SerializeToString()


def raw(server, data: bytes, *, half_close: bool = False, wait: float = 5.0) -> bytes:
    """Send ``data`` on a raw socket and read until the server closes or answers (``wait`` seconds at most)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and len(out.split(b"\r\n\r\n", 1)[1]) >= _length(out):
                    break
        except TimeoutError:
            out += b"<still open>"
        return out


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def head(server, path: str, key: str, extra: str) -> bytes:
    return f"POST {API}{path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\n{extra}\r\n".encode()


# -- the body: key first, bounded, framed exactly ---------------------------------------------------------------


def test_the_key_is_checked_before_the_body_is_read_and_a_huge_body_is_refused_unread(server):
    started = time.monotonic()
    answer = raw(server, head(server, "create_session", "tml-wrong", "Content-Length: 400000000\r\n"))
    assert answer.startswith(b"HTTP/1.1 401") and b"X-API-Key" in answer  # no byte of the 400 MB was sent
    answer = raw(server, head(server, "create_session", server.api_key, "Content-Length: 400000000\r\n"))
    assert answer.startswith(b"HTTP/1.1 413") and b"64 MiB" in answer
    assert time.monotonic() - started < 10
    assert request(server, "create_session", {})[0] == 200


def test_a_client_that_announces_a_body_and_sends_nothing_is_dropped_after_the_timeout(server):
    started = time.monotonic()
    answer = raw(server, head(server, "create_session", server.api_key, "Content-Length: 1000\r\n") + b"{",
                 wait=8)  # fmt: skip
    assert b"<still open>" not in answer and not answer.startswith(b"HTTP/1.1 200")  # dropped, IO_TIMEOUT_S = 1
    assert time.monotonic() - started < 6
    assert request(server, "create_session", {})[0] == 200


@pytest.mark.parametrize("length", ["abc", "-5", "1e3", " "])
def test_a_content_length_that_is_not_a_byte_count_is_a_400(server, length):
    answer = raw(server, head(server, "create_session", server.api_key, f"Content-Length: {length}\r\n") + b"{}")
    assert answer.startswith(b"HTTP/1.1 400") and b"not a byte count" in answer


def test_a_short_body_is_a_400_never_decoded(server):
    model_id = model(server, session(server))
    body = forward_request(model_id, 1)
    answer = raw(server, head(server, "forward_backward", server.api_key, f"Content-Length: {len(body)}\r\n")
                 + body[:-2], half_close=True)  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 400")
    assert f"{len(body) - 2} of its Content-Length {len(body)}".encode() in answer
    status, body, _ = request(server, "forward_backward", forward_request(model_id, 1))  # seq 1 is still free
    assert status == 200 and result(server, body["request_id"])


def test_zstd_bodies_are_bounded_and_must_be_one_whole_frame(server):
    model_id = model(server, session(server))
    zstd = {"Content-Encoding": "zstd"}
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (80 << 20))  # 80 MiB from a few KiB
    assert len(bomb) < 100_000
    status, body, _ = request(server, "forward_backward", bomb, headers=zstd)
    assert status == 413 and "decompresses beyond 64 MiB" in body["error"]
    good = zstandard.ZstdCompressor().compress(forward_request(model_id, 1))
    for bad, why in ((b"\x28\xb5\x2f\xfd garbage", "not valid zstd"), (good[:-3], "not one complete zstd frame"),
                     (good + b"more", "not one complete zstd frame")):  # fmt: skip
        status, body, _ = request(server, "forward_backward", bad, headers=zstd)
        assert status == 400 and why in body["error"], body
    status, body, _ = request(server, "forward_backward", good, headers=zstd)
    assert status == 200 and result(server, body["request_id"])


# -- malformed requests: a 4xx JSON answer, and the server keeps serving ----------------------------------------

WRONG = ["x", 7, 2.5, True, [], {}, [1, "a"]]


def malformed_bodies(endpoint: str, valid: dict) -> list[bytes | dict | list | str]:
    """Wrong JSON shapes, and each field of ``valid`` replaced by every value of another type."""
    bodies: list = [[valid], "text", 3, b"{", b"\xff\xfe{}", b"[" * 100_000, b'{"a": ' + b"9" * 5000 + b"}"]
    for field, value in valid.items():
        for wrong in WRONG:
            if type(wrong) is not type(value) and not (isinstance(value, dict) and isinstance(wrong, dict)):
                bodies.append({**valid, field: wrong})
        if isinstance(value, dict):
            for inner, inner_value in value.items():
                bodies += [{**valid, field: {**value, inner: w}} for w in WRONG if type(w) is not type(inner_value)]
    return bodies


def test_every_endpoint_answers_malformed_requests_with_a_4xx_json_error_and_keeps_serving(server):
    session_id = session(server)
    model_id = model(server, session_id)
    valid = {
        "create_session": {"tags": []},
        "session_heartbeat": {"session_id": session_id},
        "create_model": {"session_id": session_id, "model_seq_id": 1, "base_model": "tiny",
                         "lora_config": {"rank": 4, "seed": 0}, "optimizer_config": {"type": "adamw"}},
        "get_info": {"model_id": model_id},
        "optim_step": {"model_id": model_id, "seq_id": 10**6, "adam_params": {"learning_rate": 0.1, "beta1": 0.9}},
        "save_weights_for_sampler": {"model_id": model_id, "seq_id": 10**6, "path": "s"},
        "save_weights": {"model_id": model_id, "seq_id": 10**6, "path": "s", "overwrite": False},
        "load_weights": {"model_id": model_id, "seq_id": 10**6, "path": "tinker://x/weights/s", "optimizer": True},
        "create_sampling_session": {"session_id": session_id, "sampling_session_seq_id": 1, "base_model": "tiny"},
        "asample": {"sampling_session_id": "s", "num_samples": 1, "prompt": {"chunks": [{"tokens": [1, 2]}]},
                    "sampling_params": {"max_tokens": 2, "temperature": 1.0, "seed": 1, "stop": ["a"]},
                    "prompt_logprobs": True, "prompt_logprobs_last_n": 1},
        "retrieve_future": {"request_id": "req-1"},
        "telemetry": {"events": []},
        "client/config": {},
        "sessions/" + session_id + "/finish": {"reason": {}},
    }  # fmt: skip
    started, sent = time.monotonic(), 0
    for endpoint, body in valid.items():
        for bad in malformed_bodies(endpoint, body):
            status, answer, headers = request(server, endpoint, bad)
            sent += 1
            if status == 200:  # a field the endpoint ignores, or one whose wrong value is still meaningful
                continue
            assert 400 <= status < 500 and answer.get("error"), (endpoint, bad, status, answer)
            assert headers.get("X-Should-Retry") == "false"
            assert request(server, "get_info", {"model_id": model_id})[0] == 200, (endpoint, bad)
    wrong_values = [{**valid["optim_step"], "seq_id": 10**6 + 1, "adam_params": "lr=1"},
                    {**valid["create_model"], "optimizer_config": "adamw"}, {**valid["create_model"],
                    "model_seq_id": 10**30}, {**valid["create_model"], "session_id": "../../x"}]  # fmt: skip
    for bad in wrong_values:
        status, answer, _ = request(server, "create_model" if "model_seq_id" in bad else "optim_step", bad)
        assert 400 <= status < 500 and answer["error"], (bad, answer)
    for bad in (b"\x08\x96\x01garbage\xff\xff", b"\xff" * 64, forward_request(model_id, 1)[:-5], b"[]",
                forward_request(model_id, 1)[:7]):  # fmt: skip
        status, answer, _ = request(server, "forward_backward", bad)
        assert 400 <= status < 500 and answer["error"], (bad, answer)
    status, answer, _ = request(server, "forward_backward", forward_request(model_id, 1))
    assert status == 200 and result(server, answer["request_id"])
    assert sent > 300 and time.monotonic() - started < 60


def test_a_refused_training_call_gives_up_its_turn(server):
    model_id = model(server, session(server))
    status, _, _ = request(server, "optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"beta1": "x"}})
    assert status == 400
    status, body, _ = request(server, "forward_backward", forward_request(model_id, 2))
    assert status == 200 and result(server, body["request_id"])  # seq 2 ran: seq 1's refusal took its turn


# -- ids and paths are the server's own -------------------------------------------------------------------------


def test_state_names_and_paths_stay_inside_state_dir(server, tmp_path):
    model_id = model(server, session(server))
    seq = iter(range(1, 100))
    outside = tmp_path / "outside"

    def save(name: str) -> tuple[int, dict]:
        status, body, _ = request(server, "save_weights", {"model_id": model_id, "seq_id": next(seq), "path": name})
        return (status, body) if status != 200 else (200, result(server, body["request_id"]))

    def load(path: str) -> dict:
        status, body, _ = request(server, "load_weights", {"model_id": model_id, "seq_id": next(seq), "path": path,
                                                           "optimizer": True})  # fmt: skip
        return result(server, body["request_id"]) if status == 200 else body

    for session_id in ("../../escape", str(outside), "session-1/../..", "x" * 65):
        status, body, _ = request(server, "create_model", {"session_id": session_id, "model_seq_id": 0,
                                  "base_model": "tiny", "lora_config": {"rank": 4}})  # fmt: skip
        assert status in (400, 404) and "session" in body["error"], session_id  # the ids are the server's own
    refusals = []
    for name in ("../x", "../../outside", str(outside), "a/b", ".hidden", "..", "x" * 200):
        refusals.append(save(name)[1])
        assert "give 1 to 128 letters" in refusals[-1]["error"], name
    assert not outside.exists() and not (tmp_path / "states" / "x").exists()
    path = save("good")[1]["path"]
    assert path == f"tinker://{model_id}/weights/good" and "error" not in load(path)
    mine = f"tinker://{model_id}"
    for bad in ("tinker://../weights/good", f"{mine}/weights/../good", f"{mine}/../x", "/etc/passwd",
                f"{mine}/sampler_weights/good", f"{mine}/weights/"):  # fmt: skip
        refusals.append(load(bad))
        assert "error" in refusals[-1], bad
    assert "error" not in load(path)
    assert str(server.service.models.states.root) not in json.dumps(refusals)


def test_only_a_folder_this_server_signed_for_that_path_is_loaded(server, tmp_path):
    model_id = model(server, session(server))
    body = request(server, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "a"})[1]
    saved = Path(server.service.models.state_folder(result(server, body["request_id"])["path"]))
    root = server.service.models.states.root
    planted = root / model_id.replace(":", "_") / "planted"
    planted.mkdir()
    (planted / "client.json").write_text((saved / "client.json").read_text())
    (planted / "shard.distcp").write_bytes(b"a pickle")
    copied = root / "session-other_train_0" / "a"
    copied.parent.mkdir()
    os.system(f"cp -r '{saved}' '{copied}'")
    (root / model_id.replace(":", "_") / "link").symlink_to(tmp_path)
    seq = iter(range(2, 100))
    for path, why in ((f"tinker://{model_id}/weights/planted", "not written by this server"),
                      ("tinker://session-other:train:0/weights/a", "not written by this server"),
                      (f"tinker://{model_id}/weights/link", "is a link")):  # fmt: skip
        status, body, _ = request(server, "load_weights", {"model_id": model_id, "seq_id": next(seq), "path": path,
                                                           "optimizer": True})  # fmt: skip
        outcome = result(server, body["request_id"]) if status == 200 else body
        assert why in outcome["error"], (path, outcome)
    (saved / "shard.distcp").write_bytes(b"changed")
    path = f"tinker://{model_id}/weights/a"
    body = request(server, "load_weights", {"model_id": model_id, "seq_id": next(seq), "path": path,
                                            "optimizer": True})[1]  # fmt: skip
    assert "changed since" in result(server, body["request_id"])["error"]


def test_a_state_without_a_manifest_is_refused_naming_the_cause_and_the_fix(server):
    model_id = model(server, session(server))
    body = request(server, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "old"})[1]
    path = result(server, body["request_id"])["path"]
    (server.service.models.state_folder(path) / tinker_states.MANIFEST).unlink()  # as an rlkit before signing saved it
    body = request(server, "load_weights", {"model_id": model_id, "seq_id": 2, "path": path, "optimizer": True})[1]
    error = result(server, body["request_id"])["error"]
    assert "the folder has no .rlkit-manifest.json" in error and "before the server signed its states" in error
    assert "re-save a state of an earlier rlkit with this version: rlkit.TrainingClient(cluster, config).load_state" \
        in error
    status, body, _ = request(server, "load_weights", {"session_id": "session-x", "model_seq_id": 0, "path": path,
                                                       "optimizer": False})  # fmt: skip
    assert status == 400 and "the folder has no .rlkit-manifest.json" in body["error"]


def test_interrupted_saves_are_cleaned_when_the_server_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_models, "TrainingClient", StubClient)
    folder = tmp_path / "states" / "session-a_train_0"
    leftovers = [folder / ".name.partial-0123abcd", folder / ".name.old-89abcdef"]
    for path in [*leftovers, folder / "name"]:
        path.mkdir(parents=True)
    cluster = type("StubCluster", (), {"world_size": 2})()
    with rlkit.serve_tinker(cluster, state_dir=tmp_path / "states"):
        assert not any(p.exists() for p in leftovers) and (folder / "name").is_dir()


def test_no_answer_names_a_path_of_the_server(server, monkeypatch, tmp_path):
    session_id = session(server)
    model_id = model(server, session_id)
    info = request(server, "get_info", {"model_id": model_id})[1]
    assert info["model_data"]["tokenizer_id"] == "tiny" and "/" not in json.dumps(info)
    caps = request(server, "get_server_capabilities", method="GET")[1]
    assert caps["supported_models"][0]["model_name"] == "tiny"
    monkeypatch.setattr(server.service.models.config, "model", str(tmp_path / "models" / "qwen"))
    assert request(server, "get_server_capabilities", method="GET")[1]["supported_models"][0]["model_name"] == "qwen"


# -- futures, retries, sessions --------------------------------------------------------------------------------


def test_a_result_survives_a_lost_answer_and_expires_by_age():
    clock = [0.0]
    pending = futures.PendingRequests(keep_delivered_s=60, keep_uncollected_s=600, clock=lambda: clock[0])
    done: Future = Future()
    delivered, uncollected = pending.add(done), pending.add(Future())
    done.set_result("r")
    pending.delivered(delivered)
    clock[0] = 59.0
    assert pending.get(delivered) is done  # polled again after a lost answer
    clock[0] = 61.0
    assert pending.get(delivered) is None and pending.get(uncollected) is not None  # still running: kept
    pending.get(uncollected).set_result("late")
    clock[0] = 660.0
    assert pending.get(uncollected) is not None
    clock[0] = 662.0
    assert pending.get(uncollected) is None


def test_retrieve_future_answers_again_after_the_first_answer(server):
    model_id = model(server, session(server))
    request_id = request(server, "forward_backward", forward_request(model_id, 1))[1]["request_id"]
    first = result(server, request_id)
    assert result(server, request_id) == first


def test_a_training_client_from_state_loads_only_a_signed_state_and_only_for_the_training_session(server):
    """create_training_client_from_state (load_weights with a session, no model_id) goes through the same confined,
    signature-checked folders as load_state, and claims the training client as create_model does."""
    owner, other = session(server), session(server)
    model_id = model(server, owner)
    body = request(server, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "a"})[1]
    path = result(server, body["request_id"])["path"]

    def from_state(session_id: str, seq: int, state_path: str) -> tuple[int, dict]:
        status, body, _ = request(server, "load_weights", {"session_id": session_id, "model_seq_id": seq,
                                  "path": state_path, "optimizer": True})  # fmt: skip
        return status, result(server, body["request_id"]) if status == 200 else body

    status, answer = from_state(other, 0, path)
    assert status == 409 and f"session {owner} is training on this server" in answer["error"]
    root = server.service.models.states.root
    shutil.copytree(root / model_id.replace(":", "_") / "a", root / model_id.replace(":", "_") / "copied")
    for bad, why in ((f"tinker://{model_id}/weights/copied", "not written by this server"),
                     (f"tinker://{model_id}/weights/../a", "give a tinker://"), (str(root), "give a tinker://"),
                     (f"tinker://{model_id}/weights/none", "no state saved under that path")):  # fmt: skip
        status, answer = from_state(owner, 1, bad)
        assert status == 400 and why in answer["error"] and str(root) not in answer["error"], (bad, answer)
    valid = {"session_id": owner, "model_seq_id": 2, "path": path, "optimizer": True, "base_model": "tiny",
             "optimizer_config": {"type": "adamw"}}  # fmt: skip
    for bad in [*malformed_bodies("load_weights", valid), {**valid, "session_id": "../x"}, {"path": path}]:
        status, answer, _ = request(server, "load_weights", bad)
        assert 400 <= status < 500 and answer["error"], (bad, answer)
    status, answer = from_state(owner, 1, path)
    assert status == 200 and answer["model_id"] == f"{owner}:train:1", answer
    assert server.service.models.current().model_id == f"{owner}:train:1"


def test_a_retry_with_the_same_idempotency_key_gets_the_first_answer_and_runs_once(server):
    model_id = model(server, session(server))
    headers = {"X-Idempotency-Key": "stainless-python-retry-1"}
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}}
    first = request(server, "optim_step", body, headers=headers)
    again = request(server, "optim_step", body, headers=headers)
    assert first[0] == again[0] == 200 and first[1] == again[1]
    assert result(server, again[1]["request_id"])["metrics"]["step"] == 1.0
    other = request(server, "optim_step", body, headers={"X-Idempotency-Key": "another"})[1]
    assert "already used" in result(server, other["request_id"])["error"]  # a new call with seq 1: refused


def test_a_second_session_cannot_take_a_live_sessions_training_client(server):
    first, second = session(server), session(server)
    model(server, first)
    status, body, headers = request(server, "create_model", {"session_id": second, "model_seq_id": 0,
                                    "base_model": "tiny", "lora_config": {"rank": 4}})  # fmt: skip
    assert status == 409 and headers["X-Should-Retry"] == "false"
    assert f"session {first} is training on this server" in body["error"] and "ServiceClient.close()" in body["error"]
    model(server, first, 1)  # its own session may replace it
    assert request(server, f"sessions/{first}/finish", {"reason": {"type": "success"}})[0] == 200
    assert request(server, "session_heartbeat", {"session_id": first})[0] == 410  # the SDK stops its heartbeats
    model(server, second)


def test_a_silent_session_releases_the_training_client():
    clock = [0.0]
    live = sessions.Sessions(timeout_s=60, clock=lambda: clock[0])
    first, second = live.create(), live.create()
    live.claim_training(first)
    clock[0] = 50.0
    live.heartbeat(first)
    clock[0] = 100.0
    with pytest.raises(futures.Refused, match="heard from 50 s ago"):
        live.claim_training(second)
    clock[0] = 111.0
    live.claim_training(second)
    live.create()  # forgets the silent first session
    with pytest.raises(futures.Refused, match="no such session"):
        live.heartbeat(first)
    with pytest.raises(futures.Refused, match="no such session"):
        live.claim_training("session-unknown")


# -- stopping ---------------------------------------------------------------------------------------------------


def test_close_finishes_the_running_call_cancels_the_queued_ones_and_ends_keep_alive_connections(server):
    model_id = model(server, session(server))
    client = server.service.models.current().client
    client.gate.clear()
    running = request(server, "forward_backward", forward_request(model_id, 1))[1]["request_id"]
    assert client.entered.wait(10)  # forward 1 runs (held by the gate)
    queued = request(server, "forward_backward", forward_request(model_id, 2))[1]["request_id"]
    keep_alive = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=5)
    keep_alive.request("POST", API + "create_session", body=b"{}", headers={"X-API-Key": server.api_key})
    assert keep_alive.getresponse().read()
    closing = threading.Thread(target=server.close)
    closing.start()
    waited = time.monotonic()  # the HTTP loop stops first (up to its 0.5 s poll), then the queued call is cancelled
    while not server.service.pending.get(queued).cancelled() and time.monotonic() - waited < 10:
        time.sleep(0.05)
    client.gate.set()
    closing.join(10)
    assert not closing.is_alive()
    assert client.forwards == 1  # the running call finished, the queued one never ran
    assert server.service.pending.get(running).result().status == 200
    assert server.service.pending.get(queued).cancelled()
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        keep_alive.request("POST", API + "create_session", body=b"{}", headers={"X-API-Key": server.api_key})
        keep_alive.getresponse()


def test_a_second_interrupt_exits_at_once(monkeypatch):
    serve_tinker = importlib.import_module("rlkit.cli.serve_tinker")
    exits = []
    monkeypatch.setattr(serve_tinker.os, "_exit", exits.append)
    stop = threading.Event()
    serve_tinker._interrupted(stop)
    assert stop.is_set() and exits == []
    serve_tinker._interrupted(stop)
    assert exits == [130]

"""rlkit.serve_tinker driven by the real Tinker SDK on 2 gloo ranks: a LoRA training client's losses, log-probs and
AdamW step equal the plain-torch reference of tests/test_primitives.py; the sampling client samples the saved
weights with the trainer's log-probs; wrong keys and unserved endpoints are refused at once; loopback only."""

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import psutil
import pytest
import torch

import rlkit
from tests.numerics import assert_close
from tests.test_primitives import (
    ADAM,
    LORA,
    actor_adapters,
    assert_adapters_equal_reference,
    data,
    reference_step,
    set_adapters,
    start_adapters,
)

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")


def to_tinker(datum: rlkit.Datum):
    """The same datum as the SDK's type (int64 targets, float32 inputs)."""
    inputs = {k: torch.tensor(v, dtype=torch.int64 if k == "target_tokens" else torch.float32)
              for k, v in datum.loss_fn_inputs.items()}  # fmt: skip
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(list(datum.tokens)), loss_fn_inputs=inputs)


def post(server, path: str, body: dict, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"X-API-Key": key, "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def cluster(cpu_cluster):
    """The session's 2-rank CPU cluster (tests/conftest.py), not one launched for this module."""
    return cpu_cluster


@pytest.fixture(scope="module")
def server(cluster):
    with rlkit.serve_tinker(cluster, config=rlkit.PrimitivesConfig(lora=LORA), poll_s=2.0) as server:
        yield server


@pytest.fixture(scope="module")
def service(server):
    """The SDK's session that owns the training client (another live session's create_model is refused); closed
    with the module, or its heartbeats would go on failing once the server is gone."""
    client = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def training(service, cluster):
    """The SDK's LoRA training client on the server, its adapters set to the reference's start."""
    client = service.create_lora_training_client(base_model="tiny", rank=LORA.rank, seed=0).result()
    cluster.run(set_adapters, start_adapters())
    return client


def test_the_sdks_forward_backward_and_optim_step_equal_the_reference(training, cluster):
    ce, is_ = data()
    ce_future = training.forward_backward([to_tinker(d) for d in ce], "cross_entropy")  # queued, not waited on
    is_future = training.forward_backward([to_tinker(d) for d in is_], "importance_sampling")
    step = training.optim_step(tinker.types.AdamParams(learning_rate=ADAM.learning_rate, beta1=ADAM.beta1,
                               beta2=ADAM.beta2, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                               grad_clip_norm=ADAM.grad_clip_norm)).result()  # fmt: skip
    ref = reference_step()
    assert ce_future.result().metrics["loss:sum"] == pytest.approx(ref["ce_loss"], rel=1e-5)
    assert is_future.result().metrics["loss:sum"] == pytest.approx(ref["is_loss"], rel=1e-5)
    outputs = ce_future.result().loss_fn_outputs + is_future.result().loss_fn_outputs
    for got, expected in zip(outputs, ref["ce_logp"] + ref["is_logp"], strict=True):
        assert_close(got["logprobs"].to_torch(), expected, rtol=1e-5, atol=1e-5, name="log-probs")
    assert step.metrics["grad_norm"] == pytest.approx(ref["norm"], rel=1e-5)
    assert_adapters_equal_reference(cluster.run(actor_adapters)[0], ref)


def test_the_sdks_sampling_client_samples_the_saved_weights_with_the_trainers_log_probs(training):
    prompt = [5, 17, 42, 9]
    sampler = training.save_weights_and_get_sampling_client().result()
    params = tinker.types.SamplingParams(max_tokens=6, seed=1, temperature=1.0)
    sequences = sampler.sample(tinker.types.ModelInput.from_ints(prompt), 3, params).result().sequences
    assert len(sequences) == 3 and all(1 <= len(s.tokens) <= 6 for s in sequences)
    for seq in sequences:
        full = prompt + list(seq.tokens)
        datum = rlkit.Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:],
                                                              "weights": [1.0] * (len(full) - 1)})  # fmt: skip
        out = training.forward([to_tinker(datum)], "cross_entropy").result().loss_fn_outputs[0]
        trainer = out["logprobs"].to_torch()[len(prompt) - 1:]
        torch.testing.assert_close(trainer, torch.tensor(seq.logprobs), rtol=1e-4, atol=1e-4)
    training.forward_backward([to_tinker(d) for d in data()[0]], "cross_entropy")
    training.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    newer = training.save_weights_and_get_sampling_client().result()
    assert newer.sample(tinker.types.ModelInput.from_ints(prompt), 1, params).result().sequences
    with pytest.raises(Exception, match="only the latest saved weights"):  # one engine: older snapshots are gone
        sampler.sample(tinker.types.ModelInput.from_ints(prompt), 1, params).result()


def test_an_unserved_endpoint_is_refused_at_once_by_name_and_later_calls_still_run(server, training):
    started = time.monotonic()
    with pytest.raises(tinker.NotFoundError, match="does not serve POST /api/v1/save_weights_external"):
        training.save_weights_external("checkpoint").result()  # takes a seq_id turn, which the refusal gives up
    assert time.monotonic() - started < 5
    out = training.forward([to_tinker(data()[0][0])], "cross_entropy").result(timeout=60)
    assert out.metrics["loss:sum"] > 0
    status, body = post(server, "/api/v1/unload_model", {}, server.api_key)
    assert status == 404 and "does not serve POST /api/v1/unload_model" in body["error"]


def test_the_sdks_save_state_and_load_state_restore_the_adapters_and_adamw(training, cluster):
    adam = tinker.types.AdamParams(learning_rate=1e-2)
    ce, is_ = ([to_tinker(d) for d in part] for part in data())
    training.forward_backward(ce, "cross_entropy")
    training.optim_step(adam)
    saved = training.save_state("after-one").result().path
    at_save = cluster.run(actor_adapters)[0]
    training.forward_backward(is_, "importance_sampling")
    first = training.optim_step(adam).result().metrics
    after_first = cluster.run(actor_adapters)[0]
    training.load_state_with_optimizer(saved).result()
    for name, tensor in cluster.run(actor_adapters)[0].items():
        assert torch.equal(tensor, at_save[name]) and not torch.equal(tensor, after_first[name]), name
    training.forward_backward(is_, "importance_sampling")
    again = training.optim_step(adam).result().metrics
    assert again["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-6) and again["step"] == first["step"]
    for name, tensor in cluster.run(actor_adapters)[0].items():
        torch.testing.assert_close(tensor, after_first[name], rtol=1e-6, atol=1e-7, msg=name)
    assert saved.endswith("/weights/after-one")
    with pytest.raises(Exception, match="exists: save under another name"):
        training.save_state("after-one").result()
    with pytest.raises(Exception, match="no state saved under that path"):
        training.load_state(saved + "-missing").result()
    assert training.forward(ce[:1], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0  # turns given up


def test_a_wrong_api_key_is_refused(server):
    for key in ("", "tml-wrong", server.api_key + "x"):
        status, body = post(server, "/api/v1/create_session", {}, key)
        assert status == 401 and "X-API-Key" in body["error"]
    assert post(server, "/api/v1/create_session", {}, server.api_key)[0] == 200
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(
            base_model="tiny", rank=LORA.rank)


def test_the_server_listens_on_loopback_only_unless_asked(server, cluster):
    port = int(server.url.rsplit(":", 1)[1])
    listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}  # fmt: skip
    assert listening == {"127.0.0.1"}
    with pytest.raises(ValueError, match="allow_remote=True"):
        rlkit.serve_tinker(cluster, host="0.0.0.0")


def test_rlkit_serve_tinker_serves_until_interrupted_and_refuses_a_remote_host_before_launch():
    refused = subprocess.run([sys.executable, "-m", "rlkit", "serve-tinker", "--host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2 and "--allow-remote" in refused.stderr
    command = [sys.executable, "-m", "rlkit", "serve-tinker", "--port", "0", "--world-size", "1", "--device", "cpu"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = proc.stdout.readline().split()[-1]
        key = proc.stdout.readline().split()[-1]
        served = SimpleNamespace(url=url)
        assert post(served, "/api/v1/create_session", {}, key)[0] == 200
        assert post(served, "/api/v1/create_session", {}, "tml-wrong")[0] == 401
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_forward_backward_custom_runs_a_client_side_loss_through_the_served_cross_entropy(training, cluster):
    """The SDK's forward_backward_custom (a forward, the loss and its gradient by the log-probs on the client, then a
    cross_entropy backward weighted by that gradient) on the served primitives: a loss equal to cross_entropy's gives
    its loss, log-probs and gradient norm; twice that loss, twice the norm."""
    ce = [to_tinker(d) for d in data()[0]]

    def weighted(scale: float):
        def loss_fn(batch, logprobs):
            pairs = zip(batch, logprobs, strict=True)
            loss = sum(-(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in pairs)
            return scale * loss, {"custom:sum": float(loss.detach())}

        return loss_fn

    def norm_after(call):
        cluster.run(set_adapters, start_adapters())  # the gradient at the same adapters each time
        out = call().result()
        return out, training.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result().metrics["grad_norm"]

    plain, plain_norm = norm_after(lambda: training.forward_backward(ce, "cross_entropy"))
    custom, custom_norm = norm_after(lambda: training.forward_backward_custom(ce, weighted(1.0)))
    _, doubled_norm = norm_after(lambda: training.forward_backward_custom(ce, weighted(2.0)))
    assert custom.metrics["custom:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)
    for got, expected in zip(custom.loss_fn_outputs, plain.loss_fn_outputs, strict=True):
        torch.testing.assert_close(got["logprobs"].to_torch(), expected["logprobs"].to_torch(), rtol=1e-5, atol=1e-5)
    assert custom_norm == pytest.approx(plain_norm, rel=1e-4) and plain_norm > 0
    assert doubled_norm == pytest.approx(2 * plain_norm, rel=1e-4)


def test_notebook_11_takes_each_sdk_client_out_of_its_future():
    """tinker 0.38 returns futures of clients (``save_weights_and_get_sampling_client``,
    ``create_lora_training_client``, ...) and warns (FutureWarning) when the future is used as the client: each such
    call in the Tinker notebook ends in ``.result()``."""
    import ast
    import inspect
    from pathlib import Path

    futures = {name for kind in (tinker.ServiceClient, tinker.TrainingClient)
               for name, fn in inspect.getmembers(kind, inspect.isfunction)
               if "Backcompat" in str(inspect.signature(fn).return_annotation)}  # fmt: skip
    assert {"save_weights_and_get_sampling_client", "create_lora_training_client"} <= futures
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "11_tinker.ipynb"
    cells = json.loads(notebook.read_text())["cells"]
    tree = ast.parse("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code"))
    resolved = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "result"}
    calls = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in futures]
    assert len(calls) >= 2 and all(id(c) in resolved for c in calls), [ast.unparse(c) for c in calls]  # fmt: skip


def test_the_tinker_guide_does_not_list_what_works_as_unsupported():
    """docs/guides/tinker.md's table: forward_backward_custom (tested above) is in the supported column."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "tinker.md").read_text()
    rows = [line.split("|")[1:3] for line in guide.splitlines() if line.startswith("| ") and line.count("|") == 3]
    assert rows and any("forward_backward_custom" in supported for supported, _ in rows)
    assert not any("forward_backward_custom" in missing for _, missing in rows)


def test_malformed_requests_get_a_4xx_json_answer_and_the_sdks_client_keeps_training(server, training):
    zstandard = pytest.importorskip("zstandard")
    zstd = {"Content-Encoding": "zstd"}
    cases = [("create_model", b"[1, 2]", {}), ("create_model", json.dumps({"session_id": "x", "model_seq_id": 0,
             "base_model": "tiny", "lora_config": {"rank": 4}, "optimizer_config": "adamw"}).encode(), {}),
             ("forward_backward", b"\x08\x96\x01garbage\xff\xff", {}),
             ("forward_backward", b"\x28\xb5\x2f\xfd not zstd", zstd),
             ("forward_backward", zstandard.ZstdCompressor().compress(b"\0" * (80 << 20)), zstd)]  # fmt: skip
    for path, body, headers in cases:
        request = urllib.request.Request(server.url + "/api/v1/" + path, data=body, method="POST",
                                         headers={"X-API-Key": server.api_key, **headers})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert 400 <= err.value.code < 500 and json.loads(err.value.read())["error"], path
    assert training.forward([to_tinker(data()[0][0])], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    assert training.get_info().model_data.tokenizer_id == "tiny"  # the name the client gave, not a server path


def test_a_second_sessions_training_client_is_refused_with_the_reason_while_the_first_trains(server, training):
    other = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    started = time.monotonic()
    with pytest.raises(tinker.ConflictError, match="is training on this server"):
        other.create_lora_training_client(base_model="tiny", rank=LORA.rank).result(timeout=30)
    assert time.monotonic() - started < 10  # refused at once, not retried
    other.close("success").result(timeout=30)
    assert training.forward([to_tinker(data()[0][0])], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0


def test_bad_data_and_adam_parameters_are_refused_by_name_at_once_and_later_calls_still_run(training):
    bad = {"tokens[1] = 257 is outside the vocabulary": rlkit.Datum(tokens=[5, 257], loss_fn_inputs={
               "target_tokens": [6, 7], "weights": [1.0, 1.0]}),
           "loss_fn_inputs['target_tokens'][0] = -1 is outside": rlkit.Datum(tokens=[5, 6], loss_fn_inputs={
               "target_tokens": [-1, 7], "weights": [1.0, 1.0]}),
           "loss_fn_inputs['weights'][1] = nan": rlkit.Datum(tokens=[5, 6], loss_fn_inputs={
               "target_tokens": [6, 7], "weights": [1.0, float("nan")]})}  # fmt: skip
    started = time.monotonic()
    for message, datum in bad.items():
        with pytest.raises(Exception, match=re.escape(f"datum 0: {message}")) as err:
            training.forward_backward([to_tinker(datum)], "cross_entropy").result(timeout=30)
        assert "Traceback" not in str(err.value) and "/rlkit/" not in str(err.value)
    with pytest.raises(Exception, match=r"learning_rate=-1.0: must be positive and finite"):
        training.optim_step(tinker.types.AdamParams(learning_rate=-1.0)).result(timeout=30)
    assert time.monotonic() - started < 30  # answered at once: no rank waited in a collective, no SDK retries
    fb = training.forward_backward([to_tinker(d) for d in data()[0]], "cross_entropy").result(timeout=60)
    assert fb.metrics["loss:sum"] > 0
    step = training.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    assert step.metrics["grad_norm"] > 0


def test_a_worker_failure_reaches_the_client_without_remote_tracebacks_or_server_paths():
    from rlkit.runtime.errors import RankFailure, RemoteError
    from rlkit.serving.tinker_service import client_message

    trace = 'Traceback (most recent call last):\n  File "/srv/rlkit/workers/primitives.py", line 9\nIndexError: x'
    error = RemoteError([RankFailure(1, "host", "cpu", "IndexError", "index 300 is out of bounds", trace),
                         RankFailure(0, "host", "cpu", "RuntimeError", "gloo: connection closed\nmore", trace)])
    assert client_message(error) == ("rank 0 raised RuntimeError: gloo: connection closed; rank 1 raised IndexError: "
                                     "index 300 is out of bounds")  # fmt: skip
    assert client_message(ValueError("datum 0: bad")) == "ValueError: datum 0: bad"


def test_the_sdks_sampler_stops_nowhere_with_an_empty_stop_list_and_computes_prompt_logprobs(training):
    prompt = [5, 17, 42, 9, 100]
    sampler = training.save_weights_and_get_sampling_client().result()
    model_input = tinker.types.ModelInput.from_ints(prompt)
    default = sampler.sample(model_input, 8, tinker.types.SamplingParams(max_tokens=12, seed=4)).result().sequences
    assert any(s.stop_reason == "stop" and len(s.tokens) < 12 for s in default)
    unstopped = sampler.sample(model_input, 8, tinker.types.SamplingParams(max_tokens=12, seed=4, stop=[])).result()
    assert all(len(s.tokens) == 12 and s.stop_reason == "length" for s in unstopped.sequences)
    got = sampler.compute_logprobs(model_input).result()
    datum = rlkit.Datum(tokens=prompt[:-1], loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * 4})
    trainer = training.forward([to_tinker(datum)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    torch.testing.assert_close(torch.tensor(got[1:]), trainer.to_torch(), rtol=1e-5, atol=1e-5)
    last = sampler.compute_logprobs(model_input, prompt_logprobs_last_n=2).result()
    assert last[:3] == [None] * 3 and last[3:] == pytest.approx(got[3:], abs=1e-6)
    assert sampler.compute_logprobs(tinker.types.ModelInput.from_ints([5])).result() == [None]
    with pytest.raises(Exception, match="topk_prompt_logprobs: not served"):
        sampler.sample(model_input, 1, tinker.types.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
                       topk_prompt_logprobs=3).result()  # fmt: skip
    with pytest.raises(Exception, match="max_tokens=100000: give 1 to 123"):
        sampler.sample(model_input, 1, tinker.types.SamplingParams(max_tokens=100_000)).result()


def test_the_sdks_create_training_client_from_state_with_and_without_optimizer(service, training, cluster):
    """Last: each new training client replaces the one before on the cluster (in the session that owns it)."""
    adam = tinker.types.AdamParams(learning_rate=1e-2)
    ce, is_ = ([to_tinker(d) for d in part] for part in data())
    training.forward_backward(ce, "cross_entropy")
    training.optim_step(adam)
    saved = training.save_state("to-resume").result().path
    at_save = cluster.run(actor_adapters)[0]
    training.forward_backward(is_, "importance_sampling")
    first = training.optim_step(adam).result().metrics
    after_first = cluster.run(actor_adapters)[0]
    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    assert resumed.get_info().lora_rank == LORA.rank
    for name, tensor in cluster.run(actor_adapters)[0].items():
        assert torch.equal(tensor, at_save[name]), name
    resumed.forward_backward(is_, "importance_sampling")
    again = resumed.optim_step(adam).result().metrics
    assert again["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-6) and again["step"] == first["step"]
    for name, tensor in cluster.run(actor_adapters)[0].items():
        torch.testing.assert_close(tensor, after_first[name], rtol=1e-6, atol=1e-7, msg=name)
    fresh = service.create_training_client_from_state(saved).result()  # weights only: a fresh AdamW
    for name, tensor in cluster.run(actor_adapters)[0].items():
        assert torch.equal(tensor, at_save[name]), name
    fresh.forward_backward(is_, "importance_sampling")
    fresh.optim_step(adam).result()
    moved = cluster.run(actor_adapters)[0]
    assert any(not torch.allclose(moved[n], after_first[n], rtol=1e-4, atol=1e-6) for n in moved)
    with pytest.raises(Exception, match="no state saved under that path"):
        service.create_training_client_from_state(saved + "-missing").result()


def test_a_fault_on_one_rank_mid_call_answers_in_seconds_naming_the_rank_and_the_server_serves_on(service, cluster):
    from tests.test_primitives import plant_fault

    training = service.create_lora_training_client(base_model="tiny", rank=LORA.rank, seed=0).result(timeout=120)
    cluster.run(set_adapters, start_adapters())
    ce = [to_tinker(d) for d in data()[0]]
    before = training.forward(ce, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    training.save_state("before-faults").result(timeout=60)  # what a restart of the workers restores
    for where, outcome in (("loss", "every rank ended the call together and the cluster serves on"),
                           ("forward", "the next call restarts them and restores the state saved in "
                                       "before-faults")):  # fmt: skip
        cluster.run(plant_fault, where)
        started = time.monotonic()
        with pytest.raises(Exception, match=f"rank 1 raised RuntimeError: planted fault .*{outcome}") as err:
            training.forward_backward(ce, "cross_entropy").result(timeout=60)
        assert time.monotonic() - started < 20, where  # not the 120 s of hang_timeout
        assert "Traceback" not in str(err.value) and "/rlkit/" not in str(err.value), str(err.value)
        again = training.forward(ce, "cross_entropy").result(timeout=180).metrics["loss:sum"]
        assert again == pytest.approx(before, rel=1e-6), where  # the same weights, on fresh workers after "forward"

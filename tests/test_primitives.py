"""rlkit.TrainingClient (Tinker's primitives) on 2 gloo ranks against a one-process reference in plain torch: the
losses, per-datum log-probs and the adapters after AdamW equal the reference's; the sampler samples the saved
weights, and its log-probs of the sampled tokens are the trainer's."""

import json
import os
import re
import signal
import time

import pytest
import torch

import rlkit
from rlkit.models import load_causal_lm, resolve_model_dir
from rlkit.models.lora import apply_lora, is_adapter_param
from rlkit.trainer.primitives import saved_lora
from tests.numerics import GRAD_ERROR_OF_NORM, adamw_first_step_tolerance, assert_close

pytest.importorskip("peft")

LORA = rlkit.LoraConfig(rank=4, alpha=8.0)
ADAPTER_ATOL = 1e-4
"""1% of the step: AdamW's first step moves each element by about lr = 1e-2, whatever its gradient, so an element
whose gradient is near eps turns rounding (a different order of the same sums) into up to ~1e-4 of movement."""
ADAM = rlkit.AdamStep(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5)


def start_adapters() -> dict[str, torch.Tensor]:
    """Adapters with B != 0 (a fresh B is 0, which leaves A's first gradient 0), by parameter name."""
    model = apply_lora_model()
    gen = torch.Generator().manual_seed(3)
    return {n: 0.1 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters() if p.requires_grad}


def apply_lora_model() -> torch.nn.Module:
    model = load_causal_lm(resolve_model_dir("tiny"), dtype=torch.float32, device=torch.device("cpu"))
    apply_lora(model, LORA)
    return model


def data() -> tuple[list[rlkit.Datum], list[rlkit.Datum]]:
    """Three cross-entropy and three importance-sampling data of different lengths (3 rows: rank 1 gets padding)."""
    gen = torch.Generator().manual_seed(5)
    ce, is_ = [], []
    for n in (7, 5, 9):
        seq = torch.randint(3, 200, (n + 1,), generator=gen).tolist()
        weights = [0.0] * 2 + torch.rand(n - 2, generator=gen).tolist()
        ce.append(rlkit.Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:], "weights": weights}))
        sampled = (-3 * torch.rand(n, generator=gen)).tolist()
        advantages = [0.0] * 2 + torch.randn(n - 2, generator=gen).tolist()
        is_.append(rlkit.Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:], "logprobs": sampled,
                                                                "advantages": advantages}))  # fmt: skip
    return ce, is_


def reference_logprobs(model: torch.nn.Module, datum: rlkit.Datum) -> torch.Tensor:
    """[N] log-probs of the datum's targets, one sequence at a time (no padding)."""
    logits = model(input_ids=torch.tensor([list(datum.tokens)])).logits[0]
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"])
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def reference_step() -> dict:
    """Tinker's definitions in plain torch: both losses' sums, their gradients added, AdamW(clip 0.5) once; with the
    clipped gradients the step took."""
    model = apply_lora_model()
    model.load_state_dict(start_adapters(), strict=False)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ce, is_ = data()
    ce_logp = [reference_logprobs(model, d) for d in ce]
    ce_loss = sum(-(torch.tensor(d.loss_fn_inputs["weights"]) * lp).sum() for d, lp in zip(ce, ce_logp, strict=True))
    is_logp = [reference_logprobs(model, d) for d in is_]
    is_loss = sum(-(torch.exp(lp - torch.tensor(d.loss_fn_inputs["logprobs"])) * torch.tensor(
        d.loss_fn_inputs["advantages"])).sum() for d, lp in zip(is_, is_logp, strict=True))  # fmt: skip
    (ce_loss + is_loss).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(trained.values()), ADAM.grad_clip_norm)
    grads = {n: p.grad.clone() for n, p in trained.items()}
    torch.optim.AdamW(trained.values(), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                      weight_decay=ADAM.weight_decay).step()  # fmt: skip
    return {"ce_loss": ce_loss.item(), "is_loss": is_loss.item(), "norm": norm.item(),
            "ce_logp": [lp.detach() for lp in ce_logp], "is_logp": [lp.detach() for lp in is_logp],
            "adapters": {n: p.detach().clone() for n, p in trained.items()}, "grads": grads}  # fmt: skip


def assert_adapters_equal_reference(got: dict[str, torch.Tensor], ref: dict) -> None:
    """Each adapter after the step equals the reference's within what float32 gradients computed in another order
    can move AdamW's first update (an element whose clipped gradient is near ``eps`` swings by up to ``lr``), plus
    float32 rounding of the weight; and the step moved each of them."""
    assert got.keys() == ref["adapters"].keys()
    grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref["grads"].values()))
    start = start_adapters()
    for name, expected in ref["adapters"].items():
        atol = adamw_first_step_tolerance(ref["grads"][name], lr=ADAM.learning_rate, eps=ADAM.eps,
                                          grad_error=GRAD_ERROR_OF_NORM * float(grad_norm))  # fmt: skip
        assert_close(got[name], expected, atol=atol + 1e-7, rtol=1e-6, name=name)
        assert not torch.allclose(expected, start[name]), f"{name}: the step did not move it"


def set_adapters(adapters: dict[str, torch.Tensor]) -> None:
    """On a worker: the actor's adapters from full tensors, then the sampler's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from rlkit.runtime import local_instance
    from rlkit.workers.primitives import PrimitivesWorker

    worker = local_instance(PrimitivesWorker)
    set_model_state_dict(worker.actor.model, adapters, options=StateDictOptions(full_state_dict=True, strict=False))
    worker.sync_engine()


def actor_adapters() -> dict[str, torch.Tensor]:
    """On a worker: the actor's full adapters (a collective)."""
    from rlkit.fsdp import iter_full_params
    from rlkit.runtime import local_instance
    from rlkit.workers.primitives import PrimitivesWorker

    return {n: t.clone() for n, t in iter_full_params(local_instance(PrimitivesWorker).actor.model, is_adapter_param)}


@pytest.fixture(scope="module")
def cluster(cpu_cluster):
    """The session's 2-rank CPU cluster (tests/conftest.py), not one launched for this module."""
    return cpu_cluster


@pytest.mark.numeric
def test_forward_backward_and_optim_step_equal_the_one_process_reference(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    cluster.run(set_adapters, start_adapters())
    ce, is_ = data()
    ce_future = client.forward_backward(ce, "cross_entropy")  # queued: nothing waits until .result()
    is_future = client.forward_backward(is_, "importance_sampling")
    step = client.optim_step(ADAM).result()
    ref = reference_step()
    assert ce_future.result().loss == pytest.approx(ref["ce_loss"], rel=1e-5)
    assert is_future.result().loss == pytest.approx(ref["is_loss"], rel=1e-5)
    for got, expected in zip(ce_future.result().logprobs + is_future.result().logprobs,
                             ref["ce_logp"] + ref["is_logp"], strict=True):  # fmt: skip
        assert_close(got, expected, rtol=1e-5, atol=1e-5, name="log-probs")
    assert step.grad_norm == pytest.approx(ref["norm"], rel=1e-5) and step.grad_norm > ADAM.grad_clip_norm
    assert_adapters_equal_reference(cluster.run(actor_adapters)[0], ref)
    norms = client.grad_norms()
    assert norms.global_norm == pytest.approx(ref["norm"], rel=1e-5)
    assert {"forward_backward", "optimizer_step"} <= set(client.memory()["phase"])


def test_the_sampler_samples_the_saved_weights_with_the_trainers_log_probs(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    cluster.run(set_adapters, start_adapters())
    prompt = [5, 17, 42, 9]
    before = client.sample(prompt, 3, max_tokens=6, seed=1)
    ce, _ = data()
    client.forward_backward(ce, "cross_entropy")
    client.optim_step(ADAM)
    unsaved = client.sample(prompt, 3, max_tokens=6, seed=1)  # the optimizer step is not saved for the sampler
    client.save_weights_for_sampler()
    after = client.sample(prompt, 3, max_tokens=6, seed=1).result()
    assert [s.tokens for s in unsaved.result()] == [s.tokens for s in before.result()]
    assert [s.logprobs for s in unsaved.result()] == [s.logprobs for s in before.result()]
    assert [s.logprobs for s in after] != [s.logprobs for s in before.result()]
    for seq in after:  # the trainer's log-probs of the sampled tokens, now that it is at the sampler's step
        full = prompt + seq.tokens
        weights = [1.0] * (len(full) - 1)
        datum = rlkit.Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": weights})
        trainer = client.forward([datum], "cross_entropy").result().logprobs[0][len(prompt) - 1:]
        torch.testing.assert_close(trainer, torch.tensor(seq.logprobs), rtol=1e-4, atol=1e-4)
    table = client.rollouts()
    assert len(table) == 9 and list(table["sampler_step"]) == [0] * 6 + [1] * 3
    assert (table["logprob_gap/mean"].iloc[6:] < 1e-4).all()  # sampler and trainer at the same step
    assert (table["logprob_gap/mean"].iloc[3:6] > 1e-3).all()  # the trainer moved on, the sampler did not


def test_stop_sequences_cut_each_completion_after_its_first_stop_and_keep_it(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    prompt, decode = [5, 17, 42, 9], client.tokenizer.decode
    full = client.sample(prompt, 8, max_tokens=10, seed=2, temperature=3.0).result()  # same seed: same draws
    longest = max(range(8), key=lambda i: len(full[i].tokens))
    assert len(full[longest].tokens) >= 4
    stop_token, stop_text = full[longest].tokens[2], decode(full[longest].tokens[1:3])
    cases = {"tokens": client.sample(prompt, 8, max_tokens=10, seed=2, temperature=3.0, stop=[stop_token]),
             "text": client.sample(prompt, 8, max_tokens=10, seed=2, temperature=3.0, stop=stop_text)}  # fmt: skip
    for kind, future in cases.items():
        for whole, cut in zip(full, future.result(), strict=True):
            n = len(cut.tokens)
            assert cut.tokens == whole.tokens[:n] and cut.logprobs == whole.logprobs[:n], kind
            hit = stop_token in cut.tokens if kind == "tokens" else stop_text in decode(cut.tokens)
            earlier = stop_token in cut.tokens[:-1] if kind == "tokens" else stop_text in decode(cut.tokens[:-1])
            assert not earlier, f"{kind}: cut after a later stop"
            assert cut.stop_reason == ("stop" if hit else whole.stop_reason), kind
            assert hit or cut.tokens == whole.tokens, f"{kind}: cut without a stop"
    for future in cases.values():
        cut = future.result()[longest]
        assert len(cut.tokens) <= 3 and cut.stop_reason == "stop"
    with pytest.raises(ValueError, match="not a mix") as err:
        client.sample(prompt, 1, stop=[3, "x"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.sample(prompt, 1, stop=[10**6])
    assert "stop" in str(err.value)


def test_load_state_restores_the_saved_adapters_and_adamw_so_the_next_step_repeats(cluster, tmp_path):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    cluster.run(set_adapters, start_adapters())
    ce, is_ = data()
    client.forward_backward(ce, "cross_entropy")
    client.optim_step(ADAM)  # AdamW's moments are not zero from here on
    saved = client.save_state(tmp_path / "state").result()
    at_save = cluster.run(actor_adapters)[0]
    client.forward_backward(is_, "importance_sampling")
    first = client.optim_step(ADAM).result()
    after_first = cluster.run(actor_adapters)[0]
    client.forward_backward(ce, "cross_entropy")  # pending gradients, which the load drops
    client.load_state(saved).result()
    for name, tensor in cluster.run(actor_adapters)[0].items():
        torch.testing.assert_close(tensor, at_save[name], rtol=0, atol=0, msg=name)
        assert not torch.equal(tensor, after_first[name]), f"{name}: the step after the save did not move it"
    client.forward_backward(is_, "importance_sampling")
    again = client.optim_step(ADAM).result()
    assert again.grad_norm == pytest.approx(first.grad_norm, rel=1e-6) and again.step == first.step == 2
    for name, tensor in cluster.run(actor_adapters)[0].items():
        torch.testing.assert_close(tensor, after_first[name], rtol=1e-6, atol=1e-7, msg=name)
    client.load_state(saved, optimizer=False).result()  # a fresh AdamW: the same gradient moves them otherwise
    client.forward_backward(is_, "importance_sampling")
    client.optim_step(ADAM).result()
    fresh = cluster.run(actor_adapters)[0]
    assert any(not torch.allclose(fresh[n], after_first[n], rtol=1e-4, atol=1e-6) for n in fresh)
    wider = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=rlkit.LoraConfig(rank=8, alpha=8.0)))
    with pytest.raises(ValueError, match="lora_rank=4 there, 8 here"):
        wider.load_state(saved).result()
    louder = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=rlkit.LoraConfig(rank=4, alpha=16.0)))
    with pytest.raises(ValueError, match="lora_alpha=8.0 there, 16.0 here"):
        louder.load_state(saved).result()
    narrower = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(
        lora=rlkit.LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"])))  # fmt: skip
    with pytest.raises(ValueError, match=r"lora_target_modules='all-linear' there, \['q_proj'\] here"):
        narrower.load_state(saved).result()


def test_a_state_saved_before_lora_settings_were_recorded_is_refused_naming_the_cause_and_the_fix(cluster, tmp_path):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    saved = client.save_state(tmp_path / "old").result()
    meta = json.loads((saved / "client.json").read_text())
    old = {"model": meta["model"], "lora_rank": 4, "step": 0}  # all that a state of rlkit 79ff466 records
    (saved / "client.json").write_text(json.dumps(old))
    with pytest.raises(ValueError) as err:
        client.load_state(saved).result()
    assert str(err.value) == (
        "old: its client.json records no lora_alpha, lora_target_modules, lora_modules_to_save: an rlkit from before "
        "states recorded their LoRA settings (issue 42) saved it, so nothing says which adapters it holds. If you know "
        "the settings it was saved with, add them to its client.json (lora_alpha: 8.0, lora_target_modules: "
        '"all-linear", lora_modules_to_save: [] are this client\'s) and load it again; once loaded, save_state writes '
        "a state this version loads")  # fmt: skip
    with pytest.raises(ValueError, match="records no lora_alpha, lora_target_modules, lora_modules_to_save"):
        saved_lora(saved)  # create_training_client_from_state's reading of it
    fixed = {**old, "lora_alpha": 8.0, "lora_target_modules": "all-linear", "lora_modules_to_save": []}
    (saved / "client.json").write_text(json.dumps(fixed))  # the fix the message gives
    client.load_state(saved).result()
    assert saved_lora(saved) == {"rank": 4, "alpha": 8.0, "target_modules": "all-linear", "modules_to_save": []}


def ce_datum(tokens: list[int], targets: list[int]) -> rlkit.Datum:
    return rlkit.Datum(tokens=tokens, loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(tokens)})


def test_bad_data_is_refused_on_the_controller_and_a_bad_share_fails_every_rank_at_once(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    with pytest.raises(ValueError, match=r"datum 0: tokens\[1\] = 257 is outside the vocabulary \(0 to 256\)"):
        client.forward_backward([ce_datum([5, 257], [6, 7])], "cross_entropy")
    with pytest.raises(ValueError, match=r"datum 1: loss_fn_inputs\['target_tokens'\]\[0\] = -3 is outside"):
        client.forward([ce_datum([5], [6]), ce_datum([5], [-3])], "cross_entropy")
    nan = rlkit.Datum(tokens=[5, 6], loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, float("nan")]})
    with pytest.raises(ValueError, match=r"datum 0: loss_fn_inputs\['weights'\]\[1\] = nan: every value must be"):
        client.forward_backward([nan], "cross_entropy")
    with pytest.raises(ValueError, match="datum 0: 129 tokens, more than the model's context of 128"):
        client.forward_backward([ce_datum(list(range(129)), list(range(129)))], "cross_entropy")
    # past the controller's check (as a caller of the workers could be): rank 1's share holds the bad id
    started = time.monotonic()
    with pytest.raises(ValueError) as err:
        client._forward([ce_datum([5, 6], [6, 7]), ce_datum([5, 6], [6, 10**6])], "cross_entropy", None, True)
    assert time.monotonic() - started < 10  # not a hang_timeout: no rank waited in a collective
    assert str(err.value) == ("forward_backward: the data breaks the model's limits: rank 1's share: row 0: "
                              "target_tokens outside the vocabulary (0 to 256)")  # fmt: skip
    assert "Traceback" not in str(err.value) and "File " not in str(err.value)
    ce, _ = data()
    assert client.forward_backward(ce, "cross_entropy").result(timeout=60).loss > 0  # the cluster still serves
    assert client.optim_step(ADAM).result(timeout=60).step == 1


def plant_fault(where: str, skip: int = 0) -> None:
    """On a worker: rank 1's next micro-batch (after ``skip`` of its losses) raises once, in its loss (between the
    collectives: "loss") or inside the first decoder layer's forward, after that layer's all-gather ("forward"); or
    rank 1 dies in its loss ("die": SIGKILL, as the out-of-memory killer does)."""
    from rlkit.runtime import context, local_instance
    from rlkit.workers import primitives

    if context().rank != 1:
        return
    if where in ("loss", "die"):
        real, calls = primitives.tinker_token_loss, []

        def faulty_loss(*args, **kwargs):
            calls.append(1)
            if len(calls) <= skip:
                return real(*args, **kwargs)
            primitives.tinker_token_loss = real
            if where == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("planted fault in the loss")

        primitives.tinker_token_loss = faulty_loss
        return
    model = local_instance(primitives.PrimitivesWorker).actor.model
    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))

    def faulty_forward(*args, **kwargs):
        raise RuntimeError("planted fault inside the forward")

    layer.forward = faulty_forward


@pytest.mark.parametrize("micro_batch_size", [8, 1])  # 1: the fault in the second micro-batch, after a backward
def test_a_fault_between_the_collectives_on_one_rank_ends_the_call_on_every_rank_and_drops_its_gradients(
    cluster, micro_batch_size
):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA, micro_batch_size=micro_batch_size))
    cluster.run(set_adapters, start_adapters())
    ce, is_ = data()
    client.forward_backward(ce, "cross_entropy").result()  # gradients the failed call drops with its own
    cluster.run(plant_fault, "loss", 0 if micro_batch_size == 8 else 1)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        client.forward_backward(is_, "importance_sampling").result(timeout=60)
    assert time.monotonic() - started < 20  # not hang_timeout (120 s): the ranks agreed before the backward
    assert str(err.value) == ("forward_backward failed: rank 1 raised RuntimeError: planted fault in the loss; every "
                              "rank ended the call together and the cluster serves on (the gradients accumulated "
                              "since the last optim_step were dropped)")  # fmt: skip
    assert cluster.broken is None
    ce_out = client.forward_backward(ce, "cross_entropy")  # the step of the reference, as if nothing had failed
    client.forward_backward(is_, "importance_sampling")
    step = client.optim_step(ADAM).result(timeout=60)
    ref = reference_step()
    assert ce_out.result().loss == pytest.approx(ref["ce_loss"], rel=1e-5)
    assert step.grad_norm == pytest.approx(ref["norm"], rel=1e-5) and step.step == 1
    assert_adapters_equal_reference(cluster.run(actor_adapters)[0], ref)


@pytest.mark.parametrize(("where", "cause"), [
    ("forward", re.escape("rank 1 raised RuntimeError: planted fault inside the forward (in the forward, where the "
                          "other ranks wait in its collectives)")),
    ("die", r"rank 1 \(pid \d+\) died during the call \S+: killed by SIGKILL \(9\) \(often the out-of-memory killer\)"),
])  # fmt: skip
def test_a_fault_inside_one_ranks_forward_restarts_the_workers_and_restores_the_last_state(cluster, tmp_path, where,
                                                                                           cause):  # fmt: skip
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    cluster.run(set_adapters, start_adapters())
    client.save_state(tmp_path / "start").result()
    ce, is_ = data()
    client.forward_backward(ce, "cross_entropy")
    assert client.optim_step(ADAM).result(timeout=60).step == 1  # trained past the state: the restart loses it
    pids = cluster.run(os.getpid)
    cluster.run(plant_fault, where)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        client.forward_backward(ce, "cross_entropy").result(timeout=60)
    assert time.monotonic() - started < 20  # rank 0 waits in an all-gather: stopped at once, not after 120 s
    assert re.fullmatch(
        f"forward_backward failed: {cause}; the ranks could not finish the call together, so the cluster's "
        "workers were stopped: the next call restarts them and restores the state saved in start \\(save_state or "
        "load_state\\)", str(err.value)), str(err.value)  # fmt: skip
    ce_out = client.forward_backward(ce, "cross_entropy")  # restarts the workers, loads "start", then runs
    client.forward_backward(is_, "importance_sampling")
    step = client.optim_step(ADAM).result(timeout=180)
    assert cluster.broken is None and set(cluster.run(os.getpid)).isdisjoint(pids)  # fresh workers
    ref = reference_step()
    assert ce_out.result().loss == pytest.approx(ref["ce_loss"], rel=1e-5)
    assert step.grad_norm == pytest.approx(ref["norm"], rel=1e-5) and step.step == 1  # the step from "start" again
    assert_adapters_equal_reference(cluster.run(actor_adapters)[0], ref)


def record_head_calls() -> None:
    """On a worker: log each call of the actor's LM head (scoring or plain logits, rows scored) from now on."""
    from rlkit.models.head import ResponseHead, response_head
    from rlkit.runtime import local_instance
    from rlkit.workers.primitives import PrimitivesWorker

    head = response_head(local_instance(PrimitivesWorker).actor.model)
    calls = head.calls = []

    def forward(hidden):
        calls.append((head._request is not None, len(head._request.rows) if head._request else hidden.shape[:-1]))
        return ResponseHead.forward(head, hidden)

    head.forward = forward


def head_calls() -> list:
    from rlkit.models.head import response_head
    from rlkit.runtime import local_instance
    from rlkit.workers.primitives import PrimitivesWorker

    head = response_head(local_instance(PrimitivesWorker).actor.model)
    calls = head.calls
    del head.forward, head.calls
    return calls


def test_forward_backward_scores_through_the_fused_head_one_micro_batch_at_a_time(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA, micro_batch_size=2))
    cluster.run(set_adapters, start_adapters())
    ce, is_ = data()
    batch = ce + [ce_datum(list(d.tokens), d.loss_fn_inputs["target_tokens"]) for d in is_[:2]]  # 5 data: 3 rows
    # per rank (rank 1: two data and a padding row), 2 micro-batches each
    cluster.run(record_head_calls)
    out = client.forward(batch, "cross_entropy").result()
    calls = cluster.run(head_calls)
    lengths = [len(d.tokens) for d in batch]
    assert calls[0] == [(True, lengths[0] + lengths[1]), (True, lengths[2])]  # only real positions, never [b, N, V]
    assert calls[1] == [(True, lengths[3] + lengths[4]), (True, 0)]
    model = apply_lora_model()
    model.load_state_dict(start_adapters(), strict=False)
    for got, datum in zip(out.logprobs, batch, strict=True):  # one sequence at a time, unfused, no padding
        torch.testing.assert_close(got, reference_logprobs(model, datum).detach(), rtol=1e-5, atol=1e-5)


def test_save_state_before_the_first_step_leaves_that_step_as_it_was(cluster, tmp_path):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    cluster.run(set_adapters, start_adapters())
    early = client.save_state(tmp_path / "early")  # AdamW has no state yet
    ce, is_ = data()
    client.forward_backward(ce, "cross_entropy")
    client.forward_backward(is_, "importance_sampling")
    assert client.optim_step(ADAM).result().step == 1
    ref = reference_step()["adapters"]
    for name, tensor in cluster.run(actor_adapters)[0].items():
        torch.testing.assert_close(tensor, ref[name], rtol=1e-4, atol=ADAPTER_ATOL, msg=name)
    client.load_state(early.result(), optimizer=True).result()  # a state of step 0: no moments to restore
    client.forward_backward(ce, "cross_entropy")
    client.forward_backward(is_, "importance_sampling")
    assert client.optim_step(ADAM).result().step == 1
    for name, tensor in cluster.run(actor_adapters)[0].items():
        torch.testing.assert_close(tensor, ref[name], rtol=1e-4, atol=ADAPTER_ATOL, msg=name)


def test_sample_refuses_ids_outside_the_vocabulary_and_max_tokens_beyond_the_context(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    prompt = [5, 17, 42, 9]
    for max_tokens in (125, 100_000, 2 * 10**7):
        with pytest.raises(ValueError, match=f"max_tokens={max_tokens}: give 1 to 124 .the model's context of 128"):
            client.sample(prompt, 1, max_tokens=max_tokens)
    with pytest.raises(ValueError, match=r"prompt\[1\] = 300 is outside the vocabulary"):
        client.sample([5, 300], 1)
    assert len(client.sample(prompt, 1, max_tokens=124, seed=0, stop=[]).result()[0].tokens) == 124


def test_an_empty_stop_list_ends_completions_at_max_tokens_only_end_of_text_included(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    prompt, eos = [5, 17, 42, 9], client.tokenizer.eos_token_id
    default = client.sample(prompt, 8, max_tokens=12, seed=4).result()
    assert any(s.stop_reason == "stop" and s.tokens[-1] == eos and len(s.tokens) < 12 for s in default)
    unstopped = client.sample(prompt, 8, max_tokens=12, seed=4, stop=[]).result()
    for stopped, whole in zip(default, unstopped, strict=True):  # the same draws, past the end-of-text
        assert len(whole.tokens) == 12 and whole.stop_reason == "length"
        assert whole.tokens[: len(stopped.tokens)] == stopped.tokens
        assert whole.logprobs[: len(stopped.tokens)] == pytest.approx(stopped.logprobs, abs=1e-6)


def test_prompt_logprobs_are_the_samplers_and_refused_once_the_trainer_moved_on(cluster):
    client = rlkit.TrainingClient(cluster, rlkit.PrimitivesConfig(lora=LORA))
    cluster.run(set_adapters, start_adapters())
    prompt = [5, 17, 42, 9, 100]
    got = client.prompt_logprobs(prompt).result()
    model = apply_lora_model()
    model.load_state_dict(start_adapters(), strict=False)
    expected = reference_logprobs(model, ce_datum(prompt[:-1], prompt[1:])).detach()
    torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-5)
    client.forward_backward(data()[0], "cross_entropy")
    client.optim_step(ADAM)
    with pytest.raises(ValueError, match="the trainer's weights have moved since the last save_weights_for_sampler"):
        client.prompt_logprobs(prompt).result()
    client.save_weights_for_sampler()
    assert client.prompt_logprobs(prompt).result() != got

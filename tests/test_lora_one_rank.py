"""LoRA on one rank (FSDP1's NO_SHARD path, a tied head or not): the merged sync into the hf engine after an update.
A module of its own: its one-rank launch shuts the session's shared 2-rank cluster down, which a module holding that
cluster could not survive."""

import dataclasses

import pytest
import torch
from role_runs import save_model_dir
from test_fsdp import make_batch, small_model
from test_lora import LORA, config

import rlkit

pytest.importorskip("peft")


def tied_model() -> torch.nn.Module:
    """small_model's weights with its head tied to its embedding (the bundled tiny model and Qwen2.5 0.5B are tied,
    7-8B models are not)."""
    untied = small_model()
    model = type(untied)(dataclasses.replace(untied.config, tie_word_embeddings=True))
    model.load_state_dict({k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}, strict=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.fixture(scope="module")
def one_rank():
    """A cluster of one rank; its launch shuts the session's shared 2-rank one down, hence a module of its own (the
    next module that asks for the shared one relaunches it)."""
    with rlkit.launch(world_size=1, device="cpu") as c:
        yield c


def update_and_sync(model_dir: str, version: int) -> dict[str, float]:
    """On the one worker: an update (its merged sync into the hf engine included), then each engine tensor's largest
    difference from W + (alpha / r) B A of the actor's full parameters after it."""
    from rlkit.fsdp import iter_full_params
    from rlkit.workers import PolicyRows, PolicyWorker

    worker = PolicyWorker(config(version), model_dir)
    batch = make_batch()
    fields = ("input_ids", "attention_mask", "response_mask", "advantages", "old_logprobs", "ref_logprobs")
    worker.update(PolicyRows(**{k: batch[k] for k in fields}))
    full = dict(iter_full_params(worker.actor.model))
    engine = dict(worker.engine.model.named_parameters())
    worker.close()
    scaling = LORA.alpha / LORA.rank
    differences = {}
    for name, tensor in engine.items():
        module, _, attr = name.rpartition(".")
        base = full.get(f"{module}.base_layer.{attr}", full.get(name))
        if attr == "weight" and f"{module}.lora_A.default.weight" in full:
            base = base + scaling * full[f"{module}.lora_B.default.weight"] @ full[f"{module}.lora_A.default.weight"]
        differences[name] = float((tensor - base).abs().max())
    return differences


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("version", "tied"), [(1, False), (2, False), (2, True)])
def test_lora_on_one_rank_syncs_merged_weights_after_an_update_tied_or_untied(one_rank, tmp_path, version, tied):
    """One rank: FSDP1 does not shard there (NO_SHARD, its own code path in torch), and after a forward it leaves the
    frozen base weights as plain tensors outside named_parameters; the first merged sync failed on them (an H100,
    untied 0.5B: KeyError 'model.layers.0.self_attn.q_proj.weight'). FSDP1 with a tied head on one rank is refused
    before launch (test_fsdp1_lora_on_an_unsharded_rank_with_tied_embeddings_is_refused_before_launch)."""
    model_dir = save_model_dir(tied_model() if tied else small_model(), tmp_path)
    differences = one_rank.run(update_and_sync, model_dir, version)[0]
    assert len(differences) == len(dict(small_model().named_parameters())) - tied, sorted(differences)
    assert max(differences.values()) < 1e-6, differences

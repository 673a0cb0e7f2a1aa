"""tinker-cookbook 0.6.1's math_rl recipe (its arithmetic task: synthetic, no download) runs unchanged against
rlkit.serve_tinker on the tiny model, 2 gloo ranks: only its configuration values differ from a hosted run (base URL,
the tiny model's directory as model and tokenizer, the role_colon renderer, a small batch, importance_sampling)."""

import asyncio
import json
import math

import pytest

import rlkit
from rlkit.models.tiny import TINY_MODEL_DIR

pytest.importorskip("tinker")
pytest.importorskip("peft")
math_rl = pytest.importorskip("tinker_cookbook.recipes.math_rl.train")

STEPS = 2


@pytest.fixture(scope="module")
def cluster(cpu_cluster):
    """The session's 2-rank CPU cluster (tests/conftest.py), not one launched for this module."""
    return cpu_cluster


def test_the_cookbooks_math_rl_recipe_trains_and_checkpoints_on_rlkits_server(cluster, tmp_path, monkeypatch):
    config = rlkit.PrimitivesConfig(lora=rlkit.LoraConfig(rank=4, alpha=8.0))
    with rlkit.serve_tinker(cluster, config=config, poll_s=2.0, state_dir=tmp_path / "states") as server:
        monkeypatch.setenv("TINKER_API_KEY", server.api_key)  # the SDK reads its key from there
        recipe = math_rl.CLIConfig(
            base_url=server.url, model_name=str(TINY_MODEL_DIR), renderer_name="role_colon", lora_rank=4,
            env="arithmetic", group_size=4, groups_per_batch=2, max_tokens=8, learning_rate=1e-2,
            loss_fn="importance_sampling", eval_every=0, save_every=0, max_steps=STEPS,
            log_path=str(tmp_path / "run"), behavior_if_log_dir_exists="delete")  # fmt: skip
        asyncio.run(math_rl.cli_main(recipe))  # the recipe's own entry point, code unchanged
        client = server.service.models.current().client
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "env/all/reward/total" in r]
        assert [r["progress/batch"] for r in steps] == list(range(STEPS))
        assert [r["step"] for r in steps] == [1.0, 2.0]  # the optim_step metrics rlkit's server sent back
        for row in steps:
            numbers = {k: v for k, v in row.items() if isinstance(v, float | int)}
            assert all(math.isfinite(v) for v in numbers.values()), numbers
            # the sampler's log-probs of the sampled tokens are the trainer's (same weights, temperature 1)
            assert abs(row["optim/kl_sample_train_v1"]) < 1e-4 and row["env/all/ac_tokens_per_turn"] >= 1
        final = json.loads((tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()[-1])
        assert final["state_path"].endswith("/weights/final") and final["sampler_path"].endswith("/final")
        folder = server.service.models.state_folder(final["state_path"])
        assert json.loads((folder / "client.json").read_text())["step"] == STEPS
        client.load_state(folder).result()  # the recipe's final state loads back

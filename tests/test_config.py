"""Config validation reports every problem at once, naming the setting and the fix."""

import pytest

from rlkit import ConfigError, CriticConfig, GRPOConfig, OptimConfig, PPOConfig, RolloutConfig
from rlkit.config import config_from_toml


def test_defaults_are_valid():
    cfg = GRPOConfig()
    assert cfg.samples_per_step == cfg.prompts_per_step * cfg.group_size


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        GRPOConfig(group_size=1, clip_eps=2.0, rollout=RolloutConfig(temperature=0.0), model="/no/such/dir")
    text = str(err.value)
    assert len(err.value.problems) == 4
    for name in ("group_size=1", "clip_eps=2.0", "rollout.temperature=0.0", "/no/such/dir"):
        assert name in text


def test_world_size_divisibility():
    cfg = GRPOConfig(prompts_per_step=3)
    cfg.check_cluster(1)
    with pytest.raises(ConfigError, match="multiple of 2"):
        cfg.check_cluster(2)
    with pytest.raises(ConfigError, match="mini_batches=5"):
        GRPOConfig(prompts_per_step=4, group_size=2, mini_batches=5).check_cluster(2)


def test_toml_round_trip(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('seed = 3\n[rollout]\nmax_new_tokens = 7\n[optim]\nlr = 0.001\nbetas = [0.9, 0.95]\n')
    cfg = config_from_toml(path)
    assert (cfg.seed, cfg.rollout.max_new_tokens, cfg.optim.lr, cfg.optim.betas) == (3, 7, 0.001, (0.9, 0.95))
    assert GRPOConfig.from_dict(cfg.to_dict()) == cfg


def test_every_config_problem_is_reported_at_once_each_typo_with_its_closest_name(tmp_path):
    """Two typos in two sections, a setting in the wrong table, an unknown one and a bad value: one report."""
    path = tmp_path / "c.toml"
    path.write_text(
        "stpes = 3\nmax_new_tokens = 8\nnonsense = 1\n[rollout]\ntemprature = 1.0\n[optim]\nlr = -1.0\n"
        "[critic.optim]\nweight_decy = 0.1\n"
    )
    path.write_text('algorithm = "ppo"\n' + path.read_text())
    with pytest.raises(ConfigError) as err:
        config_from_toml(path)
    assert err.value.problems == [
        "unknown setting stpes: did you mean steps?",
        "unknown setting max_new_tokens: did you mean rollout.max_new_tokens (under [rollout])?",
        "unknown setting nonsense: the top level has no such setting; remove it",
        "unknown setting rollout.temprature: did you mean rollout.temperature?",
        "unknown setting critic.optim.weight_decy: did you mean critic.optim.weight_decay?",
        "optim.lr=-1.0: must be > 0 (e.g. 1e-5 for a 0.5B model)",
    ]


def test_tables_come_from_the_dataclasses_so_a_new_section_is_checked_without_a_list(tmp_path):
    from dataclasses import dataclass, field

    @dataclass(kw_only=True)
    class SearchConfig:
        max_turns: int = 1

    @dataclass(kw_only=True)
    class SearchingConfig(GRPOConfig):
        search: SearchConfig = field(default_factory=SearchConfig)

    assert SearchingConfig.from_dict({"search": {"max_turns": 3}}).search == SearchConfig(max_turns=3)
    with pytest.raises(ConfigError, match=r"unknown setting search.max_turn: did you mean search.max_turns\?"):
        SearchingConfig.from_dict({"search": {"max_turn": 3}})


def test_earlier_layouts_are_read_with_a_warning_naming_the_new_place(caplog):
    from rlkit.config import config_from_dict

    with caplog.at_level("WARNING", logger="rlkit.config"):
        rl = config_from_dict({"rollout": {"max_prompt_tokens": 99}})
        dpo = config_from_dict({"algorithm": "dpo", "train_files": "p.parquet", "max_completion_tokens": 9})
    assert rl.data.max_prompt_tokens == 99
    assert dpo.data.train_files == ["p.parquet"] and dpo.data.max_completion_tokens == 9
    text = caplog.text
    assert "[rollout] max_prompt_tokens is deprecated: write it as max_prompt_tokens under [data]" in text
    assert "train_files (at the top level) is deprecated: write it as train_files under [data]" in text


def test_the_config_as_run_is_written_as_toml_that_reads_back(tmp_path):
    from rlkit.config import config_from_toml, to_toml

    config = PPOConfig(kl_clamp=None, rewards=[{"function": "r.py:f", "weight": 0.5, "name": "a \"b\""}],
                       data={"train_files": ["x.parquet"]}, critic={"optim": {"lr": 2e-3}})
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config.to_dict()))
    back = config_from_toml(path)
    assert "# kl_clamp: None" in path.read_text()
    assert back == PPOConfig(**{**vars(config), "kl_clamp": 10.0})  # TOML has no None: the default comes back


def test_ppo_config_shares_settings_and_round_trips(tmp_path):
    from rlkit.config import RLConfig, config_from_dict, config_from_toml

    ppo = PPOConfig()
    assert isinstance(ppo, RLConfig) and isinstance(GRPOConfig(), RLConfig)
    assert (ppo.advantage, ppo.group_size, ppo.lam, ppo.kl_mode) == ("gae", 1, 0.95, "reward")
    assert config_from_dict(ppo.to_dict()) == ppo
    assert config_from_dict(GRPOConfig(advantage="rloo").to_dict()) == GRPOConfig(advantage="rloo")
    path = tmp_path / "ppo.toml"
    path.write_text('algorithm = "ppo"\nlam = 0.9\n[critic]\nvalue_clip = 0.5\n[critic.optim]\nlr = 0.002\n')
    cfg = config_from_toml(path)
    assert isinstance(cfg, PPOConfig) and cfg.critic == CriticConfig(value_clip=0.5, optim=OptimConfig(lr=0.002))
    assert cfg.lam == 0.9
    with pytest.raises(ConfigError, match='algorithm="ppo" given to GRPOConfig'):
        GRPOConfig.from_dict(ppo.to_dict())


def test_algorithm_settings_are_validated_together():
    with pytest.raises(ConfigError) as err:
        GRPOConfig(
            advantage="gae", loss_agg="sum", clip_high=0.0, dual_clip=0.5, kl_estimator="k9", kl_mode="both",
            gamma=1.5, entropy_coef=-0.1,
        )
    text = str(err.value)
    for name in ('advantage="gae" needs a critic', 'loss_agg="sum"', "clip_high=0.0", "dual_clip=0.5",
                 'kl_estimator="k9"', 'kl_mode="both"', "gamma=1.5", "entropy_coef=-0.1"):
        assert name in text
    assert len(err.value.problems) == 8
    with pytest.raises(ConfigError) as err:
        PPOConfig(advantage="grpo", critic=CriticConfig(value_clip=-1.0, optim=OptimConfig(lr=0.0)))
    assert len(err.value.problems) == 4  # grpo needs groups (group_size=1), not a PPO estimator, clip, lr
    assert "critic.optim.lr=0.0" in str(err.value) and "critic.value_clip=-1.0" in str(err.value)
    assert GRPOConfig(advantage="reinforce++", group_size=1).group_size == 1
    with pytest.raises(ConfigError, match='group_size=1: must be >= 2 with advantage="rloo"'):
        GRPOConfig(advantage="rloo", group_size=1)


def test_rollout_engine_settings(tmp_path):
    assert GRPOConfig(rollout="vllm").rollout == RolloutConfig(engine="vllm")
    path = tmp_path / "c.toml"
    path.write_text('rollout = "vllm"\n')
    assert config_from_toml(path).rollout.engine == "vllm"
    with pytest.raises(ConfigError) as err:
        GRPOConfig(rollout=RolloutConfig(engine="sglang", gpu_memory_utilization=1.5, kv_cache_gb=-1))
    assert len(err.value.problems) == 3
    assert "valid engines are ('hf', 'vllm')" in str(err.value)


def test_vllm_engine_needs_vllm_installed():
    import importlib.util

    config = GRPOConfig(rollout="vllm")
    if importlib.util.find_spec("vllm") is not None:
        config.check_cluster(2)
    else:
        with pytest.raises(ConfigError, match=r'pip install "rlkit\[vllm\]"'):
            config.check_cluster(2)


def test_skipping_the_logprob_pass_needs_one_step_per_batch_and_kl_in_the_loss():
    GRPOConfig(recompute_logprobs=False, kl_coef=0.1)
    with pytest.raises(ConfigError) as err:
        GRPOConfig(recompute_logprobs=False, ppo_epochs=2, kl_coef=0.1, kl_mode="reward")
    assert len(err.value.problems) == 2
    assert "recompute_logprobs=False with ppo_epochs=2, mini_batches=1" in str(err.value)
    assert 'use kl_mode="loss" or recompute_logprobs=True' in str(err.value)
    with pytest.raises(ConfigError, match="mini_batches=4"):
        GRPOConfig(recompute_logprobs=False, mini_batches=4)


def test_config_and_data_import_nothing_above_algos():
    """Importing rlkit.config and rlkit.data (without rlkit/__init__, which imports the whole library) loads no
    model code, transformers, vLLM or runtime; and no function in rlkit/config imports above rlkit/algos either."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "rlkit"
    script = (
        "import sys, types; package = types.ModuleType('rlkit'); package.__path__ = [sys.argv[1]]; "
        "sys.modules['rlkit'] = package; import rlkit.config, rlkit.data; "
        "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('transformers', 'vllm', 'rlkit')))"
    )
    loaded = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, check=True)
    packages = {".".join(m.split(".")[:2]) for m in loaded.stdout.split()}
    assert packages == {"rlkit", "rlkit.algos", "rlkit.config", "rlkit.data"}, packages
    for path in (root / "config").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlkit."):
                assert node.module.split(".")[1] in ("algos", "config"), f"{path.name} imports {node.module}"


# -- settings of the wrong type (rlkit.config.typed), named before anything runs ----------------------------------

WRONG_TYPES_TOML = """
steps = "10"
[lora]
rank = "eight"
alpha = "16"
dropout = "0"
target_modules = ["q_proj", 3]
[agent]
max_turns = "3"
call_timeout = "fast"
"""
WRONG_TYPES = [
    'steps="10": must be an integer, not a string',
    'lora.rank="eight": must be an integer, not a string',
    'lora.alpha="16": must be a number, not a string',
    'lora.dropout="0": must be a number, not a string',
    "lora.target_modules=['q_proj', 3]: must be a list of strings or a string, not a list holding an integer (3)",
    'agent.max_turns="3": must be an integer, not a string',
    'agent.call_timeout="fast": must be a number, not a string',
]


def test_settings_of_the_wrong_type_are_named_together_with_the_type_expected_and_the_value_given(tmp_path):
    """The issue's TOML: each wrong type named at once (a typo beside them too), no traceback from a comparison."""
    path = tmp_path / "c.toml"
    path.write_text(WRONG_TYPES_TOML + "[rollout]\ntemprature = 1.0\n")
    with pytest.raises(ConfigError) as err:
        config_from_toml(path)
    assert err.value.problems == ["unknown setting rollout.temprature: did you mean rollout.temperature?",
                                  *WRONG_TYPES]  # fmt: skip


@pytest.mark.parametrize(
    "table, expected",
    [
        ("lora = 8\n", "lora=8: must be a [lora] table (LoraConfig), not an integer"),
        ("[lora]\nrank = 8.5\n", "lora.rank=8.5: must be an integer, not a float"),
        ("[lora]\nrank = true\n", "lora.rank=True: must be an integer, not a boolean"),
        ("[critic.lora]\nrank = 4.0\n", "critic.lora.rank=4.0: must be an integer, not a float"),
        ("[optim]\nbetas = 0.9\n", "optim.betas=0.9: must be a list of 2 numbers, not a float"),
        ("[optim]\nbetas = [0.9, 0.99, 0.5]\n", "optim.betas=(0.9, 0.99, 0.5): must be a list of 2 numbers, not a "
                                                "tuple of 3 items"),
        ("clip_high = \"0.28\"\n", 'clip_high="0.28": must be a number or None, not a string'),
        ("[fsdp]\nreshard_after_forward = 1\n", "fsdp.reshard_after_forward=1: must be true or false, not an integer"),
        ("[data]\nchat_template = \"yes\"\n", 'data.chat_template="yes": must be true or false or None, not a string'),
        ("[data]\ntrain_files = 3\n", "data.train_files=3: must be a list of strings, not an integer"),
        ("trackers = \"tensorboard\"\n", 'trackers="tensorboard": must be a list of strings, not a string'),
        ("rewards = [\"r.py:f\"]\n", "rewards=['r.py:f']: must be a list of [[rewards]] tables (RewardSpec), not a "
                                     'list holding a string ("r.py:f")'),
        ("[[rewards]]\nfunction = \"r.py:f\"\nweight = \"1\"\n", 'rewards[0].weight="1": must be a number, not a '
                                                               "string"),
        ("[rollout]\nengine = [\"vllm\"]\n", "rollout.engine=['vllm']: must be a string, not a list"),
    ],
)
def test_a_wrong_type_in_any_section_is_named_before_the_value_checks_run(tmp_path, table, expected):
    """Tables, arrays of tables, optional settings and tuples; ``rank = 8.5`` and ``rank = true`` passed the value
    checks before and reached torch.empty on the workers."""
    path = tmp_path / "c.toml"
    path.write_text('algorithm = "ppo"\n' + table)
    with pytest.raises(ConfigError) as err:
        config_from_toml(path)
    assert err.value.problems == [expected]


def test_the_python_api_names_wrong_types_at_once_in_nested_sections_and_lists():
    import rlkit

    with pytest.raises(ConfigError) as err:
        rlkit.GRPOConfig(lora=rlkit.LoraConfig(rank="eight"), steps="10", rewards=[rlkit.RewardSpec(weight=None)],
                         agent={"call_timeout": "fast"})  # fmt: skip
    assert err.value.problems == ['steps="10": must be an integer, not a string',
                                  'lora.rank="eight": must be an integer, not a string',
                                  "rewards[0].weight=None: must be a number, not None",
                                  'agent.call_timeout="fast": must be a number, not a string']  # fmt: skip
    with pytest.raises(ConfigError, match=r"^1 problem\(s\) in the config:\n  - critic.lora.rank=4.0: must be an "
                                          r"integer, not a float$"):  # a table given as a dict, two levels down
        rlkit.PPOConfig(critic=CriticConfig(lora={"rank": 4.0}))
    with pytest.raises(ConfigError) as err:
        rlkit.DPOConfig(beta="0.1", optim=OptimConfig(betas=[0.9, "0.99"]))
    assert err.value.problems == ['beta="0.1": must be a number, not a string',
                                  "optim.betas=[0.9, '0.99']: must be a list of 2 numbers, not a list holding a "
                                  'string ("0.99")']  # fmt: skip
    with pytest.raises(ConfigError, match=r'max_samples="16": must be an integer, not a string'):
        rlkit.PrimitivesConfig(max_samples="16")
    with pytest.raises(ConfigError, match=r"lora=OptimConfig\(lr=1e-05, .*\.\.\.: must be a \[lora\] table "
                                          r"\(LoraConfig\), not an OptimConfig$"):  # one section for another
        rlkit.GRPOConfig(lora=OptimConfig())


def test_the_right_types_pass_an_int_is_a_number_and_a_list_a_tuple():
    cfg = GRPOConfig(optim=OptimConfig(lr=1, betas=[0.9, 0.95]), clip_high=None, kl_clamp=5,
                     data={"train_files": "prompts.jsonl"})  # fmt: skip
    assert (cfg.optim.lr, cfg.optim.betas, cfg.kl_clamp, cfg.data.train_files) == (1, [0.9, 0.95], 5, ["prompts.jsonl"])


def test_a_huge_value_given_is_cut_in_the_message():
    with pytest.raises(ConfigError) as typed:
        GRPOConfig(seed=["x" * 10_000])
    (problem,) = typed.value.problems
    assert problem.startswith("seed=['xxx") and "...: must be an integer, not a list" in problem and len(problem) < 120


def test_a_setting_given_a_wrong_type_after_the_config_was_made_is_named_before_launch():
    """``Trainer(cluster, config)`` runs check_launch first: dataclasses can be changed after they are checked."""
    from rlkit.diagnostics import check_launch

    cfg = GRPOConfig()
    cfg.lora.rank = "8"  # type: ignore[assignment]
    cfg.rollout.max_new_tokens = 8.0  # type: ignore[assignment]
    with pytest.raises(ConfigError) as err:
        check_launch(cfg, world_size=2)
    assert err.value.problems == ['rollout.max_new_tokens=8.0: must be an integer, not a float',
                                  'lora.rank="8": must be an integer, not a string']  # fmt: skip


def test_the_type_check_reads_every_annotation_of_every_config():
    """Each setting of each config, given a value of no type any annotation takes, is named by its dotted name: the
    check covers every field, nested sections included, with no list to keep in step."""
    import dataclasses

    import rlkit
    from rlkit.config.fields import settings
    from rlkit.config.typed import type_problems

    for kind in (rlkit.GRPOConfig, rlkit.PPOConfig, rlkit.DPOConfig, rlkit.KTOConfig, rlkit.PrimitivesConfig):
        config = kind()
        names = []
        for setting in settings(kind):
            if setting.table.startswith(("rewards", "tools")):
                continue  # the items of (empty) arrays of tables
            owner = config
            for part in filter(None, setting.table.split(".")):
                owner = getattr(owner, part)
            if dataclasses.is_dataclass(getattr(owner, setting.name)):
                continue  # a section: its own settings follow
            setattr(owner, setting.name, object())
            names.append(f"{setting.table}.{setting.name}".lstrip("."))
        assert [p.split("=")[0] for p in type_problems(config)] == names, kind


def test_the_type_check_reads_literals_dicts_and_open_tuples_of_any_dataclass():
    """Annotations no config uses yet, on a dataclass of the test's own: a section added with them is checked."""
    import dataclasses
    from typing import Literal

    from rlkit.config.typed import type_problems

    @dataclasses.dataclass
    class Inner:
        mode: Literal["a", "b"] = "a"

    @dataclasses.dataclass
    class Outer:
        weights: dict[str, float] = dataclasses.field(default_factory=dict)
        sizes: tuple[int, ...] = ()
        inner: Inner = dataclasses.field(default_factory=Inner)

    assert type_problems(Outer(weights={"x": 1, "y": 0.5}, sizes=[1, 2, 3], inner=Inner(mode="b"))) == []
    assert type_problems(Outer(weights={"x": "1"}, sizes=(1, True), inner=Inner(mode="c")), "t") == [
        "t.weights={'x': '1'}: must be a table of numbers, not a table holding a string (\"1\")",
        "t.sizes=(1, True): must be a list of integers, not a tuple holding a boolean (True)",
        't.inner.mode="c": must be one of "a", "b", not a string',
    ]

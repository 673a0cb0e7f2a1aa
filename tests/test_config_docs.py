"""Every setting is documented: the settings reference (docs/reference/settings) is made from these docs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from rlkit.config import DPOConfig, GRPOConfig, KTOConfig, PPOConfig, RolloutConfig
from rlkit.config.fields import settings

CONFIGS = [GRPOConfig, PPOConfig, DPOConfig, KTOConfig]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_setting_has_a_doc(config):
    undocumented = [f"{s.table}.{s.name}".lstrip(".") for s in settings(config) if not s.doc.strip()]
    assert undocumented == [], f"{config.__name__}: write a docstring under each of {undocumented}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_the_settings_are_every_field_of_every_section(config):
    def walk(cls: type, table: str) -> list[str]:
        found = []
        for f in dataclasses.fields(cls):
            where = f"{table}.{f.name}" if table else f.name
            found.append(where)
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(value):
                found += walk(type(value), where)
        return found

    listed = [f"{s.table}.{s.name}".lstrip(".") for s in settings(config)]
    assert set(walk(config, "")) <= set(listed)
    assert len(listed) == len(set(listed))


def test_a_setting_reads_its_type_default_doc_and_section():
    by_name = {(s.table, s.name): s for s in settings(PPOConfig)}
    turn = by_name[("agent", "max_turn_tokens")]
    assert (turn.annotation, turn.default) == ("int", "0") and "one model turn" in turn.doc
    assert by_name[("", "rollout")].default == "[rollout]"
    assert by_name[("", "clip_high")].annotation == "float | None"
    assert by_name[("", "advantage")].default == "'gae'", "PPOConfig's own default, not RLConfig's"
    assert by_name[("critic.lora", "rank")].table == "critic.lora"
    assert ("rewards", "function") in by_name, "the items of [[rewards]]"
    assert {s.table for s in settings(RolloutConfig)} == {""}


def test_a_field_without_a_doc_reads_as_empty():
    @dataclass
    class Undocumented:
        documented: int = 1
        """Has one."""
        bare: list[int] = field(default_factory=list)

    by_name = {s.name: s for s in settings(Undocumented)}
    assert by_name["documented"].doc == "Has one."
    assert (by_name["bare"].doc, by_name["bare"].default) == ("", "[]")

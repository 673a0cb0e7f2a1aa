"""Prompt texts from a prompt column: plain strings as they are, chat messages through the chat template."""

from __future__ import annotations

from typing import Any


def render_prompts(
    values: list[Any],
    tokenizer: Any,
    chat_template: bool | None,
    prompt_key: str,
    tools: list[Any] | None = None,
    generation_prompt: bool = True,
) -> tuple[list[str], bool, list[str]]:
    """The text the model sees for each value of the prompt column.

    A value is a string or a list of ``{"role": str, "content": str}`` messages; the column
    must hold one kind. Messages (and strings, with ``chat_template=True``, as one user
    message) go through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``,
    with ``tools`` (the tools' JSON schemas of a multi-turn run) when given; without the generation prompt when
    ``generation_prompt`` is False (a run with an environment: its trajectories open it, after the environment's
    first observation).

    Returns (texts, templated, problems): ``templated`` says whether the chat template was applied.
    """
    kind, problems = _column_kind(values, prompt_key)
    if problems:
        return [], False, problems
    use_template = chat_template if chat_template is not None else kind == "messages"
    if kind == "messages" and not use_template:
        return [], False, [
            f'data.prompt_key="{prompt_key}" holds chat messages but data.chat_template = false: '
            "set chat_template = true (or leave it unset), or give plain-text prompts"
        ]
    if not use_template:
        return list(values), False, []
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        return [], True, [
            f'data.prompt_key="{prompt_key}" needs a chat template but the tokenizer of {name} has none: add '
            '"chat_template" to its tokenizer_config.json (or a chat_template.jinja file beside it), '
            "or give plain-text prompts with data.chat_template = false"
        ]
    messages = [as_messages(v) for v in values]
    try:
        texts = [
            tokenizer.apply_chat_template(
                m, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
            )
            for m in messages
        ]
    except Exception as exc:  # noqa: BLE001 - a template that fails on the data is reported, not raised
        return [], True, [f"the tokenizer's chat template failed on the prompts: {type(exc).__name__}: {exc}"]
    return texts, True, []


def as_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string becomes one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


def _column_kind(values: list[Any], prompt_key: str) -> tuple[str, list[str]]:
    """ "text" or "messages", or the first rows that are neither or disagree."""
    if not values:
        return "text", []
    kinds = [prompt_kind(v) for v in values]
    bad = [i for i, k in enumerate(kinds) if k is None]
    if bad:
        shown = ", ".join(f"row {i}: {values[i]!r:.80}" for i in bad[:3])
        return "", [
            f'data.prompt_key="{prompt_key}": {len(bad)} row(s) are neither a non-empty string nor a list of '
            f'{{"role": str, "content": str}} messages ({shown}); fix or remove them'
        ]
    if len(set(kinds)) > 1:
        first_text, first_chat = kinds.index("text"), kinds.index("messages")
        return "", [
            f'data.prompt_key="{prompt_key}" mixes plain strings (row {first_text}) and chat messages '
            f"(row {first_chat}); give one kind in the column"
        ]
    return str(kinds[0]), []


def prompt_kind(value: Any) -> str | None:
    """ "text" (a non-empty string), "messages" (a non-empty list of chat messages), or None (neither)."""
    if isinstance(value, str):
        return "text" if value.strip() else None
    if isinstance(value, list) and value and all(is_message(m) for m in value):
        return "messages"
    return None


def is_message(m: Any) -> bool:
    """A ``{"role": str, "content": str}`` chat message."""
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)

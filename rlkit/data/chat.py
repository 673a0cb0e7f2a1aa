"""Token in, token out: the ids a multi-turn trajectory appends after each model turn, and the drift check.

The model's own tokens are never re-tokenised. After a model turn (the engine's sampled ids, through the
end-of-turn token), a trajectory appends the ids of what the chat template writes next: the rest of the
closed turn, the observation's messages and the next generation prompt. They are what follows a fixed
stand-in assistant turn's end-of-turn token once the observation's messages follow it (what the engine sees
next; the stand-in turn itself may render differently when it is no longer the last, as Qwen3's does), so only
the template's own tokens and the observation's text are tokenised. The boundary rule: the model's turn ends
at its end-of-turn token (the tokenizer's eos, where the engine stops); whatever the template writes after
that token (Qwen's "\\n" after ``<|im_end|>``) belongs to the observation, and is masked out of the loss with it.

Observations are text: the contents of tool results and of the environment's messages are tokenised with the
tokenizer's special tokens split into plain text, so a tool result that writes ``<|im_end|>`` or
``<|eot_id|><|start_header_id|>assistant`` cannot close its turn or forge an assistant's (only the template's own
special tokens are control tokens). The model's own turns keep their special tokens (they are its sampled ids).

A template that is not append-only (one that rewrites earlier turns, e.g. drops their reasoning) or a model
that samples a non-canonical tokenisation makes the ids differ from a re-render of the whole conversation:
:meth:`ChatRenderer.drift` finds the first differing position and shows the context, and the trajectory
trains on the ids the engine saw, never on the re-render.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

STAND_IN = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
"""The conversation the observation deltas are rendered after (its content does not reach the deltas)."""
CONTEXT = 10
"""Tokens shown on each side of a drift."""


class TemplateError(ValueError):
    """The chat template cannot give token deltas (it is not append-only, or ends no assistant turn with eos)."""


class ChatRenderer:
    """The token deltas of a tokenizer's chat template, with the tools' schemas rendered into the prompt."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.stop_id: int = tokenizer.eos_token_id
        self._stand_in: list[int] | None = None
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len)
        self._special_ids = {text: tokenizer.convert_tokens_to_ids(text) for text in specials}
        self._specials = re.compile("|".join(map(re.escape, reversed(specials)))) if specials else None
        """The special tokens' texts, longest first (as the tokenizer matches them)."""

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        """The template's text of ``messages`` (with the tools), and the next assistant turn's opening if asked."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def ids(
        self, messages: list[dict[str, Any]], *, generation_prompt: bool, observations_from: int | None = None
    ) -> list[int]:
        """The ids of ``messages`` rendered. The contents of the messages from index ``observations_from`` on (none
        when None) that are not the model's (tool results, the environment's replies) are tokenised as text: the
        special tokens written in them are plain text, never control tokens."""
        specials = self._specials
        if specials is None or observations_from is None:
            return self.tokenizer(self.render(messages, generation_prompt=generation_prompt), add_special_tokens=False)[
                "input_ids"
            ]
        marker = f"\ue000{uuid.uuid4().hex}\ue001"  # in no content: it marks the special tokens' text in theirs
        shown = [
            {**m, "content": specials.sub(lambda found: found[0][0] + marker + found[0][1:], m["content"])}
            if i >= observations_from and m.get("role") != "assistant" and isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]  # fmt: skip
        text = self.render(shown, generation_prompt=generation_prompt)
        # the template's special tokens are control tokens; the text between them (observations unmarked) is text,
        # tokenised piece by piece as the tokenizer does between special tokens
        pieces = [piece.replace(marker, "") for piece in specials.split(text)]
        plain = self.tokenizer(pieces, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids: list[int] = list(plain[0])
        for special, after in zip(specials.findall(text), plain[1:], strict=True):
            ids += [self._special_ids[special], *after]
        return ids

    def observation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids to append after a model turn that ended with its end-of-turn token: the template's tokens after
        that token, ``messages`` (tool results or the environment's reply), and the next generation prompt.

        They are what follows the stand-in assistant turn's end-of-turn token in a render of the stand-in
        conversation and ``messages``: what the engine sees next. The stand-in turn itself may render differently
        once messages follow it (Qwen3 writes an empty ``<think></think>`` only into a last assistant turn); the
        turns before it may not.

        Raises:
            TemplateError: the template does not end its assistant turn with the eos token, or rewrites the turns
                before the stand-in assistant turn when messages follow it.
        """
        if self._stand_in is None:
            self._stand_in = self.ids(STAND_IN, generation_prompt=False)
        before = self._stand_in
        if self.stop_id not in before:
            raise TemplateError(
                f"the chat template does not end an assistant turn with the eos token "
                f"{self.tokenizer.convert_ids_to_tokens(self.stop_id)!r} (id {self.stop_id}), where the engine stops "
                f"a turn: {self.render(STAND_IN, generation_prompt=False)!r}; set the tokenizer's eos_token to the "
                "template's end-of-turn token (e.g. <|im_end|>)"
            )
        after = self.ids([*STAND_IN, *messages], generation_prompt=True, observations_from=len(STAND_IN))
        ends, later = _ends(before, self.stop_id), _ends(after, self.stop_id)
        earlier = ends[-2]  # the stand-in's ids before its assistant turn, whose end-of-turn token is its last
        if len(later) < len(ends) or after[:earlier] != before[:earlier]:
            raise TemplateError(
                "the chat template is not append-only: the turns before an assistant turn change when messages "
                f"follow it (first at position {first_difference(before[:earlier], after)}), so turns cannot be "
                "appended as token deltas"
            )
        return after[later[len(ends) - 1] :]

    def opening_ids(self, prompt_ids: list[int], messages: list[dict[str, Any]], observation: str | None) -> list[int]:
        """The ids that open a trajectory of a run with an environment, after its prompt (``messages`` rendered
        without the generation prompt, as ``prompt_ids``): the environment's first observation as a user message
        (when its reset gave one), then the generation prompt.

        Raises:
            TemplateError: the template renders the prompt differently once a message follows it.
        """
        extra = [{"role": "user", "content": observation}] if observation else []
        after = self.ids([*messages, *extra], generation_prompt=True, observations_from=len(messages))
        if after[: len(prompt_ids)] != prompt_ids:
            raise TemplateError(
                "the chat template renders the prompt differently once the environment's first observation follows "
                f"it (first at position {first_difference(prompt_ids, after)}), so it cannot open the trajectory"
            )
        return after[len(prompt_ids) :]

    def shortened(self, text: str, tokens: int, side: str) -> str:
        """``text`` cut to its first (``side`` "left"), last ("right") or first and last ("middle", half each)
        ``tokens`` tokens (tokenised as text, as observations are), the cut marked "...(truncated)"; as it is when it is
        no longer."""
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if len(ids) <= tokens:
            return text
        decode = self.tokenizer.decode
        if side == "left":
            return decode(ids[:tokens]) + "...(truncated)"
        if side == "right":
            return "(truncated)..." + decode(ids[-tokens:])
        half = tokens // 2
        return decode(ids[:half]) + "...(truncated)..." + decode(ids[len(ids) - (tokens - half) :])

    def drift(self, messages: list[dict[str, Any]], ids: list[int], observations_from: int | None = None) -> str:
        """Where ``ids`` (a trajectory's prompt and response, token in / token out) stop matching the re-rendered
        ``messages`` (observations from index ``observations_from`` on, tokenised as text as they were); "" when they
        match. The re-render may run on past ``ids`` (the template closes the last turn)."""
        rendered = self.ids(messages, generation_prompt=False, observations_from=observations_from)
        at = first_difference(ids, rendered)
        if at is None or at == len(ids):
            return ""
        decode = self.tokenizer.decode
        lo = max(0, at - CONTEXT)
        return (
            f"token {at} of {len(ids)}: the trajectory has {decode(ids[at : at + 1])!r} where the re-rendered "
            f"conversation has {decode(rendered[at : at + 1])!r}; after {decode(ids[lo:at])!r} the trajectory "
            f"goes on {decode(ids[at : at + CONTEXT])!r}, the re-render {decode(rendered[at : at + CONTEXT])!r}"
        )

    def problems(self) -> list[str]:
        """Why this template cannot run trajectories: no template, tools it does not show, no tool role, not
        append-only, no eos at the end of an assistant turn."""
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        if not getattr(self.tokenizer, "chat_template", None):
            return [f"tools and environments need a chat template, and the tokenizer of {name} has none: add "
                    '"chat_template" to its tokenizer_config.json (or a chat_template.jinja beside it)']  # fmt: skip
        messages: list[dict[str, Any]] = [{"role": "tool", "content": "3"}] if self.tools else []
        messages.append({"role": "user", "content": "4"})
        try:
            self.observation_ids(messages)
        except TemplateError as exc:
            return [f"the chat template of {name}: {exc}"]
        except Exception as exc:  # noqa: BLE001 - a template failing on the stand-in is reported
            return [f"the chat template of {name} fails on tool or user messages after an assistant turn "
                    f"({type(exc).__name__}: {exc})"]  # fmt: skip
        bare = self.tokenizer.apply_chat_template(STAND_IN[:1], add_generation_prompt=True, tokenize=False)
        if self.tools and self.render(STAND_IN[:1], generation_prompt=True) == bare:
            return [f"the chat template of {name} ignores tools: the model would never see their schemas; use a "
                    "template that renders `tools` (as Qwen's and Llama's do)"]  # fmt: skip
        return []


def _ends(ids: list[int], token: int) -> list[int]:
    """The position just after each ``token`` in ``ids``, with 0 first (the position after none)."""
    return [0] + [i + 1 for i, value in enumerate(ids) if value == token]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter one's length if one is a prefix of the other,
    None if they are equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

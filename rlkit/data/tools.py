"""Tools: plain Python functions the model may call, their JSON schemas, and the parsers that find the calls.

A tool is a function with type hints and a Google-style docstring (an ``Args:`` line per parameter);
``transformers.utils.get_json_schema`` turns it into the schema that ``apply_chat_template(tools=...)``
renders, as the model's own chat template lays it out. A parser reads a model turn's text and returns
every call it holds, or why a call could not be read; :func:`run_tool` checks a call's arguments against
the schema and runs it. Functions travel to the workers by value (cloudpickle), like reward functions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the schema the chat template shows it."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters": {...}}}``."""
    method: bool = False
    """``fn`` is a method of the environment's class: a call runs it on the trajectory's own instance."""

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments: ``{"type": "object", "properties": {...}, "required": [...]}``."""
        return self.schema["function"].get("parameters", {"properties": {}})


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in a model turn: its name and arguments, or why it could not be read."""

    text: str
    """The call's text as the model wrote it (between the markers)."""
    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str = ""
    """Empty when the call was read; else what is wrong with it."""


def make_tools(
    functions: Sequence[Callable[..., Any]], methods: Sequence[Callable[..., Any]] = ()
) -> tuple[list[Tool], list[str]]:
    """The tools of ``functions`` and of an environment class's ``methods`` (``self`` is no parameter), and the
    problems found making their schemas (missing type hints or docstring lines, two tools of one name), each
    naming the function and the fix."""
    from transformers.utils import get_json_schema

    tools, problems = [], []
    for i, fn in enumerate([*functions, *methods]):
        label = getattr(fn, "__qualname__", None) or repr(fn)
        if not callable(fn):
            problems.append(f"tools[{i}] is a {type(fn).__name__}, not a function")
            continue
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # noqa: BLE001 - transformers' reason is what the user must read
            problems.append(
                f"tool {label}: no JSON schema from its signature and docstring ({type(exc).__name__}: {exc}); give "
                "every parameter a type hint and the docstring an Args: section with a line per parameter"
            )
            continue
        tools.append(Tool(schema["function"]["name"], fn, schema, method=i >= len(functions)))
    names = [t.name for t in tools]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        problems.append(f"tools: several tools are named {clashes}; the model calls a tool by name, so rename one")
    return tools, problems


def parse_hermes(text: str) -> list[ParsedCall]:
    """The calls of a Qwen/Hermes turn: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an
    unclosed ``<tool_call>`` is a call that could not be read."""
    calls = []
    for match in re.finditer(r"<tool_call>(.*?)(</tool_call>|$)", text, flags=re.DOTALL):
        body, closed = match.group(1).strip(), bool(match.group(2))
        calls.append(_read_call(body) if closed else ParsedCall(body, error="<tool_call> is never closed"))
    return calls


def parse_mistral(text: str) -> list[ParsedCall]:
    """The calls of a Mistral turn: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``."""
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return []
    body = text.split(marker, 1)[1].strip()
    try:
        values = json.JSONDecoder().raw_decode(body)[0]
    except json.JSONDecodeError as exc:
        return [ParsedCall(body, error=f"the calls are not JSON ({exc})")]
    if not isinstance(values, list):
        return [ParsedCall(body, error="expected a JSON list of calls after [TOOL_CALLS]")]
    return [_read_call(json.dumps(v)) for v in values]


TOOL_PARSERS: dict[str, Callable[[str], list[ParsedCall]]] = {"hermes": parse_hermes, "mistral": parse_mistral}
"""``agent.tool_parser`` -> the function that reads a model turn's calls."""


def _read_call(body: str) -> ParsedCall:
    """One call's JSON: ``{"name": str, "arguments": {...}}`` (``arguments`` may be a JSON string of the object)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedCall(body, error=f"the call is not JSON ({exc})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ParsedCall(body, error='the call is not an object with a "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ParsedCall(body, name=value["name"], error='"arguments" is a string that is not JSON')
    if not isinstance(arguments, dict):
        return ParsedCall(body, name=value["name"], error='"arguments" is not an object')
    return ParsedCall(body, name=value["name"], arguments=arguments)


def argument_problem(tool: Tool, arguments: dict[str, Any]) -> str:
    """Why ``arguments`` do not fit ``tool``'s schema (unknown or missing parameters), or ""."""
    properties = tool.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    missing = sorted(set(tool.parameters.get("required", [])) - set(arguments))
    if unknown or missing:
        return f"{tool.name} takes {sorted(properties)}: unknown {unknown}, missing {missing}"
    return ""


def result_text(value: Any) -> str:
    """A tool's return value as the text of its tool message: strings as they are, None as "" (a tool that only acts;
    ``rlkit.rollout.actions`` warns once per tool, in case its ``return`` was forgotten), the rest as JSON, else
    their ``str()``. Raises what that ``str()`` raises."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # not JSON, circular, too deep
        return str(value)

"""The error every config check reports into, and the check helper."""

from __future__ import annotations


class ConfigError(ValueError):
    """One or more settings are invalid; ``problems`` lists each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the config:\n{lines}")


def need(problems: list[str], ok: bool, message: str) -> None:
    """Append ``message`` to ``problems`` unless ``ok``."""
    if not ok:
        problems.append(message)

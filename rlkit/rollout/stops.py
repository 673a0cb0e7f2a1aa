"""Stop sequences beyond end-of-text: token ids, or strings matched in the decoded completion.

A completion is cut right after its first stop (the stop's own tokens kept, as Tinker and vLLM return them). Cutting
a finished sample is exact: the tokens before the cut were drawn from the same distributions as if sampling had
stopped there, since a token never depends on the ones after it. Only the compute past the stop is wasted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopSequences:
    """Where a completion ends besides end-of-text (which always ends it)."""

    tokens: frozenset[int] = frozenset()
    """Token ids: the completion ends with the first of them."""
    strings: tuple[str, ...] = ()
    """Strings: the completion ends with the first token whose text completes one of them."""

    @classmethod
    def parse(cls, stop: str | Sequence[str] | Sequence[int] | None, vocab_size: int) -> StopSequences:
        """From Tinker's ``SamplingParams.stop`` (a string, strings, or token ids); ValueError naming what is wrong."""
        items = [stop] if isinstance(stop, str) else list(stop or [])
        if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
            bad = [t for t in items if not 0 <= t < vocab_size]  # type: ignore[operator]
            if bad:
                raise ValueError(f"stop token ids {bad} are outside the vocabulary (0 to {vocab_size - 1})")
            return cls(tokens=frozenset(items))  # type: ignore[arg-type]
        if all(isinstance(s, str) and s for s in items):
            return cls(strings=tuple(items))  # type: ignore[arg-type]
        raise ValueError(f"stop={stop!r}: give token ids or non-empty strings, not a mix")

    def __bool__(self) -> bool:
        return bool(self.tokens or self.strings)

    def cut(self, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> int | None:
        """The length of the shortest prefix of ``tokens`` [T] that ends with a stop; None when none occurs."""
        ends = [i + 1 for i, t in enumerate(tokens) if t in self.tokens][:1]
        if self.strings and self._has_string(list(tokens), decode):
            low, high = 1, len(tokens)  # the text of a longer prefix contains that of a shorter one
            while low < high:
                mid = (low + high) // 2
                low, high = (low, mid) if self._has_string(list(tokens[:mid]), decode) else (mid + 1, high)
            ends.append(low)
        return min(ends) if ends else None

    def _has_string(self, tokens: list[int], decode: Callable[[list[int]], str]) -> bool:
        text = decode(tokens)
        return any(s in text for s in self.strings)

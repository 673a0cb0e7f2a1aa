"""A reward file named from TOML: ``[[rewards]] function = "rewards/addition.py:correct"``.

Any function ``fn(prompts, completions, **fields) -> list[float]`` works; the dataset's ``answer``
column arrives as the keyword argument ``answer`` (one entry per completion).
"""


def correct(prompts: list[str], completions: list[str], *, answer: list[str], **fields: object) -> list[float]:
    """1.0 where the completion, up to the end-of-text marker, is the reference answer, else 0.0."""
    return [float(c.split("<|endoftext|>")[0].strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

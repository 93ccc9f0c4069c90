"""Rewards for examples/grpo-planet-colours.yaml, in TRL's signature: f(prompts, completions,
**columns) -> one float per completion. `colour` is the prompt record's column of that name: the
planet's colour, which the prompt's scout report states beside its moon's (another colour)."""

from featherweight.data.demo_task import first_colour


def _text(completion) -> str:
    """A completion's text: a string, or TRL's [{"role": "assistant", "content": ...}]."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def planet_colour(prompts, completions, colour, **kwargs) -> list[float]:
    """1.0 when the first colour the completion names is the planet's (as its report states; the
    moon's colour, or none, is 0.0)."""
    return [
        float(first_colour(_text(c)) == want) for c, want in zip(completions, colour, strict=True)
    ]


def names_a_colour(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion names any colour at all: a small shaping reward (weight 0.2 in the
    walk) for a base model that often answers without one."""
    return [float(first_colour(_text(c)) is not None) for c in completions]

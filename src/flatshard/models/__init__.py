"""Built-in models for the demo, tests and benchmarks."""

from flatshard.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "PRESETS", "GPTConfig"]

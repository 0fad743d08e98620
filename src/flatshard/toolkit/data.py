"""A synthetic corpus that a small model can actually learn, reproducible per (step, rank).

Tokens follow a random first-order Markov chain in which every token has ``branching``
possible successors with fixed, skewed probabilities. Every row has the same
probabilities, so the best achievable loss (the chain's entropy rate) is exactly the
entropy of those probabilities, far below the uniform-guess baseline ``ln(vocab_size)``.
"""

from __future__ import annotations

import math

import torch


class SyntheticCorpus:
    def __init__(self, vocab_size: int, seq_len: int, *, branching: int = 4, seed: int = 1234) -> None:
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size={vocab_size}], got {branching}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        weights = torch.tensor([2.0**-i for i in range(branching)])
        self.probs = weights / weights.sum()  # shared by every row
        self.successors = torch.stack(
            [torch.randperm(vocab_size, generator=gen)[:branching] for _ in range(vocab_size)]
        )

    @property
    def entropy_rate(self) -> float:
        """Nats per token of the best possible predictor (the loss floor)."""
        return float(-(self.probs * self.probs.log()).sum())

    @property
    def uniform_loss(self) -> float:
        """Nats per token of guessing uniformly: ``ln(vocab_size)``."""
        return math.log(self.vocab_size)

    def batch(self, step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both ``(batch_size, seq_len)`` int64.

        Deterministic in (seed, step, rank): the data position of a run is just its step.
        """
        gen = torch.Generator().manual_seed(hash((self.seed, step, rank)) & (2**62 - 1))
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=gen)
        choice = torch.multinomial(self.probs, batch_size * self.seq_len, replacement=True, generator=gen)
        choice = choice.view(batch_size, self.seq_len)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


class ByteCorpus:
    """A text file as byte-level tokens (vocabulary 256): each sequence is a window of the
    file at a place drawn from (seed, step, rank), so the data position of a run is its step."""

    vocab_size = 256

    def __init__(self, path: str, seq_len: int, *, seed: int = 1234) -> None:
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < seq_len + 2:
            raise ValueError(f"{path} has {len(raw)} bytes: too short for sequences of {seq_len} tokens")
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.seed = seed

    @property
    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)

    entropy_rate = None  # unknown for real text

    def batch(self, step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(hash((self.seed, step, rank)) & (2**62 - 1))
        starts = torch.randint(len(self.tokens) - self.seq_len - 1, (batch_size,), generator=gen)
        window = torch.arange(self.seq_len + 1)
        tokens = self.tokens[starts[:, None] + window]
        return tokens[:, :-1], tokens[:, 1:]

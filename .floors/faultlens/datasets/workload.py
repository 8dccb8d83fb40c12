"""Training workload: heavy-tailed sequence lengths packed into micro-batches.

With sequence packing every micro-batch holds the same number of tokens, but
attention costs grow with the *square* of each sequence's length, so two
micro-batches of equal size can take very different times (ResiHP's point).
Lengths are log-normal (mean ``mean_len``), clipped to the context length,
and packed back to back into fixed token budgets; a sequence that crosses a
budget boundary is split there (the usual packing with truncation), so every
micro-batch has exactly ``tokens_per_microbatch`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    mean_len: float = 700.0
    sigma: float = 1.4  # log-normal shape: larger = heavier tail
    context_len: int = 8192
    tokens_per_microbatch: int = 8192


@dataclass(frozen=True)
class MicroBatches:
    """Per-micro-batch workload, all arrays of the same length."""

    n_seqs: np.ndarray
    sum_len: np.ndarray
    sum_len_sq: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)

    def reshape(self, *shape: int) -> MicroBatches:
        return MicroBatches(*(a.reshape(shape) for a in (self.n_seqs, self.sum_len, self.sum_len_sq, self.tokens)))


def draw_lengths(rng: np.random.Generator, n: int, spec: WorkloadSpec, mean_len: float | None = None) -> np.ndarray:
    """``n`` sequence lengths (int64), log-normal with the requested mean, clipped to [1, context_len]."""
    mean = spec.mean_len if mean_len is None else mean_len
    mu = np.log(mean) - spec.sigma**2 / 2
    lens = np.exp(rng.normal(mu, spec.sigma, n))
    return np.clip(np.rint(lens), 1, spec.context_len).astype(np.int64)


def pack(rng: np.random.Generator, n_microbatches: int, spec: WorkloadSpec,
         mean_len: float | None = None) -> MicroBatches:
    """Draw sequences and pack them into ``n_microbatches`` micro-batches of fixed token budget.

    ``mean_len`` overrides the spec's mean (a surge of long sequences).
    """
    budget = spec.tokens_per_microbatch
    total = n_microbatches * budget
    mean = float(spec.mean_len if mean_len is None else mean_len)
    n_draw = int(total / min(mean, spec.context_len) * 1.3) + 64
    lens = draw_lengths(rng, n_draw, spec, mean)
    while lens.sum() < total:
        lens = np.concatenate([lens, draw_lengths(rng, n_draw // 4 + 64, spec, mean)])
    ends = np.cumsum(lens)
    keep = np.searchsorted(ends, total) + 1
    ends = ends[:keep]
    ends[-1] = total
    # cut points: sequence ends and micro-batch boundaries; each piece is one (part of a) sequence
    cuts = np.union1d(ends, np.arange(budget, total + 1, budget, dtype=np.int64))
    starts = np.concatenate([[0], cuts[:-1]])
    piece = cuts - starts
    mb = starts // budget
    n_seqs = np.bincount(mb, minlength=n_microbatches).astype(np.int64)
    sum_len = np.bincount(mb, weights=piece, minlength=n_microbatches).astype(np.int64)
    sum_len_sq = np.bincount(mb, weights=piece.astype(np.float64) ** 2, minlength=n_microbatches).astype(np.int64)
    return MicroBatches(n_seqs=n_seqs, sum_len=sum_len, sum_len_sq=sum_len_sq, tokens=sum_len.copy())

"""Deterministic data: every replica reads a disjoint slice of each step's global batch, the same in every run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ntp_ds.batch.planner import BatchPlan

IGNORE_INDEX = -100


@dataclass
class SyntheticTokens:
    """A seeded generated language: a Markov chain over the vocabulary that a tiny model learns within a few steps.

    The next token is the current one plus one of `branching` seeded offsets (mod vocab_size), taken with
    probabilities 1/2, 1/4, ... (the last two share the rest), so the next-token entropy is under 2 bits whatever
    the vocabulary: the loss falls from ln(vocab_size) towards it as the model learns. A sample is a cumulative sum
    of offsets, drawn in one go from (seed, index), so any replica can read any sample, quickly at any length.
    `branching=0` gives uniform random tokens (nothing to learn).
    """

    vocab_size: int
    seq_len: int
    size: int = 4096
    seed: int = 0
    branching: int = 4

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self._offsets = torch.randperm(self.vocab_size, generator=g)[:max(self.branching, 1)]
        weights = [2.0 ** -min(k + 1, self.branching - 1) for k in range(self.branching)]
        self._probs = torch.tensor(weights or [1.0])

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        if self.branching == 0 or self.seq_len == 1:
            ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=g)
        else:
            start = torch.randint(0, self.vocab_size, (1,), generator=g)
            choices = torch.multinomial(self._probs, self.seq_len - 1, replacement=True, generator=g)
            ids = torch.cat([start, start + self._offsets[choices].cumsum(0)]) % self.vocab_size
        return {"input_ids": ids, "labels": ids.clone()}


def counted_tokens(labels: torch.Tensor) -> int:
    """Tokens that enter the loss: labels are shifted by one inside the model, and IGNORE_INDEX is skipped."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: every input bit flips about half of the output bits."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class FeistelPermutation:
    """A seeded bijection of [0, size), computed per index in O(1) memory.

    A balanced Feistel network permutes [0, 4**h), the smallest power of four >= size; an index it sends past the
    end is sent through again (cycle walking) until it lands inside: the walk follows the index's cycle, which comes
    back into [0, size), so the result is a bijection of [0, size). About 4 walks at worst on average, since
    4**h < 4 * size.
    """

    size: int
    key: int
    rounds: int = 6

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size={self.size} must be at least 1")

    @property
    def _half_bits(self) -> int:
        return max(1, ((self.size - 1).bit_length() + 1) // 2)

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} outside [0, {self.size})")
        x = self._encrypt(index)
        while x >= self.size:
            x = self._encrypt(x)
        return x

    def _encrypt(self, x: int) -> int:
        half = self._half_bits
        mask = (1 << half) - 1
        left, right = x >> half, x & mask
        for r in range(self.rounds):
            round_key = _mix64((self.key + (r + 1) * 0x9E3779B97F4A7C15) & _MASK64)
            left, right = right, left ^ (_mix64(right ^ round_key) & mask)
        return (left << half) | right


class GlobalBatchSampler:
    """Sample indices of step s's global batch: a seeded permutation per epoch, read in order.

    The permutation is a `FeistelPermutation` keyed by (seed, epoch), computed per index: no per-epoch table, so
    a token file of billions of samples costs no memory, and any position (a resume, a recovery) is read directly.
    """

    def __init__(self, dataset_size: int, seed: int = 0):
        self.dataset_size, self.seed = dataset_size, seed

    def permutation(self, epoch: int) -> FeistelPermutation:
        key = _mix64((_mix64(self.seed & _MASK64) + epoch) & _MASK64)
        return FeistelPermutation(self.dataset_size, key)

    def indices(self, step: int, global_samples: int, start: int = 0) -> list[int]:
        """Indices of the `global_samples` samples that follow sample number `start + step * global_samples`."""
        first = start + step * global_samples
        out, perms = [], {}
        for pos in range(first, first + global_samples):
            epoch, i = divmod(pos, self.dataset_size)
            if epoch not in perms:
                perms[epoch] = self.permutation(epoch)
            out.append(perms[epoch](i))
        return out


def replica_micro_batches(dataset, sampler: GlobalBatchSampler, plan: BatchPlan, replica: int,
                          step: int) -> Iterator[dict]:
    """Yield replica `replica`'s micro-batches for `step`, each carrying the global batch's counted token count.

    The count lets the engine weight every micro-batch by its tokens, so the update is the token-weighted mean over
    the whole global batch whatever the split between replicas.
    """
    idx = sampler.indices(step, plan.global_samples)
    global_tokens = sum(counted_tokens(dataset[i]["labels"]) for i in idx)
    part = plan.replicas[replica]
    pos = part.offset
    for size in part.micro_sizes:
        items = [dataset[i] for i in idx[pos:pos + size]]
        pos += size
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batch["global_tokens"] = global_tokens
        yield batch

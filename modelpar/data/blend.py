"""Blends: windows drawn from several datasets with given weights, deterministic, dp-sharded and resumable.

    blend = Blend.of([("data/web", 0.7), ("data/code", 0.3)])
    windows, sampler = open_blend(blend, vocab_size, seq_len, global_batch=32, dp_rank=r, dp_size=dp, seed=0)
    inputs, targets = windows.batch(sampler.next_batch())

One epoch of a blend is ``N = n_1 + ... + n_k`` windows (``n_i`` the windows of dataset ``i``), of which dataset
``i`` supplies ``q_i``: its weight's share of ``N``, rounded so the quotas sum to ``N`` (largest remainder), so
the realised weights are within ``1/N`` of the asked ones. Dataset ``i``'s windows come from its own endless
stream of seeded permutations, one per pass over it, read on from epoch to epoch: a small dataset with a large
weight repeats (a pass per ``n_i`` windows), a large one with a small weight is walked through over several
epochs. The ``N`` picks are then shuffled together by the epoch's seed, and :class:`WindowSampler` cuts them
into global batches and dp slices exactly as for one file::

    dataset 0 (n=6, q=4)   stream 3 0 5 1 | 4 2 ...        epoch 0 takes 3 0 5 1, epoch 1 takes 4 2 + next pass
    dataset 1 (n=4, q=6)   stream 2 1 3 0 2 0 | 1 3 ...    (upsampled: a second pass within the epoch)
    epoch order            shuffle(picks of 0 + picks of 1), then global batches as in WindowSampler
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modelpar.data.prepare import PreparedInfo, tokenizer_for
from modelpar.data.sampler import WindowSampler
from modelpar.data.shards import WindowSet, open_dataset, read_manifest
from modelpar.data.token_file import DataError


@dataclass(frozen=True)
class Blend:
    """Datasets (a token file or shard directory each) and their sampling weights (any positive scale)."""

    parts: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, parts: Sequence[tuple[str, float]]) -> Blend:
        parts = tuple((str(path), float(weight)) for path, weight in parts)
        check_weights([w for _, w in parts], "blend")
        return cls(parts)

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self.parts]

    @property
    def weights(self) -> list[float]:
        return [w for _, w in self.parts]

    def __str__(self) -> str:
        return "blend of " + ", ".join(f"{path} (weight {weight:g})" for path, weight in self.parts)


def check_weights(weights: Sequence[float], name: str) -> None:
    """One line naming the first weight that is negative or not finite, or a sum of zero."""
    if not weights:
        raise DataError(f"{name} lists no datasets; give at least one {{path, weight}}")
    for i, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise DataError(f"{name}[{i}].weight={w} must be a finite number >= 0")
    if sum(weights) <= 0:
        raise DataError(f"{name} weights sum to 0; give at least one dataset a positive weight")


def quotas(weights: Sequence[float], total: int) -> list[int]:
    """Integers summing to ``total`` in the proportions of ``weights`` (largest remainder; ties to the first)."""
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))[: total - sum(out)]:
        out[i] += 1
    return out


class BlendSampler(WindowSampler):
    """A :class:`WindowSampler` over a blend's epochs: indices into the datasets' windows numbered one after
    another (dataset ``i``'s from ``offsets[i]``), ``quotas[i]`` of them from dataset ``i`` per epoch."""

    def __init__(
        self,
        dataset_windows: Sequence[int],
        weights: Sequence[float],
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        check_weights(list(weights), "blend")
        self.dataset_windows = [int(n) for n in dataset_windows]
        super().__init__(sum(self.dataset_windows), global_batch, dp_rank, dp_size, seed)
        self.quotas = quotas(list(weights), self.num_windows)
        self.offsets = np.concatenate([[0], np.cumsum(self.dataset_windows)[:-1]]).astype(np.int64)

    def epoch_order(self, epoch: int, seed: int | None = None) -> np.ndarray:
        seed = self.seed if seed is None else seed
        if self._order_key != (seed, epoch):
            picks = [self._picks(i, epoch, seed) for i in range(len(self.quotas))]
            order = np.concatenate(picks)
            self._order = order[np.random.default_rng([seed, epoch]).permutation(len(order))]
            self._order_key = (seed, epoch)
        return self._order

    def _picks(self, dataset: int, epoch: int, seed: int) -> np.ndarray:
        """Dataset ``dataset``'s windows of ``epoch``: positions ``epoch*q .. epoch*q + q - 1`` of its stream."""
        n, q = self.dataset_windows[dataset], self.quotas[dataset]
        start, stop = epoch * q, (epoch + 1) * q
        pieces = []
        for lap in range(start // n, -(-stop // n)):  # the passes over the dataset this epoch touches
            order = np.random.default_rng([seed, dataset + 1, lap]).permutation(n)
            pieces.append(order[max(start - lap * n, 0) : min(stop - lap * n, n)])
        return np.concatenate(pieces).astype(np.int64) + self.offsets[dataset] if pieces else np.empty(0, np.int64)

    def dataset_of(self, indices: np.ndarray) -> np.ndarray:
        """Which dataset each window index belongs to."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1

    def _composition(self) -> list[list[int]]:
        return [[n, q] for n, q in zip(self.dataset_windows, self.quotas, strict=True)]

    def state_dict(self) -> dict:
        return super().state_dict() | {"blend": self._composition()}

    def load_state_dict(self, state: dict) -> None:
        mine = self._composition()
        if state.get("blend") != mine:
            raise DataError(
                f"the saved run sampled a blend of (windows, quota) {state.get('blend')} but this run's is {mine}; "
                "resume with the same data.blend, data.seq_len and weights"
            )
        super().load_state_dict(state)


def tokenizer_fingerprint_of(path: str | Path) -> str | None:
    """What identifies the tokenizer of a token file or shard directory (None: a bare ``.npy`` says nothing)."""
    path = Path(path)
    if path.is_dir():
        return read_manifest(path)["tokenizer"]["fingerprint"]
    if not PreparedInfo.sidecar_path(path).is_file():
        return None
    return tokenizer_for(path).fingerprint


def open_blend(blend: Blend, vocab_size: int, seq_len: int) -> tuple[WindowSet, list[int]]:
    """The blend's datasets as one :class:`WindowSet` and each one's window count; refuses mixed tokenizers."""
    seen: dict[str, str] = {}
    for path in blend.paths:
        fingerprint = tokenizer_fingerprint_of(path)
        if fingerprint is not None:
            seen.setdefault(fingerprint, path)
    if len(seen) > 1:
        (a_fp, a), (b_fp, b) = list(seen.items())[:2]
        raise DataError(
            f"data.blend mixes tokenizers: {a} ({a_fp}) and {b} ({b_fp}); prepare every dataset with the same tokenizer"
        )
    datasets = [open_dataset(path, vocab_size, seq_len) for path in blend.paths]
    parts = [part for d in datasets for part in (d.parts if isinstance(d, WindowSet) else (d,))]
    return WindowSet.of(str(blend), parts), [d.num_windows for d in datasets]

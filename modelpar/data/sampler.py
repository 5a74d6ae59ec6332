"""WindowSampler: which windows each data-parallel rank trains on, resumable mid-epoch.

Every rank computes the same global order (a permutation seeded by ``(seed, epoch)``) and takes its own
contiguous slice of each global batch::

    epoch order    7 2 9 0 | 4 1 8 5 | 3 6          10 windows, global_batch = 4, dp = 2
    step 0         [7 2 | 9 0]        rank 0: 7 2   rank 1: 9 0
    step 1         [4 1 | 8 5]        rank 0: 4 1   rank 1: 8 5
    (3 6 are dropped: an incomplete global batch would change the loss scale)

So the union of the ranks' slices, in rank order, is exactly the dp=1 batch: dp only splits the work of a
step and never changes which tokens it sees, which is what lets dp=2 gradients equal dp=1's. The state is
a position in that global order, so a run can also resume with a different dp.
"""

from __future__ import annotations

import hashlib

import numpy as np

from modelpar.data.token_file import DataError


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DataError(f"{name}={value!r} must be an integer >= {minimum}")


class WindowSampler:
    """Deterministic, dp-sharded, resumable order over ``num_windows`` windows.

    Step ``k`` of an epoch is ``order[k*global_batch : (k+1)*global_batch]`` of that epoch's order; dp rank
    ``r`` gets the ``r``-th of ``dp_size`` equal contiguous slices. ``shuffle=False`` keeps the windows in
    file order (evaluation).
    """

    def __init__(
        self,
        num_windows: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_int("num_windows", num_windows, 1)
        _check_int("global_batch", global_batch, 1)
        _check_int("dp_size", dp_size, 1)
        _check_int("seed", seed, 0)
        if global_batch > num_windows:
            raise DataError(
                f"global_batch={global_batch} windows exceeds the {num_windows} windows in the data; "
                "lower the batch size, shorten seq_len or add data"
            )
        if global_batch % dp_size:
            nearby = [b for b in (global_batch // dp_size * dp_size, (global_batch // dp_size + 1) * dp_size) if b]
            raise DataError(
                f"global_batch={global_batch} is not divisible by dp={dp_size}; try {' or '.join(map(str, nearby))}"
            )
        if not (isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            raise DataError(f"dp_rank={dp_rank!r} must be in 0..{dp_size - 1}")
        self.num_windows, self.global_batch = num_windows, global_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.step_in_epoch = 0, 0
        self._order_key: tuple[int, int] | None = None
        self._order = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows // self.global_batch

    @property
    def local_batch(self) -> int:
        """Windows per step on this dp rank: ``global_batch / dp_size``."""
        return self.global_batch // self.dp_size

    def epoch_order(self, epoch: int, seed: int | None = None) -> np.ndarray:
        """The global order of ``epoch``: ``order: [num_windows]`` int64, the same on every rank."""
        seed = self.seed if seed is None else seed
        if self._order_key != (seed, epoch):
            if self.shuffle:
                self._order = np.random.default_rng([seed, epoch]).permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows, dtype=np.int64)
            self._order_key = (seed, epoch)
        return self._order

    def next_batch(self) -> np.ndarray:
        """This rank's window indices for the next step: ``[global_batch / dp_size]`` int64."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        start = self.step_in_epoch * self.global_batch + self.dp_rank * self.local_batch
        self.step_in_epoch += 1
        return self.epoch_order(self.epoch)[start : start + self.local_batch].copy()

    def _order_digest(self, epoch: int, seed: int) -> str:
        return hashlib.sha256(self.epoch_order(epoch, seed).tobytes()).hexdigest()[:16]

    def state_dict(self) -> dict:
        """JSON-serialisable position in the global order; dp rank and size are not part of it."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_windows": self.num_windows,
            "global_batch": self.global_batch,
            "order_digest": self._order_digest(self.epoch, self.seed),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next batch is the one the saved run would have taken next."""
        for name in ("num_windows", "global_batch", "shuffle"):
            if state[name] != getattr(self, name):
                raise DataError(
                    f"the saved sampler has {name}={state[name]} but this run has {getattr(self, name)}; "
                    "resume with the same data, seq_len and global batch"
                )
        if not 0 <= state["step_in_epoch"] <= self.steps_per_epoch:
            raise DataError(f"saved step_in_epoch={state['step_in_epoch']} is outside 0..{self.steps_per_epoch}")
        # The order is recomputed, not saved; a numpy whose random stream changed would silently reorder.
        if state["order_digest"] != self._order_digest(state["epoch"], state["seed"]):
            raise DataError(
                f"epoch {state['epoch']} shuffles differently than in the saved run (numpy changed its random "
                "stream?); resume with the numpy version that wrote the checkpoint"
            )
        self.seed, self.epoch, self.step_in_epoch = state["seed"], state["epoch"], state["step_in_epoch"]

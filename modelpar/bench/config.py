"""The ``modelpar-bench`` recipe schema: a training recipe plus ``bench.*``, checked before any rank starts.

``recipes/bench.yaml`` lists ``modelpar_bench_schema`` first in its defaults; ``register_bench_schema()``
stores it with Hydra (``modelpar-bench`` calls it before composing, as a script composing ``bench`` must).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from modelpar.training.config import TrainConfig


@dataclass
class BenchOptions:
    sweep: list[str] = field(default_factory=list)  # layout specs (``parse_layout``); empty: the recipe's layout
    warmup: int = 1  # untimed steps of each side before the measured ones
    rounds: int = 4  # ours, peer, ours, peer ...
    steps_per_round: int = 2
    passes: int = 1  # sweep the layouts this many times round-robin; steps of every pass pool into one median
    peer: bool = True
    peer_partition: str = "same"  # same: the peer runs our layer split; uniform: torch users' even split
    peak_tflops: float = 0.0  # per rank; 0: measure a one-thread fp32 matmul
    results_dir: str = ""  # empty: the run's directory (a multirun's sweep directory); or a path: benchmarks/results
    name: str = "bench"  # file stem of the results
    profile_rank: int = -1  # >= 0: cProfile the timed steps (ours, the peer) on this rank: <name>_profile_*.txt
    # one more step with every collective wait timed: each kind's waited (exposed) seconds and count, per rank
    trace_comm: bool = False
    timeout_s: float = 1800.0


@dataclass
class BenchRecipe(TrainConfig):
    """A training recipe plus the benchmark's own options (``bench.*``)."""

    bench: BenchOptions = field(default_factory=BenchOptions)


def register_bench_schema() -> None:
    """Register the schema with Hydra's ConfigStore as ``modelpar_bench_schema``."""
    ConfigStore.instance().store(name="modelpar_bench_schema", node=BenchRecipe)


def check_options(opts: BenchOptions) -> None:
    """Refuse impossible ``bench.*`` values with one line naming the fix, before any rank starts."""
    if opts.peer_partition not in ("same", "uniform"):
        raise ValueError(f"bench.peer_partition={opts.peer_partition!r} must be 'same' or 'uniform'")
    for name in ("rounds", "steps_per_round", "passes"):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"bench.{name}={value!r} must be a whole number >= 1 (nothing would be timed)")
    if isinstance(opts.warmup, bool) or not isinstance(opts.warmup, int) or opts.warmup < 1:
        raise ValueError(
            f"bench.warmup={opts.warmup!r} must be a whole number >= 1: each side's first step is always untimed"
        )
    if not opts.peak_tflops >= 0:
        raise ValueError(f"bench.peak_tflops={opts.peak_tflops!r} must be > 0 TFLOP/s per rank, or 0 to measure it")
    if not opts.timeout_s > 0:
        raise ValueError(f"bench.timeout_s={opts.timeout_s!r} must be > 0 seconds")
    if isinstance(opts.profile_rank, bool) or not isinstance(opts.profile_rank, int) or opts.profile_rank < -1:
        raise ValueError(f"bench.profile_rank={opts.profile_rank!r} must be a rank (>= 0), or -1 for no profile")
    if not opts.name or any(c in opts.name for c in "/\\"):
        raise ValueError(f"bench.name={opts.name!r} must be a plain file stem, e.g. bench_mine")

"""modelpar-bench: layout benchmarks of the trainer's step, raced run by run against PyTorch's own parallelism.

    modelpar-bench                                     # recipes/bench.yaml: bench-tiny, the default sweep
    modelpar-bench bench.sweep='[tp2,pp2-1f1b]' bench.rounds=3
    modelpar-bench -m parallel=single,tp2,pp2,tp2-pp2  # one layout per Hydra job; the rows merge
    modelpar-bench bench.peak_tflops=989 trainer.device=cuda ...   # MFU against a GPU's peak

Results go to the run's directory (``runs/bench/<time>``; a multirun's sweep directory, where its jobs' rows
merge) and every file written is printed; ``bench.results_dir=benchmarks/results`` updates the committed
results. What is measured: ``modelpar.bench.harness``. An unknown key (``bench.roundz=3``) is refused in one line.
A bad ``bench.*`` value, layout or data file is one line on stderr and exit status 2, before any rank starts.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from modelpar.bench.config import BenchRecipe, register_bench_schema
from modelpar.bench.harness import run
from modelpar.cli.overrides import refuse_unknown_overrides
from modelpar.training.config import RECIPES


def _recipe_layout_requested() -> bool:
    """A multirun, or a ``parallel=`` group on the command line, without ``bench.sweep=``: bench that layout."""
    hydra_cfg = HydraConfig.get()
    task = list(hydra_cfg.overrides.task)
    if any(o.lstrip("+~").startswith("bench.sweep=") for o in task):
        return False
    return hydra_cfg.mode == RunMode.MULTIRUN or any(o.startswith("parallel=") for o in task)


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="bench")
def _app(dcfg: DictConfig) -> None:
    cfg: BenchRecipe = OmegaConf.to_object(dcfg)
    if _recipe_layout_requested():
        cfg.bench.sweep = []
    if not cfg.bench.results_dir:  # the run's own directory; a multirun's jobs share the sweep's, so rows merge
        hydra_cfg = HydraConfig.get()
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        cfg.bench.results_dir = hydra_cfg.sweep.dir if multirun else hydra_cfg.runtime.output_dir
    try:
        run(cfg)
    except ValueError as exc:
        print(f"modelpar-bench: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def main() -> None:
    refuse_unknown_overrides("modelpar-bench", BenchRecipe, RECIPES)
    register_bench_schema()
    _app()


if __name__ == "__main__":
    main()

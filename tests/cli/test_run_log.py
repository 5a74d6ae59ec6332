"""A run directory holds no empty Hydra job log: the engine prints, it does not use logging."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from modelpar.training.config import RECIPES, register_schema


def test_the_recipes_write_no_job_log_file():
    register_schema()
    for name in ("train", "eval"):
        with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
            cfg = compose(name, return_hydra_config=True)
        handlers = cfg.hydra.job_logging.get("handlers") or {}
        assert not any("filename" in h for h in handlers.values()), (name, handlers)

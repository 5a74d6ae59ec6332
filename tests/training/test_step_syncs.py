"""A steady training step reads the device back to the host once: loss, norm and the plug-ins' values together,
in the step's read-back, nothing else.

On CPU nothing truly waits, so the calls that would sync on a GPU are counted (``count_host_syncs``). torch's
own non-fused AdamW reads its step counters with ``.item()`` on CPU tensors (``via`` torch/optim); on a GPU it
keeps them on the host, so only calls made by modelpar's code count here.
"""

from __future__ import annotations

import pytest

from modelpar.bench.host_syncs import count_host_syncs
from modelpar.testing import run_on_ranks
from tests.helpers import make_config


def _syncs_of_steady_step(cfg, data_path: str) -> list[str]:
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    trainer.train_step()  # the first step builds optimizer state and buffers
    with count_host_syncs() as log:
        trainer.train_step()
    return [str(s) for s in log.syncs if s.via is None]


@pytest.mark.parametrize(
    "parallel, optim",
    [
        ({}, {}),
        ({"tp": 2, "pp": 2, "microbatches": 4}, {}),
        ({"pp": 2, "dp": 2, "schedule": "zb-h1", "microbatches": 2}, {"zero": 1}),
        ({"dp": 4, "microbatches": 1}, {}),  # with the replicas' gradient-outlier check on (dp >= 3)
    ],
    ids=["single", "tp2-pp2", "dp2-pp2-zb-zero1", "dp4-outlier-check"],
)
def test_a_steady_step_has_one_host_sync(parallel, optim, token_path, tmp_path):
    from dataclasses import replace

    cfg = make_config(tmp_path, **parallel)
    cfg = replace(cfg, optim=replace(cfg.optim, **optim), trainer=replace(cfg.trainer, check_every=0))
    world = cfg.parallel.layout().world_size
    for rank, syncs in enumerate(run_on_ranks(world, _syncs_of_steady_step, cfg, token_path, timeout_s=120)):
        assert len(syncs) == 1, f"rank {rank}: {syncs}"
        assert "training/readback.py" in syncs[0], f"rank {rank}: {syncs}"

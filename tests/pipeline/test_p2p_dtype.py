"""Activations and their gradients cross pipeline stages in the compute dtype: bf16 under bf16 autocast."""

from __future__ import annotations

from dataclasses import replace

import pytest

from modelpar.testing import run_on_ranks
from tests.helpers import make_config


def _p2p_bytes_and_loss(cfg, data_path: str) -> tuple[dict, float]:
    import torch.distributed as dist

    from modelpar.pipeline import runtime as runtime_module
    from modelpar.training.trainer import Trainer

    sent: dict[str, int] = {}
    post = dist.batch_isend_irecv

    def counting(ops):
        for op in ops:
            if op.op is dist.isend:
                key = str(op.tensor.dtype)
                sent[key] = sent.get(key, 0) + op.tensor.numel() * op.tensor.element_size()
        return post(ops)

    runtime_module.dist.batch_isend_irecv = counting
    try:
        metrics = Trainer(cfg, data_path, None).train_step()
    finally:
        runtime_module.dist.batch_isend_irecv = post
    return sent, metrics.loss


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_runs_send_half_the_bytes_of_fp32_and_train_alike(schedule, token_path, tmp_path):
    # native collectives: the exchange ones would post their own isend/irecv, which are not pipeline traffic
    base = make_config(tmp_path, pp=2, schedule=schedule, microbatches=2, collectives="native")
    runs = {}
    for dtype in ("fp32", "bf16"):
        cfg = replace(base, trainer=replace(base.trainer, dtype=dtype, check_every=0))
        runs[dtype] = run_on_ranks(2, _p2p_bytes_and_loss, cfg, token_path, timeout_s=120)
    for rank in range(2):
        fp32_sent, fp32_loss = runs["fp32"][rank]
        bf16_sent, bf16_loss = runs["bf16"][rank]
        assert set(fp32_sent) == {"torch.float32"} and set(bf16_sent) == {"torch.bfloat16"}, (fp32_sent, bf16_sent)
        assert bf16_sent["torch.bfloat16"] * 2 == fp32_sent["torch.float32"]
        assert abs(bf16_loss - fp32_loss) < 2e-2 * abs(fp32_loss)  # bf16 rounding only

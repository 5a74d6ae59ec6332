"""Latent attention (model.mla) trains what the single-device run trains through the real step: pipeline stages
(pp2 with tp2 + sp, partial sums of the replicated down-projections summed by the optimizer's finalisation) and
cp2 under pp2 with selective recompute; losses, gradient norms and parameters after every step."""

from dataclasses import replace

import numpy as np
import pytest

from modelpar.model.config import MLAConfig
from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError, validate
from tests.helpers import TINY, assemble, assert_matches_reference, make_config, train_and_collect

MODEL = replace(
    TINY,
    kv_heads=TINY.heads,
    mla=MLAConfig(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
)


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return str(path)


def configure(tmp_path, **layout):
    cfg = make_config(tmp_path, **layout)
    # eps: see tests/training/test_context_parallel
    return replace(cfg, model=MODEL, optim=replace(cfg.optim, eps=1e-6))


@pytest.fixture(scope="module")
def reference(token_path, tmp_path_factory):
    (result,) = run_on_ranks(1, train_and_collect, configure(tmp_path_factory.mktemp("ref")), token_path)
    return result[0], assemble([result])


@pytest.mark.parametrize(
    "layout",
    [dict(pp=2, tp=2, sp=True), dict(pp=2, cp=2, cp_comm="allgather", recompute="selective")],
    ids=["pp2-tp2-sp", "pp2-cp2-allgather-selective"],
)
def test_latent_attention_trains_the_single_device_run(layout, token_path, reference, tmp_path):
    cfg = configure(tmp_path, **layout)
    validate(cfg)
    results = run_on_ranks(4, train_and_collect, cfg, token_path)
    assert_matches_reference(results, reference, layout)


def test_head_exchange_is_refused_for_latent_attention(tmp_path):
    with pytest.raises(RecipeError, match=r"parallel\.cp_comm=alltoall exchanges heads.*use parallel\.cp_comm=ring"):
        validate(configure(tmp_path, cp=2, cp_comm="alltoall"))

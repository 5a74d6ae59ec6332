"""A model with YaRN-scaled RoPE and q, k, v and o_proj biases trains what the single-device run trains through the
real step (tp2 x pp2 with sp, the o_proj bias's partial gradients summed by the optimizer's finalisation; cp2 x dp2
under ZeRO-3), and its checkpoint, which records the scaling and the biases, resumes onto the uninterrupted run."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.checkpoint.store import read_index
from modelpar.model.config import ModelConfig
from modelpar.model.rope import RopeScaling
from modelpar.testing import run_on_ranks
from modelpar.training.config import validate
from tests.helpers import TINY, assemble, assert_matches_reference, make_config, train_and_collect

YARN = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=4, mscale=0.8, mscale_all_dim=1.0)
MODEL = replace(TINY, rope_scaling=YARN, attention_bias=True, attention_out_bias=True)


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return str(path)


def configure(tmp_path, **layout):
    cfg = make_config(tmp_path, **layout)
    return replace(cfg, model=MODEL, optim=replace(cfg.optim, eps=1e-6))  # eps: see test_context_parallel


@pytest.fixture(scope="module")
def reference(token_path, tmp_path_factory):
    (result,) = run_on_ranks(1, train_and_collect, configure(tmp_path_factory.mktemp("ref")), token_path)
    return result[0], assemble([result])


@pytest.mark.parametrize(
    "layout, optim", [(dict(pp=2, tp=2, sp=True), {}), (dict(cp=2, dp=2), {"zero": 3})], ids=["tp2-pp2-sp", "cp2-zero3"]
)
def test_a_scaled_biased_model_trains_the_single_device_run(layout, optim, token_path, reference, tmp_path):
    cfg = configure(tmp_path, **layout)
    cfg = replace(cfg, optim=replace(cfg.optim, **optim))
    validate(cfg)
    results = run_on_ranks(4, train_and_collect, cfg, token_path)
    assert_matches_reference(results, reference, layout)


def test_its_checkpoint_records_the_scaling_and_biases_and_resumes_onto_the_uninterrupted_run(token_path, tmp_path):
    cfg = configure(tmp_path, tp=2)
    straight = run_on_ranks(2, train_and_collect, cfg, token_path, None, (2,))  # saves at step 2 of 3
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    saved = ModelConfig(**read_index(ckpt)["model"])
    assert saved.rope_scaling == YARN and saved.attention_bias and saved.attention_out_bias
    assert saved.identity() == MODEL.identity()
    again = replace(cfg, trainer=replace(cfg.trainer, out_dir=str(tmp_path / "again")))
    resumed = run_on_ranks(2, train_and_collect, again, token_path, str(ckpt))
    for (losses, _), (want, _) in zip(resumed, straight, strict=True):
        assert losses == want[2:]  # step 3, bit for bit
    got, want = assemble(resumed), assemble(straight)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())

"""The block's structure under ZeRO: a Gemma-style block (sandwich norms, (1 + w), GeGLU, scaled embedding,
soft-caps) and GPT-OSS's pieces (sinks, biases, biased clamped experts over ep) trained three steps with ZeRO-2/3
give the single-device losses and weights."""

from __future__ import annotations

from dataclasses import replace

import pytest

from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.model.structure import BlockStructure
from modelpar.testing import run_on_ranks
from tests.helpers import TINY, assemble, assert_matches_reference, make_config, train_and_collect

MODELS = {
    "gemma": replace(
        TINY, qk_norm=True, sliding_window=5, window_layers=[0, 2],
        block=BlockStructure(
            norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True, query_scale=10.0,
            attention_softcap=2.0, final_softcap=3.0, local_rope_theta=50.0,
        ),
    ),
    "gpt_oss": replace(
        TINY, tie_embeddings=False, sliding_window=5, window_layers=[0, 2], attention_bias=True,
        attention_out_bias=True, moe=MoEConfig(experts=4, top_k=2, ffn_hidden=24, bias=True,
                                               activation="clamped_swiglu", swiglu_limit=1.0),
        block=BlockStructure(attention_sinks=True),
    ),
}  # fmt: skip
CASES = [("gemma", dict(dp=2, pp=2), 2), ("gemma", dict(dp=2), 3), ("gpt_oss", dict(dp=2, ep=2), 3)]


def _cfg(tmp_path, model: ModelConfig, zero: int = 0, **parallel):
    cfg = make_config(tmp_path, **parallel)
    return replace(cfg, model=model, optim=replace(cfg.optim, zero=zero))


@pytest.fixture(scope="module")
def references(token_path, tmp_path_factory):
    out = {}
    for name, model in MODELS.items():
        (result,) = run_on_ranks(1, train_and_collect, _cfg(tmp_path_factory.mktemp(name), model), token_path)
        out[name] = result[0], assemble([result])
    return out


@pytest.mark.parametrize("name, layout, zero", CASES, ids=[f"{n}-zero{z}-{len(p)}" for n, p, z in CASES])
def test_block_structure_under_zero_matches_the_single_device(token_path, tmp_path, references, name, layout, zero):
    cfg = _cfg(tmp_path, MODELS[name], zero, **layout)
    results = run_on_ranks(cfg.parallel.pp * cfg.parallel.dp, train_and_collect, cfg, token_path)
    assert_matches_reference(results, references[name], f"{name} {layout} zero-{zero}")

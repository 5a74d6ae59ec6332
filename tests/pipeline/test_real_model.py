"""The runtime drives ``modelpar.model.transformer`` chunks (Llama-style, tensor-parallel inside) unchanged."""

from __future__ import annotations

import pytest
import torch

from modelpar import ParallelLayout
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_chunk, build_model
from modelpar.pipeline import PipelineRuntime, build_schedule, partition_explicit, partition_uniform
from modelpar.testing import current_groups, run_on_ranks

CONFIG = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=48, max_seq_len=16)
# a sliding window of 3 (< SEQ) on the first layer, the second attending to every earlier token
WINDOWED = ModelConfig(**{**CONFIG.__dict__, "sliding_window": 3, "window_layers": [0]})
BATCH, SEQ, M, SEED = 2, 8, 4, 3


def tokens_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (M, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    return ids[..., :-1], ids[..., 1:]


def _pipeline_step(schedule: str, counts=None, config: ModelConfig = CONFIG) -> tuple[float, dict[str, torch.Tensor]]:
    groups = current_groups()
    pp = groups.layout.pp
    part = partition_uniform(config.layers, pp) if counts is None else partition_explicit(counts, config.layers, pp)
    chunks = [
        build_chunk(
            config,
            groups,
            part.layers(c),
            first=part.has_embedding(c),
            last=part.has_head(c),
            split_blocks=part.split_blocks(c),
            seed=SEED,
        )
        for c in part.chunks_of(groups.pp_rank)
    ]
    runtime = PipelineRuntime(
        chunks,
        groups,
        build_schedule(schedule, pp, M),
        activation_shape=chunks[0].activation_shape(BATCH, SEQ),
        loss_fn=chunks[-1].loss,
    )
    result = runtime.step(*tokens_and_targets())
    grads = {name: p.grad.clone() for chunk in chunks for name, p in chunk.named_parameters()}
    return result.loss, grads


def reference(config: ModelConfig = CONFIG) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(config, seed=SEED)
    tokens, targets = tokens_and_targets()
    loss = model.loss(model(tokens.flatten(0, 1)), targets.flatten(0, 1))
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "schedule, counts, config",
    [
        ("1f1b", None, CONFIG),
        ("zb-h1", None, CONFIG),
        ("1f1b", (1.5, 0.5), CONFIG),
        ("zb-h1", (0.5, 1.5), CONFIG),
        ("1f1b", (1.5, 0.5), WINDOWED),
    ],
    ids=["1f1b", "zb-h1", "1f1b-half", "zb-h1-half", "1f1b-half-window"],
)
def test_two_stage_llama_matches_the_single_device_model(schedule, counts, config):
    """Whole-block splits and splits between a block's attention and MLP halves (and local/global layers)."""
    want_loss, want_grads = reference(config)
    results = run_on_ranks(2, _pipeline_step, schedule, counts, config, layout=ParallelLayout(pp=2))
    seen: set[str] = set()
    for rank, (loss, grads) in enumerate(results):
        assert loss == pytest.approx(want_loss, rel=1e-5), f"{schedule} rank {rank}"
        for name, grad in grads.items():
            err = (grad - want_grads[name]).norm() / want_grads[name].norm()
            assert err <= 1e-5, f"{schedule} rank {rank} grad of {name}: relative error {err:.2e}"
        seen |= grads.keys()
    assert seen == want_grads.keys()


def test_tensor_parallel_stages_give_the_single_device_loss():
    want_loss, _ = reference()
    losses = [loss for loss, _ in run_on_ranks(4, _pipeline_step, "1f1b", layout=ParallelLayout(tp=2, pp=2))]
    assert losses == pytest.approx([want_loss] * 4, rel=1e-5)

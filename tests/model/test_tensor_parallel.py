"""Every tensor-parallel layout computes the single-device model: logits, every gradient, AdamW steps."""

from __future__ import annotations

import pytest
import torch

from modelpar.model.transformer import build_model
from modelpar.optim.finalize import reduce_tensor_parallel_grads
from modelpar.testing import current_groups, run_on_ranks
from tests.model.reference import CONFIGS, SEED, batch, check_pieces, layout_for, pieces, rel_err

TOL = 1e-5
LAYOUTS = [(tp, sp) for tp in (1, 2, 4) for sp in (False, True)]


def _sharded_forward_backward(config, sp, reduce_grads=True, keep_shard=True):
    model = build_model(config, current_groups(), seed=SEED, sequence_parallel=sp, sp_keep_shard=keep_shard)
    ids, targets = batch(config)
    logits = model(ids)
    loss = model.loss(logits, targets)
    loss.backward()
    partial = pieces(model)
    if reduce_grads:
        reduce_tensor_parallel_grads(model)
    padded = [model.embed_tokens.weight.grad, model.lm_head.weight.grad]
    held = model.config.vocab_size - model.embed_tokens.vocab_start
    return {
        "loss": loss.item(),
        "logits": logits.detach(),
        "grads": pieces(model),
        "partial_grads": partial,
        "padding_grad": max((g[max(held, 0) :].abs().max().item() if g.shape[0] > held else 0.0) for g in padded),
    }


def _reference(config):
    ref = build_model(config, seed=SEED)
    ids, targets = batch(config)
    logits = ref(ids)
    loss = ref.loss(logits, targets)
    loss.backward()
    return ref, loss.item(), logits.detach()


@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize(("tp", "sp"), LAYOUTS, ids=[f"tp{tp}-{'sp' if sp else 'nosp'}" for tp, sp in LAYOUTS])
def test_logits_and_every_gradient_match_the_single_device_model(tp, sp, case):
    config = CONFIGS[case]
    ref, ref_loss, ref_logits = _reference(config)
    results = run_on_ranks(4, _sharded_forward_backward, config, sp, layout=layout_for(tp))[:tp]

    logits = torch.cat([r["logits"] for r in results], dim=-1)[..., : config.vocab_size]
    assert logits.shape == ref_logits.shape
    assert rel_err(logits, ref_logits) <= TOL
    assert all(abs(r["loss"] - ref_loss) <= TOL * abs(ref_loss) for r in results)
    grads = {name: shard.grad for name, shard in ref.logical_shards().items()}
    check_pieces([r["grads"] for r in results], grads, TOL)
    assert all(r["padding_grad"] == 0.0 for r in results), "padded vocab rows received gradient"


@pytest.mark.parametrize("case", ["gqa-kv2-tied"])
def test_sequence_parallel_keeping_the_gathered_inputs_also_matches_the_single_device_model(case):
    """``sp_keep_shard=false``: the column-parallel linears keep the gathered input (one all-gather fewer in
    backward); the default keeps the shard (``test_logits_and_every_gradient_match_the_single_device_model``)."""
    config = CONFIGS[case]
    ref, ref_loss, _ = _reference(config)
    results = run_on_ranks(4, _sharded_forward_backward, config, True, True, False, layout=layout_for(2))[:2]
    assert all(abs(r["loss"] - ref_loss) <= TOL * abs(ref_loss) for r in results)
    grads = {name: shard.grad for name, shard in ref.logical_shards().items()}
    check_pieces([r["grads"] for r in results], grads, TOL)


PARTIAL = [
    (2, True, "mha-untied", "layers.0.input_layernorm.weight"),
    (4, False, "gqa-kv1-untied", "layers.0.self_attn.k_proj.weight"),
    (2, False, "qknorm-hd12-kv1", "layers.0.self_attn.q_norm.weight"),  # each tp rank normalises its own heads
]


@pytest.mark.parametrize(("tp", "sp", "case", "partial_name"), PARTIAL, ids=[p[3].split(".")[-2] for p in PARTIAL])
def test_partial_gradients_are_wrong_until_reduced_over_tp(tp, sp, case, partial_name):
    """Sequence-parallel norms, replicated kv heads and QK-norm weights only hold a partial gradient before the
    reduction."""
    config = CONFIGS[case]
    ref, _, _ = _reference(config)
    grads = {name: shard.grad for name, shard in ref.logical_shards().items()}
    results = run_on_ranks(4, _sharded_forward_backward, config, sp, layout=layout_for(tp))[:tp]
    index, _, partial = results[0]["partial_grads"][partial_name]
    assert rel_err(partial, grads[partial_name][index], scale=grads[partial_name]) > 1e-2
    check_pieces([r["grads"] for r in results], grads, TOL)


def _adamw_losses(config, sp, steps):
    return _train(build_model(config, current_groups(), seed=SEED, sequence_parallel=sp), config, steps)


def _train(model, config, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids, targets = batch(config, step)
        loss = model.loss(model(ids), targets)
        loss.backward()
        reduce_tensor_parallel_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("case", ["mha-untied", "gqa-kv2-tied"])
@pytest.mark.parametrize(("tp", "sp"), LAYOUTS[2:], ids=[f"tp{tp}-{'sp' if sp else 'nosp'}" for tp, sp in LAYOUTS[2:]])
def test_three_adamw_steps_give_the_single_device_losses(tp, sp, case):
    config = CONFIGS[case]
    want = _train(build_model(config, seed=SEED), config, 3)
    for losses in run_on_ranks(4, _adamw_losses, config, sp, 3, layout=layout_for(tp))[:tp]:
        assert len(losses) == 3
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)) <= TOL, (losses, want)
    assert want[-1] < want[0]

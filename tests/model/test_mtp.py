"""Multi-token prediction on one device against the DeepSeek-V3 formulas written out here, and its config errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import ModelConfig, ModelConfigError
from modelpar.model.mtp import stack_targets
from modelpar.model.transformer import build_model

CONFIG = ModelConfig(
    vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=16, init_std=0.2, mtp_depth=2
)


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_loss(model, ids, targets, weight):
    """main CE + weight/D * sum_k CE_k, module k at position i: eh_proj([rms(E[t_{i+k}]); rms(h^{k-1})]) -> its
    block -> rms -> head, against t_{i+k+1}, over the positions where it exists."""
    h = model.embed_tokens.weight[ids]
    for block in model.layers.values():
        h = block(h)
    head = model.lm_head.weight
    losses = [F.cross_entropy((rms(h, model.norm.weight) @ head.T).flatten(0, 1), targets.flatten())]
    seq = ids.shape[1]
    for k, module in enumerate(model.mtp.modules_, start=1):
        nxt = targets[:, k - 1 :]  # t_{i+k} for i < s-k+1
        emb = model.embed_tokens.weight[nxt[:, : seq - k]]
        joined = torch.cat([rms(emb, module.enorm.weight), rms(h[:, : seq - k], module.hnorm.weight)], -1)
        h = module.block(joined @ module.eh_proj.T)
        logits = rms(h, module.norm.weight) @ head.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten()))
        h = torch.cat([h, h.new_zeros(h.shape[0], k, h.shape[2])], 1)  # pad back: later depths read positions < s-k
    return losses[0] + weight / CONFIG.mtp_depth * sum(losses[1:]), losses


def test_mtp_loss_and_gradients_equal_the_written_out_formulas():
    model = build_model(CONFIG, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 61, (2, 12), generator=g)
    targets = torch.randint(0, 61, (2, 12), generator=g)
    loss = model.loss(model(ids), stack_targets(targets, 2))
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want, parts = reference_loss(model, ids, targets, CONFIG.mtp_loss_weight)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert float(got["mtp.modules_.1.eh_proj"].abs().max()) > 0  # the second depth trained
    values, tokens, calls = model.mtp.take()
    torch.testing.assert_close(values, torch.stack(parts[1:]).detach(), rtol=1e-5, atol=1e-6)
    assert tokens.tolist() == [2 * 11, 2 * 10] and calls == 1
    # plain targets (evaluation): the main loss alone
    torch.testing.assert_close(model.loss(model(ids), targets), parts[0], rtol=1e-5, atol=1e-6)


def test_stacked_targets_shift_within_the_window():
    t = torch.arange(5).reshape(1, 5)
    assert stack_targets(t, 2)[0].tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, -100], [4, -100, -100]]


def test_mtp_names_its_tensors_and_shares_the_embedding():
    model = build_model(CONFIG, seed=0)
    names = set(model.logical_shards())
    assert {"mtp.1.eh_proj.weight", "mtp.1.enorm.weight", "mtp.1.hnorm.weight", "mtp.1.norm.weight"} <= names
    assert "mtp.0.self_attn.o_proj.weight" in names and "mtp.0.mlp.down_proj.weight" in names
    assert model.mtp_embed is model.embed_tokens
    assert CONFIG.identity()["mtp_depth"] == 2 and "mtp_depth" not in ModelConfig().identity()


@pytest.mark.parametrize("field", ["mtp_depth", "mtp_loss_weight"])
def test_negative_mtp_fields_are_one_line_errors(field):
    with pytest.raises(ModelConfigError, match=f"model.{field}=-1") as info:
        ModelConfig(**{field: -1}).check()
    assert "\n" not in str(info.value)

"""DeepSeek-V3 routing on one device: the MoE layer against transformers' DeepseekV3MoE on the same weights, the
sequence-wise balance loss against a per-sequence reference, and the routing fields' one-line errors."""

from __future__ import annotations

import pytest
import torch

from modelpar.model.config import ModelConfig, ModelConfigError, MoEConfig
from modelpar.model.moe import MoELayer
from modelpar.model.router import limit_to_groups
from modelpar.parallel.regions import TensorParallelGroup

H, F_EXPERT, E = 32, 24, 8


def deepseek_layer(**moe) -> MoELayer:
    fields = dict(experts=E, top_k=3, ffn_hidden=F_EXPERT, router="sigmoid", n_group=4, topk_group=2)
    config = ModelConfig(hidden=H, moe=MoEConfig(**fields | moe))
    config.check()
    return MoELayer(config, TensorParallelGroup())


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "raw"])
def test_group_limited_moe_equals_transformers_deepseek_v3_moe(norm_topk_prob):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_config = DeepseekV3Config(
        hidden_size=H,
        moe_intermediate_size=F_EXPERT,
        n_routed_experts=E,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm_topk_prob,
    )
    theirs = DeepseekV3MoE(hf_config).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        theirs.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.2)
    ours = deepseek_layer(shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob)
    state = {
        "gate.weight": theirs.gate.weight,
        "gate.e_score_correction_bias": theirs.gate.e_score_correction_bias,
    }
    for e in range(E):
        gate, up = theirs.experts.gate_up_proj[e].chunk(2)
        state |= {f"experts.{e}.w1.weight": gate, f"experts.{e}.w3.weight": up}
        state[f"experts.{e}.w2.weight"] = theirs.experts.down_proj[e]
    for name in ("gate", "up", "down"):
        state[f"shared_experts.{name}_proj.weight"] = getattr(theirs.shared_experts, f"{name}_proj").weight
    with torch.no_grad():
        shards = ours.logical_shards()
        assert shards.keys() == state.keys()
        for name, shard in shards.items():
            shard.tensor.copy_(state[name])
    x = torch.randn(3, 7, H, generator=g)
    with torch.no_grad():
        want, got = theirs(x), ours(x)
        # the group limit decides: without it some token picks an expert outside its two best groups
        _, _, chosen = theirs.gate(x)
        scores = (x.reshape(-1, H) @ theirs.gate.weight.T).sigmoid() + theirs.gate.e_score_correction_bias
        assert not torch.equal(scores.topk(3).indices.sort().values, chosen.sort().values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_limit_to_groups_keeps_the_groups_with_the_best_two_scores():
    choice = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.1, 0.2]])  # groups of 2: sums 0.9, 1.0, 0.3
    kept = limit_to_groups(choice, 3, 1)
    assert torch.equal(kept.isfinite(), torch.tensor([[False, False, True, True, False, False]]))
    assert torch.equal(limit_to_groups(choice, 3, 2).isfinite()[0, :4], torch.ones(4, dtype=torch.bool))


def brute_force_sequence_loss(weight, bias, x: torch.Tensor, coef: float, k: int = 3) -> torch.Tensor:
    """coef * mean over sequences of sum_i f_i P_i, f_i = E/(k T) * count_i (constant), P_i the sequence's mean
    normalised sigmoid score; routing re-derived from the scores with the group limit, written out."""
    e = weight.shape[0]
    losses = []
    for seq in x:  # [s, h]
        scores = (seq @ weight.T).sigmoid()
        choice = scores.detach() + bias
        counts = torch.zeros(e)
        for t in range(seq.shape[0]):
            group_best = choice[t].view(4, 2).sort(-1, descending=True).values[:, :2].sum(-1)
            groups = group_best.topk(2).indices.tolist()
            allowed = [i for i in range(e) if i // 2 in groups]
            for i in sorted(allowed, key=lambda i: -float(choice[t, i]))[:k]:
                counts[i] += 1
        f = counts * e / (k * seq.shape[0])
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        losses.append(coef * (f * p).sum())
    return torch.stack(losses).mean()


def test_sequence_wise_balance_loss_equals_the_per_sequence_reference():
    coef = 0.3
    layer = deepseek_layer(aux_loss_coef=coef, aux_loss_scope="sequence")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for shard in layer.logical_shards().values():
            shard.tensor.copy_(torch.randn(shard.global_shape, generator=g) * 0.3)
    x = torch.randn(3, 6, H, generator=g)
    layer(x).backward(torch.zeros(3, 6, H))  # no output gradient: the router's is the balance loss's alone
    aux_grad = layer.gate_weight.grad
    weight = layer.gate_weight.detach().clone().requires_grad_()
    want = brute_force_sequence_loss(weight, layer.score_bias.detach(), x, coef)
    want.backward()
    stats = layer.take_stats()
    assert float(stats["aux_loss"]) == pytest.approx(float(want.detach()), rel=1e-5)
    torch.testing.assert_close(aux_grad, weight.grad, rtol=1e-4, atol=1e-7)
    assert float(weight.grad.abs().max()) > 0
    # the whole-micro-batch Switch loss is a different number: the scope really changed what is computed
    switch = deepseek_layer(aux_loss_coef=coef, aux_loss_scope="micro_batch")
    switch.load_state_dict(layer.state_dict())
    switch(x).sum()
    assert float(switch.take_stats()["aux_loss"]) != pytest.approx(float(want.detach()), rel=1e-3)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_group=3), r"model.moe.n_group=3 must divide experts=8; try n_group in \[1, 2, 4, 8\]"),
        (dict(topk_group=5), "model.moe.topk_group=5 must be in 1..n_group=4"),
        (dict(top_k=5, topk_group=2), "model.moe.top_k=5 exceeds the 4 experts of topk_group=2 groups of 2"),
        (dict(routed_scaling_factor=0.0), "model.moe.routed_scaling_factor=0.0 must be > 0"),
        (dict(first_k_dense_replace=2), "model.moe.first_k_dense_replace=2 must be in 0..1"),
        (dict(first_k_dense_replace=1, layers=[0]), "first_k_dense_replace=1 leaves no MoE layer"),
        (dict(aux_loss_scope="seq"), "model.moe.aux_loss_scope='seq' is not one of"),
    ],
)
def test_bad_routing_fields_are_one_line_errors(fields, message):
    config = ModelConfig(
        hidden=H, moe=MoEConfig(**dict(experts=E, top_k=3, router="sigmoid", n_group=4, topk_group=2) | fields)
    )
    with pytest.raises(ModelConfigError, match=message) as info:
        config.check()
    assert "\n" not in str(info.value)


def test_dense_first_layers_use_the_model_width_and_experts_their_own():
    from modelpar.model.transformer import build_model

    config = ModelConfig(
        hidden=H, layers=3, ffn_hidden=40, moe=MoEConfig(experts=4, top_k=2, ffn_hidden=8, first_k_dense_replace=2)
    )
    model = build_model(config, seed=0)
    kinds = [type(model.layers[str(i)].mlp).__name__ for i in range(3)]
    assert kinds == ["ParallelSwiGLU", "ParallelSwiGLU", "MoELayer"]
    shards = model.logical_shards()
    assert shards["layers.0.mlp.gate_proj.weight"].global_shape == (40, H)
    assert shards["layers.2.mlp.experts.0.w1.weight"].global_shape == (8, H)
    assert config.identity()["moe"]["first_k_dense_replace"] == 2
    assert "n_group" not in config.identity()["moe"]  # defaults stay out: older mixtures keep their identity

"""The mixture-of-experts layer on one device against a per-token reference written from the papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import ModelConfig, ModelConfigError, MoEConfig
from modelpar.model.grouped_mm import grouped_linear
from modelpar.model.moe import MoELayer
from modelpar.model.transformer import build_model
from modelpar.parallel.regions import TensorParallelGroup

H, F_EXPERT = 32, 24


def make_layer(seed: int = 0, **moe) -> MoELayer:
    config = ModelConfig(hidden=H, moe=MoEConfig(ffn_hidden=F_EXPERT, **{"experts": 4, "top_k": 2} | moe))
    config.check()
    layer = MoELayer(config, TensorParallelGroup())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, shard in layer.logical_shards().items():
            value = torch.randn(shard.global_shape, generator=generator) * 0.3
            if name.endswith("e_score_correction_bias"):
                value = value * 0.5
            shard.tensor.copy_(value)
    return layer


def weights_of(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {name: shard.tensor.clone().requires_grad_() for name, shard in layer.logical_shards().items()}


def reference(w: dict[str, torch.Tensor], x: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, dict]:
    """Token by token: route, run the chosen experts, sum; plus the Switch aux loss and z-loss terms."""
    tokens = x.reshape(-1, H)
    logits = tokens @ w["gate.weight"].T
    if moe.router == "softmax":
        scores = logits.softmax(-1)
        choose = scores
    else:
        scores = logits.sigmoid()
        choose = scores + w["gate.e_score_correction_bias"]
    rows = []
    counts = torch.zeros(moe.experts)
    kept = torch.zeros(moe.experts)
    capacity = (
        math.ceil(moe.capacity_factor * tokens.shape[0] * moe.top_k / moe.experts) if moe.capacity_factor else None
    )
    for t in range(tokens.shape[0]):
        chosen = choose[t].topk(moe.top_k).indices.tolist()
        weights = scores[t, chosen] / scores[t, chosen].sum()
        out = torch.zeros(H)
        for j, e in enumerate(chosen):
            counts[e] += 1
            if capacity is not None and kept[e] >= capacity:
                continue  # dropped: rows of each expert are kept in token order
            kept[e] += 1
            xt = tokens[t]
            act = F.silu(w[f"experts.{e}.w1.weight"] @ xt) * (w[f"experts.{e}.w3.weight"] @ xt)
            out = out + weights[j] * (w[f"experts.{e}.w2.weight"] @ act)
        rows.append(out)
    y = torch.stack(rows).reshape(x.shape)
    if moe.shared_experts:
        g, u, d = (w[f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
        y = y + (F.silu(x @ g.T) * (x @ u.T)) @ d.T
    n = tokens.shape[0]
    probs = scores if moe.router == "softmax" else scores / scores.sum(-1, keepdim=True)
    f = counts / (n * moe.top_k)
    aux = moe.aux_loss_coef * moe.experts * (f * probs.mean(0)).sum()
    z = moe.z_loss_coef * logits.logsumexp(-1).square().mean()
    return y, {"aux": aux, "z": z, "counts": counts, "dropped": (counts - kept).sum()}


def run_layer(layer: MoELayer, x: torch.Tensor, grad_y: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    grads = {name: shard.grad.clone() for name, shard in layer.logical_shards().items() if shard.param.requires_grad}
    return y.detach(), x.grad, grads, layer.take_stats()


MOE_VARIANTS = {
    "softmax-top2": dict(),
    "sigmoid-top3-bias": dict(router="sigmoid", top_k=3),
    "softmax-top1-shared": dict(top_k=1, shared_experts=1),
}


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("variant", MOE_VARIANTS.values(), ids=MOE_VARIANTS.keys())
def test_moe_layer_equals_the_per_token_reference(variant, grouped):
    layer = make_layer(grouped_gemm=grouped, **variant)
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
    grad_y = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(2))
    y, grad_x, grads, stats = run_layer(layer, x, grad_y)
    w = weights_of(layer)
    xr = x.clone().requires_grad_()
    y_ref, terms = reference(w, xr, layer.moe)
    y_ref.backward(grad_y)
    torch.testing.assert_close(y, y_ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_x, xr.grad, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, w[name].grad, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(stats["tokens_per_expert"].float(), terms["counts"])
    assert float(stats["routed"]) == 15 * layer.top_k and float(stats["dropped"]) == 0


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_and_z_loss_gradients_equal_autograd_of_the_losses(router):
    layer = make_layer(router=router, aux_loss_coef=0.3, z_loss_coef=0.05)
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(3))
    grad_y = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(4))
    _, grad_x, grads, stats = run_layer(layer, x, grad_y)
    w = weights_of(layer)
    xr = x.clone().requires_grad_()
    y_ref, terms = reference(w, xr, layer.moe)
    ((y_ref * grad_y).sum() + terms["aux"] + terms["z"]).backward()
    torch.testing.assert_close(grad_x, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads["gate.weight"], w["gate.weight"].grad, atol=1e-5, rtol=1e-5)
    assert float(stats["aux_loss"]) == pytest.approx(float(terms["aux"].detach()), rel=1e-6)
    # the aux loss's gradient really reaches the router (not only the task loss's)
    _, _, plain, _ = run_layer(make_layer(router=router), x, grad_y)
    assert not torch.allclose(plain["gate.weight"], grads["gate.weight"], atol=1e-4)


def test_capacity_drops_the_rows_past_each_experts_capacity_and_reports_them():
    layer = make_layer(capacity_factor=0.5)
    x = torch.randn(4, 6, H, generator=torch.Generator().manual_seed(5))
    grad_y = torch.randn(4, 6, H, generator=torch.Generator().manual_seed(6))
    y, grad_x, grads, stats = run_layer(layer, x, grad_y)
    w = weights_of(layer)
    xr = x.clone().requires_grad_()
    y_ref, terms = reference(w, xr, layer.moe)
    y_ref.backward(grad_y)
    torch.testing.assert_close(y, y_ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads["experts.1.w2.weight"], w["experts.1.w2.weight"].grad, atol=1e-5, rtol=1e-5)
    capacity = math.ceil(0.5 * 24 * 2 / 4)
    assert float(stats["dropped"]) == float(terms["dropped"]) == float((terms["counts"] - capacity).clamp(min=0).sum())
    assert float(stats["dropped"]) > 0


def test_grouped_matmul_equals_one_matmul_per_expert_with_empty_experts():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(11, 16, generator=generator, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=generator, requires_grad=True)
    counts = torch.tensor([3, 0, 8, 0])
    y = grouped_linear(x, w, counts, grouped=True)
    (y * torch.arange(8.0)).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y_loop = grouped_linear(x, w, counts, grouped=False)
    (y_loop * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(y, y_loop)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    assert gw[1].abs().sum() == 0 and gw[3].abs().sum() == 0


def test_balancing_bias_moves_towards_the_less_loaded_experts():
    layer = make_layer(router="sigmoid", bias_update_rate=0.01)
    before = layer.score_bias.detach().clone()
    layer.update_bias(torch.tensor([10.0, 2.0, 3.0, 1.0]))  # mean 4
    step = layer.score_bias.detach() - before
    torch.testing.assert_close(step, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def test_moe_model_names_its_tensors_as_mixtral_and_trains_on_one_device():
    config = ModelConfig(vocab_size=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn_hidden=48)
    config.moe = MoEConfig(experts=4, top_k=2, every=2, aux_loss_coef=0.01)
    model = build_model(config, seed=3)
    names = set(model.logical_shards())
    assert {"layers.0.mlp.gate.weight", "layers.2.mlp.experts.3.w1.weight", "layers.1.mlp.up_proj.weight"} <= names
    assert "layers.1.mlp.gate.weight" not in names
    assert sorted(model.moe_layers()) == [0, 2]
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = model.loss(model(ids), ids)
    loss.backward()
    assert torch.isfinite(loss) and model.layers["2"].mlp.routed_experts.w2.grad.abs().sum() > 0
    every_matmul = sum(s.tensor.numel() for n, s in model.logical_shards().items() if not n.endswith("norm.weight"))
    routed_away = 2 * (4 - 2) * 3 * 32 * 48  # two MoE layers, two of four experts not used per token
    embedding_lookup = 64 * 32  # not a matmul
    assert config.matmul_params() == every_matmul - routed_away - embedding_lookup


@pytest.mark.parametrize(
    "moe, message",
    [
        (dict(experts=4, top_k=5), "model.moe.top_k=5 must be in 1..experts=4"),
        (dict(experts=4, router="topk"), "model.moe.router='topk' is not one of"),
        (dict(experts=4, layers=[0, 7]), "model.moe.layers=[0, 7] must be distinct layer ids in 0..1"),
        (dict(experts=4, bias_update_rate=0.1), "set model.moe.router=sigmoid"),
    ],
)
def test_impossible_moe_shapes_are_refused_in_one_line(moe, message):
    with pytest.raises(ModelConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        ModelConfig(moe=MoEConfig(**moe)).check()
    assert "\n" not in str(info.value)

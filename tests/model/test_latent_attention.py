"""Multi-head latent attention on one device: transformers' DeepseekV3Attention's function and parameter count,
the rope_interleave permutation, its config checks and identity, and recompute giving the same gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from modelpar.model.config import MLAConfig, ModelConfig, ModelConfigError
from modelpar.model.layers.latent_attention import LatentAttention, halves_from_interleaved
from modelpar.model.transformer import build_model
from modelpar.parallel.regions import TensorParallelGroup
from tests.model.reference import rel_err

transformers = pytest.importorskip("transformers")

MLA = MLAConfig(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
CONFIG = ModelConfig(
    vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=4, ffn_hidden=40, max_seq_len=16, init_std=0.2, mla=MLA
)


def _hf_attention(q_lora_rank, interleave):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    hf = DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_interleave=interleave,
        rope_theta=100.0,
        attention_bias=False,
    )
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(hf, layer_idx=0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if "proj" in name else 1.0) + (1.0 if "norm" in name else 0.0))
    return attn, DeepseekV3RotaryEmbedding(hf)


@pytest.mark.parametrize("q_lora_rank, interleave", [(16, False), (None, True)], ids=["q-lora", "q-proj-interleaved"])
def test_layer_matches_transformers_deepseek_v3_attention(q_lora_rank, interleave):
    """The same weights give DeepseekV3Attention's output and input gradient (fp32, 1e-5); with
    ``rope_interleave`` the RoPE rows of q and k_pe are permuted by ``halves_from_interleaved`` first."""
    hf, rotary = _hf_attention(q_lora_rank, interleave)
    ours = LatentAttention(
        32,
        4,
        q_lora_rank=q_lora_rank or 0,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_theta=100.0,
        tp=TensorParallelGroup(),
    )
    weights = {name: p.detach().clone() for name, p in hf.named_parameters()}
    if interleave:
        q_name = "q_b_proj.weight" if q_lora_rank else "q_proj.weight"
        weights[q_name] = halves_from_interleaved(weights[q_name], 4, 12)
        weights["kv_a_proj_with_mqa.weight"] = halves_from_interleaved(weights["kv_a_proj_with_mqa.weight"], 4, 16)
    shards = ours.logical_shards()
    assert set(shards) == set(weights)
    with torch.no_grad():
        for name, shard in shards.items():
            shard.tensor.copy_(weights[name])

    x = torch.randn(2, 7, 32, requires_grad=True)
    positions = torch.arange(7)[None].expand(2, -1)
    want = hf(x, rotary(x, positions), attention_mask=None)[0]
    (want_dx,) = torch.autograd.grad(want.square().sum(), x)
    got = ours(x)
    (got_dx,) = torch.autograd.grad(got.square().sum(), x)
    assert rel_err(got, want) <= 1e-5
    assert rel_err(got_dx, want_dx) <= 1e-5


def test_interleaving_matters():
    """Without the permutation an interleaved checkpoint computes another function (so the test above tests it)."""
    hf, rotary = _hf_attention(16, True)
    ours = LatentAttention(
        32, 4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        rope_theta=100.0, tp=TensorParallelGroup(),
    )  # fmt: skip
    with torch.no_grad():
        for name, shard in ours.logical_shards().items():
            shard.tensor.copy_(dict(hf.named_parameters())[name])
    x = torch.randn(2, 7, 32)
    want = hf(x, rotary(x, torch.arange(7)[None].expand(2, -1)), attention_mask=None)[0]
    assert rel_err(ours(x), want) > 1e-3


def test_v3_attention_parameter_count_is_transformers():
    """DeepSeek-V3's attention (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128): the
    planner's matmul weights per layer are the Linear weights of transformers' layer, built on the meta device."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf = DeepseekV3Config(
        hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    )  # fmt: skip
    with torch.device("meta"):
        attn = DeepseekV3Attention(hf, layer_idx=0)
    linear = sum(m.weight.numel() for m in attn.modules() if isinstance(m, torch.nn.Linear))
    v3 = ModelConfig(
        hidden=7168, heads=128, kv_heads=128,
        mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    )  # fmt: skip
    v3.check()
    assert v3.attention_params() == linear == 187_105_280
    assert v3.attention_score_dims() == (192, 128)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_lora_rank=-1), r"model\.mla\.kv_lora_rank=-1 must be >= 0"),
        (dict(kv_lora_rank=0), r"model\.mla\.q_lora_rank=16 needs latent attention"),
        (dict(q_lora_rank=-2), r"model\.mla\.q_lora_rank=-2 must be >= 0"),
        (dict(qk_nope_head_dim=0), r"model\.mla\.qk_nope_head_dim=0 must be >= 1"),
        (dict(v_head_dim=0), r"model\.mla\.v_head_dim=0 must be >= 1"),
        (dict(qk_rope_head_dim=3), r"model\.mla\.qk_rope_head_dim=3 must be even"),
    ],
)
def test_a_bad_mla_field_is_one_line_naming_it(change, message):
    with pytest.raises(ModelConfigError, match=message) as err:
        replace(CONFIG, mla=replace(MLA, **change)).check()
    assert "\n" not in str(err.value)


def test_mla_refuses_grouped_kv_heads_and_fp8():
    with pytest.raises(ModelConfigError, match=r"model\.kv_heads=2 with latent attention.*set model\.kv_heads=4"):
        replace(CONFIG, kv_heads=2).check()
    with pytest.raises(ModelConfigError, match=r"model\.fp8=rowwise covers GQA attention only"):
        replace(CONFIG, fp8="rowwise").check()
    replace(CONFIG, hidden=36).check()  # hidden need not divide by heads: MLA's head dims are its own


def test_mla_is_part_of_the_identity_only_when_on():
    dense = replace(CONFIG, mla=MLAConfig())
    assert "mla" not in dense.identity()
    assert CONFIG.identity()["mla"] == MLA.identity()
    assert ModelConfig(**{**CONFIG.__dict__, "mla": MLA.identity()}).mla == MLA  # read back from an index


def _step(recompute, modules=("elementwise",)):
    model = build_model(CONFIG, seed=3, recompute=recompute, recompute_modules=modules)
    g = torch.Generator().manual_seed(5)
    ids, targets = torch.randint(0, 61, (2, 12), generator=g), torch.randint(0, 61, (2, 12), generator=g)
    loss = model.loss(model(ids), targets)
    loss.backward()
    return loss.detach(), {name: s.grad.clone() for name, s in model.logical_shards().items()}


def test_recompute_gives_bit_identical_loss_and_gradients():
    loss, grads = _step("none")
    assert "layers.0.self_attn.kv_b_proj.weight" in grads
    for recompute, modules in [("full", ()), ("selective", ("attention",)), ("selective", ("elementwise",))]:
        loss_rc, grads_rc = _step(recompute, modules or ("elementwise",))
        assert torch.equal(loss, loss_rc), (recompute, modules)
        for name, grad in grads.items():
            assert torch.equal(grad, grads_rc[name]), (recompute, modules, name)


def test_triton_kernels_give_the_torch_loss_and_gradients():
    """The Triton path (v zero-padded to the qk head dim for the flash kernel), under the interpreter on CPU."""
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, 61, (1, 8), generator=g), torch.randint(0, 61, (1, 8), generator=g)
    runs = []
    for kernels in ("torch", "triton"):
        model = build_model(replace(CONFIG, kernels=kernels, layers=1), seed=3)
        loss = model.loss(model(ids), targets)
        loss.backward()
        runs.append((loss.item(), {name: s.grad.clone() for name, s in model.logical_shards().items()}))
    (want_loss, want), (got_loss, got) = runs
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for name, grad in want.items():
        assert rel_err(got[name], grad) <= 1e-4, name

"""QK-clip (MuonClip) holds each head's largest attention logit near its threshold, the same at every layout."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.model.config import MLAConfig
from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError, validate
from tests.helpers import TINY, assemble, make_config

# weights: at this lr (30x the other parity tests') Adam's division by sqrt(v) turns the layouts' last-bit
# differences in a rarely seen token's embedding gradient into up to 4.3e-6 (seen at dp2)
ATOL = 5e-6
TAU = 0.08  # the tiny model's logits start near 0.06 and pass 0.16 within 10 steps at this lr unclipped


def clip_config(tmp_path, tau: float, zero_: int = 0, **parallel):
    cfg = make_config(tmp_path, **parallel)
    optim = dict(lr=3e-2, min_lr=3e-2, warmup_steps=0, zero=zero_, muon_ns_dtype="fp32")
    optim = replace(cfg.optim, name="muon", qk_clip=tau, **optim)
    return replace(cfg, optim=optim, trainer=replace(cfg.trainer, steps=10))


def train_with_maxima(cfg, data_path: str):
    """Every step's loss, each layer's per-head largest logit (before that step's clip), this rank's pieces."""
    from modelpar.checkpoint.reshard import model_pieces
    from modelpar.training.qk_clip import QKClip
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    (clip,) = [p for p in trainer.train_one.plugins if isinstance(p, QKClip)]
    losses, maxima = [], []
    while trainer.step < cfg.trainer.steps:
        losses.append(trainer.train_step().loss)
        maxima.append(torch.stack(clip.last_max))  # [layers of this rank, heads]
    pieces = {(p.name, p.region): t.detach().clone() for p, t in model_pieces(trainer.model.chunks).items()}
    return losses, torch.stack(maxima), pieces


@pytest.fixture(scope="module")
def single(token_path, tmp_path_factory):
    out = {}
    for tau in (TAU, 1e9):
        cfg = clip_config(tmp_path_factory.mktemp("ref"), tau)
        ((losses, maxima, pieces),) = run_on_ranks(1, train_with_maxima, cfg, token_path)
        out[tau] = losses, maxima, assemble([(None, pieces)])
    return out


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_a_clip_sets_each_heads_largest_logit_to_the_threshold(heads, kv_heads):
    """On the same input after the clip, every head that was over tau is at tau exactly, the others unchanged
    (grouped-query attention: each query head by its own factor although its key head is shared)."""
    from modelpar.model.layers.attention import ParallelAttention
    from modelpar.parallel.regions import TensorParallelGroup
    from modelpar.training.qk_clip import _clip

    torch.manual_seed(0)
    m = ParallelAttention(32, heads, kv_heads, 10000.0, TensorParallelGroup())
    with torch.no_grad():
        m.qkv_proj.weight.normal_(0, 0.3)
    x = torch.randn(2, 16, 32)
    m.max_logits = torch.full((heads,), float("-inf"))
    m(x)
    before = m.max_logits
    tau = float(before.median())
    _clip(m, before, tau)
    m.max_logits = torch.full((heads,), float("-inf"))
    m(x)
    want = torch.minimum(before, torch.tensor(tau))
    torch.testing.assert_close(m.max_logits, want, rtol=1e-5, atol=0)
    assert (before > tau).any() and (before < tau).any()


@pytest.mark.parametrize("q_lora_rank", [16, 0], ids=["q-latent", "q-proj"])
def test_a_clip_sets_each_latent_heads_largest_logit_to_the_threshold(q_lora_rank):
    """Latent attention, the K2 report's split: q_C and k_C by sqrt(gamma), q_R by gamma, the shared k_R kept."""
    from modelpar.model.layers.latent_attention import LatentAttention
    from modelpar.parallel.regions import TensorParallelGroup
    from modelpar.training.qk_clip import _clip

    torch.manual_seed(0)
    dims = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_theta=10000.0)
    m = LatentAttention(32, 4, q_lora_rank=q_lora_rank, tp=TensorParallelGroup(), **dims)
    with torch.no_grad():
        for w in (m.down_proj.weight, m.kv_b_proj.weight, *([m.q_b_proj.weight] if q_lora_rank else [])):
            w.normal_(0, 0.5)
    x = torch.randn(2, 16, 32)
    m.max_logits = torch.full((4,), float("-inf"))
    m(x)
    before = m.max_logits
    tau = float(before.median())
    _clip(m, before, tau)
    m.max_logits = torch.full((4,), float("-inf"))
    m(x)
    torch.testing.assert_close(m.max_logits, torch.minimum(before, torch.tensor(tau)), rtol=1e-5, atol=0)
    assert (before > tau).any() and (before < tau).any()


def test_qk_clip_keeps_the_logits_below_the_unclipped_run(single):
    _, free, _ = single[1e9]
    _, clipped, _ = single[TAU]
    assert free.max() > 2 * TAU  # unclipped the logits run away
    first = int((clipped.amax(dim=(1, 2)) > TAU).nonzero()[0])  # the first step that clipped
    assert first < 6
    assert torch.equal(clipped[: first + 1], free[: first + 1])  # nothing changes before the first clip
    # each step's logits start from tau and move by one update (large at this lr): below the free run's
    assert (clipped[first + 1 :].amax(dim=(1, 2)) < free[first + 1 :].amax(dim=(1, 2))).all()


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2), dict(cp=2), dict(tp=2, sp=True, cp=2), dict(dp=2, zero_=1), dict(dp=2, zero_=3)],
    ids=["tp2", "cp2", "tp2-sp-cp2", "dp2-zero1", "dp2-zero3"],
)
def test_qk_clip_is_layout_invariant(single, token_path, tmp_path, layout):
    cfg = clip_config(tmp_path, TAU, **layout)
    p = cfg.parallel
    results = run_on_ranks(p.tp * p.cp * p.dp, train_with_maxima, cfg, token_path)
    ref_losses, ref_maxima, ref_params = single[TAU]
    for losses, maxima, _ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        torch.testing.assert_close(maxima, ref_maxima, rtol=1e-5, atol=2e-6)
    params = assemble([(None, pieces) for _, _, pieces in results])
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_qk_clip_on_latent_attention_at_tp2_matches_one_device(token_path, tmp_path):
    model = replace(
        TINY,
        kv_heads=TINY.heads,
        mla=MLAConfig(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    )
    runs = {}
    for tp in (1, 2):
        cfg = clip_config(tmp_path / f"tp{tp}", 0.03, tp=tp)  # its logits start near 0.02
        cfg = replace(cfg, model=model, trainer=replace(cfg.trainer, steps=6))
        runs[tp] = run_on_ranks(tp, train_with_maxima, cfg, token_path)
    ((ref_losses, ref_maxima, ref_pieces),) = runs[1]
    assert (ref_maxima > 0.03).any()  # it clipped
    for losses, maxima, _ in runs[2]:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        torch.testing.assert_close(maxima, ref_maxima, rtol=1e-5, atol=2e-6)
    params, ref_params = assemble([(None, p) for _, _, p in runs[2]]), assemble([(None, ref_pieces)])
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_qk_clip_with_qk_norm_is_refused_in_one_line(tmp_path):
    cfg = clip_config(tmp_path, TAU)
    cfg = replace(cfg, model=replace(cfg.model, qk_norm=True))
    with pytest.raises(RecipeError, match="optim.qk_clip=0.08 is not supported with model.qk_norm=true") as info:
        validate(cfg)
    assert "\n" not in str(info.value)

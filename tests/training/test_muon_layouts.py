"""Muon trains to the single-device run's losses and weights (1e-5) at every layout: each logical matrix is
orthogonalised whole wherever tp, pp, ep and ZeRO-1/2/3 put its pieces."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.model.config import MoEConfig
from modelpar.testing import RankError, run_on_ranks
from modelpar.training.config import RecipeError, validate
from tests.helpers import TINY, assemble, assert_matches_reference, make_config, train_and_collect

MOE = replace(
    TINY,
    tie_embeddings=False,
    moe=MoEConfig(experts=4, top_k=2, ffn_hidden=24, aux_loss_coef=0.05),
)


def muon_config(tmp_path, model=TINY, zero_: int = 0, per_head: bool = False, **parallel):
    cfg = make_config(tmp_path, **parallel)
    # Newton-Schulz in fp32: in bf16 (torch's default) a gradient differing from one device's in its last fp32
    # bit (another summation order) can round to another bf16 value, which moves an update by ~1e-5
    optim = replace(cfg.optim, name="muon", zero=zero_, muon_ns_dtype="fp32", muon_per_head=per_head)
    return replace(cfg, model=model, optim=optim)


@pytest.fixture(scope="module")
def references(token_path, tmp_path_factory):
    out = {}
    for name, model in (("dense", TINY), ("moe", MOE), ("per-head", TINY)):
        # the MoE's balancing loss is over the whole batch: one micro-batch (its layouts too)
        micro = 1 if model.moe else 2
        cfg = muon_config(
            tmp_path_factory.mktemp(f"ref-{name}"), model, microbatches=micro, per_head=name == "per-head"
        )
        (result,) = run_on_ranks(1, train_and_collect, cfg, token_path)
        out[name] = (result[0], assemble([result]))
    return out


LAYOUTS = [
    ("dense", dict(tp=2)),
    ("dense", dict(tp=2, sp=True)),
    ("dense", dict(pp=2)),
    ("dense", dict(dp=2)),
    ("dense", dict(dp=2, zero_=1)),
    ("dense", dict(dp=2, zero_=2)),
    ("dense", dict(dp=2, zero_=3)),
    ("dense", dict(tp=2, dp=2, zero_=3)),
    ("dense", dict(pp=2, vpp=2, schedule="zbv", microbatches=2)),
    ("per-head", dict(tp=2)),  # q/k/v per head: each tp rank's heads
    ("per-head", dict(dp=2, zero_=1)),  # a ZeRO-1 segment may cut a head
    ("moe", dict(dp=2, ep=2, microbatches=1)),  # each rank orthogonalises the experts it owns, one at a time
    ("moe", dict(dp=2, ep=2, microbatches=1, zero_=1)),
]


@pytest.mark.parametrize(
    "model, layout", LAYOUTS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.items()))
)
def test_muon_layout_matches_single_device(model, layout, token_path, references, tmp_path):
    cfg = muon_config(tmp_path, MOE if model == "moe" else TINY, per_head=model == "per-head", **layout)
    p = cfg.parallel
    results = run_on_ranks(p.tp * p.pp * p.dp, train_and_collect, cfg, token_path)
    assert_matches_reference(results, references[model], layout)


def test_muon_differs_from_adamw(token_path, references, tmp_path):
    """The reference is Muon's, not AdamW's: the same run under AdamW ends elsewhere."""
    cfg = replace(muon_config(tmp_path), optim=replace(muon_config(tmp_path).optim, name="adamw"))
    (result,) = run_on_ranks(1, train_and_collect, cfg, token_path)
    name = "layers.1.self_attn.q_proj.weight"
    assert (assemble([result])[name] - references["dense"][1][name]).abs().max() > 1e-4


def test_muon_with_hybrid_sharding_is_refused_in_one_line(tmp_path):
    cfg = muon_config(tmp_path, zero_=3, dp=4)
    cfg = replace(cfg, optim=replace(cfg.optim, zero_group=2))
    with pytest.raises(RecipeError, match="optim.name=muon with optim.zero_group=2") as info:
        validate(cfg)
    assert "\n" not in str(info.value)


# -- checkpoints: the momentum buffers are logical tensors, like Adam's moments ---------------------------


def test_muon_resume_continues_bit_for_bit(token_path, tmp_path):
    cfg = muon_config(tmp_path / "a", tp=2, pp=2)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=4))
    straight = run_on_ranks(4, train_and_collect, cfg, token_path, None, (2,))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-00000002")
    resumed_cfg = replace(cfg, trainer=replace(cfg.trainer, out_dir=str(tmp_path / "b")))
    resumed = run_on_ranks(4, train_and_collect, resumed_cfg, token_path, ckpt)
    for (losses_a, pieces_a), (losses_b, pieces_b) in zip(straight, resumed, strict=True):
        assert losses_a[2:] == losses_b, "losses after resume differ"
        for key, tensor in pieces_a.items():
            assert torch.equal(tensor, pieces_b[key]), f"{key[0]} differs after resume"


@pytest.mark.parametrize(
    "source, layout",
    [(dict(tp=2, pp=2), dict(dp=2, zero_=3)), (dict(dp=2, zero_=1), dict(tp=2))],
    ids=["tp2pp2-to-dp2zero3", "dp2zero1-to-tp2"],
)
def test_muon_state_reshards_into_another_layout(token_path, references, tmp_path, source, layout):
    """Saved at step 2 under one layout, resumed under another: step 3 lands where the uninterrupted run does
    (a fresh momentum buffer would not)."""
    src = muon_config(tmp_path / "src", **source)
    run_on_ranks(src.parallel.tp * src.parallel.pp * src.parallel.dp, train_and_collect, src, token_path, None, (2,))
    ckpt = str(tmp_path / "src" / "checkpoints" / "step-00000002")
    cfg = muon_config(tmp_path / "dst", **layout)
    results = run_on_ranks(cfg.parallel.tp * cfg.parallel.dp, train_and_collect, cfg, token_path, ckpt)
    ref_losses, ref_params = references["dense"]
    for losses, _ in results:
        np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-5)
    params = assemble(results)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_switching_from_adamw_to_muon_at_resume_is_refused_in_one_line(token_path, tmp_path):
    src = replace(muon_config(tmp_path / "src"), optim=replace(muon_config(tmp_path).optim, name="adamw"))
    run_on_ranks(1, train_and_collect, src, token_path, None, (2,))
    ckpt = str(tmp_path / "src" / "checkpoints" / "step-00000002")
    with pytest.raises(RankError, match=r"holds AdamW state for .*, which this run updates with Muon") as info:
        run_on_ranks(1, train_and_collect, muon_config(tmp_path / "dst"), token_path, ckpt)
    line = next(x for x in str(info.value).splitlines() if "holds AdamW state" in x)
    assert "optim.name" in line

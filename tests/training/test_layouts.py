"""Training on any layout computes what the single-device run computes: losses and parameters step by step."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.testing import run_on_ranks
from modelpar.training.config import ModelConfig, TrainConfig
from tests.helpers import TINY, assemble, assert_matches_reference, logits_after_loading, make_config, train_and_collect


@pytest.fixture(scope="module")
def reference(token_path, tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("ref"))
    (result,) = run_on_ranks(1, train_and_collect, cfg, token_path)
    return result[0], assemble([result])


LAYOUTS = [
    dict(tp=2),
    dict(tp=2, sp=True),
    dict(pp=2),
    dict(dp=2),
    dict(dp=2, zero_=1),
    dict(tp=2, pp=2),
    dict(pp=2, schedule="zb-h1", microbatches=4),
    dict(pp=2, vpp=2, schedule="interleaved", microbatches=2),
    dict(dp=2, pp=2, zero_=1),
    dict(tp=4),  # kv_heads=2 < tp: k/v rows replicated, counted once in the grad norm
    dict(tp=4, zero_=1),
    dict(tp=2, pp=2, partition="explicit", stage_layers=[3, 1]),  # uneven, as partition=flops splits
    dict(tp=2, pp=2, partition="explicit", stage_layers=[2.5, 1.5]),  # a cut between attention and MLP
    dict(pp=2, vpp=2, schedule="interleaved", microbatches=2, partition="explicit", stage_layers=[0.5, 1.5, 1.5, 0.5]),
    dict(tp=2, collectives="native"),  # gloo's own ring instead of the exchange
    # full recompute: each block's forward (its tp collectives included) reruns inside backward
    dict(recompute="full"),
    dict(tp=2, pp=2, recompute="full"),
    dict(tp=2, sp=True, recompute="full"),
    dict(tp=2, pp=2, schedule="zb-h1", microbatches=4, recompute="full"),  # B reruns the forward, W reuses it
    dict(
        pp=2,
        vpp=2,
        schedule="interleaved",
        microbatches=2,
        partition="explicit",
        stage_layers=[0.5, 1.5, 1.5, 0.5],
        recompute="full",
    ),
    dict(dp=2, pp=2, zero_=1, schedule="gpipe", recompute="full"),
    # selective recompute: matmul and attention outputs kept, the rest rerun; or the MLP half rerun whole
    dict(tp=2, pp=2, recompute="selective"),
    dict(tp=2, sp=True, recompute="selective", recompute_modules=["mlp", "elementwise"]),
    dict(pp=2, schedule="zb-h1", microbatches=4, recompute="selective", recompute_modules=["attention"]),
    # ZeRO-2 / ZeRO-3 on FSDP2: gradients (and weights) sharded over dp, block by block
    dict(dp=2, zero_=2),
    dict(dp=2, zero_=3),
    dict(dp=2, tp=2, zero_=3),
    dict(dp=2, tp=2, sp=True, zero_=2),
    dict(dp=2, pp=2, zero_=3),
    dict(dp=2, pp=2, vpp=2, schedule="interleaved", microbatches=2, zero_=3),
    dict(dp=4, zero_=3, recompute="full"),
    dict(dp=4, zero_=3, zero_group_=2),  # hybrid: shards over pairs of ranks, replicas across the pairs
    dict(dp=2, pp=2, zero_=3, recompute="selective"),
    # saved activations through the host-memory hooks
    dict(tp=2, pp=2, offload_activations=True),
    dict(dp=2, recompute="full", offload_activations=True),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_layout_matches_single_device(layout, token_path, reference, tmp_path):
    layout = dict(layout)
    zero, zero_group = layout.pop("zero_", 0), layout.pop("zero_group_", 0)
    cfg = make_config(tmp_path, **layout)
    cfg = replace(cfg, optim=replace(cfg.optim, zero=zero, zero_group=zero_group))
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    results = run_on_ranks(world, train_and_collect, cfg, token_path)
    ref_losses, ref_params = reference
    assert_matches_reference(results, (ref_losses, ref_params), layout)


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2, pp=2), dict(dp=2, pp=2, zero_=1), dict(dp=2, pp=2, zero_=3)],
    ids=["tp2-pp2", "dp2-pp2-zero1", "dp2-pp2-zero3"],
)
def test_resume_continues_bit_for_bit(token_path, tmp_path, layout):
    cfg = _with_zero(tmp_path / "a", layout)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=4))
    straight = run_on_ranks(4, train_and_collect, cfg, token_path, None, (2,))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-00000002")
    resumed_cfg = replace(cfg, trainer=replace(cfg.trainer, out_dir=str(tmp_path / "b")))
    resumed = run_on_ranks(4, train_and_collect, resumed_cfg, token_path, ckpt)
    for (losses_a, pieces_a), (losses_b, pieces_b) in zip(straight, resumed, strict=True):
        assert losses_a[2:] == losses_b, "losses after resume differ"
        for key, tensor in pieces_a.items():
            assert torch.equal(tensor, pieces_b[key]), f"{key[0]} differs after resume"


@pytest.mark.parametrize("tp", [1, 4])
def test_tp2_pp2_checkpoint_loads_into_other_layouts_with_identical_logits(token_path, tmp_path, tp):
    cfg = make_config(tmp_path / "src", tp=2, pp=2)
    run_on_ranks(4, train_and_collect, cfg, token_path, None, (3,))
    ckpt = str(tmp_path / "src" / "checkpoints" / "step-00000003")
    ref_cfg = make_config(tmp_path / "ref")
    ((ref_logits, _),) = run_on_ranks(1, logits_after_loading, ref_cfg, token_path, ckpt)
    new_cfg = make_config(tmp_path / "dst", tp=tp)
    out = run_on_ranks(tp, logits_after_loading, new_cfg, token_path, ckpt)
    for logits, _ in out:
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    # and the reference itself is the trained model, not a fresh init
    fresh = make_config(tmp_path / "fresh")
    ((untrained, _),) = run_on_ranks(1, logits_after_loading, fresh, token_path, None)
    assert not torch.allclose(untrained, ref_logits)


def _with_zero(cfg: TrainConfig, layout: dict) -> TrainConfig:
    layout = dict(layout)
    zero = layout.pop("zero_", 0)
    cfg = make_config(cfg, **layout)
    return replace(cfg, optim=replace(cfg.optim, zero=zero))


@pytest.mark.parametrize(
    "source, layout",
    [
        (dict(tp=2, pp=2), dict()),
        (dict(tp=2, pp=2), dict(tp=4)),
        (dict(tp=2, pp=2), dict(dp=2, zero_=1)),
        (dict(dp=2, pp=2, zero_=1), dict(tp=2)),  # ZeRO-1's dp segments gathered into logical moments
        (dict(pp=2, partition="explicit", stage_layers=[1.5, 2.5]), dict(pp=2)),  # block 1 cut in two, then whole
        (dict(dp=4, zero_=3), dict()),  # ZeRO-3 dp shards gathered into whole tensors and moments
        (dict(tp=2, pp=2), dict(dp=2, pp=2, zero_=3)),  # and scattered back into dp shards
    ],
    ids=[
        "tp2pp2-to-single",
        "tp2pp2-to-tp4",
        "tp2pp2-to-dp2zero1",
        "dp2pp2zero1-to-tp2",
        "pp2-halves-to-pp2",
        "dp4zero3-to-single",
        "tp2pp2-to-dp2pp2zero3",
    ],
)
def test_optimizer_state_follows_a_checkpoint_into_another_layout(token_path, reference, tmp_path, source, layout):
    """Save at step 2 under one layout, resume under another: step 3 lands where the uninterrupted run does,
    which needs the Adam moments and step count (a fresh optimizer takes a different step)."""
    src = _with_zero(tmp_path / "src", source)
    world = src.parallel.tp * src.parallel.pp * src.parallel.dp
    run_on_ranks(world, train_and_collect, src, token_path, None, (2,))  # 3 steps (the lr schedule's length)
    ckpt = str(tmp_path / "src" / "checkpoints" / "step-00000002")
    cfg = _with_zero(tmp_path / "dst", layout)
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    results = run_on_ranks(world, train_and_collect, cfg, token_path, ckpt)
    ref_losses, ref_params = reference
    for losses, _ in results:
        np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-5)
    params = assemble(results)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _offloaded_bytes(cfg: TrainConfig, data_path: str) -> tuple[int, int]:
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    trainer.train_step()
    offload = trainer.model.chunks[0].offload
    return offload.bytes_offloaded, offload.tensors_offloaded


def test_the_trainer_offloads_saved_activations(token_path, tmp_path):
    cfg = make_config(tmp_path, offload_activations=True)
    ((moved, count),) = run_on_ranks(1, _offloaded_bytes, cfg, token_path)
    # per micro-batch (2) and layer at least the MLP's gate|up output (b=4, s=16, 2 x ffn 48, fp32: 24 KiB)
    assert count >= 2 * TINY.layers and moved >= 2 * TINY.layers * 4 * 16 * 96 * 4, (moved, count)


# -- ZeRO-2/3 (FSDP2) under ZB-H1's split backward, and with kv heads replicated over tp ---------------------

TINY_KV1 = replace(TINY, kv_heads=1)  # at tp2 each rank holds the one kv head: its rows are summed over tp


@pytest.fixture(scope="module")
def reference_kv1(token_path, tmp_path_factory):
    cfg = replace(make_config(tmp_path_factory.mktemp("ref-kv1")), model=TINY_KV1)
    (result,) = run_on_ranks(1, train_and_collect, cfg, token_path)
    return result[0], assemble([result])


FSDP_LAYOUTS = [
    # B and W split: sync off for every B and W, each chunk's gradients reduce-scattered after its last W
    (TINY, dict(dp=2, pp=2, schedule="zb-h1", microbatches=4, zero_=2)),
    (TINY, dict(dp=2, pp=2, schedule="zb-h1", microbatches=4, zero_=3)),
    (TINY, dict(dp=2, pp=2, schedule="zb-h1", microbatches=2, zero_=2, recompute="full")),  # W reruns forwards
    (TINY, dict(dp=2, pp=2, schedule="zb-h1", microbatches=2, zero_=3, recompute="full")),
    (TINY, dict(dp=2, pp=2, schedule="zb-h1", microbatches=2, zero_=3, reduce_every_micro_batch_=True)),
    # the replicated k/v rows summed over tp on the dp shards FSDP2 reduce-scattered (sp: the norms too)
    (TINY_KV1, dict(dp=2, tp=2, zero_=3)),
    (TINY_KV1, dict(dp=2, tp=2, sp=True, zero_=2)),
]


@pytest.mark.parametrize(
    "model, layout",
    FSDP_LAYOUTS,
    ids=lambda v: f"kv{v.kv_heads}" if isinstance(v, ModelConfig) else "-".join(f"{k}{x}" for k, x in v.items()),
)
def test_fsdp_layout_matches_single_device(model, layout, token_path, request, tmp_path):
    optim = {k[:-1]: v for k, v in layout.items() if k.endswith("_")}
    cfg = make_config(tmp_path, **{k: v for k, v in layout.items() if not k.endswith("_")})
    cfg = replace(cfg, model=model, optim=replace(cfg.optim, **optim))
    cfg = replace(cfg, trainer=replace(cfg.trainer, check_every=1, drift_action="halt"))  # tp-replicated rows agree
    ref_losses, ref_params = request.getfixturevalue("reference" if model is TINY else "reference_kv1")
    results = run_on_ranks(cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp, train_and_collect, cfg, token_path)
    assert_matches_reference(results, (ref_losses, ref_params), layout)

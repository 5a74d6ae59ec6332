"""Context parallelism trains what the single-device run trains: losses, gradient norms and parameters after
every step, with each sequence split over cp ranks (ring, all-gather, all-to-all or hybrid attention), composed
with tp (and sp), pp, dp and ZeRO-1/3, with and without document masking."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.testing import run_on_ranks
from tests.helpers import TINY, assemble, assert_matches_reference, make_config, train_and_collect

EOS = 3


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    """Packed documents: EOS (id 3) about every 6 tokens, so each window holds several documents."""
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16)
    tokens[np.random.default_rng(1).random(4000) < 0.15] = EOS
    np.save(path, tokens)
    return str(path)


def configure(tmp_path, layout: dict, documents: bool):
    layout = dict(layout)
    zero = layout.pop("zero_", 0)
    cfg = make_config(tmp_path, **layout)
    return replace(
        cfg,
        # Adam's m/sqrt(v) turns the fp32 rounding of a near-zero gradient into a whole step; with eps=1e-6
        # updates stay proportional to gradients that small, so parameters compare at 1e-5 after 3 steps
        optim=replace(cfg.optim, zero=zero, eps=1e-6),
        data=replace(cfg.data, document_mask=documents, eos_id=EOS if documents else -1),
    )


@pytest.fixture(scope="module")
def references(token_path, tmp_path_factory):
    out = {}
    for documents in (False, True):
        cfg = configure(tmp_path_factory.mktemp("ref"), {}, documents)
        (result,) = run_on_ranks(1, train_and_collect, cfg, token_path)
        out[documents] = result[0], assemble([result])
    return out


def test_document_mask_changes_the_single_device_run(references):
    """The masked reference differs from the causal one (so the masked parity tests below test the mask)."""
    (plain, _), (masked, _) = references[False], references[True]
    assert not np.allclose(plain, masked, rtol=1e-3)


LAYOUTS = [
    (dict(cp=2), False),
    (dict(cp=2), True),
    (dict(cp=2, cp_comm="allgather"), True),
    (dict(cp=2, tp=2, sp=True), True),
    (dict(cp=2, dp=2, zero_=1), False),
    (dict(cp=2, pp=2), True),
    (dict(cp=2, pp=2, schedule="zb-h1", microbatches=4, recompute="full"), False),
    (dict(cp=2, pp=2, schedule="gpipe"), False),
    (dict(cp=2, pp=2, vpp=2, schedule="interleaved", microbatches=2), True),
    (dict(cp=2, tp=2), False),
    (dict(cp=2, dp=2), True),
    (dict(cp=4), True),
    (dict(cp=4, cp_comm="allgather"), False),
    (dict(cp=2, recompute="selective"), True),  # elementwise ops rerun, attention and matmul outputs kept
    (dict(cp=2, recompute="selective", recompute_modules=["attention"]), True),  # the ring reruns in backward
    (dict(cp=2, offload_activations=True), False),
    # heads exchanged by all-to-all (Ulysses), alone and with a ring across all-to-all pairs (hybrid)
    (dict(cp=2, cp_comm="alltoall"), True),
    (dict(cp=4, cp_comm="alltoall"), False),  # 2 kv heads repeated to one per cp rank
    (dict(cp=4, cp_comm="hybrid", cp_a2a=2), True),
    (dict(cp=2, cp_comm="alltoall", tp=2, sp=True), True),  # one kv head per tp rank, repeated
    (dict(cp=2, cp_comm="alltoall", dp=2, zero_=1), False),  # the optimizer state sharded over dp x cp
    (dict(cp=2, cp_comm="alltoall", dp=2, zero_=3), False),
    (dict(cp=2, cp_comm="alltoall", pp=2, recompute="full"), True),
]


@pytest.mark.parametrize(
    "layout, documents",
    LAYOUTS,
    ids=["-".join(f"{k}{v}" for k, v in lay.items()) + ("-documents" if docs else "") for lay, docs in LAYOUTS],
)
def test_context_parallel_matches_single_device(layout, documents, token_path, references, tmp_path):
    cfg = configure(tmp_path, layout, documents)
    p = cfg.parallel
    results = run_on_ranks(p.tp * p.cp * p.pp * p.dp, train_and_collect, cfg, token_path)
    ref_losses, ref_params = references[documents]
    assert_matches_reference(results, (ref_losses, ref_params), layout)


def _world(cfg) -> int:
    p = cfg.parallel
    return p.tp * p.cp * p.pp * p.dp


@pytest.mark.parametrize(
    "source, target",
    [(dict(cp=2, zero_=1), dict()), (dict(), dict(cp=2, dp=2, zero_=1))],
    ids=["cp2-zero1-to-single", "single-to-cp2-dp2-zero1"],
)
def test_checkpoint_moves_between_cp_layouts(source, target, token_path, references, tmp_path):
    """Saved at step 2 under one cp layout, resumed under another: step 3 lands where the uninterrupted
    single-device run does (weights and Adam moments are logical tensors, the same whatever cp)."""
    src = configure(tmp_path / "src", source, True)
    run_on_ranks(_world(src), train_and_collect, src, token_path, None, (2,))
    ckpt = tmp_path / "src" / "checkpoints" / "step-00000002"
    index = json.loads((ckpt / "index.json").read_text())
    if source.get("cp", 1) > 1:  # cp ranks hold the same weights: one of them writes each piece
        written = {piece["file"] for entry in index["tensors"].values() for piece in entry["pieces"]}
        assert written == {"model-00000.safetensors"}, written
    cfg = configure(tmp_path / "dst", target, True)
    results = run_on_ranks(_world(cfg), train_and_collect, cfg, token_path, str(ckpt))
    ref_losses, ref_params = references[True]
    for losses, _ in results:
        np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-5)
    params = assemble(results)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_reshard_writes_a_cp_layout_with_the_same_logical_tensors(token_path, tmp_path):
    from modelpar.checkpoint.store import Piece, load_pieces, read_index
    from modelpar.cli.ckpt import main as ckpt_main

    src_cfg = configure(tmp_path / "src", dict(cp=2), False)
    src_cfg = replace(src_cfg, trainer=replace(src_cfg.trainer, steps=2))
    run_on_ranks(2, train_and_collect, src_cfg, token_path, None, (2,))
    src = tmp_path / "src" / "checkpoints" / "step-00000002"
    assert ckpt_main(["reshard", str(src), str(tmp_path / "dst"), "--cp", "2", "--dp", "2"]) == 0
    dst = next((tmp_path / "dst").glob("step-*"))
    a, b = read_index(src), read_index(dst)
    assert (a["layout"]["cp"], b["layout"]["cp"], b["layout"]["dp"]) == (2, 2, 2)
    wanted = [Piece.whole(name, tuple(entry["global_shape"])) for name, entry in a["tensors"].items()]
    before, after = load_pieces(src, a, wanted), load_pieces(dst, b, wanted)
    assert all(torch.equal(before[p], after[p]) for p in wanted)


def test_bf16_autocast_at_cp2_tracks_the_single_device_bf16_run(token_path, tmp_path):
    """Under bf16 autocast the blocks' outputs are bf16 but their lse merge, dK/dV sums and ring transfers of
    gradients stay fp32: cp2's losses and norms follow the single device's to bf16's precision."""
    runs = {}
    for name, layout in (("single", {}), ("ring", dict(cp=2)), ("allgather", dict(cp=2, cp_comm="allgather"))):
        cfg = configure(tmp_path / name, layout, True)
        cfg = replace(cfg, trainer=replace(cfg.trainer, dtype="bf16"))
        runs[name] = run_on_ranks(_world(cfg), train_and_collect, cfg, token_path)[0][0]
    for name in ("ring", "allgather"):
        np.testing.assert_allclose(runs[name], runs["single"], rtol=2e-3, err_msg=name)

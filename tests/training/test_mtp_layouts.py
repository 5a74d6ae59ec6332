"""Multi-token prediction on a dense model with a tied embedding trains as on one device: losses, the first
step's gradients and the parameters after 3 steps, at tp2, pp2 (the embedding shared by the first and the last
stage), cp2 x tp2 with sequence parallel, the interleaved schedule, and the split input/weight backward of
ZB-H1 and ZB-V (the V placement: both ends of the model on one rank). Expert layouts with MTP
are in test_expert_parallel (the deepseek router)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.testing import run_on_ranks
from tests.helpers import TINY, assemble, make_config
from tests.training.recorded_runs import fit_and_read_metrics, train_and_collect

LAYOUTS = [
    dict(tp=2, dp=2),
    dict(pp=2, dp=2),
    dict(cp=2, tp=2, sp=True),
    dict(pp=2, vpp=2, schedule="interleaved"),
    dict(pp=2, schedule="zb-h1"),
    dict(pp=2, vpp=2, schedule="zbv"),
]


def mtp_config(tmp_path, **parallel):
    cfg = make_config(tmp_path, **parallel)
    return replace(cfg, model=replace(TINY, mtp_depth=2, mtp_loss_weight=0.5))


@pytest.fixture(scope="module")
def reference(token_path, tmp_path_factory):
    ((losses, grads, pieces, _),) = run_on_ranks(
        1, train_and_collect, mtp_config(tmp_path_factory.mktemp("r")), token_path
    )
    return losses, assemble([(None, grads)]), assemble([(None, pieces)])


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in d.items()) for d in LAYOUTS])
def test_mtp_layout_matches_single_device(layout, reference, token_path, tmp_path):
    ref_losses, ref_grads, ref_params = reference
    cfg = mtp_config(tmp_path, **layout)
    results = run_on_ranks(cfg.parallel.layout().world_size, train_and_collect, cfg, token_path)
    for losses, *_ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=str(layout))
    grads = assemble([(None, g) for _, g, _, _ in results])
    assert grads.keys() == ref_grads.keys() and "mtp.1.eh_proj.weight" in grads
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max())
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")
    params = assemble([(None, p) for _, _, p, _ in results])
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=3e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(document_mask=True), "model.mtp_depth=2 with data.document_mask=true"),
    ],
)
def test_unsupported_mtp_recipes_are_one_line_errors(change, message, tmp_path):
    from modelpar.training.config import RecipeError, validate

    cfg = mtp_config(tmp_path, pp=2)
    cfg = replace(cfg, data=replace(cfg.data, **change))
    with pytest.raises(RecipeError, match=message) as info:
        validate(cfg)
    assert "\n" not in str(info.value)


def test_mtp_losses_and_tokens_reach_metrics_jsonl_alike_on_every_layout(token_path, tmp_path):

    (want,) = run_on_ranks(1, fit_and_read_metrics, mtp_config(tmp_path / "one"), token_path)
    got = run_on_ranks(4, fit_and_read_metrics, mtp_config(tmp_path / "pp", pp=2, cp=2), token_path)[0]
    assert len(got) == len(want) == 3
    for ours, theirs in zip(got, want, strict=True):
        assert ours["mtp"]["tokens"] == theirs["mtp"]["tokens"] == 8 * (15 + 14)  # 8 windows of 16, depths 1, 2
        np.testing.assert_allclose(ours["mtp"]["loss"], theirs["mtp"]["loss"], rtol=1e-5)
        assert 0 < ours["mtp"]["loss"][0] < ours["loss"]  # each depth's own mean, beside the weighted total

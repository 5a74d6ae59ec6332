"""ZB-V and DualPipeV (two chunks per rank folded in a V) train exactly as the single-device model does."""

from dataclasses import replace

import pytest
import torch

from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError, validate
from tests.helpers import TINY, assemble, assert_matches_reference, make_config, train_and_collect

UNTIED = replace(TINY, tie_embeddings=False)
HALVES = dict(partition="explicit", stage_layers=[0.5] * 8)  # pp4 x vpp2: eight chunks of half a block each

# (model, layout): every V layout runs 3 steps and is compared with the single-device run of that model
LAYOUTS = [
    (TINY, dict(pp=2, schedule="zbv", microbatches=4)),
    (TINY, dict(pp=2, schedule="dualpipev", microbatches=4)),
    (TINY, dict(pp=2, schedule="zbv", microbatches=2)),  # m = pp: the smallest V
    (TINY, dict(pp=4, schedule="zbv", microbatches=4, **HALVES)),
    (TINY, dict(pp=4, schedule="dualpipev", microbatches=8, **HALVES)),
    (TINY, dict(tp=2, sp=True, pp=2, schedule="zbv", microbatches=4)),
    (TINY, dict(tp=2, pp=2, schedule="dualpipev", microbatches=4, recompute="full")),
    (TINY, dict(pp=2, schedule="zbv", microbatches=4, recompute="selective", recompute_modules=["attention"])),
    (TINY, dict(pp=2, schedule="zbv", microbatches=4, recompute="selective", recompute_modules=["elementwise"])),
    (TINY, dict(dp=2, pp=2, schedule="zbv", microbatches=2, zero_=1)),
    (UNTIED, dict(dp=2, pp=2, schedule="zbv", microbatches=2, zero_=3)),
    (TINY, dict(dp=2, pp=2, vpp=1, schedule="zb-h1", microbatches=2, zero_=3)),  # what a tied V's refusal names
    (UNTIED, dict(dp=2, pp=2, schedule="dualpipev", microbatches=2, zero_=2, recompute="full")),
    (TINY, dict(cp=2, pp=2, schedule="zbv", microbatches=2)),
    (TINY, dict(pp=2, schedule="dualpipev", microbatches=4, offload_activations=True)),
]


@pytest.fixture(scope="module")
def references(token_path, tmp_path_factory):
    out = {}
    for model in (TINY, UNTIED):
        cfg = replace(make_config(tmp_path_factory.mktemp("ref")), model=model)
        (result,) = run_on_ranks(1, train_and_collect, cfg, token_path)
        out[model.tie_embeddings] = (result[0], assemble([result]))
    return out


def _config(tmp_path, model, layout):
    layout = dict(layout)
    zero = layout.pop("zero_", 0)
    cfg = make_config(tmp_path, **{"vpp": 2, **layout})
    return replace(cfg, model=model, optim=replace(cfg.optim, zero=zero))


def _id(x) -> str:
    if not isinstance(x, dict):
        return "tied" if x.tie_embeddings else "untied"
    return "-".join(f"{k}{v}" for k, v in x.items() if k != "stage_layers")


@pytest.mark.parametrize("model, layout", LAYOUTS, ids=_id)
def test_v_schedule_matches_single_device(model, layout, token_path, references, tmp_path):
    cfg = _config(tmp_path, model, layout)
    p = cfg.parallel
    results = run_on_ranks(p.tp * p.cp * p.pp * p.dp, train_and_collect, cfg, token_path)
    assert_matches_reference(results, references[model.tie_embeddings], layout)


def test_a_zbv_checkpoint_resumes_bit_for_bit_and_loads_under_1f1b(token_path, tmp_path):
    cfg = _config(tmp_path / "a", TINY, dict(pp=2, schedule="zbv", microbatches=4))
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=4))
    straight = run_on_ranks(2, train_and_collect, cfg, token_path, None, (2,))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-00000002")
    resumed = run_on_ranks(
        2, train_and_collect, replace(cfg, trainer=replace(cfg.trainer, out_dir=str(tmp_path / "b"))), token_path, ckpt
    )
    for (losses_a, pieces_a), (losses_b, pieces_b) in zip(straight, resumed, strict=True):
        assert losses_a[2:] == losses_b
        assert all(torch.equal(t, pieces_b[k]) for k, t in pieces_a.items())
    # the same checkpoint under 1F1B (one chunk per rank): the same two steps, to float rounding
    plain = make_config(tmp_path / "c", pp=2, microbatches=4)
    plain = replace(plain, trainer=replace(plain.trainer, steps=4))
    other = run_on_ranks(2, train_and_collect, plain, token_path, ckpt)
    for got, want in zip([lo for r in other for lo in r[0]], [lo for r in straight for lo in r[0][2:]], strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(assemble(other), assemble(straight), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "layout, zero, message",
    [
        (dict(pp=2, schedule="zbv"), 0, "set parallel.vpp=2"),
        (dict(pp=2, vpp=2, schedule="dualpipev"), 3, "tied embeddings"),
        (
            dict(pp=2, vpp=2, schedule="zbv"),
            3,
            "with parallel.schedule=zb-h1 or interleaved, or under zbv at optim.zero=1",
        ),
    ],
)
def test_what_a_v_cannot_do_is_refused_in_one_line(tmp_path, layout, zero, message):
    cfg = make_config(tmp_path, **layout)
    with pytest.raises(RecipeError, match=message) as err:
        validate(replace(cfg, optim=replace(cfg.optim, zero=zero)))
    assert "\n" not in str(err.value)

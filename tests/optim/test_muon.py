"""Muon on one device equals torch's own ``torch.optim.Muon`` + ``torch.optim.AdamW`` applied by hand.

The reference optimises each logical matrix (q, k and v of the fused q/k/v weight, gate and up of the fused MLP
weight) as its own tensor with ``torch.optim.Muon``, and everything else (embedding, norms) with
``torch.optim.AdamW``; the engine runs its ``optim.name=muon`` optimizer on the fused model.
"""

from dataclasses import replace

import pytest
import torch

from modelpar.optim import set_lr
from modelpar.optim.muon import MuonSettings, adjust_ratio, newton_schulz, newton_schulz_batched, newton_schulz_flops
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import current_groups, run_on_ranks
from modelpar.training.build import build_rank_model, build_rank_optimizer
from tests.helpers import make_config

LR, WD, STEPS = 2e-2, 0.1, 4


def test_newton_schulz_is_torchs():
    g = torch.Generator().manual_seed(0)
    for shape in [(8, 24), (24, 8), (16, 16)]:
        m = torch.randn(shape, generator=g)
        ref = torch.optim._muon._zeropower_via_newtonschulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(newton_schulz(m, MuonSettings()), ref)
    assert adjust_ratio("match_rms_adamw", (8, 32)) == 0.2 * 32**0.5
    assert adjust_ratio("original", (32, 8)) == 2.0
    assert newton_schulz_flops((8, 32), 5) == newton_schulz_flops((32, 8), 5) == 5 * 2 * (2 * 8 * 8 * 32 + 8**3)


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_batched_newton_schulz_equals_one_matrix_at_a_time(ns_dtype):
    """Experts of one shape go through Newton-Schulz as one batch: each equals its own loop iteration."""
    settings = MuonSettings(ns_dtype=ns_dtype)
    g = torch.Generator().manual_seed(0)
    for shape in ((16, 16), (24, 16), (12, 40)):
        batch = torch.randn(5, *shape, generator=g)
        batch[2] *= 100.0  # each matrix scaled by its own norm, not the batch's
        loop = torch.stack([newton_schulz(m, settings) for m in batch])
        together = newton_schulz_batched(batch, settings)
        tol = dict(rtol=1e-6, atol=1e-7) if ns_dtype == "fp32" else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(together.float(), loop.float(), **tol)


def _batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _engine_and_torch(cfg, adjust_lr: str, per_head: bool = False):
    groups = current_groups()
    model = build_rank_model(cfg, groups, torch.device("cpu"))
    (chunk,) = model.chunks
    (ref,) = build_rank_model(cfg, groups, torch.device("cpu")).chunks  # the same init (trainer.seed)
    opt = build_rank_optimizer(cfg, model, groups)
    settings = MuonSettings(adjust_lr=adjust_lr)
    shards = ref.logical_shards()
    matrices = {n: s for n, s in shards.items() if settings.uses_muon(n, s.global_shape)}
    fused = {id(s.param) for s in matrices.values()}
    # torch's Muon over standalone copies of each logical matrix (per head: each head's rows of q, k and v),
    # its AdamW over every other parameter
    d = cfg.model.head_size
    blocks = {}  # standalone name -> (logical name, rows)
    for n, sh in matrices.items():
        split = per_head and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
        rows = sh.global_shape[0]
        for first in range(0, rows, d if split else rows):
            blocks[f"{n}[{first}]"] = (n, slice(first, first + (d if split else rows)))
    standalone = {b: torch.nn.Parameter(matrices[n].tensor[r].clone()) for b, (n, r) in blocks.items()}
    muon = torch.optim.Muon(list(standalone.values()), lr=LR, weight_decay=WD, adjust_lr_fn=adjust_lr)
    others = [(n, p) for n, p in ref.named_parameters() if id(p) not in fused]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for _, p in others if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for _, p in others if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    # q k v o gate up down per layer; per head: q's 4 heads, k's and v's 2 each
    assert len(muon.param_groups[0]["params"]) == 4 * (4 + 2 + 2 + 4 if per_head else 7)
    ours, theirs = [], []
    for step in range(STEPS):
        x, y = _batch(step % 2, cfg.model.vocab_size)  # two batches in turn: the loss falls
        loss = chunk.loss(chunk(x), y)
        loss.backward()
        opt.reduce_gradients()
        set_lr(opt, LR)
        opt.step()
        opt.zero_grad()
        ours.append(loss.item())

        loss = ref.loss(ref(x), y)
        loss.backward()
        for b, w in standalone.items():
            n, r = blocks[b]
            w.grad = matrices[n].grad[r].clone()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for b, w in standalone.items():
                n, r = blocks[b]
                matrices[n].tensor[r].copy_(w)
        muon.zero_grad()
        adamw.zero_grad()
        ref.zero_grad(set_to_none=True)
        theirs.append(loss.item())
    mine = {n: s.tensor.clone() for n, s in chunk.logical_shards().items()}
    return ours, theirs, mine, {n: s.tensor.clone() for n, s in shards.items()}


@pytest.mark.parametrize(
    "adjust_lr, per_head",
    [("match_rms_adamw", False), ("original", False), ("match_rms_adamw", True)],
    ids=["match_rms_adamw", "original", "per-head"],
)
def test_one_device_equals_torch_muon_and_adamw(tmp_path, adjust_lr, per_head):
    cfg = make_config(tmp_path)
    optim = dict(lr=LR, weight_decay=WD, grad_clip=0.0, muon_adjust_lr=adjust_lr, warmup_steps=0)
    cfg = replace(cfg, optim=replace(cfg.optim, name="muon", muon_per_head=per_head, **optim))
    ((ours, theirs, mine, ref),) = run_on_ranks(1, _engine_and_torch, cfg, adjust_lr, per_head, layout=ParallelLayout())
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-6, atol=0)
    assert ours[-2] < ours[0] and ours[-1] < ours[1], ours
    for name, want in ref.items():
        torch.testing.assert_close(mine[name], want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")

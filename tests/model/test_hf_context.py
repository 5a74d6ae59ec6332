"""An imported Hugging Face Llama evaluated with each sequence split over cp ranks (and tp) gives transformers'
logits and loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.reference import rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-5
TOKENS = torch.tensor([[3, 17, 60, 0, 42, 9, 9, 31, 5], [59, 1, 2, 44, 12, 37, 50, 8, 8]])


def _cp_logits_and_loss(path, comm):
    import torch.distributed as dist

    from modelpar.model.hf import config_from_hf, import_hf
    from modelpar.model.transformer import build_model
    from modelpar.parallel.collectives import all_gather
    from modelpar.parallel.context import split_for_context
    from modelpar.testing import current_groups

    groups = current_groups()
    model = build_model(config_from_hf(path), groups, seed=0, cp_comm=comm)
    import_hf(path, model)
    inputs, targets = (split_for_context(t, model.cp) for t in (TOKENS[:, :-1], TOKENS[:, 1:]))
    with torch.no_grad():
        logits = model(inputs)
        loss = model.loss(logits.clone(), targets).reshape(1)
    dist.all_reduce(loss, group=groups.cp_group)
    if groups.layout.tp > 1:
        logits = all_gather(logits.contiguous(), groups.tp_group, dim=-1)
    return logits, (loss / groups.layout.cp).item(), groups.cp_rank


@pytest.mark.parametrize("layout, comm", [(ParallelLayout(cp=2), "ring"), (ParallelLayout(tp=2, cp=2), "allgather")])
def test_imported_model_gives_transformers_loss_at_cp(hf_model, layout, comm):
    from modelpar.parallel.context import merge_from_context

    path, _ = hf_model
    hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want_logits = hf(TOKENS[:, :-1]).logits
    want_loss = F.cross_entropy(want_logits.flatten(0, 1), TOKENS[:, 1:].flatten()).item()
    results = run_on_ranks(layout.world_size, _cp_logits_and_loss, path, comm, layout=layout)
    by_cp = {cp_rank: logits for logits, _, cp_rank in results}  # tp ranks of one cp rank hold the same
    logits = merge_from_context([by_cp[r] for r in range(layout.cp)])[..., : want_logits.shape[-1]]
    assert rel_err(logits, want_logits) <= TOL
    for _, loss, _ in results:
        assert loss == pytest.approx(want_loss, rel=TOL)

"""Multi-head latent attention computes the single-device model at every tp / sp / cp layout: loss and every
gradient (after the tp partial sums and the cp mean), in one call of the warm 4-rank pool that builds each
layout's groups in turn."""

from __future__ import annotations

from dataclasses import replace

import torch

from modelpar import ParallelLayout
from modelpar.model.config import MLAConfig, ModelConfig
from modelpar.model.transformer import build_model
from modelpar.optim.finalize import reduce_tensor_parallel_grads
from modelpar.parallel.context import document_ids, split_for_context
from modelpar.parallel.groups import ParallelGroups
from modelpar.testing import run_on_ranks
from tests.model.reference import check_pieces, pieces

MLA = MLAConfig(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
CONFIGS = {
    "q-lora": ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=4, ffn_hidden=40, max_seq_len=16, init_std=0.2, mla=MLA
    ),
    "q-proj": ModelConfig(
        vocab_size=53, hidden=36, layers=2, heads=4, kv_heads=4, ffn_hidden=24, max_seq_len=16, init_std=0.2,
        tie_embeddings=True, mla=replace(MLA, q_lora_rank=0),
    ),
}  # fmt: skip
EOS = 0
# (config, layout, cp exchange, sequence parallel, document mask)
CASES = [
    ("q-lora", dict(tp=2, dp=2), "ring", False, False),
    ("q-lora", dict(tp=2, dp=2), "ring", True, False),
    ("q-proj", dict(tp=2, dp=2), "ring", True, True),
    ("q-lora", dict(tp=4), "ring", True, False),
    ("q-lora", dict(cp=2, dp=2), "ring", False, False),
    ("q-lora", dict(cp=2, dp=2), "allgather", False, True),
    ("q-lora", dict(cp=2, tp=2), "ring", True, True),
    ("q-proj", dict(cp=2, tp=2), "allgather", False, False),
    ("q-lora", dict(cp=4), "ring", False, True),
]
PROBE = "layers.0.self_attn.kv_a_proj_with_mqa.weight"  # replicated over tp: partial until summed


def _batch():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(1, 53, (2, 17), generator=gen)
    tokens[0, [4, 5, 11]] = EOS
    tokens[1, [9]] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(config, groups, comm, sp, with_documents):
    """Loss and gradient pieces of one forward/backward; under cp the cp ranks' mean, as dp x cp reduction does."""
    import torch.distributed as dist

    model = build_model(config, groups, seed=3, cp_comm=comm, sequence_parallel=sp)
    inputs, targets = _batch()
    if with_documents:
        documents = document_ids(inputs, eos_id=EOS)
        model.documents.source = lambda: documents
    loss = model.loss(model(split_for_context(inputs, model.cp)), split_for_context(targets, model.cp))
    loss.backward()
    unreduced = model.logical_shards()[PROBE].grad.clone()
    reduce_tensor_parallel_grads(model)
    grads = pieces(model)
    loss = loss.detach()
    if model.cp.size > 1:
        for tensor in (loss, unreduced, *(g for _, _, g in grads.values())):
            dist.all_reduce(tensor, group=model.cp.group)
            tensor /= model.cp.size
    return loss.item(), grads, unreduced


def _every_layout(cases):
    out = []
    for name, layout, comm, sp, documents in cases:
        groups = ParallelGroups.build(ParallelLayout(**layout))
        loss, grads, unreduced = _loss_and_grads(CONFIGS[name], groups, comm, sp, documents)
        first = groups.dp_rank == 0 and groups.cp_rank == 0  # one copy of every piece
        out.append((loss, grads if first else None, unreduced))
    return out


def test_every_layout_gives_the_single_device_loss_and_gradients():
    per_rank = run_on_ranks(4, _every_layout, CASES, timeout_s=300)
    references = {}
    for i, (name, layout, comm, sp, documents) in enumerate(CASES):
        if (name, documents) not in references:
            loss, grads, _ = _loss_and_grads(CONFIGS[name], None, "ring", False, documents)
            references[name, documents] = loss, {n: g for n, (_, _, g) in grads.items()}
        want_loss, want = references[name, documents]
        label = (name, layout, comm, sp, documents)
        results = [rank[i] for rank in per_rank]
        for loss, _, _ in results:
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), label
        check_pieces([grads for _, grads, _ in results if grads is not None], want, 1e-5)
        if layout.get("tp", 1) > 1:  # each tp rank's share of a replicated down-projection is not the whole
            unreduced = results[0][2]
            assert ((unreduced - want[PROBE]).abs().max() / want[PROBE].abs().max()).item() > 1e-2, label

"""Shared by the model tests: one forward (and backward) of a tiny model on any layout, run inside a worker, with
the gradients reduced as a step would reduce them, so that several layouts share one warm-pool call.

``run_layouts(cases)`` runs on every rank of the pool: for each ``(config, layout, options, hf_path)`` it builds that
layout's groups, its chunk (tp, cp, ep; pp=2 as two stages joined by send/recv, whole blocks or halves),
optionally loads HF weights, runs the batch (split over dp, and over cp as the trainer splits it) and returns this
rank's loss (the global mean; None off the last stage) and its ``(index, local gradient)`` of every logical tensor.
"""

from __future__ import annotations

import torch

from tests.model.reference import rel_err

# inputs [:, :-1], targets [:, 1:]; 4 sequences, so dp up to 4 splits them
IDS = torch.tensor(
    [[3, 17, 60, 0, 42, 9, 9, 31, 5], [59, 1, 2, 44, 12, 37, 50, 8, 8], [7, 7, 21, 33, 4, 58, 16, 2, 40],
     [11, 45, 0, 13, 29, 52, 3, 36, 19]]
)  # fmt: skip


def transformers_loss(model) -> float:
    """A transformers causal LM's next-token loss on ``IDS`` (what an imported model must reproduce)."""
    with torch.no_grad():
        logits = model(IDS[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), IDS[:, 1:].flatten()).item()


def check_import_export(path, want: float, out, model_type: str, hf_class, tol: float) -> None:
    """The HF directory ``path`` imported with no overrides gives transformers' loss ``want``; exported to ``out``
    it holds the tensors transformers saved, bit for bit, names ``model_type`` and reloads in ``hf_class`` with
    that loss."""
    import json

    import pytest
    from safetensors.torch import load_file

    from modelpar.model.hf import config_from_hf, export_hf, import_hf
    from modelpar.model.transformer import build_model

    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    with torch.no_grad():
        assert abs(model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item() - want) <= tol * want
    export_hf(model, out)
    original, exported = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    assert transformers_loss(hf_class.from_pretrained(out).eval()) == pytest.approx(want, rel=tol)


def reference_loss_and_grads(config, *, seed=0, hf_path=None, **options):
    """The single-device model on the whole batch: (loss, {name: gradient})."""
    from modelpar.model.hf import import_hf
    from modelpar.model.transformer import build_model

    model = build_model(config, seed=seed, **options)
    if hf_path is not None:
        import_hf(hf_path, model)
    loss = model.loss(model(IDS[:, :-1]), IDS[:, 1:])
    loss.backward()
    # a tensor without a gradient (the sigmoid router's balancing bias) is held but not compared
    return loss.item(), {
        name: None if shard.grad is None else shard.grad.clone() for name, shard in model.logical_shards().items()
    }


def _stages(config, groups, seed, options):
    """This rank's chunk: the whole model, or its stage of ``options["stage_layers"]`` blocks a stage (halves
    allowed: [1.5, 0.5] cuts block 1 between its attention and its MLP), by default an even split."""
    from modelpar.model.transformer import build_chunk

    pp, stage = groups.layout.pp, groups.pp_rank
    if pp == 1:
        return build_chunk(config, groups, range(config.layers), first=True, last=True, seed=seed, **options)
    stage_layers = options.pop("stage_layers", [config.layers // pp] * pp)
    start = round(2 * sum(stage_layers[:stage]))  # in block halves
    end = start + round(2 * stage_layers[stage])
    split = {start // 2: "mlp"} if start % 2 else {}
    split |= {end // 2: "attention"} if end % 2 else {}
    ids = range(start // 2, (end + 1) // 2)
    first, last = stage == 0, stage == pp - 1
    return build_chunk(config, groups, ids, first=first, last=last, seed=seed, split_blocks=split, **options)


def layout_loss_and_grads(config, layout, options, *, seed=0, hf_path=None, backward=True):
    """On one rank of ``layout``: (global mean loss or None, {name: (index, gradient or None)})."""
    import torch.distributed as dist

    from modelpar.model.hf import import_hf
    from modelpar.optim.finalize import reduce_tensor_parallel_grads, sum_tied_embedding
    from modelpar.parallel.context import split_for_context
    from modelpar.parallel.groups import ParallelGroups

    groups = ParallelGroups.build(layout)
    chunk = _stages(config, groups, seed, dict(options))
    if hf_path is not None:
        import_hf(hf_path, chunk)
    rows = IDS.shape[0] // layout.dp
    mine = IDS[groups.dp_rank * rows : (groups.dp_rank + 1) * rows]
    inputs, targets = (split_for_context(t, chunk.cp) for t in (mine[:, :-1], mine[:, 1:]))
    with torch.set_grad_enabled(backward):
        loss = _run(chunk, groups, inputs, targets, backward)
    dp_cp = layout.dp * layout.cp
    if loss is not None and dp_cp > 1:  # every rank's mean over as many tokens: the mean of the means
        dist.all_reduce(loss, group=groups.dp_cp_group)
        loss /= dp_cp
    out = {}
    if backward:
        reduce_tensor_parallel_grads(chunk)
        if config.tie_embeddings and layout.pp > 1:  # the first stage's embedding and the last stage's copy
            embedding = chunk.embed_tokens if chunk.first else chunk.lm_head
            sum_tied_embedding([embedding.weight], groups.embedding_group)
    for name, shard in chunk.logical_shards().items():
        grad = None if not backward or shard.grad is None else shard.grad.clone()
        if grad is not None and dp_cp > 1:
            # dense weights: the mean over the dp x cp ranks; an expert: the sum over those holding it (each
            # saw its own routed rows), over dp x cp as every rank's loss is a mean over its own tokens
            if ".experts." not in name:
                dist.all_reduce(grad, group=groups.dp_cp_group)
            elif layout.ep < dp_cp:
                dist.all_reduce(grad, group=groups.expert_dp_group)
            grad /= dp_cp
        out[name] = (shard.index, grad)
    return (None if loss is None else loss.item()), out


def _run(chunk, groups, inputs, targets, backward):
    import torch.distributed as dist

    if groups.layout.pp == 1:
        loss = chunk.loss(chunk(inputs), targets)
        if backward:
            loss.backward()
        return loss.detach()
    peer = groups.pp_ranks[1 - groups.pp_rank]
    if chunk.first:
        y = chunk(inputs)
        dist.send(y.detach().contiguous(), peer)
        if backward:
            grad = torch.empty_like(y)
            dist.recv(grad, peer)
            y.backward(grad)
        return None
    x = torch.empty(*chunk.activation_shape(inputs.shape[0], inputs.shape[1] * chunk.cp.size))
    dist.recv(x, peer)
    x.requires_grad_(backward)
    loss = chunk.loss(chunk(x), targets)
    if backward:
        loss.backward()
        dist.send(x.grad.contiguous(), peer)
    return loss.detach()


def run_layouts(cases, backward=True):
    """Every case ``(config, layout, options, hf_path or None)`` on this rank, one after another (one pool call
    for all); the results in the order of ``cases``."""
    return [layout_loss_and_grads(c, layout, o, hf_path=hf, backward=backward) for c, layout, o, hf in cases]


def check_against_reference(per_rank_results, want_loss, want_grads, tol, label="") -> None:
    """Each rank's loss (where it has one) and every piece of every gradient equal the single-device ones; the
    ranks together hold every logical tensor."""
    seen = set()
    for rank, (loss, grads) in enumerate(per_rank_results):
        if loss is not None:
            assert abs(loss - want_loss) <= tol * abs(want_loss), f"{label} rank {rank}: loss {loss} != {want_loss}"
        for name, (index, grad) in grads.items():
            seen.add(name)
            if grad is not None:
                err = rel_err(grad, want_grads[name][index], scale=want_grads[name])
                assert err <= tol, f"{label} rank {rank}: {name} relative error {err:.3g} > {tol}"
    assert seen == set(want_grads), f"{label}: the ranks hold {sorted(seen ^ set(want_grads))} differently"

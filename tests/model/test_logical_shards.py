"""Logical tensors: layout-invariant initialisation, pipeline chunks, loading full or sliced global tensors."""

from __future__ import annotations

import pytest
import torch

from modelpar import LayoutError, ParallelLayout
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_chunk, build_model
from modelpar.optim.finalize import reduce_tensor_parallel_grads
from modelpar.testing import current_groups, run_on_ranks
from tests.model.reference import BATCH, CONFIGS, SEED, SEQ, batch, check_pieces, layout_for, pieces, rel_err

TOL = 1e-5


def _weights(config, sp):
    return pieces(build_model(config, current_groups(), seed=SEED, sequence_parallel=sp), "value")


@pytest.mark.parametrize("case", ["mha-untied", "gqa-kv1-untied", "gqa-q8-kv4-tied"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_same_seed_gives_the_same_global_weights_for_every_tp(tp, case):
    config = CONFIGS[case]
    want = {name: shard.tensor for name, shard in build_model(config, seed=SEED).logical_shards().items()}
    assert set(want) >= {"embed_tokens.weight", "layers.1.self_attn.k_proj.weight", "norm.weight"}
    assert ("lm_head.weight" in want) != config.tie_embeddings
    assert want["embed_tokens.weight"].shape == (config.vocab_size, config.hidden)
    check_pieces(run_on_ranks(4, _weights, config, False, layout=layout_for(tp))[:tp], want, tol=0.0)


def test_different_seeds_give_different_weights():
    config = CONFIGS["mha-untied"]
    a, b = (build_model(config, seed=s).logical_shards() for s in (0, 1))
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"].tensor, b["layers.0.mlp.up_proj.weight"].tensor)


def _pipeline_vs_whole(config, sp):
    groups = current_groups()
    whole = build_model(config, groups, seed=SEED, sequence_parallel=sp)
    kw = dict(seed=SEED, sequence_parallel=sp)
    stages = [
        build_chunk(config, groups, [0], first=True, last=False, **kw),
        build_chunk(config, groups, [1], first=False, last=True, **kw),
    ]
    ids, targets = batch(config)
    hidden = stages[0](ids)
    assert tuple(hidden.shape) == stages[0].activation_shape(BATCH, SEQ) == stages[1].activation_shape(BATCH, SEQ)
    logits = stages[1](hidden)
    stages[1].loss(logits, targets).backward()
    want = whole(ids)
    whole.loss(want, targets).backward()
    for chunk in (whole, *stages):
        reduce_tensor_parallel_grads(chunk)
    whole_shards = whole.logical_shards()
    grads = {}
    for chunk in stages:
        for name, shard in chunk.logical_shards().items():
            assert torch.equal(shard.tensor, whole_shards[name].tensor), f"{name} differs between pp and whole"
            # tied embeddings: first and last stage each hold a copy; the trainer adds their gradients
            grads[name] = grads.get(name, 0) + shard.grad
    assert set(grads) == set(whole_shards)
    return (
        rel_err(logits, want),
        max(rel_err(grads[name], shard.grad) for name, shard in whole_shards.items()),
        tuple(hidden.shape),
    )


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("case", ["mha-untied", "gqa-kv2-tied"])
def test_pipeline_chunks_compose_to_the_whole_model(case, sp):
    tp = 2
    for logits_err, grad_err, shape in run_on_ranks(4, _pipeline_vs_whole, CONFIGS[case], sp, layout=layout_for(tp)):
        assert logits_err <= TOL and grad_err <= TOL
        assert shape == (BATCH, SEQ // tp if sp else SEQ, CONFIGS[case].hidden)


def _load_and_run(config, state, sliced):
    model = build_model(config, current_groups(), seed=SEED + 1)
    if sliced:
        model.load_logical(lambda name, shard: state[name][shard.index].clone())
    else:
        model.load_logical(lambda name, shard: state[name])
    ids, _ = batch(config)
    return model(ids).detach(), model.full_state()


@pytest.mark.parametrize("sliced", [False, True], ids=["full", "sliced"])
@pytest.mark.parametrize("tp", [2, 4])
def test_loading_global_tensors_into_any_tp_reproduces_the_model(tp, sliced):
    config = CONFIGS["gqa-kv2-tied"]
    ref = build_model(config, seed=SEED)
    state = ref.full_state()
    want = ref(batch(config)[0]).detach()
    results = run_on_ranks(4, _load_and_run, config, state, sliced, layout=layout_for(tp))[:tp]
    logits = torch.cat([r[0] for r in results], dim=-1)[..., : config.vocab_size]
    assert rel_err(logits, want) <= TOL
    for _, gathered in results:
        assert gathered.keys() == state.keys()
        assert all(torch.equal(gathered[name], state[name]) for name in state)


def test_loading_a_tensor_of_the_wrong_shape_names_it():
    model = build_model(CONFIGS["mha-untied"], seed=SEED)
    with pytest.raises(ValueError, match=r"embed_tokens.weight: got shape \(3, 3\)"):
        model.load_logical(lambda name, shard: torch.zeros(3, 3))


def _sequence_error(config):
    model = build_model(config, current_groups(), seed=SEED, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 6 divisible by tp=4"):
        model.activation_shape(BATCH, 6)
    with pytest.raises(ValueError, match="divisible by tp=4"):
        model(torch.zeros(BATCH, 6, dtype=torch.int64))
    return model.activation_shape(BATCH, SEQ)


def test_sequence_parallel_needs_the_sequence_divisible_by_tp():
    config = CONFIGS["mha-untied"]
    assert run_on_ranks(4, _sequence_error, config, layout=layout_for(4))[0] == (BATCH, SEQ // 4, config.hidden)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(hidden=30, heads=4), "hidden=30 is not a multiple of heads=4"),
        (dict(hidden=36, heads=4), "head dim hidden/heads=9 must be even"),
        (dict(heads=4, kv_heads=3), "kv_heads=3 must divide heads=4"),
        (dict(kernels="cuda"), "kernels='cuda' is not one of"),
        (dict(layers=0), "layers=0 must be >= 1"),
    ],
)
def test_config_rejects_impossible_shapes(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields).check()


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (ParallelLayout(tp=3), r"tp=3 does not divide heads=4; try tp in \[1, 2, 4\]"),
        (ParallelLayout(tp=8), r"tp=8 does not divide heads=4"),
        (ParallelLayout(pp=4), r"pp\*vpp=4 exceeds the 2 layers"),
    ],
)
def test_layout_that_cannot_shard_the_model_is_refused_in_one_line(layout, message):
    with pytest.raises(LayoutError, match=message):
        CONFIGS["mha-untied"].check_layout(layout)


def test_chunk_refuses_layer_ids_outside_the_model():
    with pytest.raises(ValueError, match=r"layer_ids=\(0, 2\) must be ascending ids in 0..1"):
        build_chunk(CONFIGS["mha-untied"], None, [0, 2], first=True, last=True, seed=SEED)

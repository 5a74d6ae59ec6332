"""compile_blocks: the compiled model computes the eager one (loss, every gradient) on every layout."""

from __future__ import annotations

import pytest
import torch

from modelpar import ParallelLayout
from modelpar.model.compile import compile_blocks
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_chunk, build_model
from modelpar.parallel.collectives import record_comm
from modelpar.pipeline import PipelineRuntime, build_schedule, partition_uniform
from modelpar.testing import current_groups, run_on_ranks

CONFIG = ModelConfig(
    vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=16, init_std=0.2
)
BATCH, SEQ, M, SEED = 2, 8, 2, 5
TOL = 1e-5
# on emulated ranks the blocks compile with aot_eager: Dynamo's capture, its graph breaks at the collectives and
# AOTAutograd's forward and backward graphs are those of inductor, without a C++ build on every rank; inductor's
# code for the block is checked against eager in one process (the first tests)
MULTI_RANK_BACKEND = "aot_eager"


def tokens_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    """ids, targets: [M, BATCH, SEQ]."""
    ids = torch.randint(0, CONFIG.vocab_size, (M, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    return ids[..., :-1], ids[..., 1:]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _whole_model_step(
    compiled: bool, sequence_parallel: bool = False, groups=None, recompute: str = "none", backend: str = "inductor"
) -> dict:
    """Loss, comm count and every gradient of one forward + backward over both micro-batches (as one batch)."""
    model = build_model(CONFIG, groups, seed=SEED, sequence_parallel=sequence_parallel, recompute=recompute)
    if compiled:
        compile_blocks(model, backend=backend)
    tokens, targets = tokens_and_targets()
    with record_comm() as comm:
        loss = model.loss(model(tokens.flatten(0, 1)), targets.flatten(0, 1))
        loss.backward()
    return {
        "loss": loss.item(),
        "collectives": comm.count(),
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "state_keys": list(model.state_dict()),
    }


def _assert_same(compiled: dict, eager: dict, where: str = "") -> None:
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=TOL, abs=0), where
    assert compiled["grads"].keys() == eager["grads"].keys()
    for name, want in eager["grads"].items():
        err = rel_err(compiled["grads"][name], want)
        assert err <= TOL, f"{where} grad of {name}: relative error {err:.2e}"


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_keep_parameter_names_and_compute_the_eager_model(recompute):
    """With full recompute, backward reruns the compiled block inside the checkpoint."""
    eager = _whole_model_step(False, recompute=recompute)
    compiled = _whole_model_step(True, recompute=recompute)
    assert compiled["state_keys"] == eager["state_keys"]
    _assert_same(compiled, eager)


def test_compile_time_is_reported_once_when_the_forward_after_the_first_backward_begins():
    model = build_model(CONFIG, seed=SEED)
    reports: list[str] = []
    compilation = compile_blocks(model, report=reports.append, backend="aot_eager")  # the cheap backend
    tokens, targets = tokens_and_targets()
    logits = [model(ids) for ids in tokens]  # a pipeline's warm-up: forwards before any backward
    for logit, target in zip(logits, targets, strict=True):
        model.loss(logit, target).backward()
    assert reports == []
    model(tokens[0])
    model(tokens[1])
    assert reports == [compilation.summary()]
    assert reports[0].startswith(f"torch.compile: compiled {CONFIG.layers} blocks in ")
    assert reports[0].endswith(" s (first step)")
    assert compilation.reported and compilation.graphs >= 1 and compilation.compile_s > 0


def _tensor_parallel_step(compiled: bool, sequence_parallel: bool) -> dict:
    return _whole_model_step(compiled, sequence_parallel, current_groups(), backend=MULTI_RANK_BACKEND)


@pytest.mark.slow
def test_sequence_parallel_blocks_compile_to_the_eager_loss_gradients_and_collectives():
    """The regions' collectives break the graph and run eagerly: same result, same collectives issued (tensor
    parallelism without sequence parallelism: in the pipeline's stages, the next test)."""
    layout = ParallelLayout(tp=2)
    eager = run_on_ranks(2, _tensor_parallel_step, False, True, layout=layout)
    compiled = run_on_ranks(2, _tensor_parallel_step, True, True, layout=layout, timeout_s=600)
    for rank, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        _assert_same(c, e, f"tp rank {rank}")
        assert c["collectives"] == e["collectives"] > 0


def _pipeline_step(compiled: bool) -> dict:
    groups = current_groups()
    part = partition_uniform(CONFIG.layers, groups.layout.pp)
    chunks = [
        build_chunk(CONFIG, groups, part.layers(c), first=part.has_embedding(c), last=part.has_head(c), seed=SEED)
        for c in part.chunks_of(groups.pp_rank)
    ]
    if compiled:
        compile_blocks(chunks, backend=MULTI_RANK_BACKEND)
    runtime = PipelineRuntime(
        chunks,
        groups,
        build_schedule("1f1b", groups.layout.pp, M),
        activation_shape=chunks[0].activation_shape(BATCH, SEQ),
        loss_fn=chunks[-1].loss,
    )
    with record_comm() as comm:
        result = runtime.step(*tokens_and_targets())
    grads = {name: p.grad.clone() for chunk in chunks for name, p in chunk.named_parameters()}
    return {"loss": result.loss, "grads": grads, "collectives": comm.count()}


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_compiled_stages_compute_the_eager_step():
    """Each stage's tensor-parallel blocks: same loss and gradients, same collectives issued."""
    layout = ParallelLayout(tp=2, pp=2)
    eager = run_on_ranks(4, _pipeline_step, False, layout=layout)
    compiled = run_on_ranks(4, _pipeline_step, True, layout=layout, timeout_s=600)
    for rank, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        _assert_same(c, e, f"rank {rank}")
        assert c["collectives"] == e["collectives"] > 0, f"rank {rank}"

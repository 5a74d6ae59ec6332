"""What modelpar-train prints: a banner that names what runs, and plain lines, not a bar, into a file."""

from __future__ import annotations

import io
from dataclasses import replace

from modelpar.cli.train import describe_run
from modelpar.model.config import MoEConfig
from modelpar.model.structure import BlockStructure
from modelpar.training.sinks import ConsoleSink, ProgressSink, open_sinks
from tests.helpers import make_config


def test_the_banner_names_zero_moe_and_masking_in_good_english(tmp_path):
    cfg = make_config(tmp_path, dp=4, microbatches=1)
    cfg = replace(cfg, optim=replace(cfg.optim, zero=3), data=replace(cfg.data, document_mask=True))
    cfg = replace(cfg, model=replace(cfg.model, moe=MoEConfig(experts=4, top_k=2)))
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=1))
    text = describe_run(cfg)
    assert "(MoE 4 experts, top-2)" in text and "(4 ranks)" in text and "ZeRO-3" in text
    assert "1 micro-batch," in text and "document masking" in text and text.endswith("1 step")
    single = describe_run(make_config(tmp_path))
    assert "(1 rank)" in single and "2 micro-batches" in single and "ZeRO" not in single


def test_the_banner_names_the_block_pieces_no_fused_kernel_runs(tmp_path):
    cfg = make_config(tmp_path)
    gemma2 = BlockStructure(norm="sandwich", norm_offset=1.0, activation="geglu", attention_softcap=50.0)
    text = describe_run(replace(cfg, model=replace(cfg.model, kernels="triton", block=gemma2)))
    assert "torch path for GeGLU (the fused MLP kernel is SwiGLU) and attention soft-cap (the flash kernel" in text
    assert "torch path" not in describe_run(replace(cfg, model=replace(cfg.model, kernels="triton")))
    assert "torch path" not in describe_run(replace(cfg, model=replace(cfg.model, kernels="torch", block=gemma2)))


def test_the_progress_bar_only_draws_on_a_terminal(tmp_path, monkeypatch):
    cfg = make_config(tmp_path)
    cfg = replace(cfg, trainer=replace(cfg.trainer, progress=True))
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a file or a pipe
    sinks = open_sinks(cfg, tmp_path, 0)
    assert any(isinstance(s, ConsoleSink) for s in sinks) and not any(isinstance(s, ProgressSink) for s in sinks)
    for sink in sinks:
        sink.close()

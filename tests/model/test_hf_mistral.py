"""Hugging Face Mistral interop: a random ``MistralForCausalLM`` whose sliding window is shorter than the
sequence, imported with no overrides (the window read from its config), gives transformers' loss on one device,
at tp2, pp2 and cp2; without the window it would not; an export loads in transformers with the same loss;
local/global ``layer_types`` and the refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import ModelConfig
from modelpar.model.hf import config_from_hf, config_to_hf, export_hf, import_hf
from modelpar.model.transformer import build_chunk, build_model
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import current_groups, run_on_ranks

transformers = pytest.importorskip("transformers")

TOL = 1e-5
WINDOW = 3
TOKENS = torch.tensor([[3, 17, 60, 0, 42, 9, 9, 31, 5], [59, 1, 2, 44, 12, 37, 50, 8, 8]])  # 8 inputs each


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A random MistralForCausalLM (window 3 of 8 tokens) saved to a directory, and transformers' loss."""
    config = transformers.MistralConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500.0,
        initializer_range=0.2, sliding_window=WINDOW,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("hf") / "mistral"
    model.save_pretrained(path)
    return path, _hf_loss(transformers.MistralForCausalLM, path)


def _hf_loss(cls, path):
    model = cls.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(TOKENS[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten()).item()


def _loss(config, path, groups=None, **options):
    from modelpar.parallel.context import split_for_context

    model = build_model(config, groups, seed=0, **options)
    import_hf(path, model)
    inputs, targets = (split_for_context(t, model.cp) for t in (TOKENS[:, :-1], TOKENS[:, 1:]))
    with torch.no_grad():
        return model.loss(model(inputs), targets).item()


def test_config_reads_the_window_and_the_loss_is_transformers(mistral):
    path, want = mistral
    config = config_from_hf(path)
    assert (config.sliding_window, config.window_layers) == (WINDOW, [])
    assert _loss(config, path) == pytest.approx(want, rel=TOL)
    # the window matters: the same weights without it give another loss
    assert _loss(replace(config, sliding_window=0), path) != pytest.approx(want, rel=1e-3)


def _layout_loss(path, layout_name):
    import torch.distributed as dist

    groups = current_groups()
    config = config_from_hf(path)
    if layout_name == "pp2":  # stage 0 holds layer 0 and the embedding, stage 1 layer 1 and the head
        first = groups.pp_rank == 0
        chunk = build_chunk(config, groups, [0] if first else [1], first=first, last=not first, seed=0)
        import_hf(path, chunk)
        with torch.no_grad():
            if first:
                dist.send(chunk(TOKENS[:, :-1]).contiguous(), 1)
                return None
            hidden = torch.empty(2, 8, config.hidden)
            dist.recv(hidden, 0)
            return chunk.loss(chunk(hidden), TOKENS[:, 1:]).item()
    comm = layout_name.removeprefix("cp2-") if layout_name.startswith("cp2") else "ring"
    loss = torch.tensor(_loss(config, path, groups, cp_comm=comm))
    if groups.layout.cp > 1:  # each cp rank's mean over its half of the tokens
        dist.all_reduce(loss, group=groups.cp_group)
        loss /= groups.layout.cp
    return loss.item()


LAYOUTS = {"tp2": ParallelLayout(tp=2), "pp2": ParallelLayout(pp=2), "cp2-ring": ParallelLayout(cp=2),
           "cp2-allgather": ParallelLayout(cp=2)}  # fmt: skip


@pytest.mark.parametrize("name", LAYOUTS)
def test_imported_mistral_gives_transformers_loss_at(mistral, name):
    path, want = mistral
    losses = [x for x in run_on_ranks(2, _layout_loss, path, name, layout=LAYOUTS[name]) if x is not None]
    assert losses and all(loss == pytest.approx(want, rel=TOL) for loss in losses), (losses, want)


def test_export_loads_in_transformers_with_the_same_loss(mistral, tmp_path):
    path, want = mistral
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    export_hf(model, tmp_path)
    exported = json.loads((tmp_path / "config.json").read_text())
    assert (exported["model_type"], exported["sliding_window"]) == ("mistral", WINDOW)
    assert _hf_loss(transformers.MistralForCausalLM, tmp_path) == pytest.approx(want, rel=TOL)


def test_llama_export_is_unchanged_and_local_global_layers_are_read_and_refused(tmp_path):
    plain = config_to_hf(ModelConfig())
    assert plain["model_type"] == "llama" and "sliding_window" not in plain
    mixtral = config_to_hf(ModelConfig(sliding_window=4, moe={"experts": 4}))
    assert (mixtral["model_type"], mixtral["sliding_window"]) == ("mixtral", 4)
    hf = config_to_hf(ModelConfig(sliding_window=4, layers=3)) | {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = config_from_hf(tmp_path)
    assert (config.sliding_window, config.window_layers) == (4, [0, 2])
    assert [config.window(i) for i in range(3)] == [4, 0, 4]
    with pytest.raises(ValueError, match=r"model.window_layers=\[0, 2\] \(local and global layers\) cannot be"):
        config_to_hf(config)
    (tmp_path / "config.json").write_text(json.dumps(hf | {"layer_types": ["sliding_attention", "chunked"]}))
    with pytest.raises(ValueError, match="layer_types=.* must give sliding_attention or full_attention per layer"):
        config_from_hf(tmp_path)

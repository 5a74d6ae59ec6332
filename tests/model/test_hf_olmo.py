"""Hugging Face OLMo 2 interop (post-norms, QK-norm over whole projections reduced over tp): imported weights give
transformers' loss and the single-device gradients on every layout; export loads back in transformers."""

from __future__ import annotations

import json

import pytest
import torch

from modelpar.model.config import ModelConfig
from modelpar.model.hf import config_from_hf, config_to_hf
from modelpar.model.structure import BlockStructure
from modelpar.parallel.layout import LayoutError, ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import (
    check_against_reference,
    check_import_export,
    reference_loss_and_grads,
    run_layouts,
    transformers_loss,
)

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SHAPE = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500.0, initializer_range=0.2,
)  # fmt: skip


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    """A random Olmo2ForCausalLM directory and transformers' loss on IDS."""
    torch.manual_seed(0)
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SHAPE)).eval()
    with torch.no_grad():  # norm weights away from one, so that a missing or misplaced norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
    path = tmp_path_factory.mktemp("hf") / "olmo2"
    model.save_pretrained(path)
    return path, transformers_loss(model)


def test_olmo2_config_maps_every_field(olmo):
    assert config_from_hf(olmo[0]) == ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=16, rope_theta=500.0,
        norm_eps=1e-5, qk_norm=True, init_std=0.2, block=BlockStructure(norm="post", qk_norm_scope="projection"),
    )  # fmt: skip


def test_imported_olmo2_gives_transformers_loss_and_exports_what_transformers_saved(olmo, tmp_path):
    path, want = olmo
    check_import_export(path, want, tmp_path, "olmo2", transformers.Olmo2ForCausalLM, TOL)


@pytest.mark.parametrize("field, value", [("attention_bias", True), ("attention_dropout", 0.1)])
def test_unsupported_olmo2_variant_is_refused_in_one_line_naming_the_field(olmo, tmp_path, field, value):
    hf = json.loads((olmo[0] / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=rf"unsupported OLMo 2 variant \({field}\)") as info:
        config_from_hf(tmp_path)
    assert "\n" not in str(info.value)


def test_export_refuses_what_olmo2_cannot_express():
    post = BlockStructure(norm="post", qk_norm_scope="projection")
    with pytest.raises(ValueError, match=r"OLMo 2 cannot express this model \(block.activation\)"):
        config_to_hf(ModelConfig(qk_norm=True, block=BlockStructure(**post.changed(), activation="geglu")))
    with pytest.raises(ValueError, match=r"OLMo 2 cannot express this model \(block.qk_norm_scope\)"):
        config_to_hf(ModelConfig(qk_norm=True, block=BlockStructure(norm="post")))


def test_projection_qk_norm_refuses_tp_that_replicates_k_heads():
    config = ModelConfig(heads=4, kv_heads=1, qk_norm=True, block=BlockStructure(qk_norm_scope="projection"))
    with pytest.raises(LayoutError, match="qk_norm_scope=projection with tp=2"):
        config.check_layout(ParallelLayout(tp=2))


LAYOUTS = [  # (layout, chunk options) on the one 4-rank pool
    (ParallelLayout(tp=2, dp=2), {}),
    (ParallelLayout(tp=2, dp=2), {"sequence_parallel": True, "recompute": "selective"}),
    (ParallelLayout(pp=2, dp=2), {"recompute": "full"}),
    (ParallelLayout(pp=2, dp=2), {"stage_layers": [1.5, 0.5]}),  # block 1's post-normed attention, then its MLP
    (ParallelLayout(cp=2, dp=2), {}),
    (ParallelLayout(cp=2, dp=2), {"cp_comm": "allgather"}),
]


def test_imported_olmo2_gives_transformers_loss_and_the_single_device_gradients_on_every_layout(olmo):
    """tp2 (the q and k norms' sums of squares reduced over tp, their weights sharded with the heads), sp, pp2,
    cp2: the loss is transformers', every gradient piece the single-device model's."""
    path, want = olmo
    config = config_from_hf(path)
    per_rank = run_on_ranks(4, run_layouts, [(config, layout, options, path) for layout, options in LAYOUTS])
    ref_loss, ref_grads = reference_loss_and_grads(config, hf_path=path)
    assert ref_loss == pytest.approx(want, rel=TOL)
    for i, (layout, options) in enumerate(LAYOUTS):
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, f"{layout} {options}")

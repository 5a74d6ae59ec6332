"""Fixtures the model tests share."""

import pytest
import torch

from tests.model.reference import HF_IDS


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_model(request, tmp_path_factory):
    """A random LlamaForCausalLM saved to a directory, and its logits on HF_IDS."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        initializer_range=0.2,
        tie_word_embeddings=request.param,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # HF initialises norms to ones, which would hide a swapped norm
                param.normal_(1.0, 0.2)
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path)
    with torch.no_grad():
        logits = model(HF_IDS).logits
    return path, logits

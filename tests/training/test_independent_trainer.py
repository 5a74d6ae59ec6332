"""Each family trained by an independent trainer: the model built by transformers from modelpar's initial weights,
stepped by torch's own AdamW (decay on matrices, as modelpar's) on the batches modelpar's single device drew,
gives modelpar's losses step by step (1e-5). Every layout is compared with modelpar's single device elsewhere;
this compares the single device with code modelpar does not own."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modelpar.testing import run_on_ranks
from modelpar.training.config import OptimConfig
from tests.training.families import FAMILIES, family_config, token_file, train_families

transformers = pytest.importorskip("transformers")

STEPS = 6
OPTIM = OptimConfig(lr=3e-3, min_lr=3e-3, warmup_steps=0, weight_decay=0.1, grad_clip=0.0)  # a constant lr
# transformers has no multi-token prediction module, and nothing in it moves DeepSeek-V3's balancing bias
INDEPENDENT = {
    family: replace(model, mtp_depth=0, moe=replace(model.moe, bias_update_rate=0.0))
    for family, model in FAMILIES.items()
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("independent")
    configs = {family: family_config(model, tmp / family, STEPS, OPTIM) for family, model in INDEPENDENT.items()}
    return tmp, run_on_ranks(1, train_families, configs, token_file(tmp), str(tmp / "hf"), timeout_s=300)[0]


def _train_with_transformers(path, batches, microbatches: int) -> list[float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": OPTIM.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    adam = torch.optim.AdamW(groups, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    losses = []
    for inputs, targets in batches:
        adam.zero_grad()
        total = 0.0
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches), strict=True):
            logits = model(x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / microbatches
            loss.backward()
            total += loss.item()
        adam.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_and_torch_adamw_give_modelpar_single_device_losses(trained, family):
    tmp, results = trained
    result = results[family]
    assert len(result["batches"]) == STEPS
    want = _train_with_transformers(tmp / "hf" / family, result["batches"], 2)
    np.testing.assert_allclose(result["losses"], want, rtol=1e-5, err_msg=family)

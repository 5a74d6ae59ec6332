"""On a CUDA device: selective recompute and offload lower the allocator's peak while keeping the gradients,
and a rerun under deterministic algorithms repeats every bit (the premise of the silent-corruption check).

CPU runs cover the same code for correctness (tests/model/test_recompute.py, tests/test_sdc.py); memory has
its meaning only here. Run by ``benchmarks/gpu_suite.py`` (``pytest -m gpu``)."""

from __future__ import annotations

import os

import pytest
import torch

from modelpar.model.activations import ActivationOffload
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_model
from modelpar.training.sdc import bit_checksum

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = ModelConfig(vocab_size=4096, hidden=512, layers=4, heads=8, kv_heads=4, ffn_hidden=1376, max_seq_len=1024)


def _step(recompute="none", modules=("elementwise",), offload=False):
    """(peak bytes during forward + backward above the weights, gradients) of one fp32 step on CUDA."""
    torch.manual_seed(0)
    model = build_model(CONFIG, seed=1, recompute=recompute, recompute_modules=modules, device="cuda")
    if offload:
        model.offload = ActivationOffload(exclude=list(model.parameters()))
    ids = torch.randint(0, CONFIG.vocab_size, (4, 1024), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model.loss(model(ids), ids).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, {n: p.grad.detach().clone() for n, p in model.named_parameters()}, model.offload


def test_selective_and_full_recompute_lower_the_peak_and_keep_the_gradients():
    plain, grads, _ = _step()
    for mode, modules in (("selective", ("elementwise",)), ("selective", ("mlp",)), ("full", ())):
        peak, got, _ = _step(mode, modules or ("elementwise",))
        assert peak < plain, (mode, modules, peak, plain)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_offload_moves_activations_to_pinned_host_memory_and_lowers_the_peak():
    plain, grads, _ = _step()
    peak, got, offload = _step(offload=True)
    assert offload.bytes_offloaded > 0 and peak < plain, (peak, plain, offload.bytes_offloaded)
    for name, g in grads.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_deterministic_rerun_repeats_every_bit():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_step()[1] for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for name in runs[0]:
        assert bit_checksum(runs[0][name]) == bit_checksum(runs[1][name]), name

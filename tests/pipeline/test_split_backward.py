"""B then W (zero-bubble's split backward) gives exactly the gradients of one ordinary backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_chunk
from modelpar.pipeline.split_backward import backward_input, backward_weight

CONFIG = ModelConfig(vocab_size=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn_hidden=48, max_seq_len=16)


class SharedWeight(nn.Module):
    """The same weight on the input path twice, plus a weight used only off it (a bias added at the end)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(torch.tanh(x @ self.w) @ self.w) + self.b


def _chunk(last: bool, split_blocks=None) -> nn.Module:
    return build_chunk(CONFIG, None, range(1, 3), first=False, last=last, seed=5, split_blocks=split_blocks)


def _cases():
    targets = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    yield "middle chunk", _chunk(False), torch.randn(2, 8, CONFIG.hidden), None
    yield "last chunk (loss)", _chunk(True), torch.randn(2, 8, CONFIG.hidden), targets
    yield "half blocks", _chunk(False, {1: "mlp", 2: "attention"}), torch.randn(2, 8, CONFIG.hidden), None
    yield "shared weight", SharedWeight(), torch.randn(4, 8), None


def _output(module, x, targets):
    y = module(x)
    return module.loss(y, targets) if targets is not None else y


@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in _cases()])
def test_input_then_weight_gradients_equal_one_backward(case):
    _, module, x0, targets = list(_cases())[case]
    params = [p for p in module.parameters() if p.requires_grad]
    grad_out = None if targets is not None else torch.randn_like(_output(module, x0, targets))

    x = x0.clone().requires_grad_(True)
    out = _output(module, x, targets)
    torch.autograd.backward(out, grad_out)
    want_dx, want = x.grad.clone(), [p.grad.clone() for p in params]
    module.zero_grad(set_to_none=True)

    fired = {id(p): 0 for p in params}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.__setitem__(id(p), fired[id(p)] + 1)) for p in params]
    x = x0.clone().requires_grad_(True)
    out = _output(module, x, targets)
    dx, pending = backward_input(out, grad_out, x, params)
    assert all(p.grad is None for p in params), "B must not touch weight gradients"
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-7)
    backward_weight(pending)
    for p, g in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
    assert set(fired.values()) == {1}, "each weight's gradient accumulates exactly once per micro-batch"
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("modules", [("elementwise",), ("attention", "elementwise")])
def test_selective_recompute_survives_the_split_backward(modules):
    """The elementwise policy caches matmul outputs for the rerun; B and W each rerun the region and both read
    that cache (zbv / zb-h1 with parallel.recompute=selective)."""
    targets = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    x0 = torch.randn(2, 8, CONFIG.hidden)
    plain = _chunk(True)
    module = build_chunk(
        CONFIG, None, range(1, 3), first=False, last=True, seed=5, recompute="selective", recompute_modules=modules
    )
    x = x0.clone().requires_grad_(True)
    plain.loss(plain(x), targets).backward()
    want_dx, want = x.grad.clone(), [p.grad.clone() for p in plain.parameters()]

    params = [p for p in module.parameters() if p.requires_grad]
    x = x0.clone().requires_grad_(True)
    dx, pending = backward_input(module.loss(module(x), targets), None, x, params)
    backward_weight(pending)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    for p, g in zip(module.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)

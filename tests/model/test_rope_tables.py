"""RoPE tables: built once per (sequence length, head dim, theta, device) and shared by every attention layer."""

from __future__ import annotations

import pytest
import torch
from modelpar_kernels import rope_tables

from modelpar.model.layers import attention
from modelpar.model.transformer import build_model
from tests.model.reference import CONFIGS, batch

CONFIG = CONFIGS["gqa-kv2-tied"]  # 2 layers


@pytest.fixture
def builds(monkeypatch) -> list[tuple]:
    """An empty table cache; every table built from now on is recorded as its ``(seq_len, head_dim, theta)``."""
    built: list[tuple] = []

    def counting_rope_tables(seq_len, head_dim, theta, **kwargs):
        built.append((seq_len, head_dim, theta))
        return rope_tables(seq_len, head_dim, theta, **kwargs)

    monkeypatch.setattr(attention, "_ROPE_TABLES", {})
    monkeypatch.setattr(attention, "rope_tables", counting_rope_tables)
    return built


def test_a_second_forward_builds_no_table(builds):
    model = build_model(CONFIG, seed=0)
    ids, _ = batch(CONFIG)
    model(ids)
    assert builds == [(ids.shape[1], CONFIG.head_size, CONFIG.rope_theta)]  # one table for both layers
    model(ids)
    assert len(builds) == 1


def test_a_new_sequence_length_gets_its_own_tables_equal_to_fresh_ones(builds):
    model = build_model(CONFIG, seed=0)
    ids, _ = batch(CONFIG)
    model(ids)
    model(ids[:, :5])
    assert [seq_len for seq_len, _, _ in builds] == [ids.shape[1], 5]
    cached = attention.cached_rope_tables(5, CONFIG.head_size, CONFIG.rope_theta, torch.device("cpu"))
    fresh = rope_tables(5, CONFIG.head_size, CONFIG.rope_theta)
    assert all(torch.equal(c, f) for c, f in zip(cached, fresh, strict=True))


def test_tables_first_built_under_inference_mode_serve_a_training_step(builds):
    model = build_model(CONFIG, seed=0)
    ids, targets = batch(CONFIG)
    with torch.inference_mode():
        model(ids)
    model.loss(model(ids), targets).backward()  # saving inference tensors for backward would raise here
    assert len(builds) == 1

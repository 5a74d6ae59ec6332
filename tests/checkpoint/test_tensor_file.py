"""The one-pass safetensors writer: any safetensors reader loads its files, and the hash it returns is the
file's."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modelpar.checkpoint.tensor_file import CHUNK, write_tensors


def test_files_load_with_safetensors_and_the_returned_hash_is_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr("modelpar.checkpoint.tensor_file.CHUNK", 64)  # many chunks per tensor
    tensors = {
        "b.weight": torch.randn(7, 5),
        "a.bf16": torch.randn(3, 33).to(torch.bfloat16),
        "rng": torch.arange(10, dtype=torch.uint8),
        "step": torch.tensor(3.0, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
        "strided": torch.arange(24, dtype=torch.int64).reshape(4, 6).t(),  # not contiguous
    }
    path = tmp_path / "x.safetensors"
    got = write_tensors(path, tensors)
    data = path.read_bytes()
    assert got == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safe_open(path, "pt") as f:  # the lazy reader agrees too
        assert torch.equal(f.get_tensor("a.bf16"), tensors["a.bf16"])
    assert CHUNK > 64


def test_a_dtype_without_a_safetensors_name_is_refused(tmp_path):
    with pytest.raises(TypeError, match="complex64"):
        write_tensors(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})

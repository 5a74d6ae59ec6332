"""The step's read-back: named device tensors come back by name, with one device-to-host copy."""

import pytest
import torch

from modelpar.training.readback import ReadBack


def test_values_come_back_by_name_whatever_their_shapes_and_dtypes():
    read = ReadBack()
    read.add("loss", torch.tensor(2.5, dtype=torch.float64))
    read.add("flags", torch.tensor([1.0, 0.0, 1.0]))
    read.add("table", torch.arange(6, dtype=torch.float64).reshape(2, 3))
    assert read.values() == {"loss": [2.5], "flags": [1.0, 0.0, 1.0], "table": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}


def test_one_host_copy_for_all_of_them(monkeypatch):
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(t.numel()) or real(t))
    read = ReadBack()
    for i in range(4):
        read.add(f"v{i}", torch.ones(i + 1))
    read.values()
    assert calls == [10]


def test_a_name_added_twice_is_refused():
    read = ReadBack()
    read.add("loss", torch.zeros(()))
    with pytest.raises(ValueError, match="'loss' added twice"):
        read.add("loss", torch.zeros(()))

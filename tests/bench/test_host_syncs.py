"""count_host_syncs: every value read on the host is counted with the line that made it; torch is left as found."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from modelpar.bench.host_syncs import count_host_syncs

WRAPPED = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "to")


def here() -> str:
    """``file:line`` of the caller, as a sync made on that line is named."""
    frame = sys._getframe(1)
    return f"tests/bench/test_host_syncs.py:{frame.f_lineno}"


def test_each_host_read_of_a_tensor_is_one_sync():
    t, v = torch.tensor(2.5), torch.arange(3)
    with count_host_syncs() as syncs:
        t.item()
        v.tolist()
        float(t)
        int(t)
        bool(t)
        list(range(10))[v[1]]
    assert syncs.count == 6
    assert [s.method for s in syncs.syncs] == ["item", "tolist", "__float__", "__int__", "__bool__", "__index__"]
    assert {s.device for s in syncs.syncs} == {"cpu"}


def test_tensor_arithmetic_and_cpu_tensors_own_copies_are_not_syncs():
    t = torch.randn(4, 3)
    with count_host_syncs() as syncs:
        (t @ t.T).sum(0).softmax(0)
        t.cpu()
        t.to("cpu")
        t.to(torch.float64)
        t.numpy()
    assert syncs.count == 0


def test_each_sync_names_the_line_that_made_it():
    t = torch.tensor([1.0, 2.0])
    with count_host_syncs() as syncs:
        first = t[0].item(), here()
        second = bool(t[1] > 0), here()
    assert [s.site for s in syncs.syncs] == [first[1], second[1]]
    assert all(s.via is None for s in syncs.syncs)


def test_a_sync_made_inside_torch_is_named_by_the_callers_line_and_the_torch_line():
    t = torch.tensor(1.25)
    with count_host_syncs() as syncs:
        line = f"{t:.2f}", here()  # Tensor.__format__ calls item() for a 0-dim tensor
    (sync,) = syncs.syncs
    assert (sync.method, sync.site) == ("item", line[1])
    assert sync.via is not None and sync.via.startswith("torch/_tensor.py:")
    assert line[1] in syncs.report() and "via torch/_tensor.py:" in syncs.report()


def test_report_groups_syncs_by_site_most_frequent_first():
    t = torch.tensor(3.0)
    with count_host_syncs() as syncs:
        for _ in range(3):
            t.item()
        single = float(t), here()
    counts = syncs.by_site()
    assert sorted(counts.values()) == [1, 3]
    lines = syncs.report().splitlines()
    assert lines[0] == "4 host sync(s)"
    assert lines[1].startswith("  3x ") and lines[2] == f"  1x {single[1]}: Tensor.__float__ on cpu"


def test_torch_tensor_is_restored_after_the_block_even_when_it_raises():
    before = {name: getattr(torch.Tensor, name) for name in WRAPPED}
    own = {name for name in WRAPPED if name in torch.Tensor.__dict__}
    with pytest.raises(RuntimeError, match="boom"), count_host_syncs():
        assert torch.Tensor.item is not before["item"]
        raise RuntimeError("boom")
    assert {name: getattr(torch.Tensor, name) for name in WRAPPED} == before
    assert {name for name in WRAPPED if name in torch.Tensor.__dict__} == own
    with count_host_syncs() as syncs:
        pass
    torch.tensor(1.0).item()
    assert syncs.count == 0


def test_nested_blocks_each_count_their_own_span_and_restore_only_at_the_outermost_exit():
    t = torch.tensor(1.0)
    original = torch.Tensor.item
    with count_host_syncs() as outer:
        t.item()
        with count_host_syncs() as inner:
            t.item()
            float(t)
        assert torch.Tensor.item is not original, "the inner exit must not unwrap the outer block's methods"
        t.item()
    assert (outer.count, inner.count) == (4, 2)
    assert torch.Tensor.item is original


def test_syncs_made_on_another_thread_are_counted():
    t = torch.tensor(1.0)
    with count_host_syncs() as syncs:
        worker = threading.Thread(target=t.item)
        worker.start()
        worker.join()
    assert syncs.count == 1


def test_include_cpu_false_leaves_out_tensors_already_on_the_host():
    t = torch.tensor(1.0)
    with count_host_syncs() as everything, count_host_syncs(include_cpu=False) as device_only:
        t.item()
    assert (everything.count, device_only.count) == (1, 0)


def test_an_unknown_cuda_sync_debug_mode_is_refused():
    with pytest.raises(ValueError, match="cuda_sync_debug='loud' must be None, 'warn' or 'error'"):
        with count_host_syncs(cuda_sync_debug="loud"):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_of_a_cuda_tensor_to_the_host_are_syncs_and_other_copies_are_not():
    t = torch.randn(8, device="cuda")
    with count_host_syncs(include_cpu=False, cuda_sync_debug="warn") as syncs:
        t.cpu()
        t.to("cpu")
        t.numpy(force=True)
        t.to("cpu", non_blocking=True)
        t.to(torch.bfloat16)
        t.sum().item()
        torch.tensor(1.0).item()  # host-resident: waits for nothing
    assert [s.method for s in syncs.syncs] == ["cpu", "to", "numpy", "item"]
    assert torch.cuda.get_sync_debug_mode() == 0

"""Newton-Schulz distributed over tp (Gram matrices all-reduced) equals the gathered matrix's (fp32, 1e-5):
the tp ranks simulated as threads of one process, summing through one mailbox."""

import threading

import pytest
import torch

from modelpar.optim.muon import MuonSettings, newton_schulz
from modelpar.optim.muon_tp import newton_schulz_sharded

SETTINGS = MuonSettings(ns_dtype="fp32")


def _on_threads(tp: int, fn):
    barrier, box, out, errors = threading.Barrier(tp), [None] * tp, [None] * tp, []

    def all_reduce_for(rank):
        def all_reduce(t):
            box[rank] = t
            barrier.wait()
            total = sum(box[r] for r in range(tp))
            barrier.wait()
            return total

        return all_reduce

    def one(rank):
        try:
            out[rank] = fn(rank, all_reduce_for(rank))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("shape", [(64, 64), (96, 32), (32, 96), (48, 64)], ids=str)
@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "cols"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_newton_schulz_equals_the_gathered_one(shape, dim, tp):
    update = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape) + dim + tp))
    whole = newton_schulz(update, SETTINGS)
    blocks = update.chunk(tp, dim)
    got = _on_threads(tp, lambda r, all_reduce: newton_schulz_sharded(blocks[r], shape, dim, SETTINGS, all_reduce))
    torch.testing.assert_close(torch.cat(got, dim), whole, rtol=1e-5, atol=1e-5)

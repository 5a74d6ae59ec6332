"""A local run opens no listening socket except on loopback: nobody on the network can join or disrupt it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import LOOPBACK, SMALL, listening_addresses

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")]


def test_a_local_multi_rank_run_listens_on_loopback_only(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "modelpar.cli.train", *SMALL, "parallel=tp2-pp2", "trainer.steps=12",
         "trainer.ckpt_every=0", f"hydra.run.dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: set[str] = set()
    while proc.poll() is None:
        seen |= listening_addresses(proc.pid)
        time.sleep(0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert seen, "the job's listening sockets were never seen (gloo's pairs listen while the ranks run)"
    exposed = sorted(addr for addr in seen if addr.split(":")[0] not in LOOPBACK)
    assert not exposed, f"listening beyond loopback: {exposed} (hex address:port as in /proc/net/tcp)"

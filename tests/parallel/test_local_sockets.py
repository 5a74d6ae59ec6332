"""A local run opens no listening socket except on loopback: nobody on the network can join or disrupt it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SMALL

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")]

LISTEN = "0A"
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


def _descendants(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in found]
        found.update(children)
        frontier.extend(children)
    return found


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _listening(inodes: set[str]) -> set[str]:
    """Local addresses (hex, as /proc/net shows them) of the listening TCP sockets among ``inodes``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                out.add(fields[1])
    return out


def test_a_local_multi_rank_run_listens_on_loopback_only(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "modelpar.cli.train", *SMALL, "parallel=tp2-pp2", "trainer.steps=40",
         "trainer.ckpt_every=0", f"hydra.run.dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: set[str] = set()
    while proc.poll() is None:
        seen |= _listening(_socket_inodes(_descendants(proc.pid)))
        time.sleep(0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert seen, "the job's listening sockets were never seen (gloo's pairs listen while the ranks run)"
    exposed = sorted(addr for addr in seen if addr.split(":")[0] not in LOOPBACK)
    assert not exposed, f"listening beyond loopback: {exposed} (hex address:port as in /proc/net/tcp)"

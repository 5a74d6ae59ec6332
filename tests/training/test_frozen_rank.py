"""A rank frozen from outside (SIGSTOP: a hung device, a paused machine) is named as the cause, not its partner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import SMALL

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")]

TIMEOUT_S = 10


def test_a_sigstopped_rank_is_named_with_its_coordinates_in_a_few_lines(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "modelpar.cli.train", *SMALL, "parallel=tp2-pp2", "trainer.steps=100000",
         "trainer.ckpt_every=0", f"trainer.timeout_s={TIMEOUT_S}", f"hydra.run.dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    record = tmp_path / "flight" / "rank-00002.json"
    pid = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                snapshot = json.loads(record.read_text())
            except (OSError, json.JSONDecodeError):
                snapshot = None
            if snapshot and snapshot["step"] >= 2:
                pid = snapshot["pid"]
                break
            time.sleep(0.2)
        assert pid is not None, "rank 2 never reached step 2"
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        _, err = proc.communicate(timeout=TIMEOUT_S + 60)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    assert proc.returncode == 1, err[-3000:]
    assert ended - frozen_at < TIMEOUT_S + 30
    report = err[err.index("modelpar-train: ") :].strip().splitlines()
    assert len(report) <= 5, err
    assert report[0].startswith("modelpar-train: rank 2 (pp 1 tp 0 dp 0) stuck in "), report
    assert "process is stopped" in report[0] and "Traceback" not in err, err
    log = tmp_path / "failure.log"
    assert str(log) in report[-1] and "Traceback" in log.read_text()

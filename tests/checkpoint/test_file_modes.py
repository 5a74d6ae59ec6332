"""What a run writes (run directory, checkpoints, flight records, metrics) is never readable by everyone."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from tests import warm_cli
from tests.helpers import SMALL

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("files, forbidden", [("group", 0o007), ("owner", 0o077)])
def test_run_files_are_not_world_readable(files, forbidden, tmp_path):
    run = tmp_path / "run"
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", *SMALL, "parallel=pp2", "trainer.steps=2", "trainer.ckpt_every=2",
         f"trainer.files={files}", f"hydra.run.dir={run}"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    paths = [run, *run.rglob("*")]
    assert any(p.name == "index.json" for p in paths) and any(p.parent.name == "flight" for p in paths)
    loose = [f"{p} {stat.filemode(p.stat().st_mode)}" for p in paths if stat.S_IMODE(os.lstat(p).st_mode) & forbidden]
    assert not loose, loose

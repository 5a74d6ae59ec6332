"""benchmarks/peer_independent.py runs modelpar-train at the peer's layout: dp=2 and nothing else."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("peer_independent", ROOT / "benchmarks" / "peer_independent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout, dp", [("single", 1), ("zero0", 2), ("zero3", 2)])
def test_ours_runs_at_the_peers_layout(tmp_path, layout, dp):
    _, _, _, zero, overrides = _script().LAYOUTS[layout]
    cmd = _script().ours_command(zero, overrides, str(tmp_path)) + ["--cfg", "job"]  # the composed recipe only
    assert cmd[0] == sys.executable
    done = warm_cli.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = yaml.safe_load(done.stdout)
    p = cfg["parallel"]
    assert (p["tp"], p["pp"], p["cp"], p["dp"], p.get("ep", 1)) == (1, 1, 1, dp, 1)  # as the peer's processes
    assert cfg["optim"]["zero"] == zero and cfg["model"]["name"] == "bench-tiny"
    assert (cfg["data"]["global_batch"], cfg["data"]["seq_len"]) == (16, 128)

"""benchmarks/moe.py runs (its layer part, tiny shapes) and its three expert paths compute the same layer."""

import json
import sys
from pathlib import Path

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]


def test_moe_layer_benchmark_smoke_writes_its_rows(tmp_path):
    out = tmp_path / "moe"
    cmd = [sys.executable, str(ROOT / "benchmarks/moe.py"), "--part", "layer", "--smoke", "--out", str(out)]
    proc = warm_cli.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]  # the script asserts the three paths agree (1e-4)
    result = json.loads(out.with_suffix(".json").read_text())
    assert len(result["layer"]) == 3 and result["steps"] is None
    for row in result["layer"]:
        for name in ("grouped", "sorted loop", "masked loop"):
            assert row[name]["median_ms"] > 0
        assert row["sorted_loop_over_grouped"] > 0
    assert "masked / grouped" in out.with_suffix(".md").read_text()


def test_moe_benchmark_refuses_a_bad_round_count_in_one_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks/moe.py"), "--rounds", "0", "--out", str(tmp_path / "x")]
    proc = warm_cli.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--rounds=0 must be >= 1" in proc.stderr
    assert not (tmp_path / "x.json").exists()

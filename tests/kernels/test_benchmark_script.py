"""benchmarks/kernels.py: without CUDA it says so in one line and exits 2; --smoke runs its code paths on CPU."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests import warm_cli

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_without_cuda_it_exits_2_with_one_line():
    done = warm_cli.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "benchmarks/kernels.py needs a CUDA device (none found); run it on a GPU machine, or pass --smoke"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_smoke_run_writes_json_and_markdown(tmp_path):
    done = warm_cli.run(
        [sys.executable, str(SCRIPT), "--smoke", "--only", "rms_norm,cross_entropy", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "kernels-smoke.json").read_text())["rows"]
    assert {(r["op"], r["impl"]) for r in rows} >= {("rms_norm", "triton"), ("cross_entropy", "eager")}
    assert not [r for r in rows if r["error"]]
    assert "| rms_norm |" in (tmp_path / "kernels-smoke.md").read_text()

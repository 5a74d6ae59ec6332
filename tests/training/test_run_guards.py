"""What a run must never do silently: resume another model, end as a success with its final state unsaved, share
its directory with a second job, leave a traceback on Ctrl-C, or log a replayed step twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from modelpar.testing import run_on_ranks
from modelpar.training.final_save import unsaved_final_state
from modelpar.training.preflight import preflight
from modelpar.training.resume_identity import identity_differences
from modelpar.training.run_dir import RunDirError, RunLock, check_writable, run_dir_of
from modelpar.training.sinks import JsonlSink
from modelpar.training.step import StepMetrics
from tests import warm_cli
from tests.helpers import SMALL, TINY, make_config, train, train_and_collect

ROOT = Path(__file__).resolve().parents[2]


# -- resume checks the checkpoint's identity --------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("tie_embeddings", False), ("qk_norm", True), ("rope_theta", 1e6), ("norm_eps", 1e-6), ("head_dim", 16)],
)
def test_every_identity_field_that_differs_is_found(field, value):
    saved = {"name": "x", **{k: getattr(TINY, k) for k in ("vocab_size", "hidden", "layers", "heads", "kv_heads")}}
    saved |= {k: getattr(TINY, k) for k in ("ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings", "qk_norm")}
    assert identity_differences(TINY, saved) == []
    differ = identity_differences(TINY, saved | {field: value})
    assert [d[0] for d in differ] == [field]


def test_a_checkpoint_from_before_head_dim_and_qk_norm_matches_their_defaults():
    old = {k: getattr(TINY, k) for k in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden")}
    old |= {"rope_theta": TINY.rope_theta, "norm_eps": TINY.norm_eps, "tie_embeddings": TINY.tie_embeddings}
    assert identity_differences(TINY, old) == []


def test_resume_of_another_model_is_refused_before_any_rank_naming_every_field(token_path, tmp_path):
    cfg = make_config(tmp_path)
    cfg = replace(cfg, data=replace(cfg.data, path=token_path), trainer=replace(cfg.trainer, steps=1, ckpt_every=1))
    run_on_ranks(1, train_and_collect, cfg, token_path, None, (1,))
    other = replace(cfg.model, tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-6)
    for resume in ("auto", str(tmp_path / "checkpoints" / "step-00000001")):
        mine = replace(cfg, model=other, trainer=replace(cfg.trainer, steps=2, resume=resume))
        with pytest.raises(ValueError) as caught:
            preflight(mine)
        message = str(caught.value)
        assert "\n" not in message
        assert "rope_theta=10000.0, norm_eps=1e-05, tie_embeddings=true" in message
        assert "set model.rope_theta=10000.0 model.norm_eps=1e-05 model.tie_embeddings=true" in message
    preflight(replace(cfg, trainer=replace(cfg.trainer, steps=2)))  # the same model resumes


# -- a failed final save is not a success -----------------------------------------------------------------


def _ckpt(root: Path, step: int) -> None:
    (root / f"step-{step:08d}").mkdir(parents=True)
    (root / f"step-{step:08d}" / "index.json").write_text("{}")
    (root / "latest").write_text(f"step-{step:08d}")


def test_a_run_whose_final_save_failed_names_the_newest_saved_step(tmp_path):
    cfg = make_config(tmp_path)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=40, ckpt_every=10))
    assert "no state of it was saved" in unsaved_final_state(cfg)
    _ckpt(tmp_path / "checkpoints", 30)
    problem = unsaved_final_state(cfg)
    assert "final step 40 failed" in problem and "step-00000030 (step 30)" in problem
    _ckpt(tmp_path / "checkpoints", 40)
    assert unsaved_final_state(cfg) is None
    no_saves = replace(cfg.trainer, ckpt_every=0, out_dir=str(tmp_path / "n"))
    assert unsaved_final_state(replace(cfg, trainer=no_saves)) is None  # none was asked for


@pytest.mark.slow
def test_a_run_that_saved_nothing_exits_non_zero_in_one_line(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")  # every save fails, as on a full disk
    proc, _ = train(tmp_path, "parallel=single", "trainer.steps=2", "trainer.ckpt_every=1")
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("modelpar-train: error:")]
    assert len(errors) == 1 and "the save of the final step 2 failed" in errors[0], proc.stderr
    assert "no state of it was saved" in errors[0] and "Traceback" not in proc.stderr


# -- the run directory ------------------------------------------------------------------------------------


def test_an_unwritable_run_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunDirError, match=r"^cannot write the run directory .*file/run .*hydra\.run\.dir=PATH$"):
        check_writable(blocker / "run")
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", f"hydra.run.dir={blocker / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("modelpar-train: error: cannot write the run directory")


def test_the_run_directory_of_a_command_line():
    assert run_dir_of(["hydra.run.dir=/x/y", "trainer.steps=2"]) == "/x/y"
    assert run_dir_of(["hydra.run.dir=/x/${now:%H}"]) == "/x/"
    assert run_dir_of(["trainer.steps=2"]) == "runs"
    assert run_dir_of(["-m", "parallel=single,tp2"]) is None


_HOLD = "import sys,time; from modelpar.training.run_dir import RunLock; lock = RunLock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)"  # noqa: E501


def test_a_second_job_into_a_locked_run_directory_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError) as caught:
            RunLock.acquire(tmp_path)
        assert f"in use by another training job (pid {holder.pid} on host {os.uname().nodename}" in str(caught.value)
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock.acquire(tmp_path)  # its holder is gone: the lock it left is stale and taken over
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


# -- metrics.jsonl holds each step once -------------------------------------------------------------------


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, step_time_s=1.0, mfu=None)


def test_a_resumed_run_does_not_log_its_replayed_steps_twice(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 6):
        sink.write(_metrics(step))
    sink.close()
    with path.open("a") as f:
        f.write('{"step": 6, "lo')  # cut short by the crash
    sink = JsonlSink(path, start_step=3)  # resumed from step 3's checkpoint: steps 4-5 are trained again
    for step in range(4, 7):
        sink.write(_metrics(step))
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


# -- Ctrl-C -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_saves_the_step_every_rank_stopped_after_in_one_line(tmp_path):
    args = [*SMALL, "parallel=single", "parallel.dp=2", "trainer.ckpt_every=0", "trainer.timeout_s=60"]
    run = [sys.executable, "-m", "modelpar.cli.train", *args, f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen([*run, "trainer.steps=10000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # the launcher alone: it passes the request on to its ranks
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("modelpar-train: interrupted")]
    assert len(lines) == 2 and "every rank stopped and saved" in lines[1], err
    saved = (tmp_path / "checkpoints" / "latest").read_text().strip()
    stopped = int(saved.removeprefix("step-"))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1] == stopped
    again = warm_cli.run([*run, f"trainer.steps={stopped + 2}"], capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, stopped + 3))

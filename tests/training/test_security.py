"""A job admits only its own workers: two-node jobs (two torchrun or SLURM-style processes on this machine,
loopback), the store's listeners, secrets kept out of everything a run writes, and the security log."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelpar.data import DataError
from modelpar.parallel.launch import LaunchError
from modelpar.training.security import record_verdict
from tests.helpers import LOOPBACK, SMALL, descendants, listening, listening_addresses, socket_inodes, train

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun script runs
JOB = ["parallel=single", "parallel.dp=2", "trainer.steps=2", "trainer.ckpt_every=2", "trainer.timeout_s=60"]
HOST = socket.gethostname()
needs_proc = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _secret(path: Path) -> Path:
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def _two_nodes(run_dir: Path, envs: list[dict], extra: list[list[str]], launcher: str):
    """Two processes forming one job of two ranks (one per "node"), started as torchrun or SLURM would; and the
    port of the job's store, hex as /proc/net/tcp shows it."""
    port, procs = _free_port(), []
    for node in range(2):
        train_cmd = ["-m", "modelpar.cli.train", *SMALL, *JOB, f"hydra.run.dir={run_dir}", *extra[node]]
        env = dict(os.environ, **envs[node])
        if launcher == "torchrun":
            cmd = [
                *TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}", "--master-addr=127.0.0.1",
                f"--master-port={port}", "--monitor-interval=0.5", *train_cmd,
            ]  # fmt: skip
        else:
            cmd = [sys.executable, *train_cmd]
            env.update(SLURM_PROCID=str(node), SLURM_NTASKS="2", SLURM_NODEID=str(node), SLURM_LOCALID="0")
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs, f"{port:04X}"


def _finish(procs, timeout=300) -> list[tuple[int, str, str]]:
    return [(p.wait(timeout), *p.communicate()) for p in procs]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    """The same job without admission: two locally spawned ranks, no secret."""
    run = tmp_path_factory.mktemp("plain")
    proc, _ = train(run, *JOB)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _losses(run)


@pytest.mark.slow
def test_a_node_holding_another_secret_is_refused_by_name_before_training_starts(tmp_path):
    job, other = _secret(tmp_path / "job.key"), _secret(tmp_path / "other.key")
    run = tmp_path / "run"
    procs, _ = _two_nodes(
        run, [{}, {"MODELPAR_JOB_SECRET": str(other)}], [[f"trainer.job_secret={job}"], []], "torchrun"
    )  # node 1 names its (other) secret through the environment
    results = _finish(procs)
    line = f"admission refused rank 1 (node 1, host {HOST}): did not prove the job secret"
    for code, _, err in results:
        assert code != 0 and line in err, err[-3000:]
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    events = [json.loads(e) for e in (run / "security.jsonl").read_text().splitlines()]
    assert [(e["event"], e["rank"]) for e in events] == [("refused-worker", 1)]
    assert events[0]["line"].startswith(line)


@pytest.mark.slow
@needs_proc
def test_a_two_node_job_holding_the_secret_trains_as_the_plain_job_and_writes_no_secret(tmp_path, plain_losses):
    job, signing = _secret(tmp_path / "job.key"), _secret(tmp_path / "signing.key")
    tokens = {"WANDB_API_KEY": secrets.token_hex(20), "HF_TOKEN": "hf_" + secrets.token_hex(17)}
    env = {"MODELPAR_JOB_SECRET": str(job), "MODELPAR_SIGNING_KEY": str(signing), "WANDB_MODE": "offline", **tokens}
    run = tmp_path / "run"
    procs, port = _two_nodes(run, [env, env], [["trainer.wandb=true"]] * 2, "torchrun")
    workers, agents = set(), set()
    while any(p.poll() is None for p in procs):
        agents |= listening(socket_inodes({p.pid for p in procs}))  # torchrun's own rendezvous store
        workers |= listening(socket_inodes(set().union(*(descendants(p.pid) - {p.pid} for p in procs))))
        time.sleep(0.2)
    for code, _, err in _finish(procs):
        assert code == 0, err[-3000:]
    assert _losses(run) == plain_losses
    assert workers and all(addr.split(":")[0] in LOOPBACK for addr in workers), workers
    # torch's agent store listens on every interface (pytorch #173909): documented, and nothing else does
    assert {addr.split(":")[1] for addr in agents} <= {port}, agents
    hidden = [job.read_text().strip(), signing.read_text().strip(), *tokens.values()]
    forms = [s.encode() for s in hidden] + [bytes.fromhex(s) for s in hidden[:2]]
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.parent.name.startswith("step-") for p in files) and any("wandb" in p.parts for p in files)
    leaks = [(str(p), form[:6]) for p in files for form in forms if form in p.read_bytes()]
    assert not leaks
    assert not (run / "security.jsonl").exists()


@pytest.mark.slow
@needs_proc
def test_the_store_modelpar_serves_listens_on_the_named_address_only(tmp_path):
    env = {"MODELPAR_JOB_SECRET": str(_secret(tmp_path / "job.key"))}  # admitted through the store it serves
    run = tmp_path / "run"
    procs, port = _two_nodes(run, [env, env], [["trainer.steps=1", "trainer.ckpt_every=0"]] * 2, "slurm")
    seen = set()
    while any(p.poll() is None for p in procs):
        seen |= listening_addresses(*(p.pid for p in procs))
        time.sleep(0.1)
    for code, _, err in _finish(procs):
        assert code == 0, err[-3000:]
    assert port in {addr.split(":")[1] for addr in seen}, (port, seen)  # the store was seen listening
    assert all(addr.split(":")[0] in LOOPBACK for addr in seen), seen


def test_verdicts_are_logged_with_the_rank_they_name(tmp_path):
    relayed = LaunchError(
        0, f"halted: AdmissionError: admission refused rank 3 (node 1, host {HOST}): did not prove the job secret"
    )
    assert record_verdict(tmp_path, relayed, 0)
    assert record_verdict(tmp_path, LaunchError(2, "halted: CheckpointError: index.sig does not match"), 2)
    assert not record_verdict(tmp_path, LaunchError(1, "rank 1 died (signal SIGKILL)"), 1)
    assert record_verdict(tmp_path, DataError("data.npy (...) is not the data ckpt was trained on (...)"), None)
    code = "halted: AdmissionError: rank 1 (node 1, host h) runs modelpar code 3f but the job runs 9c; install ..."
    assert record_verdict(tmp_path, LaunchError(0, code), 0)
    events = [json.loads(e) for e in (tmp_path / "security.jsonl").read_text().splitlines()]
    assert [(e["event"], e["rank"]) for e in events] == [
        ("refused-worker", 3),
        ("tampered-checkpoint", 2),
        ("changed-data", None),
        ("code-version", 1),
    ]
    assert all(e["time"].endswith("+00:00") for e in events)


def test_a_secret_file_others_can_read_stops_the_job_before_any_rank_starts(tmp_path):
    key = _secret(tmp_path / "job.key")
    key.chmod(0o640)
    proc, _ = train(tmp_path / "run", *JOB, f"trainer.job_secret={key}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"modelpar-train: error: the job secret {key} is readable by others (mode 0640); run `chmod 600 {key}`"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_local_job_with_a_secret_admits_again_on_each_restart(tmp_path):
    key = _secret(tmp_path / "job.key")
    run = tmp_path / "run"
    restarts = ["trainer.max_restarts=1", "trainer.restart_backoff_s=0", "trainer.ckpt_every=1"]
    proc, _ = train(run, *JOB, *restarts, f"trainer.job_secret={key}", faults="kill@1:1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((run / "restarts.jsonl").read_text().splitlines()) == 1
    assert len(_losses(run)) == 2 and not (run / "security.jsonl").exists()

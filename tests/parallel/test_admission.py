"""Admission over a real TCP store on loopback: ranks are threads, each with its own client connection; a rogue
is one more client that holds no secret."""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import threading

import pytest
import torch.distributed as dist

from modelpar.parallel.admission import AdmissionError, AdmissionSpec, AdmissionTimeout, admit
from modelpar.parallel.secret_file import SecretFileError

TIMEOUT = datetime.timedelta(seconds=20)
HOST = socket.gethostname()


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield store


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def _secret(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


def _admit_all(server, specs: dict[int, AdmissionSpec], world: int) -> dict[int, object]:
    """``admit`` on each rank in ``specs`` (threads, one client each); the prefix each returned or its error."""
    out: dict[int, object] = {}

    def rank_main(rank):
        try:
            out[rank] = admit(_client(server), rank, world, specs[rank], TIMEOUT)
        except (AdmissionError, TimeoutError) as exc:
            out[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_ranks_holding_the_secret_are_admitted_and_meet_under_one_secret_prefix(server, tmp_path):
    spec = AdmissionSpec(_secret(tmp_path, "job"), attempt=0, recipe="r")
    out = _admit_all(server, dict.fromkeys(range(3), spec), 3)
    assert all(isinstance(p, str) for p in out.values()), out
    assert len(set(out.values())) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_with_another_secret_is_refused_by_every_rank_in_the_same_line(server, tmp_path, world):
    job, other = _secret(tmp_path, "job"), _secret(tmp_path, "other")
    specs = {r: AdmissionSpec(other if r == 1 else job) for r in range(world)}
    out = _admit_all(server, specs, world)
    assert all(isinstance(e, AdmissionError) for e in out.values()), out
    lines = {str(e) for e in out.values()}
    assert len(lines) == 1
    (line,) = lines
    assert line.startswith(f"admission refused rank 1 (node 0, host {HOST}): did not prove the job secret"), line
    assert "\n" not in line
    assert [r for r, e in out.items() if e.reporter] == [0]
    assert {tuple(e.refused) for e in out.values()} == {(1,)}


def test_a_rank_without_a_secret_is_refused(server, tmp_path):
    job = _secret(tmp_path, "job")
    out = _admit_all(server, {0: AdmissionSpec(job), 1: AdmissionSpec(job), 2: AdmissionSpec("")}, 3)
    assert {str(e).split(":")[0] for e in out.values()} == {f"admission refused rank 2 (node 0, host {HOST})"}


def _rogue_rank(server, rank: int, attempt: int, response: str) -> threading.Thread:
    """A process without the secret playing ``rank``: a fresh nonce, then a response it recorded earlier."""

    def play():
        client = _client(server)
        ns = f"modelpar-admission/{attempt}/"
        client.compare_set(f"{ns}nonce/{rank}", "", secrets.token_hex(16))
        client.wait([f"{ns}nonce/{r}" for r in range(3)])
        client.compare_set(f"{ns}response/{rank}", "", response)

    thread = threading.Thread(target=play)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("attempt", "reason"),
    [(0, "did not prove the job secret"), (1, "replayed a response of another rank or attempt")],
)
def test_a_replayed_response_is_refused(tmp_path, attempt, reason):
    """Rank 1's genuine response of an earlier job (fresh store, same attempt 0) or of the previous attempt."""
    job = _secret(tmp_path, "job")
    first = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    assert all(isinstance(p, str) for p in _admit_all(first, dict.fromkeys(range(3), AdmissionSpec(job)), 3).values())
    recorded = first.get("modelpar-admission/0/response/1").decode()
    server = first if attempt == 1 else dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rogue = _rogue_rank(server, 1, attempt, recorded)
    out = _admit_all(server, {0: AdmissionSpec(job, attempt), 2: AdmissionSpec(job, attempt)}, 3)
    rogue.join(30)
    for e in out.values():
        assert isinstance(e, AdmissionError), out
        assert str(e).startswith(f"admission refused rank 1 (node 0, host {HOST}): {reason}"), str(e)


def test_keys_a_process_without_the_secret_writes_elsewhere_are_ignored(server, tmp_path):
    job = _secret(tmp_path, "job")
    rogue = _client(server)
    for key in ("modelpar-admission/0/nonce/7", "modelpar-admission/0/response/3", "modelpar-pg/0/x/rank_0", "junk"):
        rogue.set(key, "rogue")
    out = _admit_all(server, dict.fromkeys(range(3), AdmissionSpec(job)), 3)
    assert all(isinstance(p, str) for p in out.values()), out
    prefix = next(iter(out.values()))
    assert rogue.num_keys() > 0 and not rogue.check([prefix + "rank_0"])  # the group's keys live elsewhere


def test_a_rank_whose_slot_a_rogue_took_first_ends_the_job_naming_it(server, tmp_path):
    job = _secret(tmp_path, "job")
    _client(server).set("modelpar-admission/0/nonce/1", "rogue")  # the rogue registers as rank 1
    out = _admit_all(server, dict.fromkeys(range(3), AdmissionSpec(job)), 3)
    assert all(isinstance(e, AdmissionError) for e in out.values()), out
    assert {str(e) for e in out.values()} == {
        f"admission refused rank 1 (node 0, host {HOST}): another process wrote its nonce first (a process without "
        "the job's secret took its place in the store); restart the job"
    }


def test_a_rank_running_another_recipe_is_named(server, tmp_path):
    job = _secret(tmp_path, "job")
    specs = {r: AdmissionSpec(job, recipe="b" if r == 2 else "a") for r in range(3)}
    out = _admit_all(server, specs, 3)
    assert {str(e) for e in out.values()} == {
        f"rank 2 (node 0, host {HOST}) runs recipe b but the job runs a; install the same modelpar and recipe on "
        "every node"
    }
    assert {e.event for e in out.values()} == {"code-version"}


def test_a_secret_file_others_can_read_is_refused_in_one_line(tmp_path):
    path = _secret(tmp_path, "job")
    os.chmod(path, 0o644)
    with pytest.raises(SecretFileError) as err:
        AdmissionSpec(path).secret()
    assert str(err.value) == f"the job secret {path} is readable by others (mode 0644); run `chmod 600 {path}`"


def test_the_environment_names_the_secret_file(tmp_path, monkeypatch):
    path = _secret(tmp_path, "job")
    monkeypatch.setenv("MODELPAR_JOB_SECRET", path)
    assert AdmissionSpec().secret() == bytes.fromhex(open(path).read())


def test_each_attempt_admits_again_in_its_own_namespace(server, tmp_path):
    spec = AdmissionSpec(_secret(tmp_path, "job"))
    first = _admit_all(server, dict.fromkeys(range(2), spec), 2)
    again = _admit_all(server, dict.fromkeys(range(2), AdmissionSpec(spec.secret_file, attempt=1)), 2)
    assert all(isinstance(p, str) for p in [*first.values(), *again.values()]), (first, again)
    assert set(first.values()).isdisjoint(again.values())


def test_a_rank_that_never_answers_is_named_when_the_timeout_ends(server, tmp_path):
    spec = AdmissionSpec(_secret(tmp_path, "job"))
    with pytest.raises(AdmissionTimeout) as err:
        admit(_client(server), 0, 2, spec, datetime.timedelta(seconds=1))
    assert str(err.value) == (
        "admission: rank(s) [1] sent no nonce within trainer.timeout_s; they did not start or hang"
    )

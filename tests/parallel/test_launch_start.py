"""Local CPU ranks forked from a server that imported the engine once: each rank still gets the launcher's
environment, working directory, file mode mask and output as they are at this launch, as a spawned rank would."""

import os
import sys

import pytest

from modelpar.backends.gloo_cpu import RankSetup
from modelpar.parallel.launch import launch


def _report(tag: str) -> None:
    rank = os.environ["RANK"]  # one write per line: the two ranks share the descriptors
    mask = os.umask(0)
    where = f"{os.environ.get('MODELPAR_TEST_MARK', '-')} {os.getcwd()} {mask:03o}"
    os.write(sys.stdout.fileno(), f"rank {rank} {tag} {where}\n".encode())
    os.write(sys.stderr.fileno(), f"rank {rank} err {tag}\n".encode())


def test_forked_ranks_get_this_launchs_environment_and_output(capfd, monkeypatch, tmp_path):
    monkeypatch.delenv("MODELPAR_RANK_START", raising=False)
    setup = RankSetup()
    assert setup.start_method == "forkserver"
    launch(2, _report, "first", rank_setup=setup, timeout_s=120)  # the server starts here, or already has
    monkeypatch.setenv("MODELPAR_TEST_MARK", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    mask = os.umask(0o027)
    try:
        launch(2, _report, "second", rank_setup=setup, timeout_s=120)
    finally:
        os.umask(mask)
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if "second" in line) == [
        f"rank 0 second set-after-the-server-started {tmp_path} 027",
        f"rank 1 second set-after-the-server-started {tmp_path} 027",
    ]
    assert sorted(line for line in err.splitlines() if line.startswith("rank")) == [
        "rank 0 err first",
        "rank 0 err second",
        "rank 1 err first",
        "rank 1 err second",
    ]


def test_spawn_can_be_asked_for_and_anything_else_is_one_line(monkeypatch):
    monkeypatch.setenv("MODELPAR_RANK_START", "spawn")
    assert RankSetup().start_method == "spawn"
    monkeypatch.setenv("MODELPAR_RANK_START", "fork")
    with pytest.raises(ValueError, match="MODELPAR_RANK_START='fork' must be forkserver or spawn"):
        RankSetup()


def _finish_then_note_teardown(out_dir: str) -> None:
    import time
    from pathlib import Path

    from modelpar.parallel.world import on_destroy

    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(1.0)  # a slow rank: the others' functions returned long before
    Path(out_dir, f"done{rank}").write_text(repr(time.time()))
    on_destroy(lambda: Path(out_dir, f"teardown{rank}").write_text(repr(time.time())))


def test_no_rank_tears_its_group_down_before_every_rank_is_done(tmp_path):
    """A rank whose function returns at once waits for the others before closing its sockets: leaving early made
    a peer still connecting fail with gloo's "Connection closed by peer" (about 1 launch in 6 of three ranks)."""
    launch(3, _finish_then_note_teardown, str(tmp_path), rank_setup=RankSetup(), timeout_s=120)
    slowest_done = float((tmp_path / "done1").read_text())
    for rank in (0, 2):
        assert float((tmp_path / f"teardown{rank}").read_text()) >= slowest_done, rank

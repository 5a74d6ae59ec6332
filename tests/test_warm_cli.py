"""tests.warm_cli.run: a command forked from the warm server looks, to the test, as it would from a fresh
interpreter (argv, working directory, environment, output, exit status, atexit, timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import warm_cli

SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "mark", os.environ.get("WARM_CLI_MARK"), "parent", os.getppid())
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread done"))).start()
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "message":
    sys.exit("a one-line refusal")
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "sleep":
    time.sleep(60)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_argv_cwd_environment_output_and_exit_status_are_the_commands(script, tmp_path):
    env = dict(os.environ, WARM_CLI_MARK="given")
    done = warm_cli.run(
        [sys.executable, str(script), "exit", "3"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert done.returncode == 3
    first, *rest = done.stdout.splitlines()
    assert first == f"argv ['exit', '3'] cwd {tmp_path} mark given parent {warm_cli._server.proc.pid}"
    assert rest == ["thread done", "atexit ran"]  # non-daemon threads joined, then the atexit handlers
    assert done.stderr == "to stderr\n"


@pytest.mark.parametrize(
    "args, code, stderr_end",
    [(["message"], 1, "a one-line refusal\n"), (["raise"], 1, "ValueError: boom\n"), (["ok"], 0, "to stderr\n")],
)
def test_exit_statuses_match_a_fresh_interpreter(script, args, code, stderr_end):
    warm = warm_cli.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)
    fresh = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)
    assert warm.returncode == fresh.returncode == code
    assert warm.stderr.endswith(stderr_end) and fresh.stderr.endswith(stderr_end)


def test_a_command_past_its_timeout_is_killed_and_raises(script):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_cli.run([sys.executable, str(script), "sleep"], capture_output=True, text=True, timeout=2)
    assert time.monotonic() - start < 30
    done = warm_cli.run([sys.executable, str(script), "ok"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0  # the server serves on


def test_an_environment_read_at_import_gets_a_fresh_interpreter(script):
    env = dict(os.environ, PYTHONWARNINGS="error")  # what a fork of a warm process could not honour
    done = warm_cli.run([sys.executable, str(script), "ok"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0
    assert done.stdout.splitlines()[0].endswith(f"parent {os.getpid()}")  # started by this process itself


def test_after_this_process_sets_an_import_time_variable_the_commands_still_run_warm(script, monkeypatch):
    warm_cli.run([sys.executable, str(script), "ok"], capture_output=True, text=True, timeout=60)  # a server is up
    first = warm_cli._server
    # what an earlier test, or an engine module imported here, may leave set (collective_trace.enable, kernels.grid)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "123")
    done = warm_cli.run([sys.executable, str(script), "ok"], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines()[0].endswith(f"parent {warm_cli._server.proc.pid}")  # a warm child, not a fallback
    assert warm_cli._server is not first and not first.alive()  # a new server has the environment; the old one ended

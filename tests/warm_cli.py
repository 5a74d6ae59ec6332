"""``run``: ``subprocess.run`` for the engine's command lines (``python -m modelpar.cli.train ...``, a benchmark
script), minus the start-up every such process pays again: importing torch, Hydra and the engine (about 2.5
CPU-seconds), and a fork server of its own for its ranks (about 4 more).

A warm server process per test worker imports them once, starts one fork server for every job's ranks, and forks
a child per command. The child is the command's process, as a fresh one would be: its own session, the given
working directory, environment and argv, stdin from /dev/null, stdout and stderr to files, ``__main__`` run by
``runpy``, and an exit as anyone can see one (non-daemon threads joined, atexit handlers run, streams flushed, the
command's exit status). Its
ranks come from the shared fork server and take the job's environment, working directory and stdio from the
launcher (``modelpar.parallel.launch``), as they do from a fork server the launcher starts itself.

What a forked child cannot honour goes to ``subprocess.run`` unchanged: a command that is not the engine's,
``input``, an environment that differs in what Python, torch or Triton read once at import (``PYTHON*``,
``TORCH*``, ``TRITON*``, ``CUDA*``, ``OMP*``, ``MKL*``, ``LD_*``), and any test that needs a fresh interpreter
calls ``subprocess.run`` itself (the console scripts, torchrun, signals sent to the process).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "TRITON", "CUDA", "OMP", "MKL", "LD_")
ENGINE_MODULES = tuple(f"modelpar.cli.{name}" for name in ("train", "eval", "ckpt", "data", "bench"))
# what the launcher's own fork server would preload for the jobs these commands start
RANK_MODULES = (
    "modelpar.parallel.launch", "modelpar.backends.gloo_cpu", "modelpar.training.trainer", "modelpar.cli.eval",
    "modelpar.cli.ckpt",
)  # fmt: skip


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _warm_target(cmd) -> tuple[str, str, list[str]] | None:
    """("module", name, args) for ``python -m modelpar... args``, ("path", file, args) for ``python <script>.py
    args``, else None."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1] == "-m" and len(cmd) > 2 and cmd[2].startswith("modelpar."):
        return ("module", cmd[2], cmd[3:])
    if cmd[1].endswith(".py") and not cmd[1].startswith("-"):
        return ("path", str(Path(cmd[1]).resolve()), cmd[2:])
    return None


class _Server:
    def __init__(self) -> None:
        code = f"import sys; sys.path.append({str(ROOT)!r}); from tests.warm_cli import serve; serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            cwd=ROOT,
        )  # fmt: skip
        self.env = _import_time_env(dict(os.environ))
        self.lock = threading.Lock()
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the warm command server did not start: {ready!r}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # the server's loop ends at end of input, and its fork server with it
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def run(self, target, argv, cwd, env, timeout):
        with self.lock, tempfile.TemporaryDirectory(prefix="warm-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"target": target, "argv": argv, "cwd": cwd, "env": env, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
            timed_out = not select.select([self.proc.stdout], [], [], timeout)[0]
            if timed_out:
                try:
                    os.killpg(pid, signal.SIGKILL)  # the command's session: it and what it started in it
                except ProcessLookupError:
                    pass
            code = int(self.proc.stdout.readline())
            return code, out.read_text(errors="replace"), err.read_text(errors="replace"), timed_out


_server: _Server | None = None


def run(cmd, *, capture_output=False, text=False, timeout=None, cwd=None, env=None, check=False, **kwargs):
    """``subprocess.run(cmd, ...)``, in a child of the warm server where the command allows it (module docstring)."""
    global _server
    target = _warm_target(cmd)
    env_given = dict(os.environ if env is None else env)
    warm = target is not None and not kwargs and (text or not capture_output)
    if warm:
        wanted = _import_time_env(env_given)
        # a server inherits this process's environment: a new one where that changed since (a test that set
        # TRITON_INTERPRET, a flight recorder's TORCH_FR_BUFFER_SIZE), and the command asks for it
        if _server is None or not _server.alive() or (wanted != _server.env and wanted == _import_time_env(os.environ)):
            if _server is not None:
                _server.close()
            _server = _Server()
        warm = wanted == _server.env
    if not warm:
        return subprocess.run(cmd, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd, env=env,
                              check=check, **kwargs)  # fmt: skip
    kind, name, argv = target
    code, stdout, stderr, timed_out = _server.run(
        (kind, name), argv, str(Path(cwd or os.getcwd()).resolve()), env_given, timeout
    )
    if not capture_output:  # the command's output is the caller's, as a child's inherited stdout and stderr are
        sys.stdout.write(stdout)
        sys.stderr.write(stderr)
        stdout = stderr = None
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    done = subprocess.CompletedProcess(cmd, code, stdout, stderr)
    if check:
        done.check_returncode()
    return done


# -- the server side -----------------------------------------------------------------------------------------


def serve() -> None:
    """Import once, start the ranks' fork server, then fork one child per request read from stdin."""
    import importlib
    import multiprocessing as mp

    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the caller's pipe: nothing else may write there
    os.dup2(2, 1)  # whatever an import prints goes where its warnings go
    from modelpar.parallel.world import RANK_PRELOAD

    for name in ENGINE_MODULES:
        importlib.import_module(name)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*RANK_PRELOAD, *RANK_MODULES])
    from multiprocessing import forkserver

    forkserver.ensure_running()
    print("ready", file=replies)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request)  # never returns: ends as the command's process would
        print(pid, file=replies)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), file=replies)


def _child(request: dict) -> None:
    import runpy
    from multiprocessing import forkserver, resource_tracker

    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    # the fork server is the server's child, not this process's: waitpid cannot ask after it, and it lives as long
    # as the server does, so a launch here connects to it as it is
    forkserver._forkserver.ensure_running = resource_tracker.ensure_running
    kind, target = request["target"]
    sys.argv = [target, *request["argv"]]
    sys.modules.pop(target, None)  # the server imported what the command imports; a fresh process has no module
    # under the command's own name (it runs as __main__)
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).parent))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to a fresh interpreter
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)


def _exit_code(code) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """What an interpreter does at exit that anyone could see (wait for non-daemon threads, run atexit handlers,
    flush stdout and stderr), without tearing down the server's modules, which only costs time."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

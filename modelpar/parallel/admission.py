"""Admission: before the first collective, every rank proves to every other that it holds the job's secret.

torch.distributed trusts whoever reaches its store: any process that connects can register as a rank. With a
job secret (``trainer.job_secret=FILE`` or ``MODELPAR_JOB_SECRET``), each attempt of a job (every start,
restart and elastic resume) runs a challenge-response over the rendezvous store before the process group
exists:

1. every rank writes a fresh random nonce under the attempt's namespace, write-once (``compare_set``): a key
   another process wrote first is a rank taken by someone else, and the job is refused naming that rank;
2. the challenge is the hash of all ranks' nonces, so no single process (not even rank 0) chooses it and no
   response from an earlier attempt answers it;
3. every rank writes ``HMAC(secret, challenge, {rank, node, host, attempt, code, recipe})``, write-once;
4. every rank reads every response and checks it. The ranks whose responses verify under a rank's own secret
   form its group; a strict majority (rank 0's side on a tie) is the job, the rest are refused. Every rank
   reaches the same verdict, in the same one line naming the refused ranks, their node and host.

A rank whose code (hash of the installed modelpar and its recipes) or recipe differs from the job's is named
the same way. The process group then meets under a prefix derived from the challenge and the secret: keys a
process without the secret writes elsewhere in the store are never read. Nothing here encrypts the traffic
or stops a process that reaches the store from disrupting the job (see docs/reliability.md).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import importlib.util
import json
import os
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from modelpar.parallel.secret_file import read_secret

SECRET_ENV = "MODELPAR_JOB_SECRET"  # names the secret's file (the secret itself never travels in the environment)
PROTOCOL = b"modelpar-admission-v1"
UNPROVEN = "did not prove the job secret (it has none, another one, or replayed an old response)"
_POLL_S = (0.005, 0.2)  # first and longest wait between looks at the store


class AdmissionError(RuntimeError):
    """The job refused a rank (or a rank's code); the message is one line every rank words alike.

    ``event``: refused-worker | code-version; ``refused``: the ranks named; ``reporter``: whether this rank is
    the one that records the event (the lowest rank the job kept)."""

    one_line = True

    def __init__(self, message: str, event: str, refused: list[int], reporter: bool):
        super().__init__(message)
        self.event, self.refused, self.reporter = event, refused, reporter


class AdmissionTimeout(TimeoutError):
    """A rank never answered the admission (it did not start, or hangs); the message names it in one line."""

    one_line = True


@dataclass(frozen=True)
class AdmissionSpec:
    """What a rank needs to take part: the secret's file ("" for none), the attempt (restart count) and a
    hash of the recipe it runs."""

    secret_file: str = ""
    attempt: int = 0
    recipe: str = ""

    def secret(self) -> bytes | None:
        path = self.secret_file or os.environ.get(SECRET_ENV, "")
        if not path:
            return None
        return read_secret(path, "the job secret", "write one with `modelpar-ckpt keygen FILE` (mode 600)")


@functools.cache
def code_version() -> str:
    """SHA-256 (16 hex digits) of the installed modelpar's source and its recipes: equal on every node of a job."""
    roots = [Path(__file__).resolve().parents[1]]
    recipes = importlib.util.find_spec("modelpar_recipes")
    if recipes is not None and recipes.submodule_search_locations:
        roots += [Path(p) for p in recipes.submodule_search_locations]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml") and p.is_file()):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def node_and_host() -> tuple[str, str]:
    """This rank's node (torchrun's GROUP_RANK, SLURM's SLURM_NODEID, else "0") and host name."""
    node = os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or "0"
    return node, socket.gethostname()


def admit(store, rank: int, world_size: int, spec: AdmissionSpec, timeout: datetime.timedelta) -> str:
    """Run the admission of ``rank`` over ``store`` (see the module's docstring). Returns the prefix under which
    the process group meets; raises ``AdmissionError`` (the job's verdict) or ``AdmissionTimeout`` (a rank that
    never answered, named)."""
    secret = spec.secret()
    ns = f"modelpar-admission/{spec.attempt}/"
    node, host = node_and_host()
    deadline = time.monotonic() + timeout.total_seconds()
    _claim(store, ns, f"nonce/{rank}", secrets.token_hex(16), rank, node, host)
    nonces = _gather(store, ns, "nonce", world_size, deadline)
    challenge = hashlib.sha256("\n".join(nonces).encode()).digest()
    info = {"rank": rank, "node": node, "host": host, "attempt": spec.attempt, "code": code_version()}
    payload = json.dumps({**info, "recipe": spec.recipe}, sort_keys=True)
    _claim(store, ns, f"response/{rank}", payload + "\n" + proof(secret, challenge, payload), rank, node, host)
    responses = _gather(store, ns, "response", world_size, deadline)
    judge(responses, secret, challenge, spec.attempt, rank)
    session = hashlib.sha256((secret or b"") + challenge).hexdigest()[:16]
    return f"modelpar-pg/{spec.attempt}/{session}/"


def proof(secret: bytes | None, challenge: bytes, payload: str) -> str:
    """The HMAC binding ``payload`` (rank, node, host, attempt, versions) to this attempt's challenge; "" without
    a secret."""
    if secret is None:
        return ""
    return hmac.new(secret, PROTOCOL + b"\n" + challenge + b"\n" + payload.encode(), hashlib.sha256).hexdigest()


def judge(responses: list[str], secret: bytes | None, challenge: bytes, attempt: int, me: int) -> None:
    """Check every rank's response as rank ``me`` sees it; raise the job's verdict, or return if all are admitted."""
    n = len(responses)
    parsed, why = [], {}
    for r, raw in enumerate(responses):
        payload, _, mac = raw.rpartition("\n")
        try:
            info = json.loads(payload)
        except ValueError:
            info = None
        if not isinstance(info, dict):
            parsed.append({})
            why[r] = "sent a malformed response"
            continue
        parsed.append(info)
        if info.get("rank") != r or info.get("attempt") != attempt:
            why[r] = "replayed a response of another rank or attempt"
        elif not hmac.compare_digest(mac, proof(secret, challenge, payload)):
            why[r] = UNPROVEN
    group = [r for r in range(n) if r not in why]
    if 2 * len(group) > n or (2 * len(group) == n and 0 in group):
        refused = sorted(why)
    else:  # this rank is on the smaller side: its own group is the one refused
        refused = group
        why = dict.fromkeys(group, UNPROVEN)
    kept = [r for r in range(n) if r not in refused]
    reporter = bool(kept) and me == kept[0]
    if refused:
        names = ", ".join(_who(r, parsed[r]) for r in refused)
        reason = why[refused[0]]
        raise AdmissionError(
            f"admission refused rank{'s' if len(refused) > 1 else ''} {names}: {reason}; give every rank the job's "
            "secret file (trainer.job_secret or MODELPAR_JOB_SECRET)",
            "refused-worker",
            refused,
            reporter,
        )
    for key, what in (("code", "modelpar code"), ("recipe", "recipe")):
        values = [info.get(key) for info in parsed]
        usual, _ = Counter(values).most_common(1)[0]
        odd = [r for r, v in enumerate(values) if v != usual]
        if odd:
            kept = [r for r in range(n) if r not in odd]
            names = ", ".join(_who(r, parsed[r]) for r in odd)
            raise AdmissionError(
                f"rank{'s' if len(odd) > 1 else ''} {names} run{'' if len(odd) > 1 else 's'} {what} "
                f"{values[odd[0]]} but the job runs {usual}; install the same modelpar and recipe on every node",
                "code-version",
                odd,
                me == kept[0],
            )


def _who(rank: int, info: dict) -> str:
    return f"{rank} (node {info.get('node', '?')}, host {info.get('host', '?')})"


def _claim(store, ns: str, key: str, value: str, rank: int, node: str, host: str) -> None:
    """Write ``value`` under ``key`` unless another process already did: then this rank was taken, and the job
    is refused (the others hear it through the namespace's ``abort`` key)."""
    if store.compare_set(ns + key, "", value).decode() == value:
        return
    message = (
        f"admission refused rank {rank} (node {node}, host {host}): another process wrote its {key.split('/')[0]} "
        "first (a process without the job's secret took its place in the store); restart the job"
    )
    store.compare_set(ns + "abort", "", message)
    raise AdmissionError(message, "refused-worker", [rank], True)


def _gather(store, ns: str, kind: str, world_size: int, deadline: float) -> list[str]:
    """Every rank's ``kind`` value, once all are written; an ``abort`` (a rank taken) or the deadline ends it."""
    keys = [f"{ns}{kind}/{r}" for r in range(world_size)]
    pause = _POLL_S[0]
    while not store.check(keys):
        if store.check([ns + "abort"]):
            message = store.get(ns + "abort").decode()
            raise AdmissionError(message, "refused-worker", [], False)
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise AdmissionTimeout(
                f"admission: rank(s) {missing} sent no {kind} within trainer.timeout_s; they did not start or hang"
            )
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])
    return [store.get(k).decode() for k in keys]


__all__ = [
    "SECRET_ENV",
    "AdmissionError",
    "AdmissionTimeout",
    "AdmissionSpec",
    "admit",
    "code_version",
    "judge",
    "proof",
]

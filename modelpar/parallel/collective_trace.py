"""torch's own flight recorder of collectives: on for every run, dumped by a rank that stalls, read back to
name the first collective the ranks of a group disagree on.

torch keeps a ring of the last collectives each process group issued (``TORCH_FR_BUFFER_SIZE`` entries; gloo
and NCCL alike in torch 2.13; point-to-point ops are not in gloo's). ``enable`` turns it on before the world is
initialised (a user's own ``TORCH_FR_BUFFER_SIZE``, 0 included, wins). ``write`` dumps this rank's ring in
torch's own format, a pickle per rank named ``rank_<N>``, so torch's analyser reads the directory too
(``python -m torch.distributed.flight_recorder.fr_trace <dir>``); gloo's dump names no group members, so ours
fills ``pg_config`` with every group's ranks. ``first_disagreement`` compares the ranks' rings group by group.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

ENV = "TORCH_FR_BUFFER_SIZE"
ENTRIES = 2000  # collectives kept per rank (a few steps of a large tensor-parallel model)
PREFIX = "rank_"


def enable() -> None:
    """Record collectives from the next ``init_process_group`` on (torch reads the variable there)."""
    os.environ.setdefault(ENV, str(ENTRIES))


def enabled() -> bool:
    try:
        return int(os.environ.get(ENV, "0")) > 0
    except ValueError:
        return False


def _raw_dump() -> bytes | None:
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) if dist.get_backend() == "nccl" else None
    dump = dump or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        return dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    except RuntimeError:
        return None


def dump() -> dict | None:
    """This rank's ring (torch's dict) with ``rank`` and every group's members in ``pg_config``; None when the
    recorder is off or the world is not up."""
    if not enabled() or not dist.is_initialized():
        return None
    raw = _raw_dump()
    if raw is None:
        return None
    trace = pickle.loads(raw)
    config = trace.setdefault("pg_config", {})
    world = dist.distributed_c10d._world
    for group, name in list(world.pg_names.items()):
        ranks = sorted(world.pg_group_ranks.get(group, {}))
        known = config.get(name)
        if known is None or known.get("ranks") in (None, "[]"):
            config[name] = {"name": name, "desc": getattr(group, "group_desc", ""), "ranks": json.dumps(ranks)}
    trace["rank"] = dist.get_rank()
    trace["ring_size"] = int(os.environ[ENV])
    return trace


def write(directory: str | Path, rank: int) -> Path | None:
    """Dump this rank's ring to ``<directory>/rank_<rank>`` (replaced whole); the path, or None if off."""
    trace = dump()
    if trace is None:
        return None
    path = Path(directory) / f"{PREFIX}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pickle.dumps(trace))
    os.replace(tmp, path)
    return path


def read(directory: str | Path) -> list[dict]:
    """Every rank's last dump, in rank order (ranks that wrote none are absent)."""
    out = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        if path.suffix == ".tmp":
            continue
        try:
            out.append(pickle.loads(path.read_bytes()))
        except (OSError, pickle.UnpicklingError, EOFError):
            continue
    return sorted(out, key=lambda t: t.get("rank", -1))


def _groups(traces: list[dict]) -> dict[str, tuple[str, list[int]]]:
    """Group name -> (description, member ranks), from whichever dump knows them."""
    groups: dict[str, tuple[str, list[int]]] = {}
    for trace in traces:
        for name, config in trace.get("pg_config", {}).items():
            ranks = json.loads(config.get("ranks") or "[]")
            if len(ranks) > 1 and name not in groups:
                groups[name] = (config.get("desc") or "", ranks)
    return groups


def _names(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _op(entry: dict) -> str:
    """The operation of a ring entry ("gloo:all_reduce" -> "all_reduce")."""
    return entry["profiling_name"].split(":")[-1]


def _signature(entry: dict) -> str:
    return f"{_op(entry)} of {entry['input_sizes']} {'/'.join(entry['input_dtypes'])}"


def _issued(trace: dict, name: str, ring: dict[int, dict]) -> int | None:
    """How many collectives this rank issued on group ``name``; None when its ring no longer tells. The ring's
    status is keyed by torch's internal group id, which only the entries pair with the group's name."""
    ids = {str(e["pg_id"]) for e in ring.values() if "pg_id" in e}
    status = [int(trace.get("pg_status", {}).get(i, {}).get("last_enqueued_collective", -1)) for i in ids]
    last = max([*status, *ring, 0])
    if last == 0 and len(trace.get("entries", ())) >= trace.get("ring_size", ENTRIES):
        return None  # no entry for the group left in a full ring: older than what it holds
    return last


def first_disagreement(traces: list[dict]) -> str | None:
    """One line naming the earliest collective on which a group's ranks part ways: issued by some members and
    not (yet) by others, or issued as different operations or shapes at the same place in the sequence; None
    when every group's ranks agree (a hang is then in point-to-point traffic or outside collectives)."""
    found = _disagreements(traces)
    return min(found)[1] if found else None


def lagging_ranks(traces: list[dict]) -> list[int]:
    """The ranks that had not issued the earliest collective their group's other members issued (the likely
    stuck ones); [] when no group's ranks part ways that way."""
    found = [d for d in _disagreements(traces) if d[2]]
    return min(found)[2] if found else []


def _disagreements(traces: list[dict]) -> list[tuple[float, str, list[int]]]:
    """(when, line, the ranks behind) for each group whose ranks part ways, at its first such collective."""
    by_rank = {t["rank"]: t for t in traces if "rank" in t}
    found: list[tuple[float, str, list[int]]] = []
    for name, (desc, ranks) in _groups(traces).items():
        seen = [r for r in ranks if r in by_rank]
        if len(seen) < 2:
            continue
        label = f"group {desc or name} ({_names(ranks)})"
        ring = {
            r: {
                e["collective_seq_id"]: e
                for e in by_rank[r]["entries"]
                if e["process_group"][0] == name and not e["is_p2p"]
            }
            for r in seen
        }
        issued = {r: _issued(by_rank[r], name, ring[r]) for r in seen}
        seen = [r for r in seen if issued[r] is not None]
        if len(seen) < 2:
            continue
        for seq in sorted(set.intersection(*(set(ring[r]) for r in seen))):
            signatures = {r: _signature(ring[r][seq]) for r in seen}
            if len(set(signatures.values())) > 1:
                when = min(ring[r][seq]["time_created_ns"] for r in seen)
                parts = "; ".join(f"rank {r} {s}" for r, s in signatures.items())
                found.append((when, f"{label}: collective #{seq} differs: {parts}", []))
                break
        low = min(issued.values())
        if low < max(issued.values()):
            seq = low + 1
            ahead = [r for r in seen if issued[r] >= seq]
            behind = [r for r in seen if issued[r] == low]
            entry = next((ring[r][seq] for r in ahead if seq in ring[r]), None)
            what = f" {_op(entry)} of {entry['input_sizes']}" if entry else ""
            found.append(
                (
                    entry["time_created_ns"] if entry else float("inf"),
                    f"{label}: collective #{seq}{what} was issued by {_names(ahead)}, not by {_names(behind)} "
                    f"(last issued #{low})",
                    behind,
                )
            )
    return found


def trace_report(directory: str | Path, ranks: int | None = None, traces: list[dict] | None = None) -> str:
    """The lines a hang report gains from torch's recorder ("" when there are no dumps); ``traces``: the
    dumps already ``read`` from ``directory``."""
    traces = read(directory) if traces is None else traces
    if not traces:
        return ""
    line = (
        first_disagreement(traces)
        or "every group's ranks issued the same recorded collectives (gloo records no point-to-point ops)"
    )
    missing = sorted(set(range(ranks)) - {t.get("rank") for t in traces}) if ranks else []
    unseen = f" (no dump from {_names(missing)})" if missing else ""
    return f"torch flight recorder{unseen}: {line}; dumps in {directory}"

"""Layout specs: one dash-separated word per layout, as ``bench.sweep`` entries and ``--layouts`` flags spell them.

parse_layout("tp2-pp2-1f1b-m4", base)  ->  base with tp=2, pp=2, schedule=1f1b, microbatches=4
layout_name(that)                      ->  "tp2-pp2-1f1b-m4" (the canonical spec, the key of a result row)
"""

from __future__ import annotations

import re
from dataclasses import replace

from modelpar.pipeline.schedule import SCHEDULES
from modelpar.training.config import ParallelConfig

_SPEC_TOKEN = re.compile(r"^(tp|cp|pp|dp|vpp|m)(\d+)$")


def parse_layout(spec: str, base: ParallelConfig) -> ParallelConfig:
    """``base`` with the settings of ``spec``: dash-separated ``tpN cpN ppN dpN vppN mN sp`` and a schedule name
    (``gpipe 1f1b interleaved zb-h1``), ``native`` / ``exchange`` for ``parallel.collectives``, ``uniform`` /
    ``params`` / ``flops`` / ``blocks`` for ``parallel.partition``, ``rc`` for ``parallel.recompute=full``,
    ``ring`` / ``allgather`` for ``parallel.cp_comm``; ``single`` is tp=cp=pp=dp=1. E.g. ``tp2-pp2-1f1b``,
    ``pp2-vpp2-interleaved``, ``tp2-native``, ``pp2-uniform``, ``single-rc``, ``cp2-allgather``.
    Unset degrees are 1; the schedule defaults to 1f1b (interleaved when vpp > 1); m to ``base.microbatches``."""
    values: dict = dict(tp=1, cp=1, pp=1, dp=1, vpp=1, sp=False, schedule="", microbatches=base.microbatches)
    text = spec.strip().replace("zb-h1", "zbh1")
    for token in text.split("-"):
        match = _SPEC_TOKEN.match(token)
        if token == "single":
            continue
        if match:
            values["microbatches" if match[1] == "m" else match[1]] = int(match[2])
        elif token == "rc":  # parallel.recompute
            values["recompute"] = "full"
        elif token == "sp":
            values["sp"] = True
        elif token in ("ring", "allgather"):  # parallel.cp_comm
            values["cp_comm"] = token
        elif token in ("native", "exchange"):  # parallel.collectives
            values["collectives"] = token
        elif token in ("uniform", "params", "flops", "blocks"):  # parallel.partition
            values["partition"] = token
        elif token.replace("zbh1", "zb-h1") in SCHEDULES:
            values["schedule"] = token.replace("zbh1", "zb-h1")
        else:
            raise ValueError(
                f"bench.sweep entry {spec!r}: cannot read {token!r}; use tpN, cpN, ppN, dpN, vppN, mN, sp, rc, "
                f"ring, allgather, native, exchange, uniform, params, flops, blocks or a schedule "
                f"({', '.join(SCHEDULES)}), e.g. 'tp2-pp2-1f1b'"
            )
    values["schedule"] = values["schedule"] or ("interleaved" if values["vpp"] > 1 else "1f1b")
    return replace(base, **values)


def layout_name(p: ParallelConfig) -> str:
    """The canonical spec of a layout, its key in ``bench.json``."""
    rc = "-rc" if p.recompute != "none" else ""
    if p.tp == p.pp == p.dp == p.cp == 1:
        return "single" + (f"-m{p.microbatches}" if p.microbatches != 8 else "") + rc
    parts = [f"{k}{getattr(p, k)}" for k in ("tp", "cp", "pp", "dp", "vpp") if getattr(p, k) > 1]
    parts += ["sp"] * (p.sp and p.tp > 1)
    parts += [p.cp_comm] * (p.cp > 1 and p.cp_comm != ParallelConfig.cp_comm)
    if p.pp > 1:
        parts.append(p.schedule)
    if p.microbatches != 8:
        parts.append(f"m{p.microbatches}")
    if p.collectives != "auto":
        parts.append(p.collectives)
    if p.pp > 1 and p.partition == "explicit":
        parts.append("split" + "+".join(f"{c:g}" for c in p.stage_layers))
    elif p.pp > 1 and p.partition != ParallelConfig.partition:
        parts.append(p.partition)
    return "-".join(parts) + rc

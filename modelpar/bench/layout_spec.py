"""Layout specs: one dash-separated word per layout, as ``bench.sweep`` entries and ``--layouts`` flags spell them.

parse_layout("tp2-pp2-1f1b-m4", base)  ->  base with tp=2, pp=2, schedule=1f1b, microbatches=4
layout_name(that)                      ->  "tp2-pp2-1f1b-m4" (the canonical spec, the key of a result row)
parse_case("dp2-zero3-sel", cfg)       ->  cfg with dp=2, optim.zero=3, parallel.recompute=selective
case_name(that)                        ->  "dp2-sel-zero3"
"""

from __future__ import annotations

import re
from dataclasses import replace

from modelpar.model.activations import DEFAULT_SELECTIVE, RECOMPUTE_MODULES
from modelpar.pipeline.schedule import SCHEDULES
from modelpar.training.config import ParallelConfig

_SPEC_TOKEN = re.compile(r"^(tp|cp|pp|dp|ep|vpp|m)(\d+)$")
_HYBRID_TOKEN = re.compile(r"^hybrid(\d+)$")  # parallel.cp_comm=hybrid with parallel.cp_a2a=N
_OPTIM_TOKEN = re.compile(r"^(zero|zg)(\d+)$")  # optim.zero, optim.zero_group (parse_case)


def parse_layout(spec: str, base: ParallelConfig) -> ParallelConfig:
    """``base`` with the settings of ``spec``: dash-separated ``tpN cpN ppN dpN epN vppN mN sp`` and a schedule name
    (``gpipe 1f1b interleaved zb-h1``), ``native`` / ``exchange`` for ``parallel.collectives``, ``uniform`` /
    ``params`` / ``flops`` / ``blocks`` for ``parallel.partition``, ``rc`` for ``parallel.recompute=full``,
    ``ring`` / ``allgather`` / ``alltoall`` for ``parallel.cp_comm`` (``hybridN``: hybrid, all-to-all groups of N),
    ``inorder`` for ``parallel.overlap_pairs=false``, ``sel`` for ``parallel.recompute=selective`` (``sel`` alone:
    the default modules, elementwise; ``sel.attention``, ``sel.attention.mlp``, ...: those), ``off`` for
    ``parallel.offload_activations``; ``single`` is tp=cp=pp=dp=1. E.g. ``tp2-pp2-1f1b``,
    ``pp2-vpp2-interleaved``, ``tp2-native``, ``pp2-uniform``, ``single-rc``, ``cp2-allgather``, ``cp4-hybrid2``,
    ``single-sel.mlp``.
    Unset degrees are 1; the schedule defaults to 1f1b (interleaved when vpp > 1); m to ``base.microbatches``;
    recompute and offload to ``base``'s."""
    values: dict = dict(tp=1, cp=1, pp=1, dp=1, ep=1, vpp=1, sp=False, schedule="", microbatches=base.microbatches)
    text = spec.strip().replace("zb-h1", "zbh1")
    for token in text.split("-"):
        match = _SPEC_TOKEN.match(token)
        if token == "single":
            continue
        if match:
            values["microbatches" if match[1] == "m" else match[1]] = int(match[2])
        elif token == "rc":  # parallel.recompute
            values["recompute"] = "full"
        elif token == "sel" or token.startswith("sel."):
            modules = token.split(".")[1:] or list(DEFAULT_SELECTIVE)
            unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
            if unknown:
                raise ValueError(
                    f"bench.sweep entry {spec!r}: {token!r} names {unknown}; selective recompute reruns some of "
                    f"{', '.join(RECOMPUTE_MODULES)}, e.g. 'sel.attention.mlp'"
                )
            values["recompute"], values["recompute_modules"] = "selective", modules
        elif token == "off":  # parallel.offload_activations
            values["offload_activations"] = True
        elif token == "sp":
            values["sp"] = True
        elif token == "inorder":  # parallel.overlap_pairs=false
            values["overlap_pairs"] = False
        elif token in ("ring", "allgather", "alltoall"):  # parallel.cp_comm
            values["cp_comm"] = token
        elif _HYBRID_TOKEN.match(token):
            values["cp_comm"], values["cp_a2a"] = "hybrid", int(token[len("hybrid") :])
        elif token in ("native", "exchange"):  # parallel.collectives
            values["collectives"] = token
        elif token in ("uniform", "params", "flops", "blocks"):  # parallel.partition
            values["partition"] = token
        elif token.replace("zbh1", "zb-h1") in SCHEDULES:
            values["schedule"] = token.replace("zbh1", "zb-h1")
        else:
            raise ValueError(
                f"bench.sweep entry {spec!r}: cannot read {token!r}; use tpN, cpN, ppN, dpN, epN, vppN, mN, sp, rc, "
                f"sel, off, inorder, ring, allgather, alltoall, hybridN, native, exchange, uniform, params, flops, "
                f"blocks or a "
                f"schedule ({', '.join(SCHEDULES)}), e.g. 'tp2-pp2-1f1b'"
            )
    values["schedule"] = values["schedule"] or ("interleaved" if values["vpp"] > 1 else "1f1b")
    return replace(base, **values)


def layout_name(p: ParallelConfig) -> str:
    """The canonical spec of a layout, its key in ``bench.json``."""
    rc = {"none": "", "full": "-rc"}.get(p.recompute, "")
    if p.recompute == "selective":
        modules = list(p.recompute_modules)
        rc = "-sel" + ("" if modules == list(DEFAULT_SELECTIVE) else "." + ".".join(modules))
    rc += "-off" * p.offload_activations
    rc += "-inorder" * (p.schedule == "dualpipev" and not p.overlap_pairs)
    if p.tp == p.pp == p.dp == p.cp == 1:
        return "single" + (f"-m{p.microbatches}" if p.microbatches != 8 else "") + rc
    parts = [f"{k}{getattr(p, k)}" for k in ("tp", "cp", "pp", "dp", "ep", "vpp") if getattr(p, k) > 1]
    parts += ["sp"] * (p.sp and p.tp > 1)
    comm = f"hybrid{p.cp_a2a}" if p.cp_comm == "hybrid" else p.cp_comm
    parts += [comm] * (p.cp > 1 and p.cp_comm != ParallelConfig.cp_comm)
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


def parse_case(spec: str, cfg):
    """``cfg`` (a training or bench recipe) with the layout of ``spec`` (``parse_layout``) and its optimizer
    words: ``zeroN`` for ``optim.zero``, ``zgN`` for ``optim.zero_group`` (unset: the recipe's)."""
    optim, rest = {}, []
    for token in spec.strip().split("-"):
        match = _OPTIM_TOKEN.match(token)
        if match:
            optim["zero" if match[1] == "zero" else "zero_group"] = int(match[2])
        else:
            rest.append(token)
    parallel = parse_layout("-".join(rest) or "single", cfg.parallel)
    return replace(cfg, parallel=parallel, optim=replace(cfg.optim, **optim))


def case_name(cfg) -> str:
    """``layout_name`` of the recipe's layout plus its ZeRO words (``-zero3``, ``-zg2``): the key of a row."""
    name = layout_name(cfg.parallel)
    if cfg.optim.zero:
        name += f"-zero{cfg.optim.zero}"
    if cfg.optim.zero_group:
        name += f"-zg{cfg.optim.zero_group}"
    return name

"""From what the ranks measured to one row per layout: medians over the timed steps, the bubble measured and
simulated, memory and communication per step, and our speed over the peer's.

    per_rank = run_on_ranks(world, bench_rank, case, data_path)        # modelpar.bench.harness
    row = summarize(case, per_rank, peak_tflops, peer_name)            # the row of bench.json
"""

from __future__ import annotations

import statistics

from modelpar.bench.config import BenchRecipe
from modelpar.bench.layout_spec import case_name
from modelpar.bench.recipe_memory import recipe_memory
from modelpar.model.flops import training_flops_per_token
from modelpar.pipeline import Costs, Timeline, build_schedule, simulate

STATE_KINDS = ("weights", "gradients", "optimizer", "buffers", "gathered")


def pool_passes(a: dict, b: dict) -> dict:
    """One rank's results of two passes as one: the timed steps of both (memory and comm of the first)."""
    out = dict(a)
    for key in ("times", "cpu_times", "losses"):
        out[key] = {name: a[key][name] + b[key][name] for name in a[key]}
    out["records"] = a["records"] + b["records"]
    return out


def summarize(cfg: BenchRecipe, per_rank: list[dict], peak_tflops: float, peer: str | None) -> dict:
    """The row of one layout: medians over the timed steps (each step's time is its slowest rank's)."""
    p = cfg.parallel
    layout = p.layout()
    tokens = cfg.data.global_batch * cfg.data.seq_len
    flops = training_flops_per_token(cfg.model, cfg.data.seq_len) * tokens

    def side(name: str) -> dict | None:
        if name not in per_rank[0]["times"]:
            return None
        steps = [max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))]
        step_s = statistics.median(steps)
        tflops = flops / step_s / layout.world_size / 1e12
        cpu = [r["cpu_times"][name][i] / r["times"][name][i] for r in per_rank for i in range(len(steps))]
        return {
            "step_s": step_s,
            "cpu_share": statistics.fmean(cpu),
            "step_s_all": steps,
            "tokens_per_s": tokens / step_s,
            "tflops_per_rank": tflops,
            "mfu": tflops / peak_tflops if peak_tflops > 0 else None,
            "first_loss": per_rank[0]["first_loss"][name],
            "losses": per_rank[0]["losses"][name],
        }

    ours, theirs = side("ours"), side("peer")
    rounds = paired_round_ratios(ours["step_s_all"], theirs["step_s_all"], cfg.bench.steps_per_round) if theirs else []
    pipeline = sorted(
        (r for r in per_rank if r["tp_rank"] == 0 and r["dp_rank"] == 0 and r.get("cp_rank", 0) == 0),
        key=lambda r: r["pp_rank"],
    )
    timelines = [Timeline(tuple(r["records"][i] for r in pipeline)) for i in range(len(pipeline[0]["records"]))]
    durations = _mean_durations(timelines)
    schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp)
    row = {
        "layout": case_name(cfg),
        "zero": cfg.optim.zero,
        "zero_group": cfg.optim.zero_group,
        "recompute_modules": list(p.recompute_modules) if p.recompute == "selective" else [],
        "offload": p.offload_activations,
        "tp": p.tp,
        "cp": p.cp,
        "cp_comm": p.cp_comm if p.cp > 1 else None,
        "pp": p.pp,
        "dp": p.dp,
        "vpp": p.vpp,
        "sp": p.sp,
        "recompute": p.recompute,
        "schedule": p.schedule if p.pp > 1 else "none",
        "micro_batches": p.microbatches,
        "world_size": layout.world_size,
        "tokens_per_step": tokens,
        "model_flops_per_step": flops,
        "peak_tflops_per_rank": peak_tflops,
        "ours": ours,
        "peer_name": peer,
        "peer_note": per_rank[0].get("peer_note"),  # why there is no peer, where we tried one
        "peer": theirs,
        "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs else None,
        "ratio_per_round": rounds,  # the spread says how far the ratio above can be trusted on a noisy machine
        "first_loss_rel_diff": abs(ours["first_loss"] - theirs["first_loss"]) / abs(ours["first_loss"])
        if theirs
        else None,
        "bubble_measured": statistics.median(t.bubble_fraction for t in timelines),
        "bubble_simulated": simulate(schedule, Costs.from_mapping(durations)).bubble_fraction,
        "bubble_replayed": statistics.median(
            simulate(schedule, Costs(per_action=_action_durations(t))).bubble_fraction for t in timelines
        ),
        "compute_s_per_stage": [statistics.median(t.compute_time(r) for t in timelines) for r in range(p.pp)],
        "mean_action_ms": {k: v * 1e3 for k, v in durations.items()},
        "activation_peak_bytes_per_stage": [r["activation_peak_bytes"] for r in pipeline],
        "memory_per_stage": memory_vs_prediction(cfg, per_rank),
        "comm_bytes_per_step": _sum_comm(per_rank),
        "pair_handovers": sum(r.get("pair_handovers", 0) for r in per_rank),
    }
    if "exposed_comm" in per_rank[0]:  # bench.trace_comm: the mean over ranks of one profiled step
        row["exposed_comm_s"] = {
            kind: statistics.fmean(r["exposed_comm"][kind]["seconds"] for r in per_rank)
            for kind in per_rank[0]["exposed_comm"]
        }
        row["comm_count_per_rank"] = {
            kind: per_rank[0]["exposed_comm"][kind]["count"] for kind in per_rank[0]["exposed_comm"]
        }
    row["losses_agree"] = row["first_loss_rel_diff"] <= 1e-5 if theirs else None
    row["_timeline"] = timelines[-1]
    return row


def memory_vs_prediction(cfg: BenchRecipe, per_rank: list[dict]) -> list[dict]:
    """Per pipeline stage, on its fullest rank: the model states (weights, gradients, optimizer, buffers, gathered
    peak) and peak saved activations (device; offload's host copies apart) measured, and ``modelpar-plan``'s
    prediction for the same recipe (``recipe_memory``), with predicted / measured for states and activations."""
    predicted = recipe_memory(cfg)
    out = []
    for stage, pred in enumerate(predicted):
        ranks = [r for r in per_rank if r["pp_rank"] == stage]
        states = max((r.get("state_bytes") or {} for r in ranks), key=lambda st: sum(st.get(k, 0) for k in STATE_KINDS))
        measured = {k: states.get(k, 0) for k in STATE_KINDS}
        measured["states"] = sum(measured.values())
        measured["gathered_weights"] = states.get("gathered_weights", 0)
        measured["gathered_gradients"] = states.get("gathered_gradients", 0)
        measured["activations"] = max(r["activation_peak_bytes"] for r in ranks)
        measured["host"] = max(r.get("activation_host_peak_bytes", 0) for r in ranks)
        guess = {
            "weights": pred.weights,
            "gradients": pred.grads,
            "optimizer": pred.optimizer,
            "buffers": pred.buffers,
            "gathered": pred.gathered,
            "states": pred.states,
            "activations": pred.saved,
            "host": pred.host,
            "working": pred.working,
        }
        out.append(
            {
                "stage": stage,
                "measured": measured,
                "predicted": guess,
                "states_ratio": guess["states"] / measured["states"] if measured["states"] else None,
                "activations_ratio": guess["activations"] / measured["activations"]
                if measured["activations"]
                else None,
            }
        )
    return out


def paired_round_ratios(ours: list[float], peer: list[float], per_round: int) -> list[float]:
    """Our speed over the peer's in each round: the median of the peer's ``per_round`` steps over the median
    of ours. Ours and the peer's steps of one round ran back to back, so a round sees one machine load; the
    spread over rounds is the noise the ratio of whole-run medians carries."""
    if len(ours) != len(peer) or per_round < 1 or len(ours) % per_round:
        raise ValueError(f"{len(ours)} and {len(peer)} steps do not split into rounds of {per_round}")
    return [
        statistics.median(peer[i : i + per_round]) / statistics.median(ours[i : i + per_round])
        for i in range(0, len(ours), per_round)
    ]


def _mean_durations(timelines: list[Timeline]) -> dict[str, float]:
    by_kind: dict[str, list[float]] = {}
    for timeline in timelines:
        for row in timeline.rows:
            for timed in row:
                if timed.action.kind.is_compute:
                    by_kind.setdefault(timed.action.kind.value, []).append(timed.duration)
    return {kind: statistics.fmean(values) for kind, values in sorted(by_kind.items())}


def _action_durations(timeline: Timeline) -> dict:
    return {t.action: t.duration for row in timeline.rows for t in row if t.action.kind.is_compute}


def _sum_comm(per_rank: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in per_rank:
        for kind, nbytes in r["comm_bytes"].items():
            total[kind] = total.get(kind, 0) + nbytes
    return dict(sorted(total.items()))


def add_ideal(rows: dict[str, dict]) -> None:
    """Pipeline rows get the bubble-bound ideal from the single-rank row (same model and batch), if any."""
    for row in rows.values():
        single = rows.get("single" + (f"-m{row['micro_batches']}" if row["micro_batches"] != 8 else ""))
        if row["pp"] > 1 and row["tp"] == row["dp"] == 1 and single:
            m, p = row["micro_batches"], row["pp"]
            ideal = single["ours"]["tokens_per_s"] * p * m / (m + p - 1)
            row["bubble_bound_ideal_tokens_per_s"] = ideal
            row["fraction_of_ideal"] = row["ours"]["tokens_per_s"] / ideal
            # > 1: the stages together computed longer than the single rank did (stage imbalance is not in it)
            row["compute_vs_single"] = sum(row["compute_s_per_stage"]) / sum(single["compute_s_per_stage"])
        if row.get("cp", 1) > 1 and row["tp"] == row["dp"] == row["pp"] == 1 and single:
            row["cp_ideal_tokens_per_s"] = single["ours"]["tokens_per_s"] * row["cp"]
            row["fraction_of_ideal"] = row["ours"]["tokens_per_s"] / row["cp_ideal_tokens_per_s"]

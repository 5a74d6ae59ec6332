"""The recipe's numeric fields against their meaningful ranges: one table, one line for the first field outside
its range (``modelpar.training.config.validate`` raises it as a ``RecipeError``)."""

from __future__ import annotations

import math

SEED_LIMIT = 2**32  # numpy's seed range, which the trainer seeds too


def out_of_range(cfg) -> str | None:
    """The first numeric field of ``cfg`` (a ``TrainConfig``; not imported here, which imports this module) outside
    its meaningful range, named with the range in one line; None if none."""
    m, o, d, t = cfg.model, cfg.optim, cfg.data, cfg.trainer
    rules = (
        ("model.max_seq_len", m.max_seq_len, m.max_seq_len >= 1, ">= 1"),
        ("model.rope_theta", m.rope_theta, m.rope_theta > 0, "> 0"),
        ("model.norm_eps", m.norm_eps, m.norm_eps > 0, "> 0"),
        ("model.init_std", m.init_std, m.init_std > 0, "> 0"),
        ("optim.lr", o.lr, o.lr >= 0, ">= 0"),
        ("optim.min_lr", o.min_lr, 0 <= o.min_lr <= o.lr, f"between 0 and optim.lr={o.lr}"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.beta1", o.beta1, 0 <= o.beta1 < 1, "in [0, 1)"),
        ("optim.beta2", o.beta2, 0 <= o.beta2 < 1, "in [0, 1)"),
        ("optim.eps", o.eps, o.eps > 0, "> 0"),
        ("optim.grad_clip", o.grad_clip, o.grad_clip >= 0, ">= 0 (0: measure the norm, clip nothing)"),
        ("optim.bucket_mb", o.bucket_mb, o.bucket_mb > 0, "> 0"),
        ("optim.muon_lr_scale", o.muon_lr_scale, o.muon_lr_scale >= 0, ">= 0"),
        ("optim.muon_momentum", o.muon_momentum, 0 <= o.muon_momentum < 1, "in [0, 1)"),
        ("optim.muon_ns_steps", o.muon_ns_steps, 1 <= o.muon_ns_steps < 100, "in [1, 100)"),
        ("optim.qk_clip", o.qk_clip, o.qk_clip >= 0, ">= 0 (0: off)"),
        ("data.seed", d.seed, 0 <= d.seed < SEED_LIMIT, "in [0, 2**32)"),
        ("data.corpus_max_bytes", d.corpus_max_bytes, d.corpus_max_bytes >= 1, ">= 1"),
        ("trainer.seed", t.seed, 0 <= t.seed < SEED_LIMIT, "in [0, 2**32)"),
        ("trainer.log_every", t.log_every, t.log_every >= 1, ">= 1"),
        ("trainer.ckpt_every", t.ckpt_every, t.ckpt_every >= 0, ">= 0 (0: no checkpoints)"),
        ("trainer.max_restarts", t.max_restarts, t.max_restarts >= 0, ">= 0 (0: a failed job stays failed)"),
        ("trainer.world", t.world, t.world >= 0, ">= 0 (0: the layout's world)"),
        ("trainer.restart_backoff_s", t.restart_backoff_s, t.restart_backoff_s >= 0, ">= 0"),
        ("trainer.keep_last", t.keep_last, t.keep_last >= 0, ">= 0 (0: keep every checkpoint)"),
        ("trainer.threads_per_rank", t.threads_per_rank, t.threads_per_rank >= 1, ">= 1"),
        ("trainer.sample_tokens", t.sample_tokens, t.sample_tokens >= 0, ">= 0 (0: no sample)"),
        ("trainer.peak_tflops", t.peak_tflops, t.peak_tflops >= 0, ">= 0 (0: no MFU)"),
        ("trainer.spike_factor", t.spike_factor, t.spike_factor == 0 or t.spike_factor > 1, "0 (off) or > 1"),
        ("trainer.check_every", t.check_every, t.check_every >= 0, ">= 0 (0: never)"),
        ("trainer.straggler_factor", t.straggler_factor, t.straggler_factor > 1, "> 1 (x the median rank)"),
        ("trainer.grad_outlier_cosine", t.grad_outlier_cosine, 0 < t.grad_outlier_cosine <= 2, "in (0, 2]"),
        ("trainer.grad_outlier_norm", t.grad_outlier_norm, t.grad_outlier_norm > 1, "> 1 (x the median replica)"),
        ("trainer.sdc_check_every", t.sdc_check_every, t.sdc_check_every >= 0, ">= 0 (0: never)"),
        ("trainer.timeline_step", t.timeline_step, t.timeline_step >= 0, ">= 0 (0: no timeline)"),
        ("eval.windows", cfg.eval.windows, cfg.eval.windows >= 1, ">= 1"),
    )
    for key, value, ok, allowed in rules:
        if not ok or (isinstance(value, float) and not math.isfinite(value)):  # NaN fails every comparison
            return f"{key}={value} must be {allowed}" + (", and finite" if ok else "")
    return None

"""Observability beyond metrics.jsonl: a torch.profiler trace per rank, and the Weights & Biases sink."""

import json
import struct
import time
from dataclasses import replace

import pytest

from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError, validate
from tests.helpers import make_config


def profiled_fit(cfg, data_path):
    """Fit on every rank while recording the collectives; returns them, this rank's actions and its trace."""
    from modelpar.parallel import collectives
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    with collectives.record_comm() as log:
        trainer.fit()
    issued = sorted({f"{e.kind}:{e.tag}" if e.tag else e.kind for e in log.events})
    trace = trainer.out_dir / "profile" / f"rank-{trainer.rank:05d}.json"
    return issued, [str(a) for a in trainer.runtime.actions], json.loads(trace.read_text())


def test_a_profiled_tp2_pp2_step_names_every_action_and_collective_on_each_rank(token_path, tmp_path):
    cfg = make_config(tmp_path, tp=2, pp=2, microbatches=4)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=3, profile_steps=[2, 2], ckpt_every=0))
    results = run_on_ranks(4, profiled_fit, cfg, token_path)
    for rank, (issued, actions, trace) in enumerate(results):
        events = trace["traceEvents"]
        ranges = [e for e in events if e.get("ph") == "X"]
        assert ranges and all(isinstance(e["ts"], int | float) and e["dur"] >= 0 for e in ranges)
        names = {e["name"] for e in ranges}
        assert "step 2" in names and "step 1" not in names and "step 3" not in names
        posted = {piece for name in names for piece in name.removeprefix("wait ").split()}
        compute = [a for a in actions if "SEND" not in a and "RECV" not in a]
        assert {"F", "B"} <= {a.lstrip("0123456789")[0] for a in compute}
        missing = [a for a in compute if a not in names] + [a for a in actions if a not in posted]
        assert not missing, f"rank {rank}: {missing} not in its trace"
        assert {"all_reduce:layer", "broadcast:loss"} <= names, names
        assert not set(issued) - names, f"rank {rank}: collectives {set(issued) - names} not in its trace"
        assert any(e.get("args", {}).get("Input Dims") for e in ranges)  # record_shapes took effect


def test_profile_steps_must_be_a_range_within_the_run(tmp_path):
    cfg = make_config(tmp_path)
    for steps in ([2], [3, 2], [0, 1], [1, 9]):
        bad = replace(cfg, trainer=replace(cfg.trainer, profile_steps=steps))
        with pytest.raises(RecipeError, match=r"trainer.profile_steps=.* must be \[first, last\]"):
            validate(bad)
    snapshot_only = replace(cfg, trainer=replace(cfg.trainer, memory_snapshot=True))
    with pytest.raises(RecipeError, match="memory_snapshot=true needs trainer.profile_steps"):
        validate(snapshot_only)


def fit_without_wandb_credentials(cfg, data_path, netrc):
    import os

    from modelpar.training.trainer import Trainer

    saved = {name: os.environ.pop(name, None) for name in ("WANDB_MODE", "WANDB_API_KEY", "NETRC")}
    os.environ["NETRC"] = netrc  # no credentials: the sink must choose offline by itself
    try:
        Trainer(cfg, data_path, None).fit()
    finally:
        os.environ.pop("NETRC")
        os.environ.update({name: value for name, value in saved.items() if value is not None})


def wandb_records(path) -> list:
    """The records of a ``.wandb`` run file (a LevelDB-style log of 32 KiB blocks of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, out, pending = path.read_bytes(), 1 << 15, 7, [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def test_wandb_sink_logs_each_step_and_the_layout_offline(token_path, tmp_path):
    pytest.importorskip("wandb")
    cfg = make_config(tmp_path, pp=2)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=3, wandb=True, ckpt_every=0))
    run_on_ranks(2, fit_without_wandb_credentials, cfg, token_path, str(tmp_path / "no-netrc"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    deadline = time.monotonic() + 30  # wandb's writer is a process of its own: under load it may lag finish()
    while True:
        records = wandb_records(next(runs[0].glob("*.wandb")))
        history = [
            {
                item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                for item in r.history.item
            }
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        if len(history) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == [m["loss"] for m in logged]
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        config |= {item.key: json.loads(item.value_json) for item in items}
    assert config["layout"]["name"] == "tp1-pp2-dp1" and config["layout"]["world_size"] == 2
    assert config["parallel"]["pp"] == 2 and config["data"]["seq_len"] == 16 and config["trainer"]["wandb"]

"""Data provenance: a checkpoint remembers its data's fingerprint; resuming on other data is refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from modelpar.checkpoint.store import read_index
from modelpar.data.fingerprint import fingerprint
from modelpar.testing import run_on_ranks
from tests.helpers import make_config, train_and_collect


def _resume(cfg, data_path: str, ckpt: str) -> str:
    from modelpar.training.trainer import Trainer

    try:
        Trainer(cfg, data_path, ckpt)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_resuming_on_a_changed_data_file_is_refused_naming_both_fingerprints(tmp_path):
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 61, size=4000, dtype=np.uint16))
    cfg = make_config(tmp_path / "run", pp=2)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=1))
    run_on_ranks(2, train_and_collect, cfg, str(data), None, (1,))
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    saved = read_index(ckpt)["data_fingerprint"]
    assert saved == fingerprint(data) and (tmp_path / "tokens.npy.fingerprint.json").exists()
    assert run_on_ranks(2, _resume, cfg, str(data), str(ckpt)) == ["loaded", "loaded"]

    np.save(data, np.random.default_rng(1).integers(0, 61, size=4000, dtype=np.uint16))  # same size, new bytes
    now = fingerprint(data)
    assert now["sha256"] != saved["sha256"]  # the cache noticed the rewrite
    for message in run_on_ranks(2, _resume, cfg, str(data), str(ckpt)):
        assert saved["sha256"][:16] in message and now["sha256"][:16] in message and "allow_changed" in message
        assert "\n" not in message
    allowed = replace(cfg, data=replace(cfg.data, allow_changed=True))
    assert run_on_ranks(2, _resume, allowed, str(data), str(ckpt)) == ["loaded", "loaded"]

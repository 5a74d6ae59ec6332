"""Signed checkpoints: with a key, a rewritten file plus a rewritten index is caught; unsigned ones are refused."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from modelpar.checkpoint.signing import SIGNATURE, keygen, load_key
from modelpar.checkpoint.store import CheckpointError, sha256_file
from modelpar.cli.ckpt import main as ckpt_main
from modelpar.testing import run_on_ranks
from tests.helpers import make_config, train_and_collect


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory, token_path):
    root = tmp_path_factory.mktemp("signed")
    key = keygen(root / "key")
    cfg = make_config(root / "run", pp=2)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=1, signing_key=str(key)))
    run_on_ranks(2, train_and_collect, cfg, token_path, None, (1,))
    return cfg, key, root / "run" / "checkpoints" / "step-00000001"


def test_keygen_writes_an_owner_only_key_and_never_overwrites(tmp_path, capsys):
    key = keygen(tmp_path / "k")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(bytes.fromhex(key.read_text().strip())) == 32
    assert ckpt_main(["keygen", str(key)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def test_a_signed_checkpoint_verifies_with_its_key(signed_run, capsys):
    _, key, ckpt = signed_run
    assert (ckpt / SIGNATURE).exists()
    assert ckpt_main(["verify", str(ckpt), "--key", str(key)]) == 0
    assert "signature verified" in capsys.readouterr().out


def _forge(ckpt: Path, dst: Path) -> Path:
    """A copy with one weight changed and the index's hash rewritten to match, as an attacker would."""
    import shutil

    shutil.copytree(ckpt, dst)
    name = sorted(p.name for p in dst.glob("model-*.safetensors"))[0]
    tensors = load_file(dst / name)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1.0
    save_file(tensors, dst / name)
    index = json.loads((dst / "index.json").read_text())
    index["files"][name] = {"sha256": sha256_file(dst / name), "bytes": (dst / name).stat().st_size}
    (dst / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    return dst


def test_a_rewritten_file_and_index_pass_the_hashes_but_not_the_signature(signed_run, tmp_path, capsys):
    _, key, ckpt = signed_run
    forged = _forge(ckpt, tmp_path / "forged")
    assert ckpt_main(["verify", str(forged)]) == 0  # SHA-256 alone cannot tell
    capsys.readouterr()
    assert ckpt_main(["verify", str(forged), "--key", str(key)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(forged / SIGNATURE) in err and "modified" in err, err


def test_an_unsigned_checkpoint_is_refused_when_a_key_is_configured(signed_run, tmp_path, capsys):
    _, key, ckpt = signed_run
    forged = _forge(ckpt, tmp_path / "unsigned")
    (forged / SIGNATURE).unlink()
    assert ckpt_main(["verify", str(forged), "--key", str(key)]) == 2
    err = capsys.readouterr().err
    assert "is unsigned and a signing key is configured" in err and str(forged / SIGNATURE) in err
    assert ckpt_main(["sign", str(forged), "--key", str(key)]) == 0  # signing it is a deliberate act
    assert ckpt_main(["verify", str(forged), "--key", str(key)]) == 0


def _resume(cfg, data_path: str, ckpt: str) -> str:
    from modelpar.training.trainer import Trainer

    try:
        Trainer(cfg, data_path, ckpt)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_resume_refuses_a_forged_checkpoint_on_every_rank(signed_run, tmp_path, token_path):
    cfg, _, ckpt = signed_run
    forged = _forge(ckpt, tmp_path / "forged")
    assert run_on_ranks(2, _resume, cfg, token_path, str(ckpt)) == ["loaded", "loaded"]
    messages = run_on_ranks(2, _resume, cfg, token_path, str(forged))
    assert all(str(forged / SIGNATURE) in m and "modified" in m for m in messages), messages


def test_hf_export_is_signed_beside_model_safetensors(signed_run, tmp_path):
    _, key, ckpt = signed_run
    out = tmp_path / "hf"
    assert ckpt_main(["export-hf", str(ckpt), str(out), "--key", str(key)]) == 0
    assert (out / "model.safetensors.sig").exists()


def test_a_signing_key_others_can_read_is_refused_naming_the_chmod(tmp_path):
    key = keygen(tmp_path / "key")
    key.chmod(0o604)
    with pytest.raises(CheckpointError) as err:
        load_key(key)
    assert str(err.value) == f"the signing key {key} is readable by others (mode 0604); run `chmod 600 {key}`"

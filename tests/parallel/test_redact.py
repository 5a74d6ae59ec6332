"""Text bound for the run directory loses every secret the process knows of."""

from __future__ import annotations

from modelpar.parallel.redact import redact


def test_secret_environment_values_and_secret_file_contents_are_redacted(tmp_path, monkeypatch):
    key = tmp_path / "job.key"
    key.write_text("ab" * 32 + "\n")
    monkeypatch.setenv("MODELPAR_JOB_SECRET", str(key))
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghij")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    monkeypatch.setenv("MY_PASSWORD", "x")  # too short to tell from ordinary text: kept
    monkeypatch.setenv("RUN_NAME", "hf_abcdefghij-run")  # not a secret's name: its value is no secret
    text = f"token hf_abcdefghij, key 0123456789abcdef, secret {'ab' * 32}, x, file {key}"
    assert redact(text) == f"token [redacted], key [redacted], secret [redacted], x, file {key}"


def test_files_named_by_the_caller_are_redacted_too(tmp_path):
    key = tmp_path / "signing.key"
    key.write_text("cd" * 32)
    assert redact(f"sig {'cd' * 32}", (str(key),)) == "sig [redacted]"

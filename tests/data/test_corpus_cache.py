"""Building the default corpus says where its cache goes (relative to the current directory by default)."""

from __future__ import annotations

from modelpar.data.corpus import default_corpus


def test_building_the_default_corpus_names_its_cache_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default_corpus("cache", max_bytes=20_000)
    assert f"in {tmp_path / 'cache'} (data.cache_dir" in capsys.readouterr().out
    default_corpus("cache", max_bytes=20_000)  # found: nothing to say
    assert capsys.readouterr().out == ""

"""The prepare bar counts input bytes in binary prefixes: 5 MiB read reads as 5.00M, not 5.00k."""

from __future__ import annotations

from modelpar.data.prepare_shards import _Progress


def test_the_prepare_bar_shows_mebibytes_as_m():
    progress = _Progress(total=10 << 20, on=True)
    progress.at(5 << 20)
    shown = str(progress.bar)
    progress.close()
    assert "5.00M/10.0M " in shown, shown

"""The widths of the shipped model presets that the kernels see, for the ahead-of-time compile and the
roofline."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """The widths of one shipped model preset (recipes/model/<name>.yaml) that kernels see."""

    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    "llama-1b": Preset(2048, 32, 8, 8192, 128256),
    "llama-8b": Preset(4096, 32, 8, 14336, 128256),
    "llama-70b": Preset(8192, 64, 8, 28672, 128256),
    "mixtral-8x7b": Preset(4096, 32, 8, 14336, 32000),
}

"""Where the independent peer's step is faster: its network, not its engine. One process, one thread, no
distribution: a training step (forward, backward, AdamW) of

- the independent peer's GPT (``--peer PATH/peer_bench.py``: GELU MLP of width 4h, learned positions),
- modelpar's bench-tiny on one device (SwiGLU MLP of width 688, RoPE; the same parameter count),
- the peer's GPT with its MLP replaced by a SwiGLU of width 688,
- and with RoPE on its queries and keys as well: the peer's own code, modelpar's architecture,

on the same batch (16 x 128 tokens), the four alternating step by step (the order flips every round), median
of the rounds after two warm-ups.

    python benchmarks/peer_model_step.py --peer PATH/peer_bench.py [--rounds 10]

Writes ``benchmarks/results/peer_model_step.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
SWIGLU_WIDTH, ROPE_THETA = 688, 10000.0


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def rope_tables(head_dim: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]: the two halves of each head rotated by position (the non-interleaved form)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def with_rope(attention: nn.Module, cos: torch.Tensor, sin: torch.Tensor):
    """The peer's attention forward with RoPE applied to its queries and keys."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            proj(x).view(b, s, -1, attention.hd).transpose(1, 2) for proj in (attention.q, attention.k, attention.v)
        )
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return attention.o(y.transpose(1, 2).reshape(b, s, -1))

    return forward


def peer_model(peer, swiglu: bool = False, rope: bool = False):
    cfg = peer.Cfg()
    model = peer.build_model(cfg)
    cos, sin = rope_tables(cfg.hidden // cfg.heads, cfg.seq)
    for block in model.layers.values():
        if swiglu:
            block.mlp = SwiGLU(cfg.hidden, SWIGLU_WIDTH)
        if rope:
            block.attn.forward = with_rope(block.attn, cos, sin)
    return model, lambda x, y: F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def our_model():
    from omegaconf import OmegaConf

    from modelpar.model.config import ModelConfig
    from modelpar.model.transformer import build_model

    recipe = OmegaConf.load(ROOT / "recipes" / "model" / "bench-tiny.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), recipe, {"kernels": "torch"}))
    model = build_model(cfg, seed=0)
    return model, lambda x, y: model.loss(model(x), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", type=Path, required=True, help="the peer script (peer_bench.py)")
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("peer_bench", a.peer.resolve())
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    cases = {
        "peer GPT (GELU 4h, learned positions)": peer_model(peer),
        "modelpar bench-tiny (SwiGLU 688, RoPE)": our_model(),
        "peer GPT, SwiGLU 688": peer_model(peer, swiglu=True),
        "peer GPT, SwiGLU 688 and RoPE": peer_model(peer, swiglu=True, rope=True),
    }
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, (model, _) in cases.items()}
    cfg = peer.Cfg()
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq), generator=gen) for _ in range(2))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(a.rounds + 2):
        for name in list(cases) if r % 2 == 0 else list(cases)[::-1]:
            (_, loss_of), opt = cases[name], optimizers[name]
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            loss.backward()
            opt.step()
            loss.item()
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times[next(iter(cases))])
    rows = [
        {
            "model": name,
            "params": sum(p.numel() for p in cases[name][0].parameters()),
            "median_step_s": statistics.median(t),
            "steps_s": t,
            "peer_over_this": base / statistics.median(t),
        }
        for name, t in times.items()
    ]
    lines = [
        "# One device, one thread: the peer's network against modelpar's (bench-tiny shape, batch 16 x 128, AdamW)\n",
        "| model | parameters | s/step (median) | peer GPT / this |",
        "|---|---|---|---|",
        *(f"| {r['model']} | {r['params']:,} | {r['median_step_s']:.3f} | {r['peer_over_this']:.2f}x |" for r in rows),
        f"\n`python benchmarks/peer_model_step.py --peer .../peer_bench.py --rounds {a.rounds}`: the four models "
        "step in turn in one process (order flipping each round), median after two warm-ups.",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "peer_model_step.json").write_text(json.dumps({"rounds": a.rounds, "rows": rows}, indent=1) + "\n")
    (RESULTS / "peer_model_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

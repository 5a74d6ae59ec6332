"""modelpar-generate: sample text from a checkpoint on one process (greedy, or temperature and top-k).

    modelpar-generate runs/<run>/checkpoints/step-00000150 --prompt "def main(" --tokens 80 --temperature 0.8 --top-k 40

The checkpoint is loaded into the single-device model whatever layout saved it (resharding is just reading
the whole of each logical tensor).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from modelpar.checkpoint.store import CheckpointError, Piece, load_pieces, read_index, resolve_checkpoint
from modelpar.cli.args import non_negative_float, non_negative_int, positive_int
from modelpar.data import ByteTokenizer, load_tokenizer, open_dataset, tokenizer_for
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import ModelChunk, build_model


def load_single_device_model(ckpt: str | Path) -> ModelChunk:
    """The whole model on this process (tp = pp = 1), weights from ``ckpt`` (a step directory or its root)."""
    ckpt = resolve_checkpoint(ckpt)
    index = read_index(ckpt)
    fields = {k: v for k, v in index["model"].items() if k in ModelConfig.__dataclass_fields__}
    model = build_model(ModelConfig(**fields), seed=0)
    shards = model.logical_shards()
    wanted = {name: Piece.whole(name, tuple(s.global_shape)) for name, s in shards.items()}
    loaded = load_pieces(ckpt, index, list(wanted.values()))
    model.load_logical(lambda name, shard: loaded[wanted[name]])
    return model.eval()


@torch.no_grad()
def generate(
    model: ModelChunk, prompt: torch.Tensor, tokens: int, temperature: float = 0.0, seed: int = 0, top_k: int = 0
):
    """prompt: [s] int64 -> [s + tokens]; greedy when ``temperature`` is 0, else sampled at ``temperature`` from
    the ``top_k`` likeliest tokens (0: all) with a generator seeded by ``seed``. Context cut to max_seq_len."""
    gen = torch.Generator().manual_seed(seed)
    ids = prompt.clone()
    for _ in range(tokens):
        context = ids[-model.config.max_seq_len :][None]
        logits = model(context)[0, -1, : model.config.vocab_size].float()
        if temperature > 0:
            if 0 < top_k < logits.numel():
                logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt])
    return ids


@dataclass(frozen=True)
class Sample:
    """A continuation sampled from a checkpoint, beside the held-out text it continues and how it was drawn."""

    prompt: str
    continuation: str
    tokens: int
    temperature: float
    top_k: int
    seed: int

    def lines(self) -> list[str]:
        """What ``modelpar-train`` prints: how it was sampled, then the prompt and the continuation apart."""
        shown = self.continuation if self.continuation.strip() else f"(only whitespace: {self.continuation!r})"
        return [
            f"modelpar-train: sample from the final weights ({self.tokens} tokens, temperature {self.temperature:g}, "
            f"top-k {self.top_k}, seed {self.seed}), continuing held-out text",
            "--- prompt ---",
            self.prompt,
            "--- continuation ---",
            shown,
        ]


def held_out_prompt(ids: torch.Tensor, tok, length: int) -> torch.Tensor:
    """Up to ``length`` tokens of ``ids: [n]`` (held-out text) from the start of its first whole line, without
    trailing whitespace: a window starts mid-line, often inside an indentation, and a prompt ending in spaces
    asks a small model for more spaces."""
    pieces = [tok.decode([int(i)]) for i in ids]
    line = next((i + 1 for i, piece in enumerate(pieces[:-1]) if "\n" in piece), 0)
    for start in (line, 0):  # from the window's start when nothing but whitespace follows its first line break
        end = min(start + length, len(pieces))
        while end > start and not pieces[end - 1].strip():
            end -= 1
        if end > start:
            return ids[start:end]
    return ids[:length]


def sample_from_checkpoint(
    ckpt: str | Path,
    token_path: str,
    tokens: int,
    *,
    seq_len: int,
    prompt_len: int = 48,
    temperature: float = 1.0,
    top_k: int = 40,
    seed: int = 0,
) -> Sample:
    """A continuation of held-out text (the first whole lines of ``token_path``'s first window), sampled at
    ``temperature`` from the ``top_k`` likeliest tokens with a fixed ``seed``, decoded with the file's tokenizer.
    Temperature 1 samples the model's own distribution: a small byte-level model cooled below it (or greedy)
    collapses into runs of the commonest byte of source code, the space."""
    model = load_single_device_model(ckpt)
    data = open_dataset(token_path, model.config.vocab_size, seq_len)
    tok = tokenizer_for(token_path)
    window, _ = data.window(0)
    prompt = held_out_prompt(window, tok, prompt_len)
    out = generate(model, prompt, tokens, temperature, seed, top_k)
    return Sample(tok.decode(prompt), tok.decode(out[len(prompt) :]), tokens, temperature, top_k, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelpar-generate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="sample from the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="byte, or a tokenizer.json written by modelpar-data (default: the one the checkpoint's training data "
        "was prepared with, else byte)",
    )
    args = parser.parse_args(argv)
    try:
        model = load_single_device_model(args.checkpoint)
        index = read_index(resolve_checkpoint(args.checkpoint), verify=False)
        tok = load_tokenizer(args.tokenizer or index.get("tokenizer") or ByteTokenizer.kind)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"modelpar-generate: error: {exc}", file=sys.stderr)
        return 2
    prompt = torch.as_tensor(tok.encode(args.prompt), dtype=torch.int64)
    out = generate(model, prompt, args.tokens, args.temperature, args.seed, args.top_k)
    if isinstance(tok, ByteTokenizer) and int(out.max()) >= 256:
        print(
            f"modelpar-generate: error: the model produced token id {int(out.max())}, which the byte tokenizer cannot "
            "decode (the checkpoint records no tokenizer); pass --tokenizer <the data's tokenizer.json>",
            file=sys.stderr,
        )
        return 2
    print(tok.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

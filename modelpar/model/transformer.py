"""A Llama-style decoder, tensor-parallel inside each layer and sliceable into pipeline stages.

    ids [b, s] -> VocabParallelEmbedding -> [Block: x + attn(norm(x)); x + mlp(norm(x))] x L -> RMSNorm
        -> column-parallel lm_head -> logits [b, s, V_pad/t] -> vocab-parallel cross-entropy

A ``ModelChunk`` is a contiguous run of blocks, plus the embedding on the first chunk and the final norm and
head on the last; the whole model is one chunk holding everything, and tp=1 without a process group is the
single-device reference. Under sequence parallel the residual stream between blocks (and between pipeline
stages) is sharded along the sequence: [b, s/t, h]. Under context parallelism every rank of the cp group holds
two chunks of each sequence (``modelpar.parallel.context``), the stream is [b, s/cp, h] ([b, s/(cp*t), h] with
sequence parallel) and only attention talks over cp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from modelpar_kernels import resolve_backend
from torch import nn
from torch.utils.checkpoint import checkpoint

from modelpar.model.activations import ActivationOffload
from modelpar.model.config import ModelConfig
from modelpar.model.init import init_logical
from modelpar.model.layers import (
    ColumnParallelLinear,
    ColumnPart,
    DocumentIds,
    LatentAttention,
    ParallelAttention,
    ParallelSwiGLU,
    RMSNorm,
    ShardInfo,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    vocab_range,
)
from modelpar.model.moe import MoELayer
from modelpar.model.mtp import MTPModule, MultiTokenPrediction
from modelpar.model.spec import ChunkGroups, ChunkSpec
from modelpar.parallel.collectives import all_reduce, comm_tag, label_module
from modelpar.parallel.layout import ParallelLayout


class Block(nn.Module):
    """One transformer layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; x: [b, s, h] or [b, s/t, h].

    How it is put together is ``config.block`` (``modelpar.model.structure``), read here and nowhere else: the
    norms' placement (pre, post, sandwich: ``_sub_layer``) and scale form, the MLP's activation, and the
    attention's scale, soft-cap, sinks, QK-norm scope and RoPE base (``_attention``).

    Block ``layer`` of the chunk ``spec`` describes: all of it, or the half ``spec.half(layer)`` names
    (``"attention"`` or ``"mlp"``, a pipeline split inside the block), the other half living in the
    neighbouring chunk, the residual stream between them being what crosses the stages. Block ``layer`` of a
    mixture-of-experts model (``config.moe.is_moe_layer``) has a ``MoELayer`` as its MLP, its experts split
    over ``groups.ep``. ``documents``: the chunk's document ids, for document-causal attention.
    """

    def __init__(
        self,
        config: ModelConfig,
        spec: ChunkSpec,
        groups: ChunkGroups | None = None,
        *,
        layer: int = 0,
        documents: DocumentIds | None = None,
    ):
        super().__init__()
        groups = groups or ChunkGroups()
        tp = groups.tp
        self.half = half = spec.half(layer)
        self.recompute = spec.recompute_policy()
        backend = resolve_backend(config.kernels, spec.device or "cpu")
        kw = dict(sequence_parallel=spec.sequence_parallel, backend=backend, device=spec.device, dtype=spec.dtype)
        structure = config.block
        self.norm_names = {part: structure.norms(part) for part in ("attention", "mlp") if half in (None, part)}
        for name in (name for pair in self.norm_names.values() for name in pair if name):
            setattr(self, name, RMSNorm(config.hidden, config.norm_eps, tp, offset=structure.norm_offset, **kw))
        if half != "mlp":
            self.self_attn = _attention(config, spec, groups, documents, kw, layer)
        if half != "attention":
            if config.moe.is_moe_layer(layer):
                self.mlp = MoELayer(config, tp, groups.ep, cp=groups.cp, **kw)
            else:
                self.mlp = ParallelSwiGLU(
                    config.hidden, config.ffn_hidden, tp, fp8=spec.fp8, cp=groups.cp, activation=structure.activation,
                    **kw,
                )  # fmt: skip
        for name, module in (("attention", getattr(self, "self_attn", None)), ("mlp", getattr(self, "mlp", None))):
            keep = spec.sp_keep_shard and not self.recompute.reruns(name)  # a rerun half gathers again anyway
            for linear in () if module is None else module.modules():
                if isinstance(linear, ColumnParallelLinear):
                    linear.keep_shard = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.half != "mlp":
            x = x + self.recompute.run_half("attention", self._attention, x)
        if self.half != "attention":
            x = x + self.recompute.run_half("mlp", self._mlp, x)
        return x

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        return self._sub_layer("attention", self.self_attn, x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self._sub_layer("mlp", self.mlp, x)

    def _sub_layer(self, part: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What sub-layer ``part`` adds to the residual stream: ``layer`` between the norms ``model.block.norm``
        places around it (``modelpar.model.structure.NORM_NAMES``)."""
        before, after = self.norm_names[part]
        x = layer(getattr(self, before)(x) if before else x)
        return getattr(self, after)(x) if after else x

    def logical_shards(self, prefix: str) -> dict[str, ShardInfo]:
        shards = {}
        for name in (name for pair in self.norm_names.values() for name in pair if name):
            shards |= getattr(self, name).logical_shards(f"{prefix}{name}.")
        if self.half != "mlp":
            shards |= self.self_attn.logical_shards(prefix + "self_attn.")
        if self.half != "attention":
            shards |= self.mlp.logical_shards(prefix + "mlp.")
        return shards


def _attention(config: ModelConfig, spec: ChunkSpec, groups: ChunkGroups, documents, kw, layer: int) -> nn.Module:
    """GQA attention (with block ``layer``'s sliding window, if any), or multi-head latent attention when
    ``config.mla`` is on."""
    m = config.mla
    if m.enabled:
        return LatentAttention(
            config.hidden,
            config.heads,
            q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            tp=groups.tp,
            cp=groups.cp,
            documents=documents,
            **kw,
        )
    b = config.block
    rope_theta, rope_scaling = b.rope(config, layer)
    return ParallelAttention(
        config.hidden,
        config.heads,
        config.kv_heads,
        rope_theta,
        groups.tp,
        head_dim=config.head_size,
        qk_norm=config.qk_norm and b.qk_norm_scope,
        norm_eps=config.norm_eps,
        norm_offset=b.norm_offset,
        query_scale=b.query_scale,
        softcap=b.attention_softcap,
        sinks=b.attention_sinks,
        cp=groups.cp,
        documents=documents,
        window=config.window(layer),
        fp8=spec.fp8,
        bias=config.attention_bias,
        out_bias=config.attention_out_bias,
        rope_scaling=rope_scaling,
        **kw,
    )


Fetch = Callable[[str, ShardInfo], torch.Tensor]


class ModelChunk(nn.Module):
    """The piece of the model ``spec`` describes: blocks ``spec.layer_ids``, plus the embedding if
    ``spec.first`` and the final norm and head if ``spec.last`` (``modelpar.model.spec``).

    ``groups``: a ``ChunkGroups``, a ``ParallelGroups`` (its tp, cp and ep groups), a ``TensorParallelGroup``
    (tp only), or None (the single device).

    ``chunk(x)``: x is token ids [b, s] int64 on the first chunk, else the residual stream [b, s, h] ([b, s/t, h]
    with sequence parallel; under context parallelism ``cp`` s is this cp rank's s/cp tokens, see
    ``modelpar.parallel.context.split_for_context``). ``documents.source`` (unset: plain causal) gives the document
    ids of the micro-batch being computed, for document-causal attention. Returns the residual stream, or this
    rank's vocab-shard logits [b, s, V_pad/t] on the last chunk. Parameters hold only this rank's tp shard;
    ``logical_shards`` maps them to the global (HF Llama named) tensors. With tied embeddings the head reuses the
    embedding when both are in this chunk; otherwise the last chunk holds a copy named ``embed_tokens.weight`` too,
    whose gradient is added to the first chunk's (and vice versa) over the embedding group
    (``modelpar.optim.finalize``).
    """

    def __init__(self, config: ModelConfig, spec: ChunkSpec, groups=None):
        super().__init__()
        self.config, self.spec = config, spec
        g = ChunkGroups.of(groups, spec.cp_comm, spec.cp_a2a)
        tp = g.tp
        self.tp, self.cp, self.ep = tp, g.cp, g.ep
        self.first, self.last = spec.first, spec.last
        self.recompute = spec.recompute
        self.offload: ActivationOffload | None = None  # set by ``parallelize``: saved activations to host memory
        self.documents = DocumentIds()
        self.layer_ids = ids = spec.layer_ids
        if not set(ids) <= set(range(config.layers)):
            raise ValueError(f"layer_ids={ids} must be ascending ids in 0..{config.layers - 1}")
        self.split_blocks = dict(spec.split_blocks)
        config.check()
        config.check_layout(ParallelLayout(tp=tp.size))
        self.sequence_parallel = spec.sequence_parallel and tp.size > 1
        self.backend = resolve_backend(config.kernels, spec.device or "cpu")
        kw = dict(sequence_parallel=self.sequence_parallel, device=spec.device, dtype=spec.dtype)
        h = config.hidden
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp, **kw) if self.first else None
        self.layers = nn.ModuleDict({str(i): Block(config, spec, g, layer=i, documents=self.documents) for i in ids})
        offset = config.block.norm_offset
        self.norm = RMSNorm(h, config.norm_eps, tp, offset=offset, backend=self.backend, **kw) if self.last else None
        self.lm_head = None
        if self.last:
            start, size = vocab_range(config.vocab_size, tp)
            head_name = "embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
            self.lm_head = ColumnParallelLinear(h, [ColumnPart(head_name, config.vocab_size, start, size)], tp, **kw)
            self.lm_head.keep_shard = spec.sp_keep_shard
            if config.tie_embeddings and self.first:
                self.lm_head.weight = self.embed_tokens.weight
        # what ``record_comm`` reports each collective under (a recompute's rerun of a block counts as "layer")
        self.cross_entropy = VocabParallelCrossEntropy(config.vocab_size, tp, self.backend) if self.last else None
        for module, tag in (
            (self.embed_tokens, "embedding"),
            (self.norm, "head"),
            (self.lm_head, "head"),
            (self.cross_entropy, "loss"),
        ):
            if module is not None:
                label_module(module, tag)
        for block in self.layers.values():
            label_module(block, "layer")
        self.mtp, self.mtp_embed, self._hidden = None, None, None
        if self.last and config.mtp_depth:
            self._build_mtp(g, kw)

    def _build_mtp(self, g: ChunkGroups, kw: dict) -> None:
        """The multi-token prediction modules (``modelpar.model.mtp``) and the embedding they share: the first
        chunk's if it is this one, the head's weight if tied, else a copy named ``embed_tokens.weight`` whose
        gradient is summed with the first stage's like a tied embedding's."""
        config, whole = self.config, replace(self.spec, split_blocks=())
        last = config.layers - 1  # each module's block is of the kind of the model's last layer
        modules = []
        for _ in range(config.mtp_depth):
            block = Block(config, whole, g, layer=last, documents=self.documents)
            modules.append(MTPModule(config, block, g.tp, backend=self.backend, **kw))
        self.mtp = MultiTokenPrediction(config, modules, g.cp, config.mtp_loss_weight)
        if self.embed_tokens is not None:
            self.mtp_embed = self.embed_tokens
        else:
            self.mtp_embed = VocabParallelEmbedding(config.vocab_size, config.hidden, g.tp, **kw)
            if config.tie_embeddings:
                self.mtp_embed.weight = self.lm_head.weight
            label_module(self.mtp_embed, "embedding")
        label_module(self.mtp, "layer")

    def share_embedding(self, weight: nn.Parameter) -> None:
        """Use the first chunk's embedding ``weight`` (held by this rank too, as the V placement puts them)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = weight
        if self.mtp_embed is not None:
            self.mtp_embed.weight = weight

    def moe_layers(self) -> dict[int, MoELayer]:
        """The mixture-of-experts MLPs of this chunk's blocks, by layer id (multi-token prediction module k's
        as layer ``layers + k``, k from 0)."""
        blocks = {int(i): block for i, block in self.layers.items()}
        if self.mtp is not None:
            blocks |= {self.config.layers + k: m.block for k, m in enumerate(self.mtp.modules_)}
        return {i: block.mlp for i, block in blocks.items() if isinstance(getattr(block, "mlp", None), MoELayer)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ids [b, s] (first chunk) or [b, s, h] / [b, s/t, h] -> [b, s, h] / [b, s/t, h] or logits."""
        if self.embed_tokens is not None:
            self._check_sequence(x.shape[1] * self.cp.size)
            x = self.embed_tokens(x)
            if self.config.block.embedding_scale:  # in the embedding's dtype, as Gemma multiplies
                x = x * torch.tensor(self.config.hidden**0.5, dtype=x.dtype)
        offload = self.offload is not None and torch.is_grad_enabled()
        with self.offload.hooks() if offload else contextlib.nullcontext():
            for block in self.layers.values():
                if self.recompute == "full" and torch.is_grad_enabled():
                    # keep the block's input only; backward reruns its forward (collectives included, in the
                    # same order on every tp rank) to get what its own backward needs
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)  # selective recompute: the block's halves decide (``model.activations``)
        if self.lm_head is not None:
            if self.mtp is not None:
                self._hidden = x  # h^0 of multi-token prediction, read by ``loss`` right after
            x = self.lm_head(self.norm(x))
            cap = self.config.block.final_softcap
            if cap:  # elementwise on this rank's vocabulary shard
                x = cap * torch.tanh(x / cap)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of this rank's logits [b, s, V_pad/t] against targets [b, s] (-100: ignored).

        With the Triton kernels the logits buffer is consumed (overwritten by its gradient): do not read it after.
        With multi-token prediction, targets [b, s, 1 + D] (``modelpar.model.mtp.stack_targets``) add the MTP
        loss of this forward's hidden state; plain [b, s] targets give the main loss alone (evaluation).
        """
        hidden, self._hidden = self._hidden, None
        if targets.dim() == 2:
            return self.cross_entropy(logits, targets)
        main = self.cross_entropy(logits, targets[..., 0])
        if self.mtp is None:
            return main
        return main + self.mtp.loss(hidden, targets, self.mtp_embed, self.lm_head, self.cross_entropy)

    def activation_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of the residual stream entering or leaving this chunk between stages, for sequences of ``seq``
        tokens: [b, s, h], [b, s/t, h] (sequence parallel), divided by cp along s under context parallelism."""
        self._check_sequence(seq)
        local = seq // self.cp.size
        return (batch, local // self.tp.size if self.sequence_parallel else local, self.config.hidden)

    def _check_sequence(self, seq: int) -> None:
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.config.max_seq_len}")
        cp = self.cp.size
        if cp > 1 and seq % (2 * cp):
            raise ValueError(f"context parallelism needs the sequence length {seq} divisible by 2*cp={2 * cp}")
        if self.sequence_parallel and (seq // cp) % self.tp.size:
            raise ValueError(
                f"sequence parallel needs the sequence length {seq} divisible by tp={self.tp.size}"
                + (f" x cp={cp}" if cp > 1 else "")
            )

    def logical_shards(self) -> dict[str, ShardInfo]:
        """Every logical tensor this chunk holds (a piece of), by HF Llama name without the ``model.`` prefix."""
        shards = {}
        if self.embed_tokens is not None:
            shards |= self.embed_tokens.logical_shards("embed_tokens.")
        for i, block in self.layers.items():
            shards |= block.logical_shards(f"layers.{i}.")
        if self.lm_head is not None:
            shards |= self.norm.logical_shards("norm.") | self.lm_head.logical_shards()
        if self.mtp is not None:
            for k, module in enumerate(self.mtp.modules_):
                shards |= module.logical_shards(f"mtp.{k}.")
            if self.mtp_embed is not self.embed_tokens and not self.config.tie_embeddings:
                shards |= self.mtp_embed.logical_shards("embed_tokens.")
        return shards

    @torch.no_grad()
    def load_logical(self, fetch: Fetch) -> None:
        """Set every logical tensor from ``fetch(name, shard)``.

        ``fetch`` returns either the full global tensor (``shard.global_shape``; this rank slices it) or just
        this rank's piece (``shard.local_shape``, i.e. ``global[shard.index]``). Padded vocab rows are untouched.
        """
        for name, shard in self.logical_shards().items():
            value = fetch(name, shard)
            if tuple(value.shape) == shard.global_shape:
                value = value[shard.index]
            elif tuple(value.shape) != shard.local_shape:
                raise ValueError(
                    f"{name}: got shape {tuple(value.shape)}, expected the global {shard.global_shape} "
                    f"or this rank's {shard.local_shape}"
                )
            shard.tensor.copy_(value)

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """The global value of every logical tensor of this chunk, assembled over tp, and every expert's over ep
        (collective, tag "export")."""
        state = {}
        for name, shard in self.logical_shards().items():
            full = torch.zeros(shard.global_shape, dtype=shard.param.dtype, device=shard.param.device)
            if shard.primary:
                full[shard.index] = shard.tensor
            if self.tp.size > 1:
                with comm_tag("export"):
                    all_reduce(full, self.tp.group)
            state[name] = full
        for i, moe in self.moe_layers().items():
            prefix = f"layers.{i}.mlp." if i < self.config.layers else f"mtp.{i - self.config.layers}.mlp."
            state |= moe.gather_experts(prefix)
        return state

    def initialise(self, seed: int) -> None:
        """Layout-invariant initialisation: every logical tensor drawn whole from (seed, name), then sliced."""
        c = self.config
        self.load_logical(
            lambda name, shard: init_logical(
                name, shard.global_shape, seed=seed, std=c.init_std, layers=c.layers, norm_offset=c.block.norm_offset
            )
        )


def build_chunk(
    config: ModelConfig, groups, layer_ids: Iterable[int], *, first: bool, last: bool, seed: int, **options
) -> ModelChunk:
    """One pipeline chunk, initialised layout-invariantly from ``seed``.

    ``groups``: as for ``ModelChunk``. ``layer_ids``, ``first``, ``last`` and ``options`` (``split_blocks``,
    ``sequence_parallel``, ``recompute``, ``cp_comm``, ``device``, ...): the fields of its ``ChunkSpec``.
    """
    chunk = ModelChunk(config, ChunkSpec(tuple(layer_ids), first=first, last=last, **options), groups)
    chunk.initialise(seed)
    return chunk


def build_model(config: ModelConfig, groups=None, *, seed: int, **options) -> ModelChunk:
    """The whole model as one chunk (no pipeline); ``options``: fields of its ``ChunkSpec``. With
    ``groups=None`` it is the single-device model."""
    return build_chunk(config, groups, range(config.layers), first=True, last=True, seed=seed, **options)

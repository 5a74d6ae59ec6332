"""What each piece of our model keeps for backward, tensor by tensor: the planner's saved-activation tables.

Derived from the code, tensor by tensor, not fitted: ``modelpar-bench`` measures the same quantities
(``modelpar.bench.meters``) and ``tests/plan/test_plan_memory.py`` holds them within 10% of each other.

**Saved activations** of one micro-batch on one rank, per block half (what autograd keeps for backward).
Symbols: ``T = b*s/cp`` tokens of the micro-batch on this rank, ``Ts`` the residual stream's (``T/t`` with
sequence parallelism, else ``T``), ``e`` bytes of the compute dtype (4 fp32, 2 bf16), ``hq = heads/t``,
``hkv = kv_heads/t`` (1 when kv heads are replicated, ``kv_heads < t``), ``d`` the head dim, ``f = ffn/t``,
``Vt`` the padded vocabulary over t. Torch kernels (the CPU reference, measured)::

    attention half                                           kept by                        bytes
      x, the half's input (the residual stream)              RMSNorm (x^2, x*r)             e*Ts*h
      x * r, r = 1/rms(x)                                    RMSNorm (* weight)             e*Ts*h
      r                                                      RMSNorm                        4*Ts
      the norm's output (all-gathered with SP: its shard)    qkv_proj                       e*Tin*h
      qkv output, whole (SDPA keeps v, a view of it)         SDPA                           e*T*(hq+2hkv)*d
      q and k after RoPE                                     SDPA                           e*T*(hq+hkv)*d
      (qk_norm) q, k times 1/rms of each head; 1/rms         q_norm, k_norm                 (e*d + 4)*T*(hq+hkv)
      attention output (o_proj's input: the same storage)    SDPA, o_proj                   e*T*hq*d
      log-sum-exp (SDPA keeps no s x s scores)               SDPA                           4*T*hq
      cos, sin rows of this rank's positions (cp > 1)        RoPE                           4*(s/cp)*d
    MLP half (dense SwiGLU)
      x, x * r, r                                            RMSNorm                        2e*Ts*h + 4*Ts
      the norm's output (all-gathered with SP: its shard)    gate_up_proj                   e*Tin*h
      gate|up output (gate and up are views of it)           silu (gate), product (up)      e*T*2f
      silu(gate)                                             product                        e*T*f
      silu(gate) * up                                        down_proj                      e*T*f
    residual adds, the tp collectives                        (nothing)
    per chunk, once: RoPE's cos/sin tables (cp = 1, shared by every layer and micro-batch)   4*s*d

A column-parallel linear's input (qkv, gate|up, latent attention's down-projection, shared experts, the head)
is kept as ``Tin`` tokens: under SP its ``T/t`` shard (``parallel.sp_keep_shard``, the default; backward
all-gathers it again), else ``T`` (the gathered input, which ``F.linear`` keeps). A half rerun in backward
(recompute) keeps the gathered input while its rerun's backward runs (``full_saved``: working memory).

bench-tiny (h=256, 8 heads, f=688, tp=1, fp32): 22.79 s*b*h fp32 elements per layer, 22.85 with the shared
tables, as ``benchmarks/activation_memory.py`` measures. Triton kernels (the GPU default; derived from what
their autograd functions save, not measured here): RMSNorm keeps x and r only, RoPE only its tables, SwiGLU
gate|up (not silu(gate)); the rest as above (QK-norm keeps its rows of q and k, a copy of the qkv output's
strided view, and 1/rms).

Recompute (``parallel.recompute``): ``full`` keeps each block's input (``e*Ts*h``; a half block's, where a
pipeline cut splits it). ``selective`` per half: a half named in ``recompute_modules`` keeps its input only;
under ``elementwise`` the other halves keep their input and PyTorch's selective checkpoint caches the outputs
of the matmuls and of attention::

    attention   input e*Ts*h, qkv output e*T*(hq+2hkv)*d, attention output e*T*hq*d + lse 4*T*hq, o_proj output e*T*h
    MLP         input e*Ts*h, gate|up output e*T*2f, down_proj output e*T*h

The recomputed tensors exist only while a rerun half's backward runs: ``working`` memory (the largest half's
full table), not kept between forward and backward, and not what the CPU meter counts.

Offload (``parallel.offload_activations``): what the blocks keep through autograd's hooks moves to host memory
where its storage is 16 KiB or more; smaller tensors, everything the embedding and head keep, and the outputs
selective checkpointing caches itself (no hook sees them) stay on the device. Each saved view is copied on
its own: x of an RMSNorm, saved by two ops, twice; of the qkv output only v, SDPA's view (``Saved.moved``).

Outside the blocks: the first chunk keeps the token ids (int64, 8*T) and the mask of ids other tp ranks own (1*T);
the last keeps the final norm's three tensors, the head's input (e*T*h) and the cross-entropy's exp(logits - max)
(fp32, 4*T*Vt) plus 14*T + 8 bytes of per-token statistics (18*T + 8 under tp; the Triton loss keeps the logits
instead: e*T*Vt; a final soft-cap's tanh keeps its output too, e*T*Vt). A mixture-of-experts MLP (``moe_saved``)
keeps its router's input and fp32 probabilities, and for each of the ``k*T/t`` routed rows its input, the expert's
gate, up, silu(gate) and product, its output and weighted output (``e*h`` or ``e*f`` each) and the int64 row indices
(GPT-OSS's clamped SwiGLU: the gate and up outputs and five more ``e*f`` per row, clamp(gate), clamp(up) + 1, the
sigmoid, their products; the experts' biases: three int64 indices per row), each grouped GEMM its int32 expert
offsets; shared experts as a dense MLP. Under ``elementwise`` only the router's matmul output is cached there: the
experts' grouped GEMMs (``aten._grouped_mm``) are not in the save list, so backward reruns them.

Multi-token prediction (``mtp_saved``): each module keeps what a head does, the embedding's ids and mask, two
RMSNorms (hnorm's x is the previous norm's) and its projection's 2h-wide input; its block is the last layer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.model.config import MLAConfig
from modelpar.model.layers.embedding import padded_vocab_size
from modelpar.plan.spec import Hardware, ModelSpec, Strategy


@dataclass(frozen=True)
class Saved:
    """One tensor kept for backward: what it is, its storage's bytes (``nbytes``), whether it passes autograd's
    saved-tensor hooks (offload can move it; False: selective checkpoint's own cache), and what offload copies
    to the host when it moves it (``moved``: every saved view on its own; default ``nbytes``). ``storage``: the
    bytes offload's 16 KiB threshold sees, where the tensor is a view of a shared one (default ``nbytes``)."""

    name: str
    nbytes: float
    hooked: bool = True
    moved: float | None = None
    storage: float | None = None

    @property
    def host_bytes(self) -> float:
        return self.nbytes if self.moved is None else self.moved

    @property
    def storage_bytes(self) -> float:
        return self.nbytes if self.storage is None else self.storage


# -- shapes ----------------------------------------------------------------------------------------------------


def activation_bytes(hardware: Hardware) -> int:
    """Bytes of one activation element: the compute dtype's."""
    return 2 if hardware.dtype == "bf16" else 4


def kernels(model: ModelSpec, hardware: Hardware) -> str:
    """``torch`` or ``triton``: the model's ``kernels`` setting, ``auto`` resolved by the hardware."""
    chosen = model.shape.kernels
    return hardware.kernels if chosen == "auto" else chosen


@dataclass(frozen=True)
class _LatentDims:
    """``MLAConfig``'s sizes, hashable (``Dims`` keys the planner's memo)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def of(cls, mla: MLAConfig) -> _LatentDims:
        return cls(*(getattr(mla, name) for name in cls.__dataclass_fields__))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class Dims:
    T: float  # tokens of the micro-batch on this rank
    Ts: float  # tokens of the residual stream (T/t under SP)
    Tin: float  # tokens of a column-parallel linear's kept input: Ts keeping the SP shard, else T (gathered)
    s: float  # local sequence length (s/cp)
    h: int
    hq: float
    hkv: float
    d: int
    f: float
    qk_norm: bool
    vt: int
    e: int
    cp: int
    tp: int
    mla: _LatentDims | None = None  # latent attention's (None: GQA)
    sandwich: bool = False  # model.block.norm=sandwich: a second RMSNorm after each half's sub-layer
    norm_scale: bool = False  # model.block.norm_offset=1: each norm keeps its computed scale 1 + weight
    geglu: bool = False  # model.block.activation=geglu: the MLP's torch path whatever the kernels
    score_keys: float = 0.0  # keys per query whose fp32 scores the plain-matmul attention keeps (0: none)
    softcap: bool = False  # model.block.attention_softcap > 0 (on the plain-matmul path: tanh's output)
    sinks: bool = False  # model.block.attention_sinks (on the plain-matmul path: one more column of scores)
    embedding_scale: bool = False  # model.block.embedding_scale: the product keeps its 0-d factor sqrt(h)
    final_softcap: bool = False  # model.block.final_softcap > 0: tanh keeps its output, the head's shard
    projection_norm: bool = False  # model.block.qk_norm_scope=projection: one RMSNorm over all q (k) heads


def dims(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> Dims:
    shape, layout = model.shape, strategy.layout
    t, cp, b = layout.tp, layout.cp, model.shape.block
    tokens = strategy.micro_batch_size * seq_len / cp
    return Dims(
        T=tokens,
        Ts=tokens / t if strategy.sp and t > 1 else tokens,
        Tin=tokens / t if strategy.sp and t > 1 and strategy.sp_keep_shard else tokens,
        s=seq_len / cp,
        h=shape.hidden,
        hq=shape.heads / t,
        hkv=max(1.0, shape.kv_heads / t),
        d=shape.head_size,
        f=shape.ffn_hidden / t,
        qk_norm=shape.qk_norm,
        vt=padded_vocab_size(shape.vocab_size, t) // t,
        e=activation_bytes(hardware),
        cp=cp,
        tp=t,
        mla=_LatentDims.of(shape.mla) if shape.mla.enabled else None,
        sandwich=b.norm == "sandwich",
        norm_scale=bool(b.norm_offset),
        geglu=b.activation == "geglu",
        score_keys=float(seq_len) if plain_matmul_attention(model, strategy) else 0.0,
        softcap=bool(b.attention_softcap),
        sinks=b.attention_sinks,
        embedding_scale=b.embedding_scale,
        final_softcap=bool(b.final_softcap),
        projection_norm=b.qk_norm_scope == "projection",
    )


def plain_matmul_attention(model: ModelSpec, strategy: Strategy) -> bool:
    """Whether the attention core keeps its [b, h, s, s] fp32 scores (``modelpar_kernels.attention_math_
    reference``): a soft-cap or sinks, which no flash kernel computes, on one cp rank or under the all-to-all
    (each rank then attends over the whole sequence with its heads); the ring and the all-gather compute them
    block by block and keep q, k, v, the output and the log-sum-exp only."""
    b = model.shape.block
    if not (b.attention_softcap or b.attention_sinks) or model.shape.mla.enabled:
        return False
    return strategy.layout.cp == 1 or strategy.cp_comm == "alltoall"


# -- saved tensors of each piece (the module docstring's tables) ----------------------------------------------


def latent_attention_saved(x: Dims, kernels: str) -> list[Saved]:
    """The latent attention half without recompute (``modelpar.model.layers.latent_attention``), derived from
    what its ops save: the fused down-projection's output whole (the latent norms keep views of it), the
    RMSNorms of the q and kv latents, the rotated latent [c_kv | k_pe] (kv_b_proj's input), q, and, at cp = 1,
    the expanded k and v attention keeps (v zero-padded to dk for the Triton kernel). The torch reference
    computes dk != dv attention in plain matmuls and keeps the probabilities, [hq, s, s] per sequence. Under cp
    the exchange keeps q, the latent, its output and lse only: the expanded K/V are rebuilt in backward."""
    m, T, Ts, e, h = x.mla, x.T, x.Ts, x.e, x.h
    hq, dk, dv, rank = x.hq, m.qk_head_dim, m.v_head_dim, m.kv_lora_rank
    latent = rank + m.qk_rope_head_dim
    q_rows = m.q_lora_rank or hq * dk
    torch_kernels = kernels == "torch"
    norm = e * Ts * h
    out = [Saved("attention: x (RMSNorm)", norm, moved=2 * norm if torch_kernels else None)]
    if torch_kernels:
        out.append(Saved("attention: x * 1/rms (RMSNorm)", norm))
    out += [
        Saved("attention: 1/rms (RMSNorm)", 4 * Ts),
        Saved("attention: down_proj input", e * x.Tin * h),
        Saved("attention: down_proj output (q | c_kv | k_pe)", e * T * (q_rows + latent)),
        Saved("attention: latent norms' 1/rms", 4 * T * (2 if m.q_lora_rank else 1)),
        Saved("attention: latent [c_kv | k_pe] (kv_b_proj input)", e * T * latent),
        Saved("attention: q after RoPE", e * T * hq * dk),
        Saved("attention: output", e * T * hq * (dk if kernels == "triton" else dv)),
        Saved("attention: log-sum-exp", 4 * T * hq),
        Saved("attention: o_proj input", e * T * hq * dv),
    ]
    if m.q_lora_rank:
        out.append(Saved("attention: q latent normed (q_b_proj input)", e * T * m.q_lora_rank))
        if torch_kernels:
            out.append(Saved("attention: q latent * 1/rms", e * T * m.q_lora_rank))
    if torch_kernels:
        out.append(Saved("attention: c_kv * 1/rms", e * T * rank))
    if x.cp == 1:
        out += [
            Saved("attention: k (expanded)", e * T * hq * dk),
            Saved("attention: v (expanded)", e * T * hq * (dk if kernels == "triton" else dv)),
        ]
        if torch_kernels:
            out.append(Saved("attention: probabilities (plain matmuls)", e * T * hq * x.s))
    return out


def attention_saved(x: Dims, kernels: str) -> list[Saved]:
    """The attention half without recompute."""
    if x.mla is not None:
        return latent_attention_saved(x, kernels)
    T, Ts, e, h, d = x.T, x.Ts, x.e, x.h, x.d
    torch_kernels = kernels == "torch"
    norm = e * Ts * h
    out = [Saved("attention: x (RMSNorm)", norm, moved=2 * norm if torch_kernels else None)]  # by x^2 and x*r
    if torch_kernels:
        out.append(Saved("attention: x * 1/rms (RMSNorm)", norm))
    out += [Saved("attention: 1/rms (RMSNorm)", 4 * Ts), Saved("attention: qkv_proj input", e * x.Tin * h)]
    if x.score_keys:  # the plain-matmul core: SDPA's tensors are not kept, fp32 copies and scores are
        out += [*qk_norm_saved(x, kernels), *plain_attention_saved(x)]
    else:
        out += [
            # whole, because SDPA keeps v, a view of it: offload moves v only
            Saved("attention: qkv output", e * T * (x.hq + 2 * x.hkv) * d, moved=e * T * x.hkv * d),
            Saved("attention: q after RoPE", e * T * x.hq * d),
            Saved("attention: k after RoPE", e * T * x.hkv * d),
            *qk_norm_saved(x, kernels),
            # SDPA's output and o_proj's input: one storage, two saved views (under cp two storages, below)
            Saved(
                "attention: output (o_proj input)", e * T * x.hq * d, moved=(1 if x.cp > 1 else 2) * e * T * x.hq * d
            ),
            Saved("attention: log-sum-exp", 4 * T * x.hq),
        ]
    if x.cp > 1:  # the exchange returns [b, hq, s, d]: o_proj's flattened input is a copy
        out.append(Saved("attention: o_proj input (cp)", e * T * x.hq * d))
        rows = 4 * x.s * d / 2  # cos (sin) rows of this rank's positions, each kept by two products per RoPE
        out += [Saved(f"attention: {name} rows (cp)", rows, moved=4 * rows) for name in ("cos", "sin")]
    else:  # views of the shared tables (counted once per stage, ``shared_tables_bytes``), moved 4 times each
        table = 2.0 * x.s * d
        out.append(Saved("attention: cos, sin (shared tables)", 0.0, moved=8 * table, storage=table))
    return out + post_norm_saved(x, kernels, "attention") + norm_scales_saved(x, "attention")


def plain_attention_saved(x: Dims) -> list[Saved]:
    """The attention core on its plain-matmul path (``plain_matmul_attention``: a soft-cap or sinks), from what
    ``attention_math_reference``'s ops keep: q, and k and v repeated to q's heads, in fp32 (the matmuls' copies),
    the fp32 softmax output over the ``score_keys`` keys (and the sinks' column), tanh's output under a soft-cap,
    the boolean [s, s] mask, and (one cp rank) o_proj's input, a copy of the transposed output. Under the
    all-to-all a rank holds ``hq/cp`` heads of all ``s`` tokens: the same bytes as ``hq`` heads of ``T``."""
    T, hq, d, keys = x.T, x.hq, x.d, x.score_keys
    copies = (("q", "the score matmul's copy"), ("k", "repeated to the q heads"), ("v", "repeated to the q heads"))
    out = [Saved(f"attention: {name}, fp32 ({what})", 4 * T * hq * d) for name, what in copies]
    if x.softcap:
        out.append(Saved("attention: capped scores tanh(s / cap), fp32", 4 * T * hq * keys))
    out += [
        Saved("attention: probabilities, fp32", 4 * T * hq * (keys + x.sinks)),
        Saved("attention: mask [s, s] (bool)", keys * keys),
    ]
    if x.cp == 1:
        out.append(Saved("attention: o_proj input (a copy)", x.e * T * hq * d))
    return out


def post_norm_saved(x: Dims, kernels: str, half: str) -> list[Saved]:
    """The second RMSNorm of a sandwich (``model.block.norm=sandwich``) on the sub-layer's output (nothing
    otherwise): as the norm before it, x (twice saved by torch's), x * 1/rms (torch) and 1/rms."""
    if not x.sandwich:
        return []
    norm = x.e * x.Ts * x.h
    torch_kernels = kernels == "torch"
    out = [Saved(f"{half}: x (post RMSNorm)", norm, moved=2 * norm if torch_kernels else None)]
    if torch_kernels:
        out.append(Saved(f"{half}: x * 1/rms (post RMSNorm)", norm))
    return out + [Saved(f"{half}: 1/rms (post RMSNorm)", 4 * x.Ts)]


def norm_scales_saved(x: Dims, half: str) -> list[Saved]:
    """``model.block.norm_offset=1``: each norm of the half keeps its computed scale ``1 + weight`` (fp32), the
    half's one or two and, in the attention half, per-head QK-norm's two of width d."""
    if not x.norm_scale:
        return []
    width = (2 if x.sandwich else 1) * x.h + (2 * x.d if half == "attention" and x.qk_norm else 0)
    return [Saved(f"{half}: norm scales 1 + weight (fp32)", 4.0 * width)]


def qk_norm_saved(x: Dims, kernels: str) -> list[Saved]:
    """QK-norm's per-head RMSNorms of q and k (nothing without it): each keeps a row tensor of its heads (torch:
    x times 1/rms; Triton: x, copied out of the qkv output's strided view) and 1/rms per head. Over the whole
    projection (``qk_norm_scope=projection``, always the torch path): x times 1/rms, one 1/rms per token, and,
    in bf16, x's fp32 copy (in fp32, x itself: a view of the qkv output, kept whole already)."""
    if not x.qk_norm:
        return []
    if x.projection_norm:
        return [
            Saved(f"attention: {name} * 1/rms, 1/rms, fp32 {name} ({name}_norm over the projection)",
                  (x.e + (4 if x.e != 4 else 0)) * x.d * x.T * heads + 4 * x.T)
            for name, heads in (("q", x.hq), ("k", x.hkv))
        ]  # fmt: skip
    what = "x * 1/rms" if kernels == "torch" else "x rows"
    return [
        Saved(f"attention: {name} {what}, 1/rms ({name}_norm)", (x.e * x.d + 4) * x.T * heads)
        for name, heads in (("q", x.hq), ("k", x.hkv))
    ]


def mlp_saved(x: Dims, kernels: str, ffn: float | None = None, tokens: float | None = None) -> list[Saved]:
    """A dense SwiGLU MLP half without recompute (``ffn``/``tokens``: an expert's width and rows, no norm)."""
    e, h = x.e, x.h
    f = x.f if ffn is None else ffn
    T = x.T if tokens is None else tokens
    torch_kernels = kernels == "torch"
    out = []
    if tokens is None:
        norm = e * x.Ts * h
        out.append(Saved("mlp: x (RMSNorm)", norm, moved=2 * norm if torch_kernels else None))
        if torch_kernels:
            out.append(Saved("mlp: x * 1/rms (RMSNorm)", norm))
        out.append(Saved("mlp: 1/rms (RMSNorm)", 4 * x.Ts))
    out += [
        Saved("mlp: gate_up_proj input", e * (x.Tin if tokens is None or tokens == x.T else T) * h),
        Saved("mlp: gate|up output", e * T * 2 * f),  # gate and up, two views
    ]
    if torch_kernels or x.geglu:  # GeGLU runs on the torch path whatever the kernels
        out.append(Saved(f"mlp: {'gelu_tanh' if x.geglu else 'silu'}(gate)", e * T * f))
    out.append(Saved("mlp: down_proj input", e * T * f))
    if tokens is None:
        out += post_norm_saved(x, kernels, "mlp") + norm_scales_saved(x, "mlp")
    return out


def moe_saved(model: ModelSpec, x: Dims, kernels: str, tp: int, ep: int = 1) -> list[Saved]:
    """A mixture-of-experts MLP half (``modelpar.model.moe``; measured at tp 1 and 2, ep 1): the norm, the router
    on this tp rank's ``T/t`` tokens, and each of their ``k`` routed rows through an expert's SwiGLU (gate and
    up are two GEMMs), weighted and added back; the shared experts as a dense SwiGLU of all ``T`` tokens.
    Every routed row is counted (no capacity drops); under ep the rows a rank computes are its tokens' on
    average (balanced routing)."""
    moe, e, h = model.shape.moe, x.e, x.h
    tokens = x.T / tp  # split over tp (sequence parallel: already)
    rows = moe.top_k * tokens
    fe = model.shape.expert_ffn_hidden
    out = mlp_saved(x, kernels)[: 3 if kernels == "torch" else 2]  # the norm's
    out += [
        # the norm's output, or (tp without SP) the rows of it this rank routes: a view, the whole kept
        Saved("moe: router input", e * x.Ts * h),
        Saved("moe: router probabilities (fp32)", 4 * tokens * moe.experts),
        Saved(
            "moe: top-k experts, weights and their sum", 8 * tokens * moe.top_k + 4 * tokens * moe.top_k + 4 * tokens
        ),
        Saved("moe: row order and token of each row (int64)", 3 * 8 * rows + (2 * 8 * rows if ep > 1 else 0)),
        Saved("moe: routed rows", e * rows * h),
        Saved("moe: gate, up outputs", e * rows * 2 * fe),
        Saved("moe: expert outputs, weighted", 2 * e * rows * h),
        Saved("moe: row weights (fp32)", 4 * rows),
    ]
    clamped = moe.activation == "clamped_swiglu"  # GPT-OSS's: g = clamp(gate), clamp(up) + 1, sigmoid(alpha g)
    own = "g, up + 1, sigmoid(alpha g), two products" if clamped else "silu(gate), silu(gate) * up"
    out.append(Saved(f"moe: {own}", e * rows * (5 if clamped else 2) * fe))
    out += [Saved("moe: the biases' row indices (int64; index_select keeps them)", 3 * 8 * rows)] * moe.bias
    out += [Saved("moe: grouped GEMMs' expert offsets (int32)", 3 * 4 * moe.experts / ep)] * moe.grouped_gemm
    if moe.shared_experts:
        shared = mlp_saved(x, kernels, ffn=moe.shared_experts * fe / tp, tokens=x.T)
        # its input: all-gathered under SP (kept whole without sp_keep_shard), else (or its shard) the router's
        out += shared if x.Tin > x.Ts else shared[1:]
    return out + post_norm_saved(x, kernels, "mlp") + norm_scales_saved(x, "mlp")


def sac_saved(x: Dims, half: str, moe=None, kernels: str = "torch") -> list[Saved]:
    """``elementwise`` selective recompute: the half's input, and the matmul/attention outputs it caches. In
    a mixture-of-experts half only the router's matmul is one of them (the experts' grouped GEMMs are rerun)."""
    e, h, T = x.e, x.h, x.T
    out = [Saved(f"{half}: input (checkpoint)", e * x.Ts * h)]
    if moe is not None:
        out.append(Saved("moe: router logits (cached)", e * T / x.tp * moe.experts, hooked=False))
        if moe.shared_experts:
            fs = moe.shared_experts * (moe.ffn_hidden or x.f * x.tp) / x.tp
            out.append(Saved("moe: shared experts' gate|up, down outputs (cached)", e * T * (2 * fs + h), hooked=False))
        return out
    if half == "attention" and x.mla is not None:  # the matmul outputs of latent attention, and its attention's
        m = x.mla
        q_rows = m.q_lora_rank or x.hq * m.qk_head_dim
        q_b = x.hq * m.qk_head_dim if m.q_lora_rank else 0
        out += [
            Saved(
                "attention: down_proj output (cached)",
                e * T * (q_rows + m.kv_lora_rank + m.qk_rope_head_dim),
                hooked=False,
            ),
            Saved(
                "attention: q_b_proj, kv_b_proj outputs (cached)",
                e * T * (q_b + x.hq * (m.qk_nope_head_dim + m.v_head_dim)),
                hooked=False,
            ),
            Saved("attention: output (cached)", e * T * x.hq * m.v_head_dim, hooked=False),
            Saved("attention: log-sum-exp (cached)", 4 * T * x.hq, hooked=False),
            Saved("attention: o_proj output (cached)", e * T * h, hooked=False),
        ]
        if x.cp == 1 and kernels == "torch":  # dk != dv attention in plain matmuls: its scores are a bmm's output
            out.append(Saved("attention: scores (cached, plain matmuls)", e * T * x.hq * x.s, hooked=False))
        return out
    if half == "attention" and x.score_keys:  # the plain-matmul core: its two batched matmuls' fp32 outputs
        out += [
            Saved("attention: qkv output (cached)", e * T * (x.hq + 2 * x.hkv) * x.d, hooked=False),
            Saved("attention: scores, fp32 (cached)", 4 * T * x.hq * x.score_keys, hooked=False),
            Saved("attention: probabilities @ v, fp32 (cached)", 4 * T * x.hq * x.d, hooked=False),
            Saved("attention: o_proj output (cached)", e * T * h, hooked=False),
        ]
    elif half == "attention":
        out += [
            Saved("attention: qkv output (cached)", e * T * (x.hq + 2 * x.hkv) * x.d, hooked=False),
            Saved("attention: output (cached)", e * T * x.hq * x.d, hooked=False),
            Saved("attention: log-sum-exp (cached)", 4 * T * x.hq, hooked=False),
            Saved("attention: o_proj output (cached)", e * T * h, hooked=False),
        ]
    else:
        out += [
            Saved("mlp: gate|up output (cached)", e * T * 2 * x.f, hooked=False),
            Saved("mlp: down_proj output (cached)", e * T * h, hooked=False),
        ]
    return out

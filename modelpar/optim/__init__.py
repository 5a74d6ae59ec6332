"""The optimizer side of a training step: data-parallel gradient averaging, ZeRO-1, clipping, AdamW, LR.

``DataParallelOptimizer`` is the one API a step talks to (``build_optimizer``: ``ReplicatedAdamW`` or
``ZeroOneOptimizer``; see ``modelpar.optim.data_parallel`` for a step). Used directly, one
step with plain AdamW (``optim.zero=0``) reads::

    sync = GradientSynchronizer([p for p, _ in params_with_info], groups.dp_group, bucket_bytes)
    opt = build_adamw(params_with_info, lr=..., betas=..., eps=..., weight_decay=...)
    ... backward of micro-batches 0..m-2, then `with sync.final_backward():` the last one ...
    sync.wait()                                                  # grads: global-batch mean
    norm = clip_grad_norm(params_with_info, max_norm, groups)
    set_lr(opt, lr_at(step, lr, warmup, total, min_lr)); opt.step(); opt.zero_grad(set_to_none=True)

With ZeRO-1 (``optim.zero=1``) ``ZeroOneAdamW`` replaces both the synchronizer and AdamW; see its docstring.
Gradient reductions over tp (sequence-parallel norms) and over the embedding group (tied weights) are linear,
so they commute with the dp average, but run them after ``wait()``: a bucket copies its gradients when it
launches, and ``wait()`` writes the averages of those copies back over ``param.grad``.
"""

from modelpar.optim.adamw import build_adamw
from modelpar.optim.build import build_optimizer
from modelpar.optim.clip import clip_grad_norm
from modelpar.optim.data_parallel import (
    ZERO_STAGES,
    DataParallelOptimizer,
    ReplicatedAdamW,
    ZeroOneOptimizer,
)
from modelpar.optim.grad_sync import DEFAULT_BUCKET_BYTES, GradientSynchronizer
from modelpar.optim.lr_schedule import lr_at, set_lr
from modelpar.optim.param_info import ParamInfo, ParamsWithInfo, default_decay
from modelpar.optim.state import load_optimizer_state_tensors, optimizer_state_tensors
from modelpar.optim.zero import ZeroOneAdamW

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ZERO_STAGES",
    "DataParallelOptimizer",
    "ReplicatedAdamW",
    "ZeroOneOptimizer",
    "build_optimizer",
    "GradientSynchronizer",
    "ParamInfo",
    "ParamsWithInfo",
    "ZeroOneAdamW",
    "build_adamw",
    "clip_grad_norm",
    "default_decay",
    "load_optimizer_state_tensors",
    "lr_at",
    "optimizer_state_tensors",
    "set_lr",
]

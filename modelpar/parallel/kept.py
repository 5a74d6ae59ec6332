"""A grad-off region kept whole by selective activation checkpointing (``kept_result``).

Selective checkpointing (``modelpar.model.activations``, ``recompute_modules=[elementwise]``) decides op by op
what to keep, and it sees every aten op inside the checkpointed half, those inside an autograd Function's
forward included. Context parallelism's attention Function is many ops (one partial attention and merge per
K/V block, the ring's sends): kept op by op, it would keep every block's partial result, and its rerun in
backward would compute and communicate the whole ring again. ``kept_result`` makes it one unit instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WATCHERS: list = []  # the activation meters watching (``modelpar.model.activations.watch`` adds to this list)

_KEPT = "modelpar.kept"  # the key, in selective checkpointing's own storage, of the results ``kept_result`` keeps


def kept_result(compute: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``compute()`` (a grad-off region, such as context parallelism's attention Function) as one kept op of
    selective checkpointing: run once, outside the checkpoint's dispatch modes, its result kept until backward,
    and handed back (the first tensor cloned) when the checkpoint reruns the half, without computing or
    communicating again. Outside a selectively checkpointed half it is ``compute()``.

    Without it, the checkpoint's policy sees every aten op inside the region: it keeps each matmul and attention
    kernel of every cp block (on the meta device, where block attention is plain matmuls, their scores too),
    and the rerun computes the whole ring again."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    stack = _get_current_dispatch_mode_stack()
    mode = stack[-1] if stack else None
    if isinstance(mode, _CachedTorchDispatchMode):  # the rerun in backward: the result of the first run
        kept = mode.storage[_KEPT]
        first, *rest = kept["results"][kept["next"]]
        kept["results"][kept["next"]] = None  # let it go once handed back
        kept["next"] += 1
        with _pop_mode_temporarily():  # an op of its own, which the checkpoint's counts must not see
            first = first.clone()
        return (first, *rest)
    if not isinstance(mode, _CachingTorchDispatchMode):
        return compute()
    with _pop_mode_temporarily():
        result = compute()
    kept = mode.storage[_KEPT]  # a fresh dict per checkpointed half
    kept.setdefault("results", []).append(result)
    kept.setdefault("next", 0)
    if WATCHERS:
        for t in result:
            WATCHERS[-1].cached(t)
    return result

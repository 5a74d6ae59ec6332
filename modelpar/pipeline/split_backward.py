"""The backward of one chunk split in two, for zero-bubble schedules: B (input gradient) then W (weights).

B walks the graph once from the chunk's output to its input and, on the way, keeps the gradient arriving at
each node that leads to a parameter (PyTorch's ``stage_backward_input``, the helper of its own zero-bubble
schedules: private, so this file is the only place that touches it). W starts from those saved gradients
and runs only the weight-gradient part, so B + W cost about one ordinary backward.

Unlike PyTorch's ``stage_backward_weight``, W here goes through ``torch.autograd.backward(..., inputs=params)``
so gradients land in ``.grad`` through autograd's accumulation: post-accumulate-grad hooks fire once per
micro-batch, as data-parallel overlap expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input


@dataclass
class PendingWeightGrad:
    """What B leaves for W: per parameter group, the graph nodes feeding it and the gradients they received."""

    params: list[torch.nn.Parameter]
    param_groups: list[dict]


def backward_input(
    output: torch.Tensor, output_grad: torch.Tensor | None, x: torch.Tensor, params: Sequence[torch.nn.Parameter]
) -> tuple[torch.Tensor, PendingWeightGrad]:
    """Gradient of the loss w.r.t. the chunk input ``x`` (same shape as ``x``), and what W needs.

    ``output``: the chunk output (``output_grad`` its gradient) or, on the last chunk, the loss (``None``).
    """
    (dx,), param_groups = stage_backward_input(
        [output], None if output_grad is None else [output_grad], [x], iter(params)
    )
    return dx, PendingWeightGrad(list(params), param_groups)


def backward_weight(pending: PendingWeightGrad) -> None:
    """Accumulate the weight gradients B prepared into ``.grad`` of every parameter (through autograd)."""
    weight_of = {_get_grad_fn_or_grad_acc(p): p for p in pending.params}
    for group in pending.param_groups:
        grads, nodes = group.get("grads") or [], group["intermediates"]
        edges, edge_grads = [], []
        for grads_in, node in zip(grads, nodes, strict=True):
            for i, grad in enumerate(grads_in or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    edge_grads.append(grad)
        if not edges:
            continue
        # A node may also sit downstream of another saved node; pin every saved node's incoming gradient to
        # what B recorded so nothing is counted twice (as PyTorch's stage_backward_weight does).
        handles = [
            node.register_prehook(lambda _, saved=g: saved)
            for g, node in zip(grads, nodes, strict=True)
            if g is not None
        ]
        try:
            inputs = [weight_of[acc] for acc in group["params"]]
            torch.autograd.backward(edges, edge_grads, inputs=inputs)
        finally:
            for handle in handles:
                handle.remove()

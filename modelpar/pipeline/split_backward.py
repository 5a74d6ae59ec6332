"""The backward of one chunk split in two, for zero-bubble schedules: B (input gradient) then W (weights).

The chunk's autograd graph, walked from its output, has an *input path*: the nodes from which the chunk
input ``x`` can be reached. Every weight hangs off that path through a *weight-only* branch (e.g. the
``weight.T`` edge of a matmul whose other edge continues towards ``x``). The node where a weight-only branch
leaves the input path is a *seed*.

- **B** asks autograd for the gradient of ``x`` only, so it evaluates the input path and nothing else, and on
  the way records the gradient arriving at each seed (a pre-hook on the seed's node).
- **W** restarts autograd at the seeds with those recorded gradients and asks only for the weights below
  them, so it evaluates just the weight-only branches. B + W cost about one ordinary backward.

A weight reachable from two seeds (a weight used twice on the input path) puts those seeds in one group; its
W pins every seed's incoming gradient to the recorded one, so a seed also reached from another seed is
counted once. W goes through ``torch.autograd.backward(..., inputs=weights)``, so gradients land in
``.grad`` through autograd's accumulation and post-accumulate-grad hooks fire once per micro-batch, as
data-parallel overlap expects. Only public autograd API is used (graph nodes, pre-hooks, gradient edges).

The weights are, by default, the leaves the graph reaches other than ``x`` (its ``AccumulateGrad`` nodes):
exactly what one ordinary backward would accumulate into. Under FSDP2 those are the gathered (unsharded)
parameters the forward used, not the sharded ones the module holds at rest (``modelpar.optim.fsdp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _SeedGroup:
    """Seeds whose weight-only branches share weights, the weights below them and the recorded gradients."""

    seeds: list[Node]
    params: list[torch.nn.Parameter]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class PendingWeightGrad:
    """What B leaves for W: the seed groups with the gradients recorded at their seeds."""

    groups: list[_SeedGroup]


def _graph_below(root: Node) -> list[Node]:
    """Every node reachable from ``root`` through ``next_functions`` (``root`` included), each once."""
    seen, order, stack = {root}, [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return order


def _reaches(nodes: list[Node], targets: set[Node]) -> dict[Node, bool]:
    """For each node: can a target be reached from it (the node itself included)? Iterative post-order."""
    memo: dict[Node, bool] = {}
    for start in nodes:
        if start in memo:
            continue
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node in memo:
                continue
            children = [c for c, _ in node.next_functions if c is not None]
            if expanded:
                memo[node] = node in targets or any(memo[c] for c in children)
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in memo)
    return memo


def _seed_groups(root: Node, x_node: Node, param_of: dict[Node, torch.Tensor] | None) -> list[_SeedGroup]:
    nodes = _graph_below(root)
    if param_of is None:  # every leaf below the output but x: what an ordinary backward accumulates into
        param_of = {n: n.variable for n in nodes if n is not x_node and hasattr(n, "variable")}
    to_x = _reaches(nodes, {x_node})
    to_param = _reaches(nodes, set(param_of))
    weights_below: dict[Node, set[Node]] = {}  # seed -> parameter nodes in its weight-only branches
    for node in nodes:
        if not to_x[node]:
            continue
        for child, _ in node.next_functions:
            if child is not None and not to_x[child] and to_param[child]:
                below = {n for n in _graph_below(child) if n in param_of}
                weights_below.setdefault(node, set()).update(below)
    # union seeds that share a weight
    owner: dict[Node, int] = {}
    groups: list[tuple[list[Node], set[Node]]] = []
    for seed, below in weights_below.items():
        hits = sorted({owner[w] for w in below if w in owner})
        seeds, params = [seed], set(below)
        for g in reversed(hits):
            seeds += groups[g][0]
            params |= groups[g][1]
            groups[g] = ([], set())
        groups.append((seeds, params))
        for w in params:
            owner[w] = len(groups) - 1
    return [_SeedGroup(seeds, [param_of[w] for w in params]) for seeds, params in groups if seeds]


def backward_input(
    output: torch.Tensor,
    output_grad: torch.Tensor | None,
    x: torch.Tensor,
    params: Sequence[torch.nn.Parameter] | None = None,
) -> tuple[torch.Tensor, PendingWeightGrad]:
    """Gradient of the loss w.r.t. the chunk input ``x`` (same shape as ``x``), and what W needs.

    ``output``: the chunk output (``output_grad`` its gradient) or, on the last chunk, the loss (``None``).
    ``x`` must be a leaf that requires grad (the received activation). ``params``: the weights W fills; by
    default every leaf of the graph but ``x``.
    """
    param_of = None if params is None else {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    groups = _seed_groups(output.grad_fn, get_gradient_edge(x).node, param_of) if output.grad_fn else []
    handles = []

    def recorder(group: _SeedGroup, seed: Node):
        def hook(grad_outputs):
            group.grads[seed] = grad_outputs

        return hook

    try:
        handles = [seed.register_prehook(recorder(g, seed)) for g in groups for seed in g.seeds]
        (dx,) = torch.autograd.grad(
            output, x, None if output_grad is None else output_grad, retain_graph=True, allow_unused=True
        )
    finally:
        for handle in handles:
            handle.remove()
    return (torch.zeros_like(x) if dx is None else dx), PendingWeightGrad(groups)


def _pinned(grads: tuple[torch.Tensor | None, ...] | None):
    """A pre-hook that replaces whatever gradient reaches a node with ``grads`` (None: leave it)."""

    def hook(_):
        return grads

    return hook


def backward_weight(pending: PendingWeightGrad) -> None:
    """Accumulate the weight gradients B prepared into ``.grad`` of every parameter (through autograd)."""
    for i, group in enumerate(pending.groups):
        edges, edge_grads = [], []
        for seed in group.seeds:
            for i, grad in enumerate(group.grads.get(seed) or ()):
                if grad is not None:
                    edges.append(GradientEdge(seed, i))
                    edge_grads.append(grad)
        if not edges:
            continue
        handles = []
        if len(group.seeds) > 1:  # a seed reached from another seed too: keep only what B recorded for it
            handles = [seed.register_prehook(_pinned(group.grads.get(seed))) for seed in group.seeds]
        try:
            # a later group may pass through nodes this one evaluates (a weight used at several depths of the
            # input path, as multi-token prediction's shared embedding and head are): keep them until the last
            torch.autograd.backward(edges, edge_grads, inputs=group.params, retain_graph=i < len(pending.groups) - 1)
        finally:
            for handle in handles:
                handle.remove()
    pending.groups.clear()

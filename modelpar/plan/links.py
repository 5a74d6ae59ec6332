"""The time of one collective on a link: ring all-reduce and all-gather (or reduce-scatter) formulas, and the
bandwidth of a group by where its ranks lie (NVLink inside a node, the network across nodes)."""

from __future__ import annotations

from modelpar.plan.spec import Hardware


def ring_all_reduce_s(nbytes: float, ranks: int, bandwidth: float, latency_s: float) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, 2(n-1) steps each moving nbytes/n."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency_s


def ring_all_gather_s(nbytes: float, ranks: int, bandwidth: float, latency_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` in total: n-1 steps of nbytes/n."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency_s


def group_bandwidth(hardware: Hardware, span: int) -> float:
    """Bandwidth of a group whose ranks lie within ``span`` consecutive ranks: NVLink if one node holds it."""
    return hardware.intra_node_bw if span <= hardware.gpus_per_node else hardware.inter_node_bw

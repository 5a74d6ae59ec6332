"""Poisoned or faulty workers: each dp replica's gradient compared with the others' before the update applies.

Per step, every rank sketches its local gradient (before the dp reduction mixes it) as a count sketch of ``SKETCH``
numbers. The gradient comes in segments the optimizer hands over (``DataParallelOptimizer.local_gradients``): under
zero-0 each all-reduce bucket's gradients back to back, seen just before the bucket's all-reduce overwrites them in
place (so while the next buckets' backward still runs), otherwise one parameter each, after backward. Each segment,
viewed as rows of ``SKETCH`` elements, is summed over its rows with one fixed random sign per row (drawn once from
a seed shared by every replica), so element ``i`` lands in bucket ``i mod SKETCH``. Two elements that share a
bucket come from different rows (or different segments) and so carry independent signs: the cross terms of a
sketch's inner product have mean zero, and inner products and cosines of sketches estimate those of the whole
gradients. The sum is one matrix-vector product per segment, a single read of the gradient; plus the local
gradient norm. One all-gather over the dp group gives every replica all
sketches; on the device, each replica's sketch is compared with the mean of the others' (leave-one-out cosine) and
its norm with the median norm. A replica whose cosine is negative and ``trainer.grad_outlier_cosine`` or more below
the median replica's (a sign-flipped gradient, where honest replicas agree), or whose norm exceeds
``trainer.grad_outlier_norm`` x the median (a scaled one), is an outlier. Honest replicas on data with no shared
direction (uniformly random tokens) have cosines near 0 with each other: then a flipped one cannot be told apart
and none is named, rather than an honest one. The statistics ride the step's one host read-back, so every rank
decides alike: ``trainer.grad_outlier_action=warn|skip|halt``. Naming the odd replica needs dp >= 3; with two,
either could be the odd one, so the check reports that they disagree (cosine below ``-grad_outlier_cosine``, or one
norm ``grad_outlier_norm`` x the other) without naming either. The signs cost 4 bytes per ``SKETCH`` parameter
elements.
"""

from __future__ import annotations

import torch

from modelpar.parallel import collectives
from modelpar.parallel.groups import ParallelGroups

OUTLIER_ACTIONS = ("off", "warn", "skip", "halt")
_SEED = 0x5EED
SKETCH = 1024  # buckets of the count sketch: the all-gather carries SKETCH + 1 floats per replica


class GradientOutlierCheck:
    """The per-step sketch, all-gather and comparison; ``add()`` and ``stats()`` on the device, ``verdict()`` on
    the host. The gradient arrives as ``segments`` of flat gradient, the same sizes on every replica (a
    parameter each, or a zero-0 all-reduce bucket's parameters back to back): ``add(i, g)`` once per segment
    with a gradient, then ``stats()`` once per step."""

    def __init__(self, segments: list[int], device, groups: ParallelGroups, cosine_gap: float, norm_max: float):
        self.groups = groups
        self.cosine_gap, self.norm_max = cosine_gap, norm_max
        self.dp = groups.layout.dp
        generator = torch.Generator().manual_seed(_SEED)  # the same signs on every replica of these sizes
        self.signs = [  # one per row of SKETCH elements, the last (shorter) row included
            (torch.randint(0, 2, (-(-n // SKETCH),), generator=generator) * 2 - 1).to(device, torch.float32)
            for n in segments
        ]
        self.sketch = torch.zeros(SKETCH + 1, dtype=torch.float32, device=device)

    def add(self, segment: int, grad: torch.Tensor) -> None:
        """Sketch segment ``segment``'s gradient (any shape; read once, plus once for its norm)."""
        g = grad.detach().float().reshape(-1)
        signs = self.signs[segment]
        rows, tail = divmod(g.numel(), SKETCH)
        if rows:
            self.sketch[:SKETCH].addmv_(g[: rows * SKETCH].view(rows, SKETCH).t(), signs[:rows])
        if tail:
            self.sketch[:tail].addcmul_(signs[rows].expand(tail), g[rows * SKETCH :])
        self.sketch[-1] += torch.dot(g, g)

    def reset(self) -> None:
        """Start a step's sketch: forget what ``add()`` saw before."""
        self.sketch.zero_()

    def stats(self) -> torch.Tensor:
        """[dp, 3] on the device: each replica's leave-one-out cosine, its gradient norm, and norm / median norm."""
        with collectives.comm_tag("grad_outliers"):
            everyone = collectives.all_gather(self.sketch.unsqueeze(0), self.groups.dp_group)  # [dp, n + 1]
        vectors, norms = everyone[:, :-1], everyone[:, -1].sqrt()
        others = (vectors.sum(0, keepdim=True) - vectors) / (self.dp - 1)  # leave-one-out means
        cosine = torch.nn.functional.cosine_similarity(vectors, others, dim=1)
        ratio = norms / norms.median().clamp_min(1e-30)
        return torch.stack([cosine, norms, ratio], dim=1)

    def verdict(self, values: list[float], step: int) -> str | None:
        """The host's reading of ``stats()`` (flattened): a one-line naming of the outliers, or None."""
        if self.dp == 2:
            return self._disagreement(values, step)
        named = []
        cosines = sorted(values[3 * i] for i in range(self.dp))
        median = cosines[self.dp // 2] if self.dp % 2 else (cosines[self.dp // 2 - 1] + cosines[self.dp // 2]) / 2
        for i in range(self.dp):
            cosine, norm, ratio = values[3 * i : 3 * i + 3]
            if (cosine < 0 and cosine < median - self.cosine_gap) or ratio > self.norm_max:
                rank = self.groups.dp_ranks[i]
                c = self.groups.layout.coords(rank)
                named.append(
                    f"rank {rank} (pp {c.pp} tp {c.tp} dp {c.dp}): cosine {cosine:.2f} to the other replicas' mean, "
                    f"norm {norm:.3g} = {ratio:.1f}x the median"
                )
        if not named:
            return None
        return f"gradient outlier at step {step + 1}: " + "; ".join(named)

    def _disagreement(self, values: list[float], step: int) -> str | None:
        """Two replicas: both see the same cosine (each other's), and the larger norm's ratio is larger / smaller."""
        cosine, norms = values[0], (values[1], values[4])
        ratio = max(values[2], values[5])
        if not (cosine < -self.cosine_gap or ratio > self.norm_max):
            return None
        ranks = " and ".join(str(r) for r in self.groups.dp_ranks)
        return (
            f"gradient disagreement at step {step + 1} between the two dp replicas (ranks {ranks}): cosine "
            f"{cosine:.2f}, norms {norms[0]:.3g} and {norms[1]:.3g}; with two replicas the odd one cannot be named "
            "(dp >= 3 names it)"
        )


def outlier_check_note(action: str, dp: int, zero: int) -> str | None:
    """One start-up line when ``trainer.grad_outlier_action`` asks for more than this layout can check."""
    # the default (warn) stays quiet where its limits are moot: a note on every dp=2 run would be noise
    if action == "off" or (action == "warn" and (dp <= 2 or zero >= 2)):
        return None
    setting = f"trainer.grad_outlier_action={action}"
    if dp < 2:
        return f"{setting} is inactive: with dp={dp} there is no other replica to compare gradients with"
    if zero >= 2:
        return (
            f"{setting} is inactive under optim.zero={zero}: gradients are reduce-scattered inside backward, so "
            "no replica's own gradient is left to compare; use optim.zero<=1 to check replicas"
        )
    if dp == 2:
        return f"{setting} at dp=2 reports replicas that disagree but cannot say which one is odd (dp >= 3 names it)"
    return None

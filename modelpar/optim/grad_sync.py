"""Data-parallel gradient averaging in buckets, overlapped with the last micro-batch's backward.

Gradients accumulate locally over the m micro-batches; only the backward of the last one triggers
communication: the caller either wraps it (``final_backward()``/``arm()``) or, when a pipeline runtime runs
the backwards, says up front how many there will be (``expect_micro_batches(m)``). Buckets hold parameters in
reverse order, the order backward finishes them, and each one's all-reduce starts as soon as all its
parameters have their final gradient::

    backward:  grad(w_L) ... grad(w_k) | grad(w_k-1) ... grad(w_j) | ...
    buckets:   [------- bucket 0 ------] [------- bucket 1 ------]
    network:                     all_reduce(0)            all_reduce(1)        wait() -> averaged grads

Buckets launch strictly in order, so every dp rank issues the same sequence of collectives even when one of
them finishes parameters in a different order or never produces some gradient; ``wait()`` launches the rest.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modelpar.optim.param_info import check_same_across, check_unique
from modelpar.parallel import collectives

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(eq=False)
class _Bucket:
    """Parameters whose gradients travel in one all-reduce, and the memory those gradients live in.

    ``flat: [numel + len(params)]`` holds the gradients back to back, then one has-a-gradient flag per parameter,
    so after the sum a parameter that no rank gave a gradient keeps ``grad = None`` (as it would at dp=1). Once a
    parameter's gradient is armed (its step's accumulations are counted), ``param.grad`` becomes ``views[pos]``:
    autograd adds the later micro-batches into the bucket in place and the all-reduce averages it where it
    lies, so a gradient is copied once per step (into the bucket) and never back, and no second gradient-sized
    buffer exists.
    """

    params: list[torch.Tensor]
    offsets: list[int]  # start of each parameter in flat; offsets[-1] == numel
    flat: torch.Tensor
    ready: set[int] = field(default_factory=set)  # positions whose final gradient has accumulated
    work: dist.Work | None = None
    views: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        spans = zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True)
        self.views = [self.flat[start:end].view_as(p) for p, start, end in spans]

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def gradients(self) -> torch.Tensor:
        """Every parameter's gradient back to back (the flags excluded)."""
        return self.flat[: self.numel]

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)

    def adopt(self, pos: int) -> None:
        """Move parameter ``pos``'s gradient into the bucket (a no-op once it lives there)."""
        p, view = self.params[pos], self.views[pos]
        if p.grad is not None and p.grad is not view:
            view.copy_(p.grad)
            p.grad = view

    def launch(
        self, group: dist.ProcessGroup, before: Callable[[torch.Tensor], None] | None = None, average: bool = False
    ) -> None:
        """Start the all-reduce (the mean over ``group`` when ``average``, else the sum); ``before(gradients())``
        first sees this rank's own gradients."""
        for pos, p in enumerate(self.params):
            if p.grad is None:
                self.views[pos].zero_()
            else:
                self.adopt(pos)
        self.flat[self.numel :].copy_(torch.tensor([p.grad is not None for p in self.params], dtype=self.flat.dtype))
        if before is not None:
            before(self.gradients())
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        self.work = collectives.all_reduce_async(self.flat, group, op)

    def unpack_average(self, divisor: int | None, read_back: bool = True) -> None:
        """Wait for the all-reduce and divide its sum by ``divisor`` in place (None: it averaged already): each
        ``param.grad`` is then its view of the average. Which parameters some rank gave a gradient is read back
        to the host (``read_back``), or left to ``drop_unused`` with the flags the caller read itself; until then
        every parameter holds its (zero, where none) average."""
        self.work.wait()
        if divisor is not None:
            self.flat.div_(divisor)
        any_grad = self.flat[self.numel :].tolist() if read_back else [1.0] * len(self.params)
        for p, view, used in zip(self.params, self.views, any_grad, strict=True):
            if used and p.grad is not view:  # this rank had none, another replica had one
                p.grad = view
        self.ready.clear()
        self.work = None

    def flags(self) -> torch.Tensor:
        """Per parameter, nonzero if some dp rank gave it a gradient (valid after ``unpack_average``)."""
        return self.flat[self.numel :]

    def drop_unused(self, any_grad: list[float]) -> None:
        """``param.grad = None`` where no dp rank gave one (``any_grad`` read from ``flags()``)."""
        for p, used in zip(self.params, any_grad, strict=True):
            if not used:
                p.grad = None


def _build_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[_Bucket]:
    """Reverse parameter order, a new bucket once ``bucket_bytes`` is reached or the dtype/device changes."""
    groups: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        if not groups or size >= bucket_bytes or (p.dtype, p.device) != (groups[-1][0].dtype, groups[-1][0].device):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    buckets = []
    for members in groups:
        offsets = [0]
        for p in members:
            offsets.append(offsets[-1] + p.numel())
        flat = torch.zeros(offsets[-1] + len(members), dtype=members[0].dtype, device=members[0].device)
        buckets.append(_Bucket(params=members, offsets=offsets, flat=flat))
    return buckets


class GradientSynchronizer:
    """Average ``param.grad`` over the data-parallel group, overlapping the all-reduces with backward.

    Per step::

        for i, micro_batch in enumerate(micro_batches):
            with sync.final_backward() if i == m - 1 else contextlib.nullcontext():
                loss(micro_batch).backward()        # loss already scaled by 1/m
        sync.wait()                                 # param.grad: mean over the global batch

    Each ``param.grad`` lives in its bucket from its first armed accumulation on (``_Bucket``), and ``wait()``
    leaves it there holding the average, so other gradient reductions (tp, tied embeddings) belong after it.
    Something that must read this rank's own gradients reads them in ``before_launch``: the all-reduce
    overwrites them in place.

    ``divisor`` (default: the group's size): each gradient becomes the group's sum divided by it; expert
    weights sum over their expert data-parallel ranks and divide by all of dp x cp (their local gradients
    already hold the other ep ranks' tokens). With dp == 1 and no divisor every call is a no-op.
    Gradients that no hook saw finish (nothing armed, or accumulated outside
    autograd, as torch's split weight backward does) are averaged by ``wait()`` all the same, just not overlapped.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        dp_group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        divisor: int | None = None,
        uses: dict[int, int] | None = None,
    ):
        """``uses``: id(param) -> backward passes per micro-batch that accumulate into it (default 1)."""
        params = [p for p in params if p.requires_grad]
        self._uses = dict(uses or {})
        check_unique(params)
        self.dp_group = dp_group
        self.dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.divisor = divisor or self.dp_size
        self._averaging = self.divisor == self.dp_size  # the all-reduce averages; else wait() divides its sum
        self._params = params
        if dp_group is not None:
            check_same_across(params, dp_group)
        self.buckets = _build_buckets(params, bucket_bytes) if self.dp_size > 1 else []
        self._where = {id(p): (b, pos) for b, bucket in enumerate(self.buckets) for pos, p in enumerate(bucket.params)}
        self._index = {id(p): i for i, p in enumerate(params)}
        self._accumulations_left: dict[int, int] = {}  # id(param) -> accumulations until its gradient is final
        self._next_launch = 0
        # (bucket index, its local gradients back to back), called just before the bucket's all-reduce
        self.before_launch: Callable[[int, torch.Tensor], None] | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params if self.dp_size > 1]

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters this synchroniser averages, in their given order."""
        return self._params

    def arm(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """The next gradient accumulated into these parameters (default: all) is final: send it when its bucket is full.

        Call before the backward of the last micro-batch. A pipeline stage with several model chunks can arm
        each chunk's parameters before that chunk's last backward.
        """
        chosen = self._where if params is None else [id(p) for p in params]
        self._accumulations_left.update({key: 1 for key in chosen if key in self._where})

    def expect_micro_batches(self, micro_batches: int) -> None:
        """From now on, each parameter's ``micro_batches``-th gradient accumulation is its final one.

        For runtimes that execute every backward themselves (pipeline schedules, split input/weight backward):
        call once at the start of the step. A parameter that misses some micro-batch reduces in ``wait()``.
        """
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} must be >= 1")
        self._accumulations_left.update({key: micro_batches * self._uses.get(key, 1) for key in self._where})

    @contextlib.contextmanager
    def final_backward(self) -> Iterator[None]:
        """``arm()`` for the backward run inside the block (the last micro-batch's)."""
        self.arm()
        yield

    def wait(self, read_back: bool = True) -> None:
        """Launch the buckets still pending (parameters without a gradient), then write the averages back.
        ``read_back=False``: the has-gradient flags stay on the device (``flags``/``drop_unused``)."""
        self.launch_pending()
        divisor = None if self._averaging else self.divisor
        for bucket in self.buckets:
            bucket.unpack_average(divisor, read_back)
        if not self.buckets and self.divisor != 1:  # one holder of these gradients: only the division is left
            torch._foreach_div_([p.grad for p in self._params if p.grad is not None], float(self.divisor))
        self._accumulations_left.clear()
        self._next_launch = 0

    def flags(self) -> torch.Tensor:
        """Every bucket's has-gradient flags, one per parameter, on the device."""
        return torch.cat([bucket.flags() for bucket in self.buckets])

    def drop_unused(self, any_grad: list[float]) -> None:
        """Take the flags of ``flags()`` (read back by the caller): no gradient where no dp rank gave one."""
        start = 0
        for bucket in self.buckets:
            bucket.drop_unused(any_grad[start : start + len(bucket.params)])
            start += len(bucket.params)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        key = id(param)
        b, pos = self._where[key]
        bucket = self.buckets[b]
        if pos in bucket.ready:
            raise RuntimeError(
                f"parameter #{self._index[key]} {tuple(param.shape)} accumulated a gradient after its final one; "
                "arm() only right before the last micro-batch's backward, and wait() before the next step"
            )
        left = self._accumulations_left.get(key)
        if left is None:
            return
        bucket.adopt(pos)  # the step's later accumulations add into the bucket
        if left > 1:
            self._accumulations_left[key] = left - 1
            return
        del self._accumulations_left[key]
        bucket.ready.add(pos)
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].is_ready():
            self._launch_next()

    def launch_pending(self) -> None:
        """Start the all-reduce of every bucket not yet started (``wait()`` does it too)."""
        while self._next_launch < len(self.buckets):
            self._launch_next()

    def _launch_next(self) -> None:
        b = self._next_launch
        before = None if self.before_launch is None else functools.partial(self.before_launch, b)
        self.buckets[b].launch(self.dp_group, before, average=self._averaging)
        self._next_launch += 1

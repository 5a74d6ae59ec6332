"""Execute one pipeline rank's action list: forward and backward of its model chunks, p2p between stages.

The runtime decides nothing about order; the schedule does (``modelpar.pipeline.schedule``). Each run of
consecutive SEND/RECV actions is posted, when the list reaches it, as one ``batch_isend_irecv``; a compute
action waits for the batch holding the receive it consumes and, first, for every batch posted before it (as
NCCL's single p2p stream would), which also lets go of the tensors sent so far. That is the rule under which
``simulate`` proved the schedule cannot deadlock. No tags are used, so gloo matches messages in order as
NCCL does, and a misordered schedule fails here too.

What a chunk must look like (one ``torch.nn.Module`` per local virtual stage, local chunk ``c`` of rank
``r`` being model chunk ``c * pp + r``, or as the schedule's placement says: under the V placement the
activation passes from one local chunk to the other on rank pp-1, and the gradient back, with no p2p)::

    model chunk 0:        chunk(tokens [b, s] int64)   -> activation [*activation_shape]
    middle chunks:        chunk(activation)            -> activation
    last model chunk:     chunk(activation or tokens)  -> output, then loss_fn(output, targets) -> scalar

Tensor-parallel collectives live inside the chunks; every tp rank of a stage runs the same list over its own
pipeline group, so the runtime needs nothing more for tp, nor for dp.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from modelpar.parallel.collectives import profiler_range
from modelpar.parallel.groups import ParallelGroups
from modelpar.parallel.handoff import Pair
from modelpar.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    comm_batches,
    input_recv,
    peer_of,
    placement_of,
)
from modelpar.pipeline.simulate import TimedAction, Timeline, check_schedule, peak_in_flight
from modelpar.pipeline.split_backward import PendingWeightGrad, backward_input, backward_weight

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ActionObserver(Protocol):
    """Told when each action starts and ends (a flight recorder, for hang reports)."""

    def begin(self, label: str, waiting: bool = False) -> None: ...

    def end(self) -> None: ...


class _NoObserver:
    def begin(self, label: str, waiting: bool = False) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class StepResult:
    """What one pipeline step returns on every rank of the pipeline group.

    ``records`` (only when the runtime's ``timing`` is on) are this rank's actions with start/end in seconds
    since the step began (after a barrier over the pipeline group, so ranks share an origin); on a GPU they
    come from CUDA events. A SEND/RECV runs from its batch's posting until the runtime waited for that batch.
    """

    loss_tensor: torch.Tensor  # 0-d fp32 on the device: mean over micro-batches, from the last stage
    records: tuple[TimedAction, ...]
    peak_in_flight: int  # most (micro-batch, chunk) activations held at once on this rank

    @property
    def loss(self) -> float:
        """The loss as a Python float (a host sync on a GPU: the trainer keeps ``loss_tensor`` instead)."""
        return float(self.loss_tensor)


class _HostClock:
    """Seconds since the step began, from the host clock (CPU: the work is done when the call returns)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter() - self.t0

    def seconds(self, mark: float) -> float:
        return mark


class _CudaClock:
    """Seconds since the step began, from CUDA events on the current stream (resolved once, after the step)."""

    def __init__(self) -> None:
        self.start = self.mark()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: torch.cuda.Event) -> float:
        mark.synchronize()
        return self.start.elapsed_time(mark) / 1e3


@dataclass(eq=False)
class _PostedBatch:
    """One ``batch_isend_irecv`` in flight; holds its send tensors alive until it is waited for."""

    index: int  # position in posting order
    actions: list[Action]
    works: list[dist.Work]
    tensors: list[torch.Tensor]
    posted_at: object  # a clock mark (``_HostClock`` / ``_CudaClock``)
    done_at: object = None


@dataclass
class _StepState:
    """Tensors alive during one step, keyed by (micro_batch, chunk)."""

    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # received or token inputs
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # activation, or scaled loss
    output_grads: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)  # chunk 0: B -> W
    pending_weight: dict[tuple[int, int], PendingWeightGrad] = field(default_factory=dict)  # other chunks: B -> W
    received: dict[Action, torch.Tensor] = field(default_factory=dict)  # RECV buffers by their action
    handed: dict[Action, torch.Tensor] = field(default_factory=dict)  # same-rank inputs, by the consuming action
    batches: list[_PostedBatch] = field(default_factory=list)  # in posting order
    waited: int = 0  # batches[:waited] are complete
    batch_of: dict[Action, _PostedBatch] = field(default_factory=dict)
    to_send: dict[Action, torch.Tensor] = field(default_factory=dict)  # SEND payloads by their action
    loss_sum: torch.Tensor | None = None
    held: int = 0
    peak: int = 0

    def hold(self, key: tuple[int, int], x: torch.Tensor, y: torch.Tensor) -> None:
        self.inputs[key], self.outputs[key] = x, y
        self.held += 1
        self.peak = max(self.peak, self.held)

    def release(self, key: tuple[int, int]) -> None:
        del self.inputs[key], self.outputs[key]
        self.output_grads.pop(key, None)
        self.pending_weight.pop(key, None)
        self.held -= 1


class PipelineRuntime:
    """Runs this rank's part of ``schedule`` on ``chunks`` (its local chunks, in local order).

    ``activation_shape`` is the per-micro-batch tensor crossing stages (``[b, s, h]``, or ``[b, s/t, h]``
    under sequence parallelism); ``dtype`` its type. ``loss_fn(output, targets)`` gives the mean loss of one
    micro-batch; the runtime scales it by ``1/m`` so that accumulated gradients equal the single-device
    model's on the whole batch. Gradients accumulate into ``.grad``: zero them before a step.

    Zero-bubble schedules (with W actions) split the backward (``modelpar.pipeline.split_backward``): B takes
    the input gradient and keeps the gradients reaching each parameter's node; W turns those into parameter
    gradients without walking the graph again, so B + W cost about one fused backward. The saved tensors W
    needs live until W, so the in-flight count runs from F to W. On model chunk 0 the input is token ids and
    there is no input gradient to take: its B is empty and its W runs the whole backward.

    Every backward goes through autograd's gradient accumulation, once per micro-batch and parameter, so
    post-accumulate-grad hooks (data-parallel overlap) see all ``m`` accumulations under every schedule.
    W fills the leaves B found in the graph (the parameters the forward used: under FSDP2 the gathered ones).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        groups: ParallelGroups,
        schedule: Schedule,
        *,
        activation_shape: Sequence[int],
        loss_fn: LossFn,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        loss_divisor: int | None = None,
    ):
        self.chunks = list(chunks)
        self.groups = groups
        self.pp = groups.layout.pp
        self.rank = groups.pp_rank
        if len(schedule) != self.pp:
            raise ScheduleError(f"schedule has {len(schedule)} rank lists but pp={self.pp}; build it for pp={self.pp}")
        check_schedule(schedule)  # a malformed or deadlocking schedule fails here, before any message
        self.actions = list(schedule[self.rank])
        self.placement = placement_of(schedule)
        self.micro_batches = 1 + max(a.micro_batch for a in self.actions)
        chunk_count = 1 + max(a.chunk for row in schedule for a in row)
        if chunk_count != len(self.chunks):
            raise ScheduleError(
                f"schedule uses {chunk_count} chunks per rank but rank {self.rank} was given {len(self.chunks)}; "
                f"pass vpp={len(self.chunks)} when building the schedule"
            )
        # the loss of each micro-batch is divided by this (default m); a rerun of one micro-batch of an m-batch
        # step passes m, so that its gradients are the step's, bit for bit
        self.loss_divisor = loss_divisor or self.micro_batches
        self.current: Action | None = None  # the compute action running now (hooks may ask which it is)
        # told (local chunk, micro-batch) before each fused backward through a chunk runs; FSDP2 uses it to
        # reduce-scatter gradients on a chunk's last micro-batch only
        self.before_backward: Callable[[int, int], None] | None = None
        # told (local chunk, micro-batch) before and after each W of a split backward (B calls no hook): FSDP2
        # makes sure the weights are gathered for W and reduce-scatters after the chunk's last W
        self.before_weight_backward: Callable[[int, int], None] | None = None
        self.after_weight_backward: Callable[[int, int], None] | None = None
        self.last_stage = self.pp * chunk_count - 1
        self.loss_rank = self.placement.locate(self.last_stage, self.pp)[0]  # holds the last chunk and the loss
        self.split_backward = any(a.kind is W for a in self.actions)
        # a schedule without backwards (``forward_only``): forwards run without autograd and keep nothing
        self.forward_only = not any(a.kind in (B, W) for row in schedule for a in row)
        self.predicted_peak = 0 if self.forward_only else peak_in_flight(self.actions)  # StepResult.peak_in_flight
        self.activation_shape = tuple(activation_shape)
        self.loss_fn = loss_fn
        self.dtype = dtype
        if device is None:
            first_param = next((p for c in self.chunks for p in c.parameters()), None)
            device = first_param.device if first_param is not None else "cpu"
        self.device = torch.device(device)
        self.observer: ActionObserver = _NoObserver()  # e.g. a FlightRecorder: told each action as it starts
        # per-action records (a barrier to share a time origin, CUDA events on GPU): off in plain training; the
        # trainer turns them on for the steps it checks for stragglers, benchmarks for every step
        self.timing = False
        # DualPipeV's (forward, backward) pairs run at once, handing over at each all-to-all or tp all-reduce
        # (see ``_run_pair``); off: they run one after the other. Where FSDP2 frees gathered weights after a
        # forward or backward, the trainer keeps only the pairs through two different chunks.
        self.pairs = getattr(schedule, "pairs", frozenset())
        self.overlap_pairs = True
        self.pair_handovers = 0  # turns handed over inside pairs, over all steps (a test and a bench read it)

    # -- one step -----------------------------------------------------------------------------------------

    def step(
        self,
        micro_batches: Sequence[torch.Tensor] | torch.Tensor | None,
        targets: Sequence[torch.Tensor] | torch.Tensor | None,
    ) -> StepResult:
        """Run forward and backward of all ``m`` micro-batches.

        ``micro_batches[j]``: token ids ``[b, s]`` (int64), needed on the rank holding model chunk 0;
        ``targets[j]``: whatever ``loss_fn`` takes, needed on the rank holding the last chunk. Other ranks
        may pass None. Returns the mean loss over micro-batches on every pipeline rank.
        """
        for name, given, needed in (
            ("micro_batches", micro_batches, self.rank == 0),
            ("targets", targets, self.rank == self.loss_rank),
        ):
            if needed and (given is None or len(given) != self.micro_batches):
                count = "None" if given is None else len(given)
                raise ValueError(f"{name} has {count} micro-batches; the schedule runs {self.micro_batches}")
        state = _StepState()
        timing = self.timing
        if timing:
            dist.barrier(group=self.groups.pp_group)  # a shared time origin, so records line up across ranks
        clock = _CudaClock() if timing and self.device.type == "cuda" else _HostClock()
        marks: dict[Action, tuple] = {}
        observer = self.observer
        batches = comm_batches(self.actions)
        pairs = self.pairs if self.overlap_pairs else frozenset()
        skip_to = 0
        for i, batch in enumerate(batches):
            if i < skip_to:
                continue
            if batch[0].kind.is_compute and pairs:
                j = next((k for k in range(i + 1, len(batches)) if batches[k][0].kind.is_compute), None)
                if j is not None and (batch[0], batches[j][0]) in pairs:
                    self._run_pair(batch[0], batches[i + 1 : j], batches[j][0], state, micro_batches, targets, clock,
                                   marks)  # fmt: skip
                    skip_to = j + 1
                    continue
            if batch[0].kind.is_compute:
                self._wait_for_input(batch[0], state, clock)
                observer.begin(str(batch[0]))
                start = clock.mark() if timing else None
                with profiler_range(str(batch[0])):  # a trace names each action (0F1, 1B0, ...)
                    self._compute(batch[0], state, micro_batches, targets)
                if timing:
                    marks[batch[0]] = (start, clock.mark())
                observer.end()
            else:
                with profiler_range(" ".join(map(str, batch))):
                    self._post(batch, state, clock)
        if state.batches:
            observer.begin(f"wait {' '.join(map(str, state.batches[-1].actions))}", waiting=True)
            self._wait_through(state.batches[-1], state, clock)
            observer.end()
        observer.begin("loss broadcast", waiting=True)
        with profiler_range("broadcast:loss"):
            loss = self._broadcast_loss(state)
        observer.end()
        records: tuple[TimedAction, ...] = ()
        if timing:
            for posted in state.batches:
                marks |= dict.fromkeys(posted.actions, (posted.posted_at, posted.done_at))
            records = tuple(
                TimedAction(a, clock.seconds(marks[a][0]), clock.seconds(marks[a][1])) for a in self.actions
            )
        return StepResult(loss, records, state.peak)

    def _wait_for_input(self, action: Action, state: _StepState, clock) -> None:
        """Wait through the batch holding the receive ``action`` consumes (none: nothing to wait for)."""
        recv = input_recv(action, self.pp, self.last_stage, self.placement)
        if recv is not None:
            self.observer.begin(f"wait {recv}", waiting=True)
            with profiler_range(f"wait {recv}"):
                self._wait_through(state.batch_of[recv], state, clock)
            self.observer.end()

    def _run_pair(self, forward, between, backward, state, micro_batches, targets, clock, marks) -> None:
        """A DualPipeV pair at once (``modelpar.parallel.handoff``): the forward on a helper thread, the
        backward here, each running while the other's collectives are in flight. Both inputs are waited for
        first (the schedule receives the backward's before the forward); the transfers listed between the two
        are posted when the forward ends."""
        for action in (forward, backward):
            self._wait_for_input(action, state, clock)

        def side(action, after=()):
            def run():
                start = clock.mark() if self.timing else None
                with profiler_range(str(action)):
                    self._compute(action, state, micro_batches, targets)
                if self.timing:
                    marks[action] = (start, clock.mark())
                for comm in after:
                    with profiler_range(" ".join(map(str, comm))):
                        self._post(comm, state, clock)

            return run

        self.observer.begin(f"{forward} with {backward}")
        pair = Pair(on_turn=lambda s: setattr(self, "current", (forward, backward)[s]))
        pair.run(side(forward, between), side(backward))
        self.pair_handovers += pair.handovers
        self.observer.end()

    def _compute(
        self,
        action: Action,
        state: _StepState,
        micro_batches: Sequence[torch.Tensor] | torch.Tensor | None,
        targets: Sequence[torch.Tensor] | torch.Tensor | None,
    ) -> None:
        key = (action.micro_batch, action.chunk)
        stage = action.stage(self.pp, self.placement)
        self.current = action
        if action.kind is F:
            if stage == 0:
                x = micro_batches[action.micro_batch].to(self.device)
            elif action in state.handed:
                x = state.handed.pop(action).requires_grad_(True)
            else:
                x = state.received.pop(Action(self.rank, RECV_F, *key)).requires_grad_(True)
            if self.forward_only:
                with torch.no_grad():
                    y = self.chunks[action.chunk](x)
            else:
                y = self.chunks[action.chunk](x)
            if stage == self.last_stage:
                target = targets[action.micro_batch].to(self.device)
                y = self.loss_fn(y, target) / self.loss_divisor
                state.loss_sum = y.detach() if state.loss_sum is None else state.loss_sum + y.detach()
            else:
                # under autocast a chunk may return bf16; the receiver's buffer is ``self.dtype``
                self._pass_on(action, F, y.detach().to(self.dtype).contiguous(), state)
            if not self.forward_only:
                state.hold(key, x, y)
        elif action.kind is B:
            self._backward(action, state)
        else:
            self._weight_backward(action, state)

    def _pass_on(self, action: Action, kind, tensor: torch.Tensor, state: _StepState) -> None:
        """Hand ``tensor`` (this action's output, or input gradient) to the action consuming it: a SEND, or,
        when that action runs on this rank (the V turnaround), directly."""
        stage = action.stage(self.pp, self.placement) + (1 if kind is F else -1)
        rank, chunk = self.placement.locate(stage, self.pp)
        if rank == self.rank:
            state.handed[Action(rank, kind, action.micro_batch, chunk)] = tensor
        else:
            state.to_send[Action(self.rank, SEND_F if kind is F else SEND_B, action.micro_batch, action.chunk)] = tensor

    def _output_grad(self, action: Action, state: _StepState) -> torch.Tensor | None:
        """Gradient of the loss w.r.t. this chunk's output: received or handed over, or None for the loss."""
        if action.stage(self.pp, self.placement) == self.last_stage:
            return None
        if action in state.handed:
            return state.handed.pop(action)
        return state.received.pop(Action(self.rank, RECV_B, action.micro_batch, action.chunk))

    def _backward(self, action: Action, state: _StepState) -> None:
        key = (action.micro_batch, action.chunk)
        x, y = state.inputs[key], state.outputs[key]
        grad = self._output_grad(action, state)
        has_input_grad = action.stage(self.pp, self.placement) > 0
        if self.split_backward:
            if has_input_grad:
                grad = grad if grad is None else grad.to(y.dtype)  # p2p runs in the compute dtype
                dx, state.pending_weight[key] = backward_input(y, grad, x)  # W fills the graph's leaves
                self._pass_on(action, B, dx.to(self.dtype).contiguous(), state)
            else:
                state.output_grads[key] = grad
            return
        if self.before_backward is not None:
            self.before_backward(action.chunk, action.micro_batch)
        torch.autograd.backward(y, grad if grad is None else grad.to(y.dtype))
        if has_input_grad:
            self._pass_on(action, B, x.grad.to(self.dtype).contiguous(), state)
        state.release(key)

    def _weight_backward(self, action: Action, state: _StepState) -> None:
        key = (action.micro_batch, action.chunk)
        if self.before_weight_backward is not None:
            self.before_weight_backward(action.chunk, action.micro_batch)
        if key in state.pending_weight:
            backward_weight(state.pending_weight[key])
        elif state.outputs[key].requires_grad:  # model chunk 0: token input, the whole backward is W
            torch.autograd.backward(state.outputs[key], state.output_grads[key])
        state.release(key)
        if self.after_weight_backward is not None:
            self.after_weight_backward(action.chunk, action.micro_batch)

    def _post(self, batch: list[Action], state: _StepState, clock) -> None:
        """Post the batch as one ``batch_isend_irecv`` (one NCCL group), without waiting."""
        ops, tensors = [], []
        for action in batch:
            peer = self.groups.pp_ranks[peer_of(action, self.pp, self.placement)[0]]
            if action.kind.is_send:
                tensor = state.to_send.pop(action)
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.groups.pp_group))
            else:
                tensor = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.groups.pp_group))
                state.received[action] = tensor
            tensors.append(tensor)
        works = dist.batch_isend_irecv(ops)
        posted = _PostedBatch(len(state.batches), batch, works, tensors, clock.mark() if self.timing else None)
        state.batches.append(posted)
        state.batch_of |= dict.fromkeys(batch, posted)

    def _wait_through(self, last: _PostedBatch, state: _StepState, clock) -> None:
        """Wait, in posting order, for every batch up to ``last``; name the stuck actions if the backend gives up."""
        while state.waited <= last.index:
            posted = state.batches[state.waited]
            try:
                for work in posted.works:
                    work.wait()
            except RuntimeError as exc:
                names = " ".join(map(str, posted.actions))
                raise RuntimeError(f"pipeline rank {self.rank} stuck in {names}: {exc}") from exc
            posted.done_at = clock.mark() if self.timing else None
            posted.tensors.clear()  # sent payloads may go now; received ones live on in state.received
            state.waited += 1

    def _broadcast_loss(self, state: _StepState) -> torch.Tensor:
        """The step's loss on every pipeline rank, left on the device (no host sync)."""
        holder = self.loss_rank
        loss = state.loss_sum if self.rank == holder else torch.zeros((), dtype=torch.float32, device=self.device)
        loss = loss.detach().to(torch.float32).reshape(())
        if self.pp > 1:
            dist.broadcast(loss, src=self.groups.pp_ranks[holder], group=self.groups.pp_group)
        return loss


def measured_timeline(results: Sequence[StepResult]) -> Timeline:
    """Gather the ranks' records (in pipeline-rank order) into one ``Timeline``, comparable to a simulated one."""
    return Timeline(tuple(r.records for r in results))

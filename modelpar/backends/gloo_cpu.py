"""What gloo on a CPU machine needs and the engine must not see: exchange collectives, core binding and
socket-thread priority. ``modelpar.backends.install`` sets it up on gloo ranks; NCCL ranks never install it.

Exchange collectives (``parallel.collectives``)
-----------------------------------------------
See the comment above ``ExchangeCollectives``.

Core binding (``trainer.cpu_affinity=auto``)
--------------------------------------------

Local rank ``r`` with ``t`` threads gets block ``r mod (cores // t)`` of ``t`` consecutive cores, out of the
cores this job may use (its affinity mask at start). With no more ranks than blocks every rank owns its
cores; with more, ranks share blocks round-robin, so consecutive ranks (the tensor-parallel partners, tp
being the innermost dimension of a layout) always sit on different cores and can run a collective at once
instead of waiting for the scheduler to swap one of them in. On the 2-core machine, tp2 x pp2 (4 ranks)
ran 5-27% faster pinned than unpinned in six pairs of runs, median 12% (``benchmarks/results/bench_affinity.md``
holds three); with one rank per core (tp2, pp2) the difference was within run-to-run noise.

GPU ranks are not pinned (their host threads mostly wait on the device).

Socket threads (``trainer.gloo_threads``)
-----------------------------------------
``trainer.gloo_threads=idle`` (opt-in; the default is ``normal``) moves gloo's socket threads (``gloo_tcp_loop``,
one per process group) to the idle scheduling class. Such a thread runs an epoll loop over level-triggered sockets and
only *tries* the connection's lock; while the rank's compute thread holds that lock (it posts every send and
receive, and writes a message itself when the peer is already waiting for it), every wake-up of the socket
thread finds the lock taken and goes straight back to epoll, so it spins on the very core the lock holder
needs. On the 2-core machine that was 4-6 million ``epoll_wait`` calls in a 13 s tp2 run and a posting time of
0.2-0.5 s per step (289 collectives) instead of 0.06 s. At idle priority the socket thread yields the core to
the compute thread whenever both want it and still runs the moment the compute thread blocks; it keeps a small
share of the core (the idle class is weighted, not starved), so progress never stops.
Alternating steps in the same workers (``benchmarks/transport_threads.py``, two runs): tp2 1.34-1.47x and
tp2 x pp2 1.09-1.10x faster, pp2 and dp2 unchanged within noise (their transfers are few and large); the socket
threads' CPU time per tp2 step fell from 271-378 ms to 45 ms. But the idle class yields to every process, not
only to its own compute thread: beside two busy processes (another job, the other test worker) the idled tp2
step ran at 0.07x and tp2 x pp2 at 0.10x of normal (``--load 2``), so it is an opt-in for a machine the job has
to itself.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modelpar.parallel.collectives import group_size, install_algorithm, installed_algorithm
from modelpar.parallel.groups import observe_group_creation

AFFINITY_MODES = ("auto", "off")
GLOO_THREAD_MODES = ("idle", "normal")
GLOO_SOCKET_THREAD = "gloo_tcp_loop"  # the name gloo gives each process group's socket (epoll) thread

_JOB_CORES: list[int] | None = None  # this process's mask when first asked: what the job may use


def job_cores() -> list[int]:
    """The cores this process could use before any pinning (its affinity mask at the first call)."""
    global _JOB_CORES
    if _JOB_CORES is None:
        _JOB_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return list(_JOB_CORES)


def core_block(local_rank: int, threads: int, cores: Sequence[int]) -> list[int]:
    """The cores of local rank ``local_rank`` running ``threads`` threads, out of ``cores``."""
    cores = sorted(cores)
    if local_rank < 0 or threads < 1:
        raise ValueError(f"local_rank={local_rank} must be >= 0 and threads={threads} >= 1")
    if len(cores) <= threads:
        return cores
    block = local_rank % (len(cores) // threads)
    return cores[block * threads : (block + 1) * threads]


def pin_cpu_rank(local_rank: int, threads: int) -> list[int]:
    """Bind this process to its block of cores (see the module docstring); returns them ([] where the OS
    offers no affinity control)."""
    cores = job_cores()
    if not cores:
        return []
    mine = core_block(local_rank, threads, cores)
    os.sched_setaffinity(0, mine)
    return mine


@contextlib.contextmanager
def pinned(local_rank: int, threads: int, enabled: bool = True) -> Iterator[list[int]]:
    """``pin_cpu_rank`` for the block's duration, then the job's whole mask again (for reused workers)."""
    if not enabled or not job_cores():
        yield []
        return
    try:
        yield pin_cpu_rank(local_rank, threads)
    finally:
        os.sched_setaffinity(0, job_cores())


def gloo_socket_threads() -> list[int]:
    """Thread ids of this process's gloo socket threads ([] where /proc is not available)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_SOCKET_THREAD:
                    out.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(out)


# process group -> the socket thread ids its creation brought along (weak: a released group must be freed,
# or its socket thread lives on)
_threads_of_group: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _record_socket_threads(kind: str, ranks: Sequence[int], create: Callable[[], dist.ProcessGroup]):
    """Group-creation observer (``observe_group_creation``): each gloo group brings its own socket thread."""
    before = set(gloo_socket_threads())
    group = create()
    if isinstance(group, dist.ProcessGroup):  # not a group this rank is outside of (torch's marker is an int)
        _threads_of_group[group] = tuple(sorted(set(gloo_socket_threads()) - before))
    return group


def watch_socket_threads() -> None:
    """Note the socket threads of every ``ParallelGroups`` group this process creates from now on."""
    observe_group_creation(_record_socket_threads)


def socket_threads(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The socket threads ``group`` brought along (empty if it was created before ``watch_socket_threads``)."""
    return _threads_of_group.get(group, ()) if isinstance(group, dist.ProcessGroup) else ()


def set_gloo_threads(mode: str, threads: Iterable[int] | None = None) -> list[int]:
    """Put gloo socket threads in the idle scheduling class (``idle``) or back to the normal one (``normal``):
    ``threads`` (ids, e.g. ``socket_threads(groups.tp_group)``), or else every one of this process.
    Returns the threads changed. Threads of process groups created later start normal. Going back to normal
    needs root or CAP_SYS_NICE (an unprivileged process may lower a thread's class but not raise it again);
    without them such threads stay idle (``priority_restorable`` tells which case this is)."""
    if mode not in GLOO_THREAD_MODES:
        raise ValueError(f"gloo thread mode {mode!r} is not one of {GLOO_THREAD_MODES}")
    if not hasattr(os, "sched_setscheduler"):
        return []
    policy = os.SCHED_IDLE if mode == "idle" else os.SCHED_OTHER
    changed = []
    for tid in gloo_socket_threads() if threads is None else threads:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except (ProcessLookupError, PermissionError):
            continue
        changed.append(tid)
    return changed


_RESTORABLE: bool | None = None


def priority_restorable() -> bool:
    """Whether this process may move a thread from the idle class back to normal (tried once on a helper
    thread that only waits; cached)."""
    global _RESTORABLE
    if _RESTORABLE is None:
        if not hasattr(os, "sched_setscheduler"):
            _RESTORABLE = False
            return _RESTORABLE
        release = threading.Event()
        helper = threading.Thread(target=release.wait, name="modelpar-priority-probe", daemon=True)
        helper.start()
        try:
            os.sched_setscheduler(helper.native_id, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(helper.native_id, os.SCHED_OTHER, os.sched_param(0))
            _RESTORABLE = True
        except OSError:
            _RESTORABLE = False
        finally:
            release.set()
            helper.join()
    return _RESTORABLE


# -- exchange collectives ------------------------------------------------------------------------------------
#
# gloo runs a collective through its worker threads and a ring of 2(t-1) steps; on loopback each step is a
# thread hand-off, so a small all-reduce is latency-bound (about 1-2 ms for 4 KiB over 2 ranks on a 2-core
# machine), while a pair of point-to-point messages costs a few hundred microseconds. For small power-of-two
# groups on gloo the collectives below therefore run as recursive doubling over torch.distributed's own
# isend/irecv (log2 t rounds, each an exchange with rank ^ 2^k), the latency-optimal textbook algorithm:
#
#   all-reduce       round k: swap the whole partial sum with rank ^ 2^k, add        (t=4: 2 rounds, 2 n sent)
#                    (t=2 above HALVES_MIN_BYTES: swap halves, add one, swap the sums back: n/2 added, not n)
#   all-gather       round k: swap the 2^k blocks gathered so far with rank ^ 2^k    (t-1 blocks sent)
#   reduce-scatter   recursive halving: send the half the partner keeps, add the half received
#
# Every rank adds the same two operands in the same order up to commutativity (a + b == b + a bit for bit), so
# all ranks end with identical results; the summation order may differ from gloo's ring by an ulp. NCCL (GPU)
# keeps its native collectives: this module is never installed there. ``set_collective_algorithm`` picks the
# policy (recipe: parallel.collectives).

COLLECTIVE_ALGORITHMS = ("auto", "native", "exchange")
EXCHANGE_MAX_BYTES = 1 << 20  # auto: above this (and more than 2 ranks), gloo's bandwidth-optimal ring wins
HALVES_MIN_BYTES = 1 << 20  # two ranks: above this an all-reduce exchanges halves (``_ExchangeAllReduce``)
_EXCHANGE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


class ExchangeCollectives:
    """A ``CollectiveAlgorithm`` (``modelpar.parallel.collectives``) running small power-of-two gloo groups as
    recursive doubling; ``policy`` is ``auto`` (exchange up to ``EXCHANGE_MAX_BYTES``, any size on 2 ranks) or
    ``exchange`` (always, on power-of-two groups)."""

    def __init__(self, policy: str = "auto"):
        if policy not in ("auto", "exchange"):
            raise ValueError(f"exchange policy {policy!r} is not auto or exchange")
        self.policy = policy
        self._gloo: dict = {}  # process group -> whether it runs on gloo

    def uses_exchange(self, group: dist.ProcessGroup | None, nbytes: int, op=dist.ReduceOp.SUM) -> bool:
        if not any(op == known for known in _EXCHANGE_OPS):
            return False
        size = group_size(group)
        gloo = self._gloo.get(group)
        if gloo is None:
            gloo = self._gloo[group] = dist.get_backend(group) == "gloo"
        if size < 2 or size & (size - 1):
            return False
        if self.policy == "exchange":
            return True
        return gloo and (size == 2 or nbytes <= EXCHANGE_MAX_BYTES)

    def all_reduce_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op):
        if tensor.is_contiguous() and self.uses_exchange(group, tensor.numel() * tensor.element_size(), op):
            return _ExchangeAllReduce(tensor, group, op)
        return None

    def all_gather_into(self, out: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
        if not self.uses_exchange(group, out.numel() * out.element_size()):
            return False
        _exchange_all_gather(out, part, group)
        return True

    def reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
        if not self.uses_exchange(group, full.numel() * full.element_size()):
            return False
        _exchange_reduce_scatter(out, full, group)
        return True


def set_collective_algorithm(name: str) -> None:
    """``auto``: exchange for small power-of-two gloo groups (any size for 2 ranks), native otherwise;
    ``native``: always the backend's own collectives; ``exchange``: always exchange on power-of-two groups."""
    if name not in COLLECTIVE_ALGORITHMS:
        raise ValueError(f"collective algorithm {name!r} is not one of {COLLECTIVE_ALGORITHMS}")
    install_algorithm(None if name == "native" else ExchangeCollectives(name))


def collective_algorithm() -> str:
    """The policy in force in this process (``native`` when no exchange algorithm is installed)."""
    installed = installed_algorithm()
    return installed.policy if isinstance(installed, ExchangeCollectives) else "native"


def uses_exchange(group: dist.ProcessGroup | None, nbytes: int, op=dist.ReduceOp.SUM) -> bool:
    """Whether a collective of ``nbytes`` over ``group`` runs as an exchange under the installed policy."""
    installed = installed_algorithm()
    return isinstance(installed, ExchangeCollectives) and installed.uses_exchange(group, nbytes, op)


def _combine(acc: torch.Tensor, other: torch.Tensor, op) -> None:
    if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:  # AVG: divided once the sum is complete
        acc.add_(other)
    elif op == dist.ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    else:
        torch.minimum(acc, other, out=acc)


def _swap(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None, peer: int) -> list:
    """Post the send of ``send`` to group rank ``peer`` and the receive of its message into ``recv``."""
    peer = dist.get_global_rank(group, peer) if group is not None else peer
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    return dist.batch_isend_irecv(ops)


class _ExchangeAllReduce:
    """Recursive-doubling all-reduce in flight; ``wait()`` finishes the remaining rounds (``dist.Work``-like).

    Two ranks and more than ``HALVES_MIN_BYTES``: each rank sends the half the other one keeps, adds the half it
    keeps, and the sums are swapped back (reduce-scatter then all-gather, as gloo's ring does for two): the same
    bytes on the wire as swapping the whole tensor, half the additions and half the receive buffer. Each half is
    summed by one rank only, so both ranks end with the same bits, and with the bits of the one-round swap
    (``a + b == b + a``). ``ReduceOp.AVG`` divides the sum by the group's size: under halves each rank divides
    only the half it summed, before the swap back."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op):
        self.tensor, self.group, self.op = tensor, group, op
        self.me, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.flat = tensor.view(-1)  # callers pass contiguous tensors only
        self.halves = self.size == 2 and self.flat.numel() * self.flat.element_size() > HALVES_MIN_BYTES
        if self.halves:
            first, second = self.flat.tensor_split(2)
            self.mine, self.theirs = (first, second) if self.me == 0 else (second, first)
            self.buf = torch.empty_like(self.mine)
            self.pending = _swap(self.theirs, self.buf, group, self.me ^ 1)
            return
        self.buf = torch.empty_like(self.flat)
        self.distance = 1
        self.pending = _swap(self.flat, self.buf, group, self.me ^ 1)

    def wait(self) -> bool:
        if self.halves:
            if self.pending:
                for work in self.pending:
                    work.wait()
                _combine(self.mine, self.buf, self.op)
                if self.op == dist.ReduceOp.AVG:
                    self.mine.div_(2)
                for work in _swap(self.mine, self.theirs, self.group, self.me ^ 1):
                    work.wait()
                self.pending = []
            return True
        while self.pending:
            for work in self.pending:
                work.wait()
            _combine(self.flat, self.buf, self.op)
            self.distance *= 2
            self.pending = (
                _swap(self.flat, self.buf, self.group, self.me ^ self.distance) if (self.distance < self.size) else []
            )
            if not self.pending and self.op == dist.ReduceOp.AVG:
                self.flat.div_(self.size)
        return True


def _exchange_all_gather(out: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """out [t*n, ...] <- every rank's ``part`` [n, ...] in rank order, by recursive doubling."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    blocks = out.view(size, *part.shape)
    blocks[me].copy_(part)
    distance = 1
    while distance < size:
        mine, theirs = me & ~(distance - 1), (me ^ distance) & ~(distance - 1)
        for work in _swap(blocks[mine : mine + distance], blocks[theirs : theirs + distance], group, me ^ distance):
            work.wait()
        distance *= 2


def _exchange_reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """out [n, ...] <- block ``rank`` of the sum over ranks of ``full`` [t*n, ...], by recursive halving."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    acc = full.reshape(size, *out.shape).clone()
    lo, span = 0, size
    while span > 1:
        half = span // 2
        keep = lo + (half if me & half else 0)
        give = lo + (0 if me & half else half)
        buf = torch.empty_like(acc[keep : keep + half])
        for work in _swap(acc[give : give + half], buf, group, me ^ half):
            work.wait()
        acc[keep : keep + half].add_(buf)
        lo, span = keep, half
    out.copy_(acc[me])


# -- set-up of a rank ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSetup:
    """What a CPU rank process does first, before torch starts its threads (``launch(..., rank_setup=...)``):
    bind to its cores when ``pin`` and watch its gloo groups' socket threads. Picklable, for spawned ranks.

    ``start_method``: CPU ranks are forked from a server process that has imported torch and the engine once
    (``forkserver``), not each started as a fresh interpreter that imports them again: on a laptop the imports
    are most of a small job's CPU time (eight ranks, eight imports of several seconds each). The server runs no
    torch op, so each rank still starts its own thread pools after its core binding. ``MODELPAR_RANK_START=spawn``
    starts each rank as a fresh interpreter instead."""

    threads: int = 1
    pin: bool = False
    start_method: str = field(default_factory=lambda: os.environ.get("MODELPAR_RANK_START", "forkserver"))

    def __post_init__(self) -> None:
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(f"MODELPAR_RANK_START={self.start_method!r} must be forkserver or spawn")

    def __call__(self, local_rank: int) -> None:
        if self.pin:
            pin_cpu_rank(local_rank, self.threads)
        watch_socket_threads()


@dataclass
class GlooTuning:
    """The tuning ``install`` applied to this rank; ``close()`` puts the socket threads back."""

    idle_threads: tuple[int, ...] = ()

    def close(self) -> None:
        set_gloo_threads("normal", self.idle_threads)


def install(collectives: str, gloo_threads: str, tp_group: dist.ProcessGroup | None, tp: int) -> GlooTuning:
    """Tune this gloo rank: the collective policy (``parallel.collectives``), and with ``gloo_threads=idle`` and
    tp > 1 the tensor-parallel group's socket thread at idle priority. Its collectives are posted and waited
    for by the compute thread, so they need no background progress; the pipeline's p2p does, so its group
    stays normal."""
    set_collective_algorithm(collectives)
    idle = socket_threads(tp_group) if gloo_threads == "idle" and tp > 1 else ()
    set_gloo_threads("idle", idle)
    return GlooTuning(tuple(idle))

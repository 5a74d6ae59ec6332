"""One rank of a real-size job on this machine: the meta device under torch's fake process group.

``fake_world(rank, world_size)`` initialises torch.distributed with the ``fake`` backend for the CPU and the
meta device: every collective completes at once, with no peers and no data. ``MetaStep`` is a
``TorchDispatchMode`` that sees every aten and c10d op the rank runs, and does two things:

- **Counts collective bytes per process group and kind**, at the c10d ops themselves (``c10d.allreduce_``,
  ``_allgather_base_``, ``_reduce_scatter_base_``, ``alltoall_base_``, ``send``, ``recv_``, ``broadcast_``...),
  so FSDP2's gathers and reduce-scatters, the pipeline's p2p and the engine's own collectives are all seen,
  whoever issued them. ``bytes`` is the tensor's (all-gather: the gathered output; reduce-scatter: the
  input; all-to-all and send: what this rank sends); ``wire`` what a ring moves out of this rank
  (all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n``, all-to-all ``(n-1)/n``, p2p all).
- **Answers host read-backs** (``.item()``, ``.tolist()``, ``bool()``) of meta tensors, which hold no data.
  Small tensors (at most ``SHADOW_MAX`` elements) whose inputs are known get a CPU *shadow*: the same op run
  on the CPU copies (factories, index arithmetic, flags, counts, fingerprints). Collectives give their outputs
  the shadow of a **symmetric world** (every peer holds what this rank holds: an all-gather repeats the input,
  an all-reduce multiplies it by the group size, an all-to-all returns it). ``torch.bincount`` (a mixture of
  experts' routed rows per expert) assumes **perfectly balanced routing**, as the planner does: each of the
  ``E`` experts gets ``rows / E`` rows (the remainder to the first ones). A read-back of a tensor with no
  shadow (the loss, the gradient norm: values of the model's data) answers 1 and is counted in ``blind_reads``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from modelpar.parallel.groups import ParallelGroups

SHADOW_MAX = 1 << 21  # elements: index rows of a vocabulary-sized tensor, never an activation

aten, c10d = torch.ops.aten, torch.ops.c10d

# c10d op -> (kind, index of the tensor whose bytes count, index of the process group)
_COLLECTIVES = {
    c10d.allreduce_.default: ("all_reduce", 0, 1),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0, 1),
    c10d._allgather_base_.default: ("all_gather", 0, 2),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0, 2),
    c10d.allgather_.default: ("all_gather", 0, 2),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1, 2),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1, 2),
    c10d.reduce_scatter_.default: ("reduce_scatter", 1, 2),
    c10d.alltoall_base_.default: ("all_to_all", 1, 2),
    c10d.broadcast_.default: ("broadcast", 0, 1),
    c10d.send.default: ("send", 0, 1),
    c10d.recv_.default: ("recv", 0, 1),
}


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch.distributed as rank ``rank`` of ``world_size`` on the fake backend (CPU and meta tensors)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; a dry run needs a fresh process")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    # a per-device backend string leaves the group's default backend undefined: tearing the group
    # down would print "No backend of type 0 found" (c10d asks the default backend for hooks); the fake one is it
    dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    try:
        yield
    finally:
        from modelpar.parallel.world import destroy_distributed

        destroy_distributed()


class _MetaDeviceHandle:
    """What FSDP2 asks of a device's module (``torch.cuda``, ``torch.cpu``) when its mesh is on the meta
    device: index 0, and the CPU's no-op streams and events (meta ops complete at once, as the CPU's do)."""

    Stream, Event = torch.cpu.Stream, torch.cpu.Event
    stream, current_stream = staticmethod(torch.cpu.stream), staticmethod(torch.cpu.current_stream)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def set_device(_device) -> None:
        return None

    @staticmethod
    def synchronize(_device=None) -> None:
        return None


@contextlib.contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """FSDP2 (ZeRO-2/3) on meta parameters, for the dry run only. FSDP2 finds a mesh's device module as
    ``getattr(torch, device_type)`` (``torch.meta`` does not exist), and its lazy init refuses parameters still
    on meta; here both are what we want: ``torch.meta`` is the handle above while the dry run steps, and the
    meta check is off. Its gathers, reduce-scatters and buffers are then meta tensors like every other."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if hasattr(torch, "meta"):
        raise RuntimeError("torch.meta already exists: this torch knows a meta device module of its own")
    check = FSDPParamGroup._validate_no_meta_params
    torch.meta = _MetaDeviceHandle
    FSDPParamGroup._validate_no_meta_params = lambda self: None
    try:
        yield
    finally:
        FSDPParamGroup._validate_no_meta_params = check
        del torch.meta


def group_names(groups: ParallelGroups) -> dict[str, str]:
    """c10d group name -> the layout's name for it (the first role a group plays: dp before dp_cp...)."""
    names: dict[str, str] = {}
    roles = [
        ("tp", groups.tp_group),
        ("pp", groups.pp_group),
        ("cp", groups.cp_group),
        ("dp", groups.dp_group),
        ("dp_cp", groups.dp_cp_group),
        ("ep", groups.ep_group),
        ("expert_dp", groups.expert_dp_group),
        ("embedding", groups.embedding_group),
        ("world", dist.group.WORLD),
        ("stage", groups.stage_group()),  # tp x dp x cp (Muon's exchange); the world when pp=1
    ]
    for role, group in roles:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            names.setdefault(group.group_name, role)
    return names


def _tensor_bytes(t) -> int:
    if isinstance(t, list | tuple):
        return sum(_tensor_bytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class MetaStep(TorchDispatchMode):
    """Collective bytes per (group, kind) and shadow values for read-backs (module docstring)."""

    def __init__(self, names: dict[str, str] | None = None):
        super().__init__()
        self.names = names or {}
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.blind_reads = 0
        self.shadows = WeakTensorKeyDictionary()
        self.recording = True

    def reset_counts(self) -> None:
        self.bytes.clear()
        self.wire.clear()
        self.calls.clear()

    # -- dispatch --------------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return self._read_back(args[0])
        if func is aten._to_copy.default and _meta_to_host(args[0], kwargs):
            return self._copy_to_host(args[0], kwargs)
        if func is aten.bincount.default and args[0].device.type == "meta":
            return self._balanced_counts(*args, **kwargs)
        if func is aten._grouped_mm.default and args[0].device.type == "meta" and args[0].dtype != torch.bfloat16:
            # its meta kernel checks CUDA's bf16-only rule; the CPU runs it in fp32: the same shape either way
            low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            return func(*low, **kwargs).to(args[0].dtype)
        if func in _COLLECTIVES:
            out = func(*args, **kwargs)
            self._collective(func, args)
            return out
        out = func(*args, **kwargs)
        self._shadow(func, args, kwargs, out)
        return out

    def _read_back(self, t: torch.Tensor):
        if t.device.type != "meta":
            return t.item()
        shadow = self.shadows.get(t)
        if shadow is not None:
            return shadow.reshape(()).item()
        self.blind_reads += 1
        return True if t.dtype == torch.bool else (1 if not t.is_floating_point() else 1.0)

    def _copy_to_host(self, t: torch.Tensor, kwargs) -> torch.Tensor:
        shadow = self.shadows.get(t)
        if shadow is None:
            self.blind_reads += 1
            shadow = torch.ones(t.shape, dtype=t.dtype)
        return shadow.to(dtype=kwargs.get("dtype") or t.dtype).clone()

    def _balanced_counts(self, x: torch.Tensor, weights=None, minlength: int = 0) -> torch.Tensor:
        if weights is not None or minlength <= 0:
            raise RuntimeError("a dry run counts bincount(rows, minlength=E) only (balanced routing)")
        rows = x.numel()
        counts = torch.full((minlength,), rows // minlength, dtype=torch.int64)
        counts[: rows % minlength] += 1
        out = torch.empty(minlength, dtype=torch.int64, device="meta")
        self.shadows[out] = counts
        return out

    def _collective(self, func, args) -> None:
        kind, which, at = _COLLECTIVES[func]
        group = args[at]
        if isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        size = group.size()
        name = self.names.get(getattr(group, "group_name", ""), f"group of {size}")
        nbytes = _tensor_bytes(args[which])
        if self.recording:
            key = (name, kind)
            self.bytes[key] += nbytes
            self.calls[key] += 1
            share = {"all_reduce": 2 * (size - 1) / size}.get(kind, (size - 1) / size)
            self.wire[key] += nbytes * (1.0 if kind in ("send", "broadcast") else share) if kind != "recv" else 0.0
        self._symmetric_shadow(kind, args, size)

    def _symmetric_shadow(self, kind: str, args, size: int) -> None:
        """Outputs of a collective in a world where every peer holds what this rank holds."""
        if kind == "all_reduce":
            for t in _flat(args[0]):
                s = self.shadows.get(t)
                if s is not None:
                    s.mul_(size)
        elif kind == "all_gather" and isinstance(args[0], torch.Tensor):
            s = self.shadows.get(args[1])
            if s is not None and args[0].numel() == s.numel() * size:
                self.shadows[args[0]] = torch.cat([s.reshape(-1)] * size).reshape(args[0].shape)
        elif kind == "all_to_all":
            s = self.shadows.get(args[1])
            if s is not None and args[0].shape == args[1].shape:
                self.shadows[args[0]] = s.clone()

    def _shadow(self, func, args, kwargs, out) -> None:
        """Run ``func`` on the CPU shadows of its inputs when all are known and the output is small."""
        outs = [t for t in _flat(out) if isinstance(t, torch.Tensor)]
        if not outs or any(t.device.type != "meta" or t.numel() > SHADOW_MAX for t in outs):
            return
        if func in (aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default):
            return
        for a in _flat(args):
            if isinstance(a, torch.Tensor) and a.device.type == "meta" and a not in self.shadows:
                return
        missing = False

        def to_cpu(a):
            nonlocal missing
            if isinstance(a, torch.Tensor):
                if a.device.type != "meta":
                    return a
                s = self.shadows.get(a)
                if s is None:
                    missing = True
                return s
            if isinstance(a, torch.device) and a.type == "meta":
                return torch.device("cpu")
            return a

        cpu_args = tree_map(to_cpu, args)
        cpu_kwargs = tree_map(to_cpu, kwargs)
        if missing:
            return
        if cpu_kwargs.get("device") is None and "device" in kwargs:
            cpu_kwargs["device"] = torch.device("cpu")
        try:
            with _no_mode():
                result = func(*cpu_args, **cpu_kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError):
            return
        for t, s in zip(outs, [r for r in _flat(result) if isinstance(r, torch.Tensor)], strict=False):
            if s.shape == t.shape:
                self.shadows[t] = s


def _meta_to_host(t, kwargs) -> bool:
    device = kwargs.get("device")
    return isinstance(t, torch.Tensor) and t.device.type == "meta" and device is not None and device.type != "meta"


class HostData(TorchFunctionMode):
    """Host data in a dry run. ``torch.tensor(data, device=meta)`` never reaches the dispatcher: it is built on
    the CPU, then given to the meta device with its CPU copy as shadow. A host factory (``randn``, ``ones``...)
    of more than ``SHADOW_MAX`` elements makes a meta tensor instead: the layout-invariant initial weights,
    drawn whole on the host and sliced, which a dry run never reads."""

    def __init__(self, step: MetaStep):
        super().__init__()
        self.step = step

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device).type == "meta":
            host = func(*args, **{**kwargs, "device": "cpu"})
            out = torch.empty_like(host, device="meta")
            self.step.shadows[out] = host
            return out
        if func in _HOST_FACTORIES and device is None and _numel(args, kwargs) > SHADOW_MAX:
            kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
            return func(*args, **kwargs, device="meta")
        return func(*args, **kwargs)


class CpuAttention:
    """``F.scaled_dot_product_attention`` of meta tensors as the CPU runs it: torch picks its kernel by device,
    and on meta it falls back to the math path, which keeps the ``s x s`` probabilities for backward; the CPU
    (and GPU) pick a flash kernel, which keeps the output and the log-sum-exp. Called here by name. Values of
    another head dim than q/k (latent attention's 128 beside 192), which the CPU flash kernel refuses, take the
    math path on the CPU too (the planner's "plain matmuls"), so they are left to it.

    The function itself is replaced while the block runs (and restored after), not intercepted by a torch
    function mode: autograd reruns a checkpointed half on the meta device's own thread, where a mode of the
    calling thread is not active, and selective recompute would then see the math path's ops in the rerun."""

    def __enter__(self):
        self._sdpa = F.scaled_dot_product_attention
        original = self._sdpa

        def sdpa(*args, **kwargs):
            if args[0].device.type == "meta" and args[2].shape[-1] == args[0].shape[-1]:
                q, k, v = args[:3]
                out, _ = aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                    attn_mask=kwargs.get("attn_mask"), scale=kwargs.get("scale"),
                )  # fmt: skip
                return out
            return original(*args, **kwargs)

        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._sdpa


_HOST_FACTORIES = (torch.randn, torch.rand, torch.ones, torch.zeros, torch.empty, torch.full)


def _numel(args, kwargs) -> int:
    shape = kwargs.get("size", args[0] if args else ())
    if isinstance(shape, int):
        shape = args if all(isinstance(a, int) for a in args) else (shape,)
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _flat(x):
    if isinstance(x, list | tuple):
        return [y for item in x for y in _flat(item)]
    return [x]


@contextlib.contextmanager
def _no_mode():
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield

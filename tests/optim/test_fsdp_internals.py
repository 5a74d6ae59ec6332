"""The private FSDP2 members that modelpar/optim/fsdp.py calls exist with the signatures it calls them by: a
torch that moves one fails here, not in the middle of a ZeRO-2/3 run."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from modelpar.testing import run_on_ranks


def _probe() -> dict:
    """What ``_end_weight_backward`` reaches for, on a real FSDP2 module of one rank."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    module = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=mesh)
    module(torch.randn(2, 4)).sum().backward()  # FSDP2 fills its state context at the first forward
    state = fully_shard.state(module)
    members = list(state._state_ctx.all_states)
    groups = [group for member in members for group in member._fsdp_param_groups]
    return {
        "states": len(members),
        "groups": len(groups),
        "post_backward": [str(inspect.signature(group.post_backward)) for group in groups],
        "final_callback": str(inspect.signature(state._root_post_backward_final_callback)),
        "switches": all(
            callable(getattr(module, n)) for n in ("set_requires_gradient_sync", "set_reshard_after_backward")
        ),
    }


def test_the_fsdp2_internals_the_engine_calls_are_where_it_calls_them():
    (found,) = run_on_ranks(1, _probe)
    assert found["states"] >= 1 and found["groups"] >= 1, found
    assert found["post_backward"] == ["(*unused: 'Any')"] * found["groups"], found  # called with no arguments
    assert found["final_callback"] == "() -> None", found
    assert found["switches"], found

"""Layout planner: predict memory and step time of every ``tp x cp x pp x dp`` strategy and rank those that fit.

An analytical model, not a simulator; it imports nothing of ``modelpar.training`` (it sits beside it). For one
strategy (layout, micro-batching, recompute and offload, ZeRO 0-3, SP) it predicts, on the busiest rank:

    spec         the inputs and outputs: ModelSpec, Hardware, CostModel, Strategy, MemoryBreakdown, Prediction
    presets      hardware presets (A100, H100, H200, this CPU machine) and the model shapes of recipes/model/
    chunks       which layers each pipeline chunk holds, and how many micro-batches a stage holds at once
    activations  what our block keeps for backward, tensor by tensor, under each recompute mode and offload
    states       the model states of ZeRO 0-3 (fp32 weights, gradients, moments, buckets, FSDP2's gathers)
    memory       the bytes of one rank of a stage (our block, or Megatron-LM's GPT block for published runs)
    step_time    compute, exposed communication of each dimension, bubble and offload: ``predict``
    search       every strategy that can run, ranked by tokens/s among those that fit: ``plan``
    explanation  why the chosen strategy runs its ZeRO stage, recompute and offload: ``explain``
    published    published training runs the time model is checked against

Memory of our block (``ModelSpec.block="llama"``, the default) is derived tensor by tensor from the code and
checked against what ``modelpar-bench`` measures (within 10%; exact on the CPU rows). The command line,
``modelpar-plan``, is ``modelpar.cli.plan``.
"""

from modelpar.plan.explanation import explain
from modelpar.plan.memory import peak_memory, stage_memory, stage_params
from modelpar.plan.presets import HARDWARE, load_hardware, load_model, model_presets
from modelpar.plan.search import SearchSpace, plan, valid_layouts
from modelpar.plan.spec import (
    GIB,
    SELECTIVE_CHOICES,
    CostModel,
    Hardware,
    MemoryBreakdown,
    ModelSpec,
    PlanError,
    PlannedLayout,
    Prediction,
    Strategy,
)
from modelpar.plan.step_time import predict

__all__ = [
    "GIB",
    "HARDWARE",
    "SELECTIVE_CHOICES",
    "CostModel",
    "Hardware",
    "MemoryBreakdown",
    "ModelSpec",
    "PlanError",
    "PlannedLayout",
    "Prediction",
    "SearchSpace",
    "Strategy",
    "explain",
    "load_hardware",
    "load_model",
    "model_presets",
    "peak_memory",
    "plan",
    "predict",
    "stage_memory",
    "stage_params",
    "valid_layouts",
]

"""gradtx: pure, composable gradient transformations for PyTorch, DTensors included."""

import torch

from gradtx import checkpoint, comm, testing
from gradtx.accumulation import AccumulateState, Accumulation, Window, accumulate
from gradtx.base import (
    EmptyState,
    GradientTransformation,
    Guard,
    ScalarTransformation,
    export_metrics,
    identity,
    metrics,
    scalar_transformation,
)
from gradtx.clipping import ClipByGlobalNormState, adaptive_clip, clip, clip_by_global_norm, unitwise_norm
from gradtx.combine import Chain, MaskedState, PartitionState, apply_updates, chain, masked, named_chain, partition
from gradtx.conditionals import ApplyIfFiniteState, apply_if_finite
from gradtx.context_parallel import cp_reduce
from gradtx.executor import StepPlan, update_and_apply
from gradtx.hyperparams import InjectHyperparamsState, inject_hyperparams
from gradtx.optim import TransformedOptimizer, no_sync, sum_grad_reduction
from gradtx.optimizers import (
    OptimizerChain,
    OptimizerSpec,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    adam,
    adamw,
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    sgd,
    trace,
)
from gradtx.pipeline import pp_reduce
from gradtx.plan import MeshGroups, Sharded, global_norm, mesh_groups

# Transform states are NamedTuples of tensors; let torch.load(weights_only=True), torch's default, read them back.
torch.serialization.add_safe_globals(
    [
        AccumulateState,
        ApplyIfFiniteState,
        ClipByGlobalNormState,
        EmptyState,
        InjectHyperparamsState,
        MaskedState,
        PartitionState,
        ScaleByAdamState,
        ScaleByScheduleState,
        TraceState,
    ]
)

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "Accumulation",
    "ApplyIfFiniteState",
    "Chain",
    "ClipByGlobalNormState",
    "EmptyState",
    "GradientTransformation",
    "Guard",
    "InjectHyperparamsState",
    "MaskedState",
    "MeshGroups",
    "OptimizerChain",
    "OptimizerSpec",
    "PartitionState",
    "ScalarTransformation",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "Sharded",
    "StepPlan",
    "TraceState",
    "TransformedOptimizer",
    "Window",
    "accumulate",
    "adam",
    "adamw",
    "adaptive_clip",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "checkpoint",
    "clip",
    "clip_by_global_norm",
    "comm",
    "cp_reduce",
    "export_metrics",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "masked",
    "mesh_groups",
    "metrics",
    "named_chain",
    "no_sync",
    "partition",
    "pp_reduce",
    "scalar_transformation",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "sum_grad_reduction",
    "testing",
    "trace",
    "unitwise_norm",
    "update_and_apply",
]

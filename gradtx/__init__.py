"""gradtx: pure, composable gradient transformations for PyTorch, DTensors included."""

from typing import Any

import torch

from gradtx import checkpoint, comm, schedules
from gradtx.core import tree  # optax.tree's counterpart: tree_map, flatten, ... (gradtx.core.tree)
from gradtx.core.base import (
    EmptyState,
    GradientTransformation,
    Guard,
    ScalarTransformation,
    export_metrics,
    identity,
    init_empty_state,
    metrics,
    scalar_transformation,
)
from gradtx.distributed.audit import AuditRow, NormAudit, norm_audit
from gradtx.distributed.context_parallel import cp_reduce
from gradtx.distributed.global_norm import global_norm
from gradtx.distributed.pipeline import pp_reduce
from gradtx.distributed.plan import MeshGroups, Sharded, mesh_groups
from gradtx.optimizers.aliases import adam, adamw, sgd
from gradtx.optimizers.lion import ScaleByLionState, lion, scale_by_lion
from gradtx.optimizers.lookahead import LookaheadParams, LookaheadState, lookahead
from gradtx.optimizers.muon import (
    ExchangePlan,
    MuonDimensionNumbers,
    MuonState,
    exchange_plan,
    muon,
    newton_schulz,
    orthogonalize,
    scale_by_muon,
    scale_by_shape,
)
from gradtx.optimizers.schedule_free import (
    ScaleByRmsWithCountState,
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)
from gradtx.optimizers.standard import (
    OptimizerChain,
    OptimizerSpec,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)
from gradtx.optimizers.trust_ratio import lamb, lars, scale_by_trust_ratio
from gradtx.schedules.builtin import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
)
from gradtx.schedules.combined import (
    cosine_onecycle_schedule,
    join_schedules,
    linear_onecycle_schedule,
    piecewise_interpolate_schedule,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from gradtx.schedules.hyperparams import InjectHyperparamsState, inject_hyperparams
from gradtx.transforms.accumulation import AccumulateState, Accumulation, Window, accumulate
from gradtx.transforms.adaptive import (
    AutoClipState,
    TrackNormsState,
    ZClipState,
    autoclip,
    clip_by_block_rms,
    track_norms,
    zclip,
)
from gradtx.transforms.averaging import EmaState, ema, incremental_update, periodic_update
from gradtx.transforms.clipping import ClipByGlobalNormState, adaptive_clip, clip, clip_by_global_norm, unitwise_norm
from gradtx.transforms.combine import (
    Chain,
    MaskedState,
    PartitionState,
    apply_updates,
    chain,
    masked,
    named_chain,
    partition,
    update_and_apply,
)
from gradtx.transforms.conditionals import ApplyIfFiniteState, apply_if_finite
from gradtx.transforms.microbatching import AccumulationType, microbatch
from gradtx.transforms.monitoring import MonitorState, SnapshotState, measure_with_ema, monitor, snapshot
from gradtx.transforms.normalize import centralize, normalize_by_update_norm
from gradtx.transforms.plateau import ReduceLROnPlateauState, reduce_on_plateau
from gradtx.transforms.privacy import (
    AddNoiseState,
    DifferentiallyPrivateAggregateState,
    add_noise,
    differentially_private_aggregate,
    dpsgd,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
)
from gradtx.transforms.sam import SAMState, sam
from gradtx.transforms.selective import (
    ConditionallyMaskState,
    ConditionallyTransformState,
    conditionally_mask,
    conditionally_transform,
    freeze,
    selective_transform,
    set_to_zero,
)
from gradtx.transforms.spikes import (
    SkipIfState,
    SkipSpikesState,
    ZeroNansState,
    skip_if,
    skip_large_updates,
    skip_not_finite,
    skip_spikes,
    zero_nans,
)
from gradtx.wrapper import TransformedOptimizer, no_sync, sum_grad_reduction

# Transform states are NamedTuples of tensors; let torch.load(weights_only=True), torch's default, read them back.
_STATES = [v for k, v in list(globals().items()) if k.endswith("State") or k == "LookaheadParams"]
torch.serialization.add_safe_globals(_STATES)

__version__ = "0.2.0"


# The public names: type checkers read re-exports from this list (a user's mypy --strict included).
__all__ = [
    "AccumulateState",
    "Accumulation",
    "AccumulationType",
    "AddNoiseState",
    "ApplyIfFiniteState",
    "AuditRow",
    "AutoClipState",
    "Chain",
    "ClipByGlobalNormState",
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "DifferentiallyPrivateAggregateState",
    "EmaState",
    "EmptyState",
    "ExchangePlan",
    "GradientTransformation",
    "Guard",
    "InjectHyperparamsState",
    "LookaheadParams",
    "LookaheadState",
    "MaskedState",
    "MeshGroups",
    "MonitorState",
    "MuonDimensionNumbers",
    "MuonState",
    "NormAudit",
    "OptimizerChain",
    "OptimizerSpec",
    "PartitionState",
    "ReduceLROnPlateauState",
    "SAMState",
    "ScalarTransformation",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByRmsWithCountState",
    "ScaleByScheduleState",
    "ScheduleFreeState",
    "Sharded",
    "SkipIfState",
    "SkipSpikesState",
    "SnapshotState",
    "TraceState",
    "TrackNormsState",
    "TransformedOptimizer",
    "Window",
    "ZClipState",
    "ZeroNansState",
    "accumulate",
    "adam",
    "adamw",
    "adaptive_clip",
    "add_decayed_weights",
    "add_noise",
    "apply_if_finite",
    "apply_updates",
    "autoclip",
    "centralize",
    "chain",
    "checkpoint",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "comm",
    "conditionally_mask",
    "conditionally_transform",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "cp_reduce",
    "differentially_private_aggregate",
    "dpsgd",
    "ema",
    "exchange_plan",
    "exponential_decay",
    "export_metrics",
    "freeze",
    "global_norm",
    "identity",
    "incremental_update",
    "init_empty_state",
    "inject_hyperparams",
    "join_schedules",
    "lamb",
    "lars",
    "linear_onecycle_schedule",
    "linear_schedule",
    "lion",
    "lookahead",
    "masked",
    "measure_with_ema",
    "mesh_groups",
    "metrics",
    "microbatch",
    "monitor",
    "muon",
    "named_chain",
    "newton_schulz",
    "no_sync",
    "norm_audit",
    "normalize_by_update_norm",
    "orthogonalize",
    "partition",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "periodic_update",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "pp_reduce",
    "reduce_on_plateau",
    "sam",
    "scalar_transformation",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_muon",
    "scale_by_schedule",
    "scale_by_shape",
    "scale_by_trust_ratio",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "schedules",
    "selective_transform",
    "set_to_zero",
    "sgd",
    "sgdr_schedule",
    "skip_if",
    "skip_large_updates",
    "skip_not_finite",
    "skip_spikes",
    "snapshot",
    "sum_grad_reduction",
    "trace",
    "track_norms",
    "tree",
    "unitwise_norm",
    "update_and_apply",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    "zclip",
    "zero_nans",
]


def __getattr__(name: str) -> Any:
    # gradtx.testing (simulated meshes, recording comms) is imported on first use, never by `import gradtx`.
    if name == "testing":
        import importlib

        return importlib.import_module("gradtx.testing")
    raise AttributeError(f"module 'gradtx' has no attribute {name!r}")

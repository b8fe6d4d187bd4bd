"""gradtx: pure, composable gradient transformations for PyTorch, DTensors included."""

from types import ModuleType
from typing import Any

import torch

from gradtx import checkpoint as checkpoint
from gradtx import comm as comm
from gradtx import schedules as schedules
from gradtx.core import tree as tree  # optax.tree's counterpart: tree_map, flatten, ... (gradtx.core.tree)
from gradtx.core.base import EmptyState as EmptyState
from gradtx.core.base import GradientTransformation as GradientTransformation
from gradtx.core.base import Guard as Guard
from gradtx.core.base import ScalarTransformation as ScalarTransformation
from gradtx.core.base import export_metrics as export_metrics
from gradtx.core.base import identity as identity
from gradtx.core.base import init_empty_state as init_empty_state
from gradtx.core.base import metrics as metrics
from gradtx.core.base import scalar_transformation as scalar_transformation
from gradtx.distributed.audit import AuditRow as AuditRow
from gradtx.distributed.audit import NormAudit as NormAudit
from gradtx.distributed.audit import norm_audit as norm_audit
from gradtx.distributed.context_parallel import cp_reduce as cp_reduce
from gradtx.distributed.global_norm import global_norm as global_norm
from gradtx.distributed.pipeline import pp_reduce as pp_reduce
from gradtx.distributed.plan import MeshGroups as MeshGroups
from gradtx.distributed.plan import Sharded as Sharded
from gradtx.distributed.plan import mesh_groups as mesh_groups
from gradtx.optimizers.aliases import adam as adam
from gradtx.optimizers.aliases import adamw as adamw
from gradtx.optimizers.aliases import sgd as sgd
from gradtx.optimizers.lion import ScaleByLionState as ScaleByLionState
from gradtx.optimizers.lion import lion as lion
from gradtx.optimizers.lion import scale_by_lion as scale_by_lion
from gradtx.optimizers.lookahead import LookaheadParams as LookaheadParams
from gradtx.optimizers.lookahead import LookaheadState as LookaheadState
from gradtx.optimizers.lookahead import lookahead as lookahead
from gradtx.optimizers.muon import ExchangePlan as ExchangePlan
from gradtx.optimizers.muon import MuonDimensionNumbers as MuonDimensionNumbers
from gradtx.optimizers.muon import MuonState as MuonState
from gradtx.optimizers.muon import exchange_plan as exchange_plan
from gradtx.optimizers.muon import muon as muon
from gradtx.optimizers.muon import newton_schulz as newton_schulz
from gradtx.optimizers.muon import orthogonalize as orthogonalize
from gradtx.optimizers.muon import scale_by_muon as scale_by_muon
from gradtx.optimizers.muon import scale_by_shape as scale_by_shape
from gradtx.optimizers.schedule_free import ScaleByRmsWithCountState as ScaleByRmsWithCountState
from gradtx.optimizers.schedule_free import ScheduleFreeState as ScheduleFreeState
from gradtx.optimizers.schedule_free import schedule_free as schedule_free
from gradtx.optimizers.schedule_free import schedule_free_adamw as schedule_free_adamw
from gradtx.optimizers.schedule_free import schedule_free_eval_params as schedule_free_eval_params
from gradtx.optimizers.schedule_free import schedule_free_sgd as schedule_free_sgd
from gradtx.optimizers.standard import OptimizerChain as OptimizerChain
from gradtx.optimizers.standard import OptimizerSpec as OptimizerSpec
from gradtx.optimizers.standard import ScaleByAdamState as ScaleByAdamState
from gradtx.optimizers.standard import ScaleByScheduleState as ScaleByScheduleState
from gradtx.optimizers.standard import TraceState as TraceState
from gradtx.optimizers.standard import add_decayed_weights as add_decayed_weights
from gradtx.optimizers.standard import scale as scale
from gradtx.optimizers.standard import scale_by_adam as scale_by_adam
from gradtx.optimizers.standard import scale_by_learning_rate as scale_by_learning_rate
from gradtx.optimizers.standard import scale_by_schedule as scale_by_schedule
from gradtx.optimizers.standard import trace as trace
from gradtx.optimizers.trust_ratio import lamb as lamb
from gradtx.optimizers.trust_ratio import lars as lars
from gradtx.optimizers.trust_ratio import scale_by_trust_ratio as scale_by_trust_ratio
from gradtx.schedules.builtin import constant_schedule as constant_schedule
from gradtx.schedules.builtin import cosine_decay_schedule as cosine_decay_schedule
from gradtx.schedules.builtin import exponential_decay as exponential_decay
from gradtx.schedules.builtin import linear_schedule as linear_schedule
from gradtx.schedules.builtin import piecewise_constant_schedule as piecewise_constant_schedule
from gradtx.schedules.builtin import polynomial_schedule as polynomial_schedule
from gradtx.schedules.combined import cosine_onecycle_schedule as cosine_onecycle_schedule
from gradtx.schedules.combined import join_schedules as join_schedules
from gradtx.schedules.combined import linear_onecycle_schedule as linear_onecycle_schedule
from gradtx.schedules.combined import piecewise_interpolate_schedule as piecewise_interpolate_schedule
from gradtx.schedules.combined import sgdr_schedule as sgdr_schedule
from gradtx.schedules.combined import warmup_constant_schedule as warmup_constant_schedule
from gradtx.schedules.combined import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from gradtx.schedules.combined import warmup_exponential_decay_schedule as warmup_exponential_decay_schedule
from gradtx.schedules.hyperparams import InjectHyperparamsState as InjectHyperparamsState
from gradtx.schedules.hyperparams import inject_hyperparams as inject_hyperparams
from gradtx.transforms.accumulation import AccumulateState as AccumulateState
from gradtx.transforms.accumulation import Accumulation as Accumulation
from gradtx.transforms.accumulation import Window as Window
from gradtx.transforms.accumulation import accumulate as accumulate
from gradtx.transforms.adaptive import AutoClipState as AutoClipState
from gradtx.transforms.adaptive import TrackNormsState as TrackNormsState
from gradtx.transforms.adaptive import ZClipState as ZClipState
from gradtx.transforms.adaptive import autoclip as autoclip
from gradtx.transforms.adaptive import clip_by_block_rms as clip_by_block_rms
from gradtx.transforms.adaptive import track_norms as track_norms
from gradtx.transforms.adaptive import zclip as zclip
from gradtx.transforms.averaging import EmaState as EmaState
from gradtx.transforms.averaging import ema as ema
from gradtx.transforms.averaging import incremental_update as incremental_update
from gradtx.transforms.averaging import periodic_update as periodic_update
from gradtx.transforms.clipping import ClipByGlobalNormState as ClipByGlobalNormState
from gradtx.transforms.clipping import adaptive_clip as adaptive_clip
from gradtx.transforms.clipping import clip as clip
from gradtx.transforms.clipping import clip_by_global_norm as clip_by_global_norm
from gradtx.transforms.clipping import unitwise_norm as unitwise_norm
from gradtx.transforms.combine import Chain as Chain
from gradtx.transforms.combine import MaskedState as MaskedState
from gradtx.transforms.combine import PartitionState as PartitionState
from gradtx.transforms.combine import apply_updates as apply_updates
from gradtx.transforms.combine import chain as chain
from gradtx.transforms.combine import masked as masked
from gradtx.transforms.combine import named_chain as named_chain
from gradtx.transforms.combine import partition as partition
from gradtx.transforms.combine import update_and_apply as update_and_apply
from gradtx.transforms.conditionals import ApplyIfFiniteState as ApplyIfFiniteState
from gradtx.transforms.conditionals import apply_if_finite as apply_if_finite
from gradtx.transforms.microbatching import AccumulationType as AccumulationType
from gradtx.transforms.microbatching import microbatch as microbatch
from gradtx.transforms.monitoring import MonitorState as MonitorState
from gradtx.transforms.monitoring import SnapshotState as SnapshotState
from gradtx.transforms.monitoring import measure_with_ema as measure_with_ema
from gradtx.transforms.monitoring import monitor as monitor
from gradtx.transforms.monitoring import snapshot as snapshot
from gradtx.transforms.normalize import centralize as centralize
from gradtx.transforms.normalize import normalize_by_update_norm as normalize_by_update_norm
from gradtx.transforms.plateau import ReduceLROnPlateauState as ReduceLROnPlateauState
from gradtx.transforms.plateau import reduce_on_plateau as reduce_on_plateau
from gradtx.transforms.privacy import AddNoiseState as AddNoiseState
from gradtx.transforms.privacy import DifferentiallyPrivateAggregateState as DifferentiallyPrivateAggregateState
from gradtx.transforms.privacy import add_noise as add_noise
from gradtx.transforms.privacy import differentially_private_aggregate as differentially_private_aggregate
from gradtx.transforms.privacy import dpsgd as dpsgd
from gradtx.transforms.privacy import per_example_global_norm_clip as per_example_global_norm_clip
from gradtx.transforms.privacy import per_example_layer_norm_clip as per_example_layer_norm_clip
from gradtx.transforms.sam import SAMState as SAMState
from gradtx.transforms.sam import sam as sam
from gradtx.transforms.selective import ConditionallyMaskState as ConditionallyMaskState
from gradtx.transforms.selective import ConditionallyTransformState as ConditionallyTransformState
from gradtx.transforms.selective import conditionally_mask as conditionally_mask
from gradtx.transforms.selective import conditionally_transform as conditionally_transform
from gradtx.transforms.selective import freeze as freeze
from gradtx.transforms.selective import selective_transform as selective_transform
from gradtx.transforms.selective import set_to_zero as set_to_zero
from gradtx.transforms.spikes import SkipIfState as SkipIfState
from gradtx.transforms.spikes import SkipSpikesState as SkipSpikesState
from gradtx.transforms.spikes import ZeroNansState as ZeroNansState
from gradtx.transforms.spikes import skip_if as skip_if
from gradtx.transforms.spikes import skip_large_updates as skip_large_updates
from gradtx.transforms.spikes import skip_not_finite as skip_not_finite
from gradtx.transforms.spikes import skip_spikes as skip_spikes
from gradtx.transforms.spikes import zero_nans as zero_nans
from gradtx.wrapper import TransformedOptimizer as TransformedOptimizer
from gradtx.wrapper import no_sync as no_sync
from gradtx.wrapper import sum_grad_reduction as sum_grad_reduction

# Transform states are NamedTuples of tensors; let torch.load(weights_only=True), torch's default, read them back.
_STATES = [v for k, v in list(globals().items()) if k.endswith("State") or k == "LookaheadParams"]
torch.serialization.add_safe_globals(_STATES)

__version__ = "0.2.0"

# The public names are the `X as X` imports above: type checkers (a user's mypy --strict included) read those. The
# list below is for `from gradtx import *` and the tests that walk the public API; it leaves out the subpackages that
# importing binds as attributes (gradtx.core, ...), except the four imported above on purpose.
_PUBLIC_MODULES = (checkpoint, comm, schedules, tree)
__all__ = [
    name
    for name, value in sorted(dict(globals()).items())
    if not name.startswith("_")
    and name not in ("Any", "ModuleType")
    and (not isinstance(value, ModuleType) or value in _PUBLIC_MODULES)
]


def __getattr__(name: str) -> Any:
    # gradtx.testing (simulated meshes, recording comms) is imported on first use, never by `import gradtx`.
    if name == "testing":
        import importlib

        return importlib.import_module("gradtx.testing")
    raise AttributeError(f"module 'gradtx' has no attribute {name!r}")

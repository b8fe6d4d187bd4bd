"""Every grad-dependent transform × every layout, on simulated meshes from 1-D to 4-D, against one device.

Each case starts one simulated world (torch's LocalTensorMode, up to 16 ranks in this process) and runs
every transform in it through ``gtx.testing.assert_matches_single_device``: updates, params, metrics and
state after every step, on every rank. Shapes come even (every shard the same size) and uneven (shards of
different sizes, some empty).
"""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from gradtx import testing

pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed.tensor import Replicate, Shard

STEPS = 2


def _tree(shapes: dict[str, tuple[int, ...]], seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * scale for k, s in shapes.items()}


SHAPES = {
    # every dim divides by the mesh sizes below
    "even": {"w": (8, 4), "b": (4,), "experts.w": (4, 4, 2), "s": ()},
    # rows fewer than ranks (empty shards) and dims that do not divide
    "uneven": {"w": (5, 3), "b": (3,), "experts.w": (3, 5, 2), "s": ()},
}


def _four_d(path: str, leaf: torch.Tensor):
    """dp (replicate) × fsdp × tp × ep: experts split over ep and fsdp, matrices over fsdp and tp."""
    if leaf.ndim == 0:
        return [Replicate()] * 4
    if "expert" in path:
        return [Replicate(), Shard(1), Replicate(), Shard(0)]
    if leaf.ndim >= 2:
        return [Replicate(), Shard(0), Shard(1), Replicate()]
    return [Replicate(), Shard(0), Replicate(), Replicate()]


def _three_d(path: str, leaf: torch.Tensor):
    """HSDP × TP: replicate × shard × tp."""
    if leaf.ndim == 0:
        return [Replicate()] * 3
    if leaf.ndim >= 2:
        return [Replicate(), Shard(0), Shard(1)]
    return [Replicate(), Shard(0), Replicate()]


LAYOUTS = [
    pytest.param((4,), ("dp",), "ddp", id="ddp-4"),
    pytest.param((4,), ("dp",), "fsdp", id="fsdp-4"),
    pytest.param((4,), ("tp",), "tp", id="tp-4"),
    pytest.param((2, 2), ("rep", "shard"), "hsdp", id="hsdp-2x2"),
    pytest.param((2, 2), ("dp", "tp"), "tp_fsdp", id="tp_fsdp-2x2"),
    pytest.param((2, 2), ("dp", "ep"), "ep_fsdp", id="ep_fsdp-2x2"),
    pytest.param((2, 2), ("dp", "cp"), "cp", id="cp-2x2"),
    pytest.param((2, 2, 2), ("rep", "fsdp", "tp"), _three_d, id="hsdp_tp-2x2x2"),
    pytest.param((2, 2, 2, 2), ("dp", "fsdp", "tp", "ep"), _four_d, id="dp_fsdp_tp_ep-2x2x2x2"),
]


def _transforms():
    """Every public transform or alias whose numbers depend on the grads (a fresh instance per case)."""
    lr = gtx.warmup_cosine_decay_schedule(0.0, 0.1, 1, 10)
    return {
        "clip": gtx.clip(0.3),
        "clip_by_global_norm": gtx.clip_by_global_norm(1.0),
        "clip_by_global_norm_inf": gtx.clip_by_global_norm(0.5, norm_type=math.inf),
        "clip_by_global_norm_p1": gtx.clip_by_global_norm(2.0, norm_type=1.0),
        "adaptive_clip": gtx.adaptive_clip(0.05),
        "adaptive_clip_tensorwise": gtx.adaptive_clip(0.05, unitwise=False),
        "clip_by_block_rms": gtx.clip_by_block_rms(0.5),
        "zclip": gtx.zclip(warmup_steps=1, z_thresh=0.5),
        "autoclip": gtx.autoclip(50.0),
        "track_norms": gtx.track_norms(),
        "skip_large_updates": gtx.skip_if(gtx.sgd(0.1), lambda u, s, p: gtx.skip_large_updates(u, s, p, 20.0)),
        "skip_spikes": gtx.skip_spikes(gtx.sgd(0.1), warmup_steps=1, z_thresh=0.5),
        "apply_if_finite": gtx.apply_if_finite(gtx.sgd(0.1), 2),
        "zero_nans": gtx.zero_nans(),
        "accumulate": gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0)),
        "sgd_nesterov": gtx.sgd(0.1, momentum=0.9, nesterov=True),
        "adam": gtx.adam(0.1),
        "adamw_schedule": gtx.adamw(lr, weight_decay=0.1),
        "inject_hyperparams": gtx.inject_hyperparams(gtx.adamw)(learning_rate=lr, weight_decay=0.1),
        "chain": gtx.chain(gtx.clip_by_global_norm(1.0), gtx.trace(0.9), gtx.scale_by_learning_rate(0.1)),
    }


# Elementwise transforms issue no collective: on the 16-rank mesh only the ones that communicate (and
# Adam, whose step counter is what a replicated leaf shared across simulated ranks used to break) run.
LOCAL_ONLY = {"clip", "zero_nans", "sgd_nesterov", "adamw_schedule", "inject_hyperparams"}


@pytest.mark.parametrize("mesh_shape, names, layout", LAYOUTS)
def test_every_transform_matches_one_device(mesh_shape, names, layout):
    # Even and uneven shapes alternate over the transforms (and start on the other one for the next
    # layout), so every transform meets both, and every layout both, at half the cost of all pairs.
    start = [p.id for p in LAYOUTS].index(next(p.id for p in LAYOUTS if p.values == (mesh_shape, names, layout)))
    cases = {}
    for kind in ("even", "uneven"):
        shape = SHAPES[kind]
        cases[kind] = (_tree(shape, 0), [_tree(shape, 1 + i, scale=1.0 + 2.0 * i) for i in range(STEPS)])
    failures = []
    with testing.simulated_mesh(mesh_shape, names) as mesh:
        for j, (name, tx) in enumerate(_transforms().items()):
            if len(mesh_shape) == 4 and name in LOCAL_ONLY:
                continue
            kind = ("even", "uneven")[(start + j) % 2]
            params, grads_seq = cases[kind]
            try:
                testing.assert_matches_single_device(tx, grads_seq, params, mesh=mesh, layout=layout)
            except AssertionError as err:
                failures.append(f"{name} ({kind}): {err}")
    assert not failures, "\n".join(failures)

"""gradtx.distributed.plan in one process: the zero-configuration norm, empty shards, cp_reduce, and the declared-plan checks.

The multi-process behaviour (plans read from DTensor placements, on every
layout) is in ``tests/distributed/test_zero_config.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradtx as gtx
from gradtx.comm import LocalComm
from gradtx.distributed.global_norm import from_placements, global_norm_of
from gradtx.testing import RecordingComm, assert_pure, assert_trees_close

NORM_TYPES = [1.0, 2.0, 3.0, math.inf]


def _reference_norm(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    # torch.linalg on the concatenation, in fp64: independent of gradtx, and fine with empty pieces.
    return torch.linalg.vector_norm(torch.cat([t.reshape(-1).to(torch.complex128) for t in tensors]), p)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.complex64])
def test_empty_shards_have_norm_zero_for_every_norm_type(p, dtype):
    g = torch.Generator().manual_seed(0)
    tree = {
        "empty": torch.empty(0, 4, dtype=dtype),
        "w": torch.randn(3, 4, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype),
        "e1": torch.empty(0, dtype=dtype),
    }
    norm = gtx.global_norm(tree, p)
    # fp32, or fp64 for fp64 leaves: nothing is rounded away.
    assert norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(norm.double(), _reference_norm(list(tree.values()), p), rtol=1e-5, atol=0)
    only_empty = {"a": torch.empty(0, dtype=dtype), "b": torch.empty(0, 3, dtype=dtype)}
    assert float(gtx.global_norm(only_empty, p)) == 0.0


@pytest.mark.parametrize("p", NORM_TYPES)
def test_clip_agc_and_finite_check_on_an_empty_shard(p):
    grads = {"empty": torch.empty(0, 4), "w": torch.tensor([[3.0, 4.0]])}
    params = {"empty": torch.empty(0, 4), "w": torch.tensor([[1.0, 1.0]])}
    tx = gtx.clip_by_global_norm(1.0, norm_type=p)
    out, state = tx.update(grads, tx.init(params))
    torch.testing.assert_close(state.grad_norm.double(), _reference_norm(list(grads.values()), p))
    assert out["empty"].shape == (0, 4)
    agc, _ = gtx.adaptive_clip(0.1).update(grads, gtx.EmptyState(), params)
    assert agc["empty"].shape == (0, 4)
    torch.testing.assert_close(agc["w"], grads["w"] * (0.1 * math.sqrt(2) / 5.0))
    fin = gtx.apply_if_finite(gtx.identity(), 1)
    _, fstate = fin.update(grads, fin.init(params))
    assert bool(fstate.last_finite)
    bad = {"empty": torch.empty(0, 4), "w": torch.tensor([[float("nan"), 1.0]])}
    _, fstate = fin.update(bad, fin.init(params))
    assert not bool(fstate.last_finite)


def test_plain_tensors_need_no_plan_and_no_collective():
    tree = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    assert from_placements(list(tree.values()), what="test") is None
    torch.testing.assert_close(global_norm_of(list(tree.values()), 2.0), torch.tensor(5.0))


def test_mesh_groups_needs_no_comm_in_one_process():
    plan = gtx.mesh_groups({"a": torch.ones(2)})
    assert isinstance(plan.comm, LocalComm) and plan.num_collectives() == 0


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"sharded": {"b": "tpp"}}, r"sharded\['b'\]"),
        ({"pp_group": "ppp"}, "pp_group"),
        ({"pp_group": "world", "tied": {"a": "ppx"}}, r"tied\['a'\]"),
    ],
)
def test_a_misspelt_group_key_names_the_argument_that_gave_it(kwargs, arg):
    from gradtx.comm.torch_dist import TorchComm

    pytest.importorskip("torch.distributed._local_tensor")
    from gradtx import testing

    with testing.simulated_mesh(2, ("tp",)) as mesh:
        tree = {"a": torch.ones(2), "b": torch.ones(2)}
        with pytest.raises(ValueError, match=rf"mesh_groups: {arg} names group '\w+', which the comm does not know"):
            gtx.mesh_groups(tree, comm=TorchComm(mesh), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tied": ["a"]}, TypeError, "tied must be a dict"),  # dict() said "update sequence element #0"
        ({"tied": "a"}, TypeError, "tied must be a dict"),
        ({"sharded": {"b"}}, TypeError, "sharded must be a dict"),
        ({"sharded": ["ab"]}, TypeError, "sharded must be a dict"),  # dict(["ab"]) made it {"a": "b"}: a over "b"
        ({"pp_group": ["pp"]}, ValueError, r"pp_group names group \['pp'\]"),  # was: unhashable type: 'list'
        ({"tied": {"a": ["pp"]}}, ValueError, r"tied\['a'\] names group \['pp'\]"),
    ],
)
def test_mesh_groups_names_the_argument_that_is_not_a_mapping_or_a_group_key(kwargs, error, match):
    kwargs = {"pp_group": "pp", **kwargs}
    with pytest.raises(error, match=f"mesh_groups: {match}"):
        gtx.mesh_groups({"a": torch.ones(2), "b": torch.ones(2)}, comm=LocalComm(), **kwargs)


def test_global_norm_of_refuses_something_that_is_not_a_plan():
    with pytest.raises(TypeError, match="mesh_groups must be a plan"):
        global_norm_of([torch.ones(2)], 2.0, mesh_groups={"a": "dp"})


def test_cp_reduce_sums_every_leaf_in_one_collective_and_is_pure():
    comm = RecordingComm()
    tx = gtx.cp_reduce("cp", comm=comm)
    grads = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    out, _ = assert_pure(tx, grads)
    for name, g in grads.items():
        torch.testing.assert_close(out[name], g)  # one rank: the sum is the grad itself
    assert {(c.op, c.group, c.num_tensors) for c in comm.calls} == {("sum", "cp", 2)}


def test_cp_reduce_needs_a_group_it_can_resolve():
    with pytest.raises(ValueError, match=r"cp_reduce\(mesh\['cp'\]\)"):
        gtx.cp_reduce("cp")
    with pytest.raises(TypeError, match="comm must implement"):
        gtx.cp_reduce("cp", comm=object())


def test_cp_reduce_refuses_a_grad_sharded_over_the_cp_ranks():
    # A grad sharded over the CP ranks (HSDP on ("dp", "cp"), torchtitan's dp_shard_cp) holds other rows on
    # each of them, already summed by the sharding: summing them again gave rows that were no grad at all.
    pytest.importorskip("torch.distributed._local_tensor")
    from torch.distributed.tensor import Shard

    from gradtx.testing import distribute, simulated_mesh

    full = {"w": torch.arange(8.0).reshape(4, 2)}
    with simulated_mesh((2, 2), ("dp", "cp")) as mesh:
        tx = gtx.cp_reduce(mesh["cp"])
        chunks = distribute(full, mesh["dp"], {"w": (Shard(0),)})  # FSDP2 over dp only: a partial grad per cp rank
        out, _ = tx.update(chunks, tx.init(chunks))
        torch.testing.assert_close(out["w"].full_tensor(), 2 * full["w"])  # both cp ranks' (equal) parts, summed
        for sharded in (
            distribute(full, mesh["cp"], {"w": (Shard(0),)}),
            distribute(full, mesh, {"w": (Shard(0), Shard(1))}),
        ):
            with pytest.raises(ValueError, match=r"cp_reduce: the grad at \['w'\] is sharded .* holds CP ranks"):
                tx.update(sharded, tx.init(sharded))


PLACEMENT_READERS = {
    "clip_by_global_norm": lambda: gtx.clip_by_global_norm(1.0),
    "adaptive_clip": lambda: gtx.adaptive_clip(0.1),
    "scale_by_trust_ratio": lambda: gtx.scale_by_trust_ratio(),
    "zclip": lambda: gtx.zclip(),
    "autoclip": lambda: gtx.autoclip(),
    "skip_spikes": lambda: gtx.skip_spikes(gtx.identity()),
    "normalize_by_update_norm": lambda: gtx.normalize_by_update_norm(),
    "clip_by_block_rms": lambda: gtx.clip_by_block_rms(1.0),
    "track_norms": lambda: gtx.track_norms(),
}


@pytest.mark.parametrize("name", sorted(PLACEMENT_READERS))
def test_a_transform_reads_the_placements_plan_once_per_layout(name, monkeypatch):
    # The plan is a pure function of the meshes, placements and shapes: a transform builds it when it first
    # sees them and again only when they change, not on every step (it costs Python work per leaf).
    from torch.distributed.tensor import Replicate, Shard

    import gradtx.distributed.global_norm as gn
    from gradtx.testing import distribute, simulated_mesh

    built = []
    real = gn.from_placements
    monkeypatch.setattr(gn, "from_placements", lambda *a, **k: built.append(1) or real(*a, **k))
    full = {"w": torch.randn(4, 6), "b": torch.randn(4)}
    first, second = {"w": (Shard(0),), "b": (Replicate(),)}, {"w": (Shard(1),), "b": (Shard(0),)}
    with simulated_mesh(2) as mesh:
        tx = PLACEMENT_READERS[name]()
        params = distribute(full, mesh, first)
        state = tx.init(params)
        for step in range(3):
            grads = distribute({k: v * (step + 1) for k, v in full.items()}, mesh, first)
            _, state = tx.update(grads, state, params)
        assert len(built) == 1
        tx.update(distribute(full, mesh, second), state, distribute(full, mesh, second))
        assert len(built) == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda plan: gtx.zclip(mesh_groups=plan),
        lambda plan: gtx.autoclip(mesh_groups=plan),
        lambda plan: gtx.clip_by_block_rms(0.05, mesh_groups=plan),
        lambda plan: gtx.normalize_by_update_norm(mesh_groups=plan),
        lambda plan: gtx.chain(gtx.track_norms(mesh_groups=plan), gtx.clip_by_global_norm(0.5, mesh_groups=plan)),
        lambda plan: gtx.skip_spikes(gtx.trace(0.9), warmup_steps=1, z_thresh=0.5, mesh_groups=plan),
        lambda plan: gtx.skip_if(
            gtx.trace(0.9), lambda u, s, p: gtx.skip_large_updates(u, s, p, 4.0, mesh_groups=plan)
        ),
    ],
    ids=["zclip", "autoclip", "clip_by_block_rms", "normalize", "track_norms", "skip_spikes", "skip_large_updates"],
)
def test_a_declared_plan_reads_a_none_grad_as_zeros(make):
    # A declared plan covers every param (a pipeline stage's); a param without a grad on a step (None) joins the
    # plan's norm as zeros, so every rank issues the same collectives. On one process, the plan's norm is the plain
    # one: the run without a plan, where the None leaf is left out.
    def run(planned: bool) -> tuple[dict, object]:
        gen = torch.Generator().manual_seed(0)
        params = {
            n: torch.randn(*s, generator=gen) for n, s in {"w": (2, 4), "b": (2,), "ew": (2, 4), "eb": (2,)}.items()
        }
        tx = make(gtx.mesh_groups(params, plain="replicated") if planned else None)
        state = tx.init(params)
        for step in range(4):
            grads = {
                n: None if step == 2 and n.startswith("e") else torch.randn(p.shape, generator=gen)
                for n, p in params.items()
            }
            updates, state = tx.update(grads, state, params)
            params = gtx.apply_updates(params, updates)
        return params, state

    assert_trees_close(run(True), run(False), rtol=1e-6, atol=1e-7)


def test_a_plan_given_a_none_grad_without_params_says_so():
    # gtx.global_norm takes no params to fill a missing grad from: the count check names the None as the likely cause.
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    plan = gtx.mesh_groups(params, plain="replicated")
    with pytest.raises(ValueError, match="built for 2 leaves, got 1.*a None leaf, a param without a grad"):
        gtx.global_norm({"w": torch.ones(2, 2), "b": None}, mesh_groups=plan)
    torch.testing.assert_close(
        gtx.global_norm({"w": torch.ones(2, 2), "b": torch.zeros(2)}, mesh_groups=plan), torch.tensor(2.0)
    )

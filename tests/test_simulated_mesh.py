"""gtx.testing's simulated meshes: the mesh, the layouts, and the single-device check itself."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.distributed as dist

import gradtx as gtx
from gradtx import testing

pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _tree(seed: int = 0, **shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _shards(x: DTensor) -> dict[int, torch.Tensor]:
    local = x.to_local()
    assert isinstance(local, LocalTensor)
    return dict(sorted(local._local_tensors.items()))


# --- the mesh ---------------------------------------------------------------------------------------


def test_simulated_mesh_yields_the_mesh_and_leaves_no_process_group_behind():
    assert not dist.is_initialized()
    with testing.simulated_mesh((2, 3), ("dp", "tp")) as mesh:
        assert tuple(mesh.shape) == (2, 3) and mesh.mesh_dim_names == ("dp", "tp")
        assert dist.get_world_size() == 6
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError), testing.simulated_mesh(2):
        raise ZeroDivisionError  # an error in the block still tears the world down
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"distribute: call it inside gtx.testing.simulated_mesh"):
        testing.distribute({"w": torch.ones(4, 3)}, mesh, "fsdp")  # the mesh outlived its world


def test_simulated_mesh_refuses_bad_shapes_and_nesting():
    with pytest.raises(ValueError, match="shape must be positive ints"), testing.simulated_mesh((2, 0)):
        pass
    with pytest.raises(ValueError, match="names must be 2 distinct strings"), testing.simulated_mesh((2, 2), ("dp",)):
        pass
    with testing.simulated_mesh(2), pytest.raises(RuntimeError, match="already initialised"), testing.simulated_mesh(2):
        pass


def test_plans_do_not_outlive_their_process_groups():
    # Two simulated worlds in a row: the second must not reduce over the first one's (destroyed) groups.
    grads = _tree(w=(6, 4), b=(4,))
    for _ in range(2):
        for tx in (gtx.clip_by_global_norm(1.0), gtx.adaptive_clip(0.01)):
            testing.assert_matches_single_device(tx, [grads], grads, mesh_shape=(2, 2), layout="tp_fsdp")
    assert not dist.is_initialized()


def test_one_transform_runs_in_one_simulated_world_after_another():
    """Before: a transform reused in a later world (a module-level tx in two tests, each with its own mesh) kept
    the plan of the first world, whose meshes equal the new ones, and reduced over its destroyed process groups:
    "ValueError: Process group ... is not initialized in the world group map"."""
    grads = _tree(w=(6, 4), b=(4,))
    txs = (gtx.clip_by_global_norm(1.0), gtx.adaptive_clip(0.01), gtx.track_norms(), gtx.lars(0.1))
    for shape, layout in [((2,), "fsdp"), ((2,), "fsdp"), ((2, 2), "tp_fsdp")]:
        for tx in txs:
            testing.assert_matches_single_device(tx, [grads], grads, mesh_shape=shape, layout=layout)


# --- the layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout, shape, expected",
    [
        ("fsdp", (4,), {"w": (Shard(0),), "b": (Shard(0),), "s": (Replicate(),)}),
        ("tp", (2,), {"w": (Shard(0),), "v": (Shard(1),), "b": (Replicate(),), "s": (Replicate(),)}),
        ("hsdp", (2, 2), {"w": (Replicate(), Shard(0)), "b": (Replicate(), Shard(0)), "s": (Replicate(), Replicate())}),
        (
            "tp_fsdp",
            (2, 2),
            {
                "w": (_StridedShard(0, split_factor=2), Shard(0)),  # FSDP2 over a column-wise TP weight
                "v": (Shard(0), Shard(1)),  # over a row-wise one
                "b": (Shard(0), Replicate()),  # a bias TP leaves replicated
                "s": (Replicate(), Replicate()),
            },
        ),
        (
            "ep_fsdp",
            (2, 2),
            {"experts.w": (Shard(1), Shard(0)), "w": (Shard(0), Replicate()), "b": (Shard(0), Replicate())},
        ),
        ("cp", (2, 2), {"w": (Shard(0), Replicate()), "b": (Shard(0), Replicate())}),
    ],
)
def test_presets_place_each_leaf_as_the_parallelism_does(layout, shape, expected):
    full = _tree(w=(4, 6), v=(6, 4), b=(4,), s=(), **{"experts.w": (2, 4, 3)})
    with testing.simulated_mesh(shape) as mesh:
        out = testing.distribute(full, mesh, layout)
        for path, placements in expected.items():
            assert isinstance(out[path], DTensor)
            assert tuple(out[path].placements) == placements, path
            # torch's own gather puts the full tensor back together, on every rank
            for r, t in out[path].full_tensor()._local_tensors.items():
                torch.testing.assert_close(t, full[path], rtol=0, atol=0, msg=f"{path} on rank {r}")


def test_uneven_shards_follow_torch_chunk_and_may_be_empty():
    full = _tree(w=(5, 3), b=(2,))
    with testing.simulated_mesh(4) as mesh:
        out = testing.distribute(full, mesh, "fsdp")
        assert [t.shape[0] for t in _shards(out["w"]).values()] == [2, 2, 1, 0]  # torch.chunk(5 rows, 4)
        assert [t.shape[0] for t in _shards(out["b"]).values()] == [1, 1, 0, 0]
        for r, t in _shards(out["w"]).items():
            chunks = torch.chunk(full["w"], 4)
            torch.testing.assert_close(t, chunks[r] if r < len(chunks) else full["w"][:0])


def test_every_rank_holds_its_own_copy_of_a_replicated_leaf():
    # torch's distribute_tensor shares one plain tensor among the simulated ranks of a replicated DTensor,
    # so an in-place update mixed with per-rank tensors runs once per rank on it: Adam's step counter moves
    # four times per step, and the update is off by about the learning rate.
    full = _tree(w=(3, 2))
    with testing.simulated_mesh((2, 2)) as mesh:
        out = testing.distribute(full, mesh, {"w": (Replicate(), Replicate())})
        shards = _shards(out["w"])
        assert len({t.data_ptr() for t in shards.values()}) == 4
    with testing.simulated_mesh(4) as mesh:
        plain = testing.distribute(full, mesh, "ddp")["w"]  # DDP's plain tensors: one replica per rank
        assert isinstance(plain, LocalTensor) and not isinstance(plain, DTensor)
        assert len({t.data_ptr() for t in plain._local_tensors.values()}) == 4
    testing.assert_matches_single_device(
        gtx.adam(0.1), [_tree(1, w=(3, 2))] * 2, full, mesh_shape=(2, 2), layout=lambda p, x: [Replicate()] * 2
    )


def test_a_placement_map_lays_out_leaves_by_path_and_glob():
    full = _tree(**{"layers.0.w": (4, 2), "layers.1.w": (4, 2), "head": (2,)})
    with testing.simulated_mesh(2) as mesh:
        out = testing.distribute(full, mesh, {"layers.*.w": [Shard(1)]})
        assert out["layers.0.w"].placements == (Shard(1),) and out["layers.1.w"].placements == (Shard(1),)
        assert out["head"].placements == (Replicate(),)
        with pytest.raises(ValueError, match="takes a 2-D mesh"):
            testing.distribute(full, mesh, "tp_fsdp")
        with pytest.raises(ValueError, match="layout must be one of"):
            testing.distribute(full, mesh, "zero3")
        with pytest.raises(ValueError, match="gives head 2 placements for a 1-D mesh"):
            testing.distribute(full, mesh, {"head": [Replicate(), Replicate()]})


# --- the check --------------------------------------------------------------------------------------


def _local_norm_clip(max_norm: float) -> gtx.GradientTransformation:
    """A user's clip with a rank-consistency bug: it measures only the shard this rank holds."""

    def init(params):
        return gtx.EmptyState()

    def update(updates, state, params=None, **extra):
        local = [u.to_local() if isinstance(u, DTensor) else u for u in optree.tree_leaves(updates)]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in local]))
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return optree.tree_map(lambda u: u * scale, updates), state

    return gtx.GradientTransformation(init, update)


def test_a_rank_inconsistent_transform_fails_naming_the_path_and_the_ranks():
    params = _tree(w=(6, 4), b=(4,))
    grads = [_tree(1, w=(6, 4), b=(4,))]
    testing.assert_matches_single_device(_local_norm_clip(1.0), grads, params, mesh_shape=1, layout="fsdp")
    with pytest.raises(
        AssertionError, match=r"step 0: updates at \['b'\]: the ranks disagree \(ranks \[0\] hold .*; ranks \[1\]"
    ):
        testing.assert_matches_single_device(
            _local_norm_clip(1.0), grads, params, mesh_shape=(2, 2), names=("dp", "tp"), layout="tp_fsdp"
        )


def test_a_consistent_but_wrong_transform_fails_against_one_device():
    # Every rank agrees, on the wrong number: it sums the squared norm over a replicated dim (a double count).
    def double_count(u, state, params=None, **extra):
        del extra
        return optree.tree_map(lambda x: x * 2.0 if isinstance(x, DTensor) else x, u), state

    tx = gtx.GradientTransformation(lambda p: gtx.EmptyState(), double_count)
    with pytest.raises(
        AssertionError, match=r"step 0: updates at \['w'\]: ranks \[0, 1, 2, 3\] differ from one device"
    ):
        testing.assert_matches_single_device(tx, [_tree(1, w=(4, 4))], _tree(w=(4, 4)), mesh_shape=4, layout="fsdp")


def test_the_state_is_checked_every_step():
    # A counter that advances only where this rank's shard is non-zero: right on one device and on even
    # shards, per rank where FSDP2 leaves a rank an empty shard.
    def init(params):
        return {"count": torch.zeros((), dtype=torch.int32)}

    def update(u, state, params=None, **extra):
        leaf = u["w"]
        local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
        return u, {"count": state["count"] + (local.abs().sum() > 0).to(torch.int32)}

    tx = gtx.GradientTransformation(init, update)
    testing.assert_matches_single_device(tx, [_tree(1, w=(4, 2))], _tree(w=(4, 2)), mesh_shape=4, layout="fsdp")
    with pytest.raises(
        AssertionError,
        match=r"step 0: state at \['count'\]: the ranks disagree \(ranks \[0, 1\] hold \[1\]; ranks \[2, 3\] hold \[0\]",
    ):
        testing.assert_matches_single_device(tx, [_tree(1, w=(2, 2))], _tree(w=(2, 2)), mesh_shape=4, layout="fsdp")


def test_empty_shards_under_every_norm_type():
    grads = _tree(w=(2, 3), b=(1,))
    for p in (1.0, 2.0, math.inf):
        testing.assert_matches_single_device(
            gtx.clip_by_global_norm(0.5, norm_type=p), [grads], grads, mesh_shape=4, layout="fsdp"
        )


def test_a_transform_that_changes_a_placement_is_reported_as_such():
    # A to_local/from_local that forgets the placements (here: Partial) is not "the ranks disagree".
    from torch.distributed.tensor import Partial

    def update(updates, state, params=None, **extra):
        def lose(u):
            if not isinstance(u, DTensor):
                return u
            return DTensor.from_local(
                u.to_local(), u.device_mesh, [Partial("avg")], run_check=False, shape=u.shape, stride=u.stride()
            )

        return optree.tree_map(lose, updates), state

    tx = gtx.GradientTransformation(lambda params: gtx.EmptyState(), update)
    with pytest.raises(
        AssertionError, match=r"step 0: updates at \['w'\]: the placement changed, Shard\(0\) -> Partial\(avg\)"
    ):
        testing.assert_matches_single_device(tx, [_tree(1, w=(4, 2))], _tree(w=(4, 2)), mesh_shape=2, layout="fsdp")


@pytest.mark.parametrize("layout, shape", [("fsdp", (4,)), ("tp_fsdp", (2, 2))])
def test_a_full_tensor_checkpoint_loads_onto_sharded_state_shard_by_shard(layout, shape):
    """gtx.checkpoint.load_state_dict of whole tensors (a torch.save of full_tensor()s) cuts each simulated rank's
    block out of them: the loaded state equals the sharded state it was saved from, on every rank."""
    full = {"w": torch.randn(8, 6), "b": torch.randn(6)}
    grads = {"w": torch.randn(8, 6), "b": torch.randn(6)}
    with testing.simulated_mesh(shape) as mesh:
        params = testing.distribute(full, mesh, layout)
        tx = gtx.adamw(0.1)
        _, state = tx.update(testing.distribute(grads, mesh, layout), tx.init(params), params)
        saved = optree.tree_map(
            lambda x: x.full_tensor() if isinstance(x, DTensor) else x, gtx.checkpoint.state_dict(state, params)
        )
        loaded = gtx.checkpoint.load_state_dict(saved, tx.init(params), params)
        for a, b in zip(optree.tree_leaves(loaded), optree.tree_leaves(state)):
            assert type(a) is type(b)
            if isinstance(b, DTensor):
                assert tuple(a.placements) == tuple(b.placements)
                torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_simulated_mesh_refuses_names_that_are_not_strings_one_per_dim():
    with pytest.raises(TypeError, match="names"), testing.simulated_mesh((2, 2), "dp"):  # not ("d", "p")
        pass
    with pytest.raises(TypeError, match="names"), testing.simulated_mesh((2, 2), ("dp", 1)):
        pass
    assert not dist.is_initialized()


@pytest.mark.parametrize("steps", [0, -3])
def test_assert_matches_single_device_refuses_steps_that_check_nothing(steps):
    grads = [{"w": torch.randn(4, 3)}]
    with pytest.raises(ValueError, match="steps"):
        testing.assert_matches_single_device(
            gtx.clip_by_global_norm(1.0), grads, {"w": torch.randn(4, 3)}, mesh_shape=(2,), layout="fsdp", steps=steps
        )
    assert not dist.is_initialized()


def test_a_layout_placement_is_checked_against_its_leaf_and_a_negative_dim_counts_from_the_end():
    full = {"w": torch.randn(6, 4), "s": torch.tensor(2.0)}
    with testing.simulated_mesh(2) as mesh:
        neg = testing.distribute(full, mesh, {"w": [Shard(-1)]})
        pos = testing.distribute(full, mesh, {"w": [Shard(1)]})
        assert tuple(neg["w"].placements) == (Shard(1),)  # as torch's distribute_tensor normalises it
        torch.testing.assert_close(neg["w"].full_tensor(), pos["w"].full_tensor(), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"shards w \(shape \(6, 4\)\) on dim 2"):
            testing.distribute(full, mesh, {"w": [Shard(2)]})
        with pytest.raises(ValueError, match="shards s"):
            testing.distribute(full, mesh, {"s": [Shard(0)]})
        with pytest.raises(TypeError, match="gives w a str"):
            testing.distribute(full, mesh, {"w": ["Shard(0)"]})
        with pytest.raises(ValueError, match=r"keys \['v', 'x\*'\] match no leaf"):  # a typo is not "replicated"
            testing.distribute(full, mesh, {"w": [Shard(0)], "v": [Shard(0)], "x*": [Shard(0)]})


def test_a_missing_grad_leaves_every_other_grad_laid_out_as_its_param():
    """The "tp" presets place matrices by position (Shard(0), Shard(1), ...): a missing grad must not shift the rest.

    Muon with params that miss a grad on some steps, on TP x FSDP2, against one device.
    """
    params = _tree(a=(6, 4), b=(4, 6), c=(5, 3), v=(4,))
    grads = [_tree(1 + i, a=(6, 4), b=(4, 6), c=(5, 3), v=(4,)) for i in range(3)]
    grads[1]["a"], grads[2]["b"], grads[2]["v"] = None, None, None
    testing.assert_matches_single_device(
        gtx.muon(0.1, weight_decay=0.1), grads, params, mesh_shape=(2, 2), names=("dp", "tp"), layout="tp_fsdp"
    )


# --- gtx.testing's checkers on DTensors of a simulated mesh ---------------------------------------------


def _scale_local(rank1_only: bool):
    def update(updates, state, params=None, **extra):
        local = updates["w"].to_local()
        if rank1_only:  # a change one rank sees: rank 0's values stay as they were
            local._local_tensors[1].mul_(3.0)
        else:  # in place through the local tensor, writing the same values (a clip whose coefficient is 1)
            local.mul_(torch.ones(()))
        return updates, state

    return gtx.GradientTransformation(lambda p: gtx.EmptyState(), update)


@pytest.mark.parametrize("rank1_only", [False, True], ids=["same-values-via-to_local", "one-rank-only"])
def test_assert_pure_sees_every_rank_and_the_local_tensor_of_a_dtensor(rank1_only):
    """Before: assert_pure passed both. An in-place op on a DTensor's local tensor does not move the DTensor's
    version counter, and torch.equal on a LocalTensor compares rank 0's values alone."""
    full = _tree(0, w=(4, 3))
    with testing.simulated_mesh((2,), ("dp",)) as mesh:
        grads = testing.distribute(full, mesh, "fsdp")
        with pytest.raises(AssertionError, match=r"update: updates at \['w'\] (was modified in place|changed value)"):
            testing.assert_pure(_scale_local(rank1_only), grads, steps=1)


def test_tree_comparisons_of_dtensors_fail_naming_the_path_and_the_rank():
    """Before: assert_trees_equal on two simulated DTensors that differ raised torch's internal RuntimeError
    ("Comparing TensorLikePair ... resulted in the unexpected exception"), not an AssertionError naming the path."""
    full = _tree(0, w=(4, 3))
    other = {"w": torch.cat([full["w"][:2], full["w"][2:] + 1.0])}  # rank 1's shard differs, rank 0's does not
    with testing.simulated_mesh((2,), ("dp",)) as mesh:
        a, b = testing.distribute(full, mesh, "fsdp"), testing.distribute(other, mesh, "fsdp")
        testing.assert_trees_equal(a, testing.distribute(full, mesh, "fsdp"))
        with pytest.raises(AssertionError, match=r"\['w'\] \(simulated rank 1\): Tensor-likes are not equal"):
            testing.assert_trees_equal(a, b)


def test_assert_matches_single_device_names_a_bad_argument_before_it_runs():
    """Before: the factory for tx raised AttributeError ('function' object has no attribute 'init'), one grads tree
    for grads_seq a KeyError (0), a negative rtol torch's RuntimeError after both runs, and mesh= with a
    mesh_shape= that differs passed on the mesh given: a 2x2 check that ran on 2 ranks."""
    grads = _tree(w=(6, 4), b=(4,))
    check = testing.assert_matches_single_device
    tx = gtx.clip_by_global_norm(1.0)
    with pytest.raises(TypeError, match="assert_matches_single_device: tx must be a GradientTransformation"):
        check(gtx.clip_by_global_norm, [grads], grads, mesh_shape=(2,), layout="fsdp")
    for bad in (grads, [], torch.ones(3)):
        with pytest.raises(ValueError, match="assert_matches_single_device: grads_seq must be a non-empty list"):
            check(tx, bad, grads, mesh_shape=(2,), layout="fsdp")
    with pytest.raises(ValueError, match="assert_matches_single_device: rtol must be >= 0"):
        check(tx, [grads], grads, mesh_shape=(2,), layout="fsdp", rtol=-1.0)
    with testing.simulated_mesh((2,)) as mesh, pytest.raises(ValueError, match="pass mesh= or mesh_shape= and names="):
        check(tx, [grads], grads, mesh=mesh, mesh_shape=(2, 2), layout="tp_fsdp")


def test_distribute_refuses_a_partial_placement():
    """Before: every rank held the whole tensor as a Partial(sum), a DTensor whose value is world times the one
    given (full_tensor() doubled it on 2 ranks)."""
    from torch.distributed.tensor import Partial

    tree = _tree(b=(4,))
    with (
        testing.simulated_mesh((2,)) as mesh,
        pytest.raises(ValueError, match=r"gives b P\(sum\); a full tensor is no"),
    ):
        testing.distribute(tree, mesh, {"b": [Partial()]})


def test_distribute_takes_a_tensor_made_inside_the_block_as_one_full_tensor():
    """Before: a tensor made inside simulated_mesh (torch's factories give it a copy per simulated rank, as in
    distribute's own docstring example) was split copy by copy, so each rank's shard held a copy per rank again:
    every op on it ran world**2 times (30x slower on 4x4), and a Generator's draws, which differ per rank, made a
    DTensor that shards no one tensor (gtx's rank_values then failed on its norm)."""
    reference = torch.arange(12.0).reshape(4, 3)
    with testing.simulated_mesh((2,), ("dp",)) as mesh:
        made_inside = torch.arange(12.0).reshape(4, 3)
        assert isinstance(made_inside, LocalTensor)  # torch's simulation: a copy per rank
        shards = _shards(testing.distribute({"w": made_inside}, mesh, "fsdp")["w"])
        assert all(type(s) is torch.Tensor for s in shards.values())
        torch.testing.assert_close(shards, dict(enumerate(reference.chunk(2))), rtol=0, atol=0)
        drawn = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))  # each rank draws its own numbers
        with pytest.raises(ValueError, match="distribute: the tensor at w differs across the simulated ranks"):
            testing.distribute({"w": drawn}, mesh, "fsdp")


def test_assert_matches_single_device_on_a_reused_mesh_takes_tensors_made_inside_it():
    """Before: grads and params made inside the mesh the check reuses (a copy per simulated rank) crashed it with
    torch's "Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)"."""
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        params = {"w": torch.linspace(-1.0, 2.0, 24).reshape(6, 4), "b": torch.linspace(0.5, 3.0, 4)}
        grads = [{k: (v * 3.0).flip(0) for k, v in params.items()}]
        assert isinstance(params["w"], LocalTensor)
        testing.assert_matches_single_device(gtx.clip_by_global_norm(1.0), grads, params, mesh=mesh, layout="tp_fsdp")
        with pytest.raises(AssertionError, match=r"step 0: updates at \['b'\]: the ranks disagree"):
            testing.assert_matches_single_device(_local_norm_clip(1.0), grads, params, mesh=mesh, layout="tp_fsdp")

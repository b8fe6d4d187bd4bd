"""Simulated meshes: every rank of a DeviceMesh in one process, on torch's ``LocalTensorMode``.

Re-exported from :mod:`gradtx.testing`; see ``docs/testing.md``. Under ``LocalTensorMode`` a DTensor's local
tensor is a ``LocalTensor`` holding each simulated rank's shard, and collectives run over those shards for real:
the code under test runs once, as every rank at the same time.

Two rough edges of torch's simulation are handled here, so they are never reported as a bug of the transform:

* ``distribute_tensor`` gives a fully replicated DTensor a *plain* local tensor shared by all the simulated
  ranks, so an in-place op mixing it with a per-rank ``LocalTensor`` runs once per rank on that one tensor (a
  step counter advances once per rank). Every leaf built here holds one copy per rank instead.
* ``distribute_tensor`` does not build ``_StridedShard`` placements (FSDP2 over TP); leaves here are built
  from per-rank shards.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode, local_tensor_mode, rank_map
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, PyTree
from gradtx.core.base import metrics as _metrics
from gradtx.testing import _mode_off, _values
from gradtx.transforms.combine import apply_updates

PRESETS = ("ddp", "fsdp", "hsdp", "tp", "tp_fsdp", "ep_fsdp", "cp")
_PRESET_NDIM = {"ddp": 1, "fsdp": 1, "tp": 1, "hsdp": 2, "tp_fsdp": 2, "ep_fsdp": 2, "cp": 2}

Layout = str | Mapping[str, Sequence[Placement]] | Callable[[str, torch.Tensor], Sequence[Placement] | None]


@contextlib.contextmanager
def simulated_mesh(shape: Sequence[int] | int, names: Sequence[str] | None = None) -> Iterator[DeviceMesh]:
    """A ``DeviceMesh`` of ``shape`` whose every rank lives in this process (torch's ``LocalTensorMode``).

    Starts a ``"fake"`` process group of ``prod(shape)`` ranks and the mode, and
    yields the mesh; on exit it destroys the process group, so nothing of the
    simulated world outlives the block (and a later block starts afresh). Code
    inside runs once for all ranks: a DTensor's local tensor holds every rank's
    shard, and each collective reduces across them.

    Args:
      shape: the mesh shape, e.g. ``(2, 2)``; up to the number of ranks you can afford (each op runs once per rank).
      names: the mesh dim names, e.g. ``("dp", "tp")``; default ``("d0", "d1", ...)``.

    Yields:
      The simulated ``DeviceMesh`` (on CPU).

    Example:
      >>> with gtx.testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
      ...     grads = gtx.testing.distribute(full_grads, mesh, "tp_fsdp")
      ...     clipped, state = gtx.clip_by_global_norm(1.0).update(grads, tx.init(grads))
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"simulated_mesh: shape must be positive ints, e.g. (2, 2), got {shape!r}")
    if names is None:
        names = tuple(f"d{i}" for i in range(len(shape)))
    elif isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"simulated_mesh: names must be a sequence of strings, one per mesh dim, got {names!r}")
    names = tuple(names)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"simulated_mesh: names must be {len(shape)} distinct strings for shape {shape}, got {names}")
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_mesh: a process group is already initialised in this process; a simulated mesh brings its "
            "own (call it outside torchrun, or destroy the process group first)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    world = math.prod(shape)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with LocalTensorMode(world):
            yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


# --- layouts -------------------------------------------------------------------------------------


def _coords(mesh: DeviceMesh) -> dict[int, tuple[int, ...]]:
    """Each simulated rank's coordinate in ``mesh``, a root mesh or a submesh sliced from one by dim names."""
    root = mesh._get_root_mesh()
    found = _COORDS.get(root)
    if found is None:
        with _mode_off():  # pure Python over the rank layout, computed once per root mesh
            ranks = root.mesh
            found = dict(zip(ranks.reshape(-1).tolist(), itertools.product(*map(range, ranks.shape))))
        _COORDS[root] = found
    if root is mesh:
        return found
    names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    if not names or any(n not in root_names for n in names):
        raise AssertionError(f"cannot place the shards of a DTensor on mesh {mesh}: slice it by dim names")
    dims = [root_names.index(n) for n in names]
    return {r: tuple(c[d] for d in dims) for r, c in found.items()}


# Reading a mesh's rank layout costs ~0.1 s here, and every shard of every leaf needs it. Weak keys: an
# entry lives as long as its mesh (equal meshes have equal coordinates, so a hit is always right).
_COORDS: weakref.WeakKeyDictionary[DeviceMesh, dict[int, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def _local_shard(
    full: torch.Tensor,
    mesh_shape: tuple[int, ...],
    placements: Sequence[Placement],
    coord: tuple[int, ...],
    *,
    copy: bool = True,
) -> torch.Tensor:
    # Mesh dims split in order, except a _StridedShard (FSDP2 over TP): it splits what the later dims left.
    order = sorted(range(len(placements)), key=lambda d: isinstance(placements[d], _StridedShard))  # stable
    local = full
    for d in order:
        p = placements[d]
        if isinstance(p, (Shard, _StridedShard)):  # torch's split: ranks past the last chunk hold an empty shard
            dim = p.dim % max(full.ndim, 1)
            chunks = torch.chunk(local, mesh_shape[d], dim)
            local = chunks[coord[d]] if coord[d] < len(chunks) else local.narrow(dim, 0, 0)
    return local.clone() if copy else local


def preset_placements(preset: str, path: str, leaf: torch.Tensor, index: int, mesh_ndim: int) -> list[Placement] | None:
    """The placements ``preset`` gives one leaf (``None``: a plain replicated tensor, as DDP holds it).

    Mesh dims are read in order, whatever their names. A leaf the parallelism cannot split that way is
    treated as that parallelism treats it: TP keeps 1-D and 0-d leaves (norm weights, a row-wise bias)
    replicated, EP shards only leaves whose path contains ``"expert"`` (dense ones are FSDP-sharded
    and replicated over ``ep``), FSDP2 keeps a 0-d leaf replicated.
    """
    if preset not in _PRESET_NDIM:
        raise ValueError(f"distribute: layout must be one of {list(PRESETS)} or a per-path mapping, got {preset!r}")
    if _PRESET_NDIM[preset] != mesh_ndim:
        raise ValueError(f"distribute: layout {preset!r} takes a {_PRESET_NDIM[preset]}-D mesh, got {mesh_ndim}-D")
    fsdp: Placement = Shard(0) if leaf.ndim >= 1 else Replicate()
    # cp: params FSDP-sharded over dp and replicated over cp, where each rank has its tokens.
    data_parallel = {"ddp": None, "fsdp": [fsdp], "hsdp": [Replicate(), fsdp], "cp": [fsdp, Replicate()]}
    if preset in data_parallel:
        return data_parallel[preset]
    # TP alternates column-wise (Shard(0)) and row-wise (Shard(1)) over the matrices, in flatten order.
    tp: Placement = Replicate() if leaf.ndim < 2 else (Shard(0) if index % 2 == 0 else Shard(1))
    if preset == "tp":
        return [tp]
    if preset == "tp_fsdp":
        # FSDP2 over a TP Shard(0) splits each TP shard's rows again: a _StridedShard on the fsdp dim (a 0-d
        # leaf, which neither splits, is replicated over both).
        return [_StridedShard(0, split_factor=1) if tp == Shard(0) else fsdp, tp]
    # ep_fsdp: experts split over ep (dim 0, the expert dim) and FSDP-sharded over fsdp along dim 1.
    if "expert" in path and leaf.ndim >= 1:
        return [Shard(1) if leaf.ndim >= 2 else Replicate(), Shard(0)]
    return [fsdp, Replicate()]


def _strided(placements: list[Placement], mesh: DeviceMesh) -> list[Placement]:
    # The split factor is the size of the later mesh dims that shard the same tensor dim.
    out = list(placements)
    for d, p in enumerate(out):
        if isinstance(p, _StridedShard):
            later = [mesh.size(e) for e, q in enumerate(out) if e > d and isinstance(q, Shard) and q.dim == p.dim]
            out[d] = _StridedShard(p.dim, split_factor=math.prod(later))
    return out


def _lookup(layout: Mapping[str, Sequence[Placement]], path: str) -> Sequence[Placement] | None:
    return next((p for key, p in layout.items() if path == key or fnmatch.fnmatchcase(path, key)), None)


def distribute(tree: PyTree, mesh: DeviceMesh, layout: Layout) -> PyTree:
    """Full tensors to DTensors on a simulated ``mesh``, laid out as a parallelism lays out params and grads.

    On a real mesh (a multi-process run) each rank builds its own part the same way.

    Args:
      tree: a pytree of full (single-device) tensors.
      mesh: a mesh from :func:`simulated_mesh`.
      layout: a preset, reading the mesh dims in order whatever their names: ``"ddp"`` (1-D: plain tensors,
        one replica per rank), ``"fsdp"`` (1-D: ``Shard(0)``), ``"tp"`` (1-D: matrices alternate
        ``Shard(0)``/``Shard(1)``, vectors replicated), ``"hsdp"`` (replicate, shard), ``"tp_fsdp"`` (fsdp, tp:
        FSDP2 over TP, ``_StridedShard`` included), ``"ep_fsdp"`` (fsdp, ep: leaves whose path contains
        ``"expert"`` split over ep) or ``"cp"`` (dp, cp); or a mapping from dotted path or glob to placements
        (unmatched leaves are replicated, a key matching no leaf is an error), or a function
        ``(path, leaf) -> placements or None``. Shapes need not divide: ranks past the last chunk hold empty
        shards, as with FSDP2.

    Returns:
      The same tree with DTensor leaves (plain per-rank replicas under ``"ddp"``). Every rank holds its own copy
      of each local tensor.

    Example:
      >>> with gtx.testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
      ...     grads = gtx.testing.distribute({"w": torch.randn(5, 3)}, mesh, "tp_fsdp")
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"distribute: mesh must be a DeviceMesh from simulated_mesh, got {type(mesh).__name__}")
    if local_tensor_mode() is None and (not dist.is_initialized() or dist.get_backend() == "fake"):
        raise RuntimeError("distribute: call it inside gtx.testing.simulated_mesh(...), or on every rank of a real run")
    if not (isinstance(layout, (str, Mapping)) or callable(layout)):
        raise TypeError(
            f"distribute: layout must be a preset name, a mapping or a function, got {type(layout).__name__}"
        )
    paths, leaves, spec = optree.tree_flatten_with_path(_full(tree))
    names = [tu.dotted(path) for path in paths]
    if unused := [k for k in (layout if isinstance(layout, Mapping) else ()) if not fnmatch.filter(names, k)]:  # typos
        raise ValueError(f"distribute: layout keys {unused} match no leaf; paths look like {names[:3]}")
    out: list[Any] = []
    matrices = 0
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        dotted = tu.dotted(path)
        if isinstance(layout, str):
            placements = preset_placements(layout, dotted, leaf, matrices, mesh.ndim)
            matrices += leaf.ndim >= 2
        else:
            found = layout(dotted, leaf) if callable(layout) else _lookup(layout, dotted)
            placements = [_checked(p, dotted, leaf) for p in found] if found is not None else [Replicate()] * mesh.ndim
            if len(placements) != mesh.ndim:
                raise ValueError(
                    f"distribute: layout gives {dotted} {len(placements)} placements for a {mesh.ndim}-D mesh"
                )
        out.append(_put(leaf.detach(), mesh, None if placements is None else _strided(list(placements), mesh)))
    return optree.tree_unflatten(spec, out)


def _full(tree: PyTree) -> PyTree:
    """``tree`` with each tensor made inside the simulation (torch's factories give each rank a copy) as the one full
    tensor it holds: split copy by copy, each rank's shard would hold a copy per rank again (world**2 work per op)."""

    def whole(path: Any, x: Any) -> Any:
        if not isinstance(x, LocalTensor):
            return x
        with _mode_off():
            first, *rest = _values(x)
            if all(
                torch.equal(t.isnan(), first.isnan()) and torch.equal(t.nan_to_num(), first.nan_to_num()) for t in rest
            ):
                return first
        raise ValueError(
            f"distribute: the tensor at {tu.dotted(path)} differs across the simulated ranks (drawn inside "
            "simulated_mesh from a torch.Generator, each rank draws its own); make the full tensors before the block"
        )

    return optree.tree_map_with_path(whole, tree, none_is_leaf=True)


def _checked(placement: Any, dotted: str, leaf: torch.Tensor) -> Placement:
    """A placement the layout gives, refused naming the path unless it fits the leaf; a negative ``Shard`` dim
    counts from the end, as in torch's ``distribute_tensor``."""
    if not isinstance(placement, Placement):
        raise TypeError(f"distribute: layout gives {dotted} a {type(placement).__name__}, not a Placement (Shard(0))")
    if placement.is_partial():  # every rank would hold the whole tensor: a pending sum of world copies of it
        raise ValueError(f"distribute: layout gives {dotted} {placement}; a full tensor is no pending sum")
    if not isinstance(placement, Shard):
        return placement
    dim = placement.dim + leaf.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < leaf.ndim:
        raise ValueError(f"distribute: layout shards {dotted} (shape {tuple(leaf.shape)}) on dim {placement.dim}")
    return Shard(dim) if type(placement) is Shard else placement


def _put(full: torch.Tensor, mesh: DeviceMesh, placements: list[Placement] | None) -> torch.Tensor:
    """``full`` as a DTensor of ``placements`` on ``mesh`` (``None``: a plain replica), every rank holding its own copy
    of its part (split as torch's ``Shard`` splits): torch's ``rank_map`` makes one per simulated rank, or in a real
    run this rank's."""
    if placements is None:  # one copy per rank, as DDP holds it
        return rank_map(lambda r: full.clone())
    coords = _coords(mesh)
    local = rank_map(lambda r: _local_shard(full, tuple(mesh.shape), placements, coords[r]))
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(full.shape, full.stride(), full.dtype))
    return DTensor(local, spec, requires_grad=False)


# --- the check -----------------------------------------------------------------------------------


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    # A redistribute's output may still be wrapped as a pending functional collective; its value is inside.
    while isinstance(t, AsyncCollectiveTensor):
        t = t.elem
    return t


def _per_rank(x: torch.Tensor, ref: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's part of ``x``, beside the same part of the single-device ``ref``: every simulated rank, or this one.

    A DTensor is compared shard by shard (no gather: ``ref`` is split as the DTensor is), anything else
    as a whole; a value every simulated rank shares is compared once per rank.
    """
    mode = local_tensor_mode()
    ranks = sorted(mode.ranks) if mode is not None else [dist.get_rank()]
    if isinstance(x, DTensor):
        mesh, value = x.device_mesh, _unwrap(x._local_tensor)
        coords = _coords(mesh)
        shape, placements = tuple(mesh.shape), tuple(x.placements)
        parts = {r: _local_shard(ref, shape, placements, coords[r], copy=False) for r in ranks}
    else:
        value = _unwrap(x)
        parts = dict.fromkeys(ranks, ref)
    held = value._local_tensors if isinstance(value, LocalTensor) else dict.fromkeys(parts, value)
    return {r: (t.detach(), parts[r]) for r, t in sorted(held.items())}


def _compare(what: str, got: PyTree, expected: PyTree, *, rtol: float, atol: float) -> None:
    if (got is None) != (expected is None):
        raise AssertionError(f"{what}: one device gave {type(expected).__name__}, the mesh {type(got).__name__}")
    where = tu.first_mismatch(expected, got)  # (two Nones match, with no leaf to compare)
    if where is not None:
        raise AssertionError(f"{what}: the mesh's tree differs from one device's at {where}")
    e_paths, e_leaves, _ = optree.tree_flatten_with_path(expected, none_is_leaf=True)
    _, g_leaves, _ = optree.tree_flatten_with_path(got, none_is_leaf=True)
    for path, e, g in zip(e_paths, e_leaves, g_leaves):
        name = f"{what} at {tu.path_str(path)}"
        if not isinstance(e, torch.Tensor):
            if isinstance(g, torch.Tensor) or e != g:
                raise AssertionError(f"{name}: one device has {e!r}, the mesh {g!r}")
            continue
        if not isinstance(g, torch.Tensor):
            raise AssertionError(f"{name}: one device has a tensor, the mesh {type(g).__name__}")  # noqa: TRY004
        with _mode_off():  # plain per-rank tensors from here on: no per-op dispatch through the mode
            _check_ranks(name, _per_rank(g, tu.local(e).detach()), rtol=rtol, atol=atol)


def _placements(x: DTensor) -> str:
    return ", ".join(f"Shard({p.dim})" if isinstance(p, Shard) else repr(p) for p in x.placements)


def _check_placements(what: str, got: PyTree, given: PyTree) -> None:
    """Fail, naming the leaf, where ``tx`` returned a DTensor placed otherwise than the grad it was given."""
    paths, out, _ = optree.tree_flatten_with_path(got, none_is_leaf=True)
    inputs = optree.tree_leaves(given, none_is_leaf=True)
    for path, g, x in zip(paths, out, inputs if len(inputs) == len(out) else []):
        if isinstance(g, DTensor) and isinstance(x, DTensor) and tuple(g.placements) != tuple(x.placements):
            raise AssertionError(
                f"{what} at {tu.path_str(path)}: the placement changed, {_placements(x)} -> {_placements(g)}: the "
                "transform returned a DTensor placed otherwise than its grad (a to_local/from_local that lost the "
                "placements, or a forgotten redistribute), so its ranks' values are not the grad's shards"
            )


def _check_ranks(name: str, ranks: dict[int, tuple[torch.Tensor, torch.Tensor]], *, rtol: float, atol: float) -> None:
    # Ranks that hold the same part of the value must agree bitwise; a rank-inconsistent value names them.
    # Per part of one device's value (a view of it): that part, and each value ranks hold (NaNs as numbers) and who.
    parts: dict[tuple[Any, ...], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, list[int]]]]] = {}
    for r, (t, ref) in ranks.items():
        key = (tuple(ref.shape), ref.data_ptr(), ref.storage_offset(), tuple(ref.stride()))
        _, held = parts.setdefault(key, (ref, []))
        n = torch.nan_to_num(t)
        same = (m for _, v, m in held if v.shape == n.shape and v.dtype == n.dtype and torch.equal(v, n))
        members = next(same, None)
        if members is None:
            held.append((t, n, [r]))
        else:
            members.append(r)
    for ref, held in parts.values():
        if len(held) > 1:
            values = "; ".join(f"ranks {m} hold {_short(v)}" for v, _, m in held)
            raise AssertionError(f"{name}: the ranks disagree ({values}); one device has {_short(ref)}")
    for r, (t, ref) in ranks.items():
        if t.dtype != ref.dtype or t.shape != ref.shape:
            raise AssertionError(
                f"{name}: rank {r} holds {t.dtype}{tuple(t.shape)}, one device's part {ref.dtype}{tuple(ref.shape)}"
            )
        if t.numel() == 0 or torch.allclose(t, ref, rtol=rtol, atol=atol, equal_nan=True):
            continue
        try:
            torch.testing.assert_close(t, ref, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            bad = [q for q, (u, v) in ranks.items() if not torch.allclose(u, v, rtol=rtol, atol=atol, equal_nan=True)]
            raise AssertionError(f"{name}: ranks {bad} differ from one device: {err}") from None


def _short(t: torch.Tensor) -> str:
    return f"{t.reshape(-1)[:4].tolist()}{'...' if t.numel() > 4 else ''}"


def assert_matches_single_device(
    tx: GradientTransformation,
    grads_seq: Sequence[PyTree],
    params: PyTree,
    *,
    mesh_shape: Sequence[int] | int | None = None,
    names: Sequence[str] | None = None,
    layout: Layout,
    steps: int | None = None,
    mesh: DeviceMesh | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **extra: Any,
) -> None:
    """Run ``tx`` on one device and on a mesh; assert that every rank gets the single-device answer at every step.

    The same grads and params run through ``tx`` twice: as full tensors, and laid out by ``layout`` on a mesh of
    ``mesh_shape`` (simulated in this process with :func:`simulated_mesh`, or the real mesh when this runs under
    ``torchrun`` with ``prod(mesh_shape)`` ranks). After every step the updates (gathered from their shards), the
    params after :func:`gradtx.apply_updates`, the metrics (:func:`gradtx.metrics`) and the whole state must match
    the single-device run on every rank; a value that the ranks do not agree on (a norm, a verdict, a counter)
    fails, naming the path and the ranks that disagree.

    Args:
      tx: the transform under test.
      grads_seq: full (single-device) grad trees, one per step (cycled when ``steps`` is longer).
      params: the full params tree.
      mesh_shape: the mesh shape, e.g. ``(2, 2)``.
      names: the mesh dim names; default ``("d0", ...)``.
      layout: a preset or placement map for :func:`distribute` (used for params and grads alike).
      steps: how many steps; default ``len(grads_seq)``.
      mesh: a mesh to reuse instead (one from an enclosing :func:`simulated_mesh`, or a real one): many checks in
        one simulated world cost one start-up.
      rtol: relative tolerance: sharded sums add in another order than one device's.
      atol: absolute tolerance.
      **extra: forwarded to every ``update`` (e.g. ``tokens=``).

    Example:
      >>> grads_seq = [{"w": torch.randn(5, 3)} for _ in range(3)]
      >>> gtx.testing.assert_matches_single_device(
      ...     gtx.clip_by_global_norm(1.0), grads_seq, {"w": torch.randn(5, 3)},
      ...     mesh_shape=(2, 2), names=("dp", "tp"), layout="tp_fsdp")
    """
    name = "assert_matches_single_device"
    check.transform(tx, arg="tx", name=name)
    if not isinstance(grads_seq, Sequence) or not grads_seq:  # a dict: one grads tree, not a list of them
        given = grads_seq if isinstance(grads_seq, Sequence) else type(grads_seq).__name__
        raise ValueError(f"{name}: grads_seq must be a non-empty list of grads trees, one per step, got {given}")
    if mesh is not None and (mesh_shape, names) != (None, None):
        raise ValueError(f"{name}: pass mesh= or mesh_shape= and names=, not both (mesh {mesh} is used as it is)")
    rtol, atol = (check.non_negative(v, arg=a, name=name) for v, a in ((rtol, "rtol"), (atol, "atol")))
    steps = len(grads_seq) if steps is None else check.integer(steps, arg="steps", name=name, minimum=1)
    params, grads_seq = _full(params), _full(list(grads_seq))  # made inside a reused mesh: one device has them whole
    real = dist.is_initialized() and local_tensor_mode() is None
    mesh_cm: Any = contextlib.nullcontext(mesh)
    if mesh is None:
        if mesh_shape is None:
            raise ValueError("assert_matches_single_device: pass mesh_shape=(...) (or a mesh= to reuse)")
        if not real:
            mesh_cm = simulated_mesh(mesh_shape, names)  # (it checks the shape and the names)
        else:  # under torchrun: the real mesh of every rank
            shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
            if dist.get_world_size() != math.prod(shape):
                raise ValueError(
                    f"assert_matches_single_device: mesh_shape {shape} has {math.prod(shape)} ranks, the process "
                    f"group {dist.get_world_size()}"
                )
            names = tuple(names) if names is not None else tuple(f"d{i}" for i in range(len(shape)))
            mesh_cm = contextlib.nullcontext(init_device_mesh("cpu", shape, mesh_dim_names=names))

    expected = []
    with _mode_off():  # inside a reused simulated mesh, one device is plain tensors with the mode off
        ref_params, ref_state = params, tx.init(params)
        for i in range(steps):
            u, ref_state = tx.update(grads_seq[i % len(grads_seq)], ref_state, ref_params, **extra)
            ref_params = apply_updates(ref_params, u)
            expected.append({"updates": u, "metrics": _metrics(ref_state), "state": ref_state, "params": ref_params})

    with mesh_cm as on:
        d_params = distribute(params, on, layout)
        d_state = tx.init(d_params)
        for i in range(steps):
            grads = g = grads_seq[i % len(grads_seq)]
            if any(x is None for x in optree.tree_leaves(g, none_is_leaf=True)):
                # A preset places each matrix by its position among them ("tp"): the params fill the missing
                # grads' places, so the others are laid out as their params.
                grads = optree.tree_map(lambda x, p: p if x is None else x, g, params, none_is_leaf=True)
            grads = optree.tree_map(
                lambda x, d: None if x is None else d, g, distribute(grads, on, layout), none_is_leaf=True
            )
            u, d_state = tx.update(grads, d_state, d_params, **extra)
            _check_placements(f"step {i}: updates", u, grads)
            d_params = apply_updates(d_params, u)
            got = {"updates": u, "metrics": _metrics(d_state), "state": d_state, "params": d_params}
            for what, exp in expected[i].items():
                _compare(f"step {i}: {what}", got[what], exp, rtol=rtol, atol=atol)

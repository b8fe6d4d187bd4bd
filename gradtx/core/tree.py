"""Small optree helpers: leaf paths for error messages, structure checks, foreach grouping.

Every transform flattens its trees with :func:`flatten`, so leaves come in one
order everywhere, and reports a bad tree through :func:`check_structure`,
which names the first pytree path that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import optree
import torch

from gradtx.core import foreach as fe

try:  # DTensor is optional: a CPU-only or old build may lack torch.distributed.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    compute_local_shape_and_global_offset = None  # type: ignore[assignment]

PyTree = Any
Path = tuple[Any, ...]


def path_str(path: Path) -> str:
    """Render an optree path like ``['fc']['weight'][0]``; the root is ``<root>``."""
    if not path:
        return "<root>"
    return "".join(f"[{key!r}]" for key in path)


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into its leaves and treespec (``None`` is an empty subtree)."""
    return optree.tree_flatten(tree)


# optree's own functions, under the names every transform uses: ``unflatten(spec, leaves)``, ``paths(tree)``
# (each leaf's path, in flatten order) and ``tree_map(fn, tree, *rest)``.
unflatten = optree.tree_unflatten
paths = optree.tree_paths
tree_map = optree.tree_map


def tensor_leaves(tree: PyTree, *, what: str) -> tuple[list[torch.Tensor], Any]:
    """``tree``'s leaves and structure, after :func:`check_tensors` (``what`` names the tree in the error)."""
    leaves, spec = flatten(tree)
    check_tensors(leaves, tree=tree, what=what)
    return leaves, spec


def device_of(tree: PyTree) -> torch.device:
    """The device of ``tree``'s first tensor (a DTensor's local shard's), or the CPU when it holds none."""
    tensors = (leaf for leaf in flatten(tree)[0] if isinstance(leaf, torch.Tensor))
    return next((local(t).device for t in tensors), torch.device("cpu"))


def dotted(path: tuple[Any, ...]) -> str:
    """A pytree path as ``"a.b.0"`` (``"<root>"`` for the root)."""
    return ".".join(str(k) for k in path) if path else "<root>"


def _shape_mismatch(expected: Any, got: Any) -> str | None:
    """How ``got``'s shape differs from ``expected``'s, or ``None`` (also when either has no shape)."""
    e_shape, g_shape = getattr(expected, "shape", None), getattr(got, "shape", None)
    if e_shape is None or g_shape is None or e_shape == g_shape:
        return None
    return f"expected shape {tuple(e_shape)}, got {tuple(g_shape)}"


def first_mismatch(expected: PyTree, got: PyTree) -> str | None:
    """Describe where ``got`` first differs in structure from ``expected``, or ``None``."""
    exp_leaves, exp_spec = optree.tree_flatten(expected)
    got_leaves, got_spec = optree.tree_flatten(got)
    if exp_spec == got_spec:
        # Every step checks its trees and almost always they match: settle that without building paths.
        shapes = list(map(_shape_mismatch, exp_leaves, got_leaves))
        if not any(shapes):
            return None
        i = next(i for i, shape in enumerate(shapes) if shape is not None)
        return f"{path_str(exp_spec.paths()[i])}: {shapes[i]}"
    exp_paths, got_paths = exp_spec.paths(), got_spec.paths()
    for e, g in zip(exp_paths, got_paths):
        if e != g:
            return f"{path_str(g)}: expected a leaf at {path_str(e)}"
    if len(exp_paths) > len(got_paths):
        return f"{path_str(exp_paths[len(got_paths)])}: missing"
    if len(got_paths) > len(exp_paths):
        return f"{path_str(got_paths[len(exp_paths)])}: unexpected"
    return f"<root>: expected structure {exp_spec}, got {got_spec}"


def check_structure(expected: PyTree, got: PyTree, *, what: str, against: str) -> None:
    """Raise ``ValueError`` naming the first path where ``got`` differs from ``expected``."""
    where = first_mismatch(expected, got)
    if where is not None:
        raise ValueError(f"{what} does not match {against} at {where}")


def require_state(state: Any, state_type: type, *, name: str) -> None:
    """Raise a clear error when ``update`` gets no state, or another transform's state."""
    if state is None:
        raise ValueError(f"{name}: state is None; call init(params) before update()")
    if not isinstance(state, state_type):
        raise TypeError(
            f"{name}: expected state of type {state_type.__name__}, got {type(state).__name__}; "
            "pass the state that this transform's init() returned"
        )


def check_tensors(
    leaves: Sequence[Any], leaf_paths: Sequence[Path] | None = None, *, tree: PyTree = None, what: str
) -> None:
    """Raise ``TypeError`` naming the first leaf that is not a dense floating-point or complex tensor.

    Integer and bool tensors have no gradient to transform (a clip or a moment
    would truncate them silently), and sparse tensors are refused as
    ``torch.nn.utils.clip_grad_norm_`` refuses them. The leaves' paths, for the
    message, are ``leaf_paths``, or read from ``tree`` only when a leaf fails.
    """
    # Three C-level passes (types, dtypes, layouts) cost two thirds of a Python loop over the leaves,
    # and run on every step; the loop runs to name the leaf that fails (and under dynamo, which
    # cannot trace an attrgetter).
    if not torch.compiler.is_compiling() and (
        all(issubclass(t, torch.Tensor) for t in set(map(type, leaves)))
        and set(attrs(leaves, "dtype")) <= _GRAD_DTYPES
        and set(attrs(leaves, "layout")) <= {torch.strided}
    ):
        return
    for i, leaf in enumerate(leaves):
        problem = _leaf_problem(leaf)
        if problem is not None:
            path = path_str(leaf_paths[i] if leaf_paths is not None else paths(tree)[i])
            raise TypeError(f"{what} leaf at {path} {problem}")


_GRAD_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.complex128}
)


def _leaf_problem(leaf: Any) -> str | None:
    """Why ``leaf`` is not a dense floating-point or complex tensor (the end of the error), or ``None``."""
    if not isinstance(leaf, torch.Tensor):
        return f"is a {type(leaf).__name__}, not a torch.Tensor"
    if leaf.layout != torch.strided:
        return (
            f"is a {leaf.layout} tensor of shape {tuple(leaf.shape)} (a sparse grad, e.g. of "
            "nn.Embedding(sparse=True)); "
            "gradtx transforms dense tensors only, as torch.nn.utils.clip_grad_norm_ refuses sparse grads: build "
            "that embedding with sparse=False, or give its param a chain with no norm (no clip, no global norm)"
        )
    if not (leaf.is_floating_point() or leaf.is_complex()):
        return f"has dtype {leaf.dtype}; gradients and params must be floating point or complex"
    return None


def check_devices(expected: Sequence[Any], got: Sequence[Any], tree: PyTree, *, what: str, against: str) -> None:
    """Raise ``ValueError`` naming the first leaf of ``tree`` whose (local) device differs from its partner's.

    ``got`` are the leaves of ``tree`` (e.g. the updates), ``expected`` the leaves
    they are combined with (the state's moments, the params), in the same order.
    """
    for i, (e, g) in enumerate(zip(expected, got)):
        if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and local(e).device != local(g).device:
            raise ValueError(
                f"{what} leaf at {path_str(paths(tree)[i])} is on {local(g).device}, {against} on "
                f"{local(e).device}; move them to one device"
            )


def attrs(xs: Sequence[Any], name: str) -> Any:
    """``xs``' attribute ``name``: read in C (``map`` with ``attrgetter``) eagerly; traced once under compile."""
    return [getattr(x, name) for x in xs] if torch.compiler.is_compiling() else map(attrgetter(name), xs)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision to compute a leaf's norms and factors in: fp64 for fp64/complex128, fp32 otherwise."""
    return torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32


def has_dtensor(leaves: Sequence[Any]) -> bool:
    """Whether any of ``leaves`` is a DTensor (one C-level pass over their types)."""
    return DTensor is not None and any(issubclass(t, DTensor) for t in set(map(type, leaves)))


def root_meshes(leaves: Sequence[Any]) -> list[Any]:
    """The root meshes of ``leaves``' DTensors, each once.

    Equal meshes count once, not only the same object: DTensor's
    sharding-propagation cache hands out specs that hold an earlier, equal
    mesh, so one model's grads may name two root objects for one grid.
    """
    meshes = {id(t.device_mesh): t.device_mesh for t in leaves if DTensor is not None and isinstance(t, DTensor)}
    roots: list[Any] = []
    for root in (m._get_root_mesh() for m in meshes.values()):
        if root not in roots:
            roots.append(root)
    return roots


def local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the shard itself, not a view autograd records), or the tensor itself."""
    if DTensor is None or not isinstance(x, DTensor):
        return x
    with torch.no_grad():
        return x.to_local()


def local_shards(xs: Sequence[Any]) -> list[Any]:
    """:func:`local` of each of ``xs``, under one ``no_grad`` for all of them (entering it costs 4 us, a
    ``to_local()`` inside it 0.4 us: per leaf, most of a norm's host work on a sharded model)."""
    if not has_dtensor(xs):
        return list(xs)
    with torch.no_grad():
        return [x.to_local() if isinstance(x, DTensor) else x for x in xs]


def check_placed(what: str, tree: PyTree, index: Sequence[int], xs: Sequence[Any], like: Sequence[Any] = ()) -> None:
    """Raise naming the first of ``xs`` (the leaves ``index`` of ``tree``) that is a ``Partial`` DTensor: a pending
    sum, whose local term every rank would take for the whole (right only for a stateless map linear in it); or,
    given ``like`` (``tree``'s leaves), one placed otherwise than its leaf there, whose local shard a local op would
    combine with another part of the tensor (silently, where the local shapes agree)."""
    if not (has_dtensor(xs) or has_dtensor(like)):
        return
    for i, x in zip(index, xs):
        placements = tuple(getattr(x, "placements", ()))
        if any(p.is_partial() for p in placements):
            raise ValueError(
                f"{what} leaf at {path_str(paths(tree)[i])} is a Partial DTensor (a pending sum), whose local term "
                "each rank would take for the whole; reduce it first (redistribute to Replicate or Shard)"
            )
        if like and placements != tuple(getattr(like[i], "placements", ())):
            raise ValueError(
                f"{what} leaf at {path_str(paths(tree)[i])} has placements {placements or 'none (a plain tensor)'}, "
                f"the state or params it is combined with {tuple(getattr(like[i], 'placements', ())) or 'none'}; "
                "shard them alike (init the state from the params as they are sharded now)"
            )


def local_part(full: torch.Tensor, like: Any) -> torch.Tensor:
    """The part of ``full`` (a whole tensor) this rank holds of the DTensor ``like``, cut out with no communication."""
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    for dim, (n, start) in enumerate(zip(shape, offset)):
        full = full.narrow(dim, start, n)  # narrow, not a slice: on a simulated mesh the offsets are per-rank SymInts
    return full


def like(template: torch.Tensor, local_result: torch.Tensor) -> torch.Tensor:
    """Wrap ``local_result`` the way ``template`` is wrapped (a DTensor with the same spec), with no communication."""
    if DTensor is not None and isinstance(template, DTensor):
        return DTensor.from_local(
            local_result,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    return local_result


def all_reduce_leaves(
    comm: Any, leaves: Sequence[torch.Tensor], op: Any, group: Any, *, write_back: bool = False
) -> list[Any]:
    """Reduce ``leaves`` over ``group`` through ``comm``, one coalesced collective on their local shards.

    With ``write_back`` the results are written back into the leaves (the same
    objects, so ``.grad`` tensors and DTensor metadata are kept); otherwise new
    leaves are returned, wrapped like the inputs.
    """
    locals_ = [local(t) for t in leaves]
    reduced = comm.all_reduce(locals_, op, group)
    if not write_back:
        return [like(t, r) for t, r in zip(leaves, reduced)]
    for loc, r in zip(locals_, reduced):
        if r is not loc:  # a one-process comm hands its inputs back
            loc.copy_(r)
    return list(leaves)


def scale_leaves(
    leaves: Sequence[torch.Tensor], factor: torch.Tensor, *, write_back: bool = False
) -> list[torch.Tensor]:
    """Multiply every leaf by the 0-d tensor ``factor``, through local shards, keeping dtypes.

    With ``write_back`` the leaves' storage is overwritten and the same objects
    are returned; otherwise new tensors are returned and the leaves are untouched.
    """
    locals_ = [local(t) for t in leaves]
    out: list[torch.Tensor] = list(leaves)
    for (device, dtype), idx in fe.group_by_device_dtype(locals_):
        group = [locals_[i] for i in idx]
        f = factor.to(device, acc_dtype(dtype), non_blocking=True)
        recording = torch.is_grad_enabled() and (f.requires_grad or any(t.requires_grad for t in group))
        if write_back and not recording and not fe.under_vmap():
            fe.mul_(group, f)
        else:
            # Autograd records (a hypergradient, or grads through the step): always new tensors, which
            # every pure caller reads from the result (the donated paths run under no_grad).
            # aot autograd (torch 2.13) cannot trace foreach_mul by a tensor scalar while autograd records.
            # Under vmap foreach has no batching rule: one multiply per tensor there too.
            scaled = [t * f for t in group] if recording or fe.under_vmap() else fe.mul(group, f)
            for i, r in zip(idx, scaled):
                # A 0-d low-precision leaf times a 0-d fp32 factor would promote to fp32.
                out[i] = like(leaves[i], r if r.dtype == locals_[i].dtype else r.to(locals_[i].dtype))
    return out


# --- absent leaves and prefix trees ---------------------------------------------------------
#
# optree treats ``None`` as an empty subtree. A grads tree may hold ``None`` where the params hold
# a tensor (a param that got no gradient); every transform then leaves that param's state alone
# and returns ``None`` there, as torch.optim skips a param whose ``.grad`` is None.


def align(
    reference: PyTree, updates: PyTree, *, what: str, against: str, tensors: bool = True
) -> tuple[list[int], list[Any], Any]:
    """Match the leaves of ``updates`` to those of ``reference``, allowing ``None`` (no update) for any of them.

    ``updates`` must have the structure of ``reference``, except that a subtree
    or leaf of ``reference`` may be ``None`` in ``updates``. Shapes must match.

    Args:
      reference: the full tree (the params, or a state tree mirroring them).
      updates: the updates tree.
      what: how to name ``updates`` in an error.
      against: how to name ``reference`` in an error.
      tensors: also require every (non-``None``) leaf of ``updates`` to be a tensor.

    Returns:
      ``(index, leaves, spec)``: ``leaves`` and ``spec`` are the flattened
      updates (``None`` dropped), and ``leaves[j]`` goes with the reference
      leaf ``index[j]``.

    Raises:
      ValueError: naming the first path that is missing, unexpected, or of another shape.
    """
    ref_leaves, ref_spec = optree.tree_flatten(reference)
    leaves, spec = optree.tree_flatten(updates)
    if tensors:
        check_tensors(leaves, tree=updates, what=what)
    if spec == ref_spec:
        if any(map(_shape_mismatch, ref_leaves, leaves)):
            check_structure(reference, updates, what=what, against=against)
        return list(range(len(leaves))), leaves, spec
    ref_paths = ref_spec.paths()
    where = {p: i for i, p in enumerate(ref_paths)}
    index: list[int] = []
    for path, leaf in zip(spec.paths(), leaves):
        i = where.get(path)
        if i is None:
            raise ValueError(f"{what} does not match {against} at {path_str(path)}: unexpected")
        shape = _shape_mismatch(ref_leaves[i], leaf)
        if shape is not None:
            raise ValueError(f"{what} does not match {against} at {path_str(path)}: {shape}")
        index.append(i)
    all_paths, all_leaves, _ = optree.tree_flatten_with_path(updates, none_is_leaf=True)
    absent = {p for p, leaf in zip(all_paths, all_leaves) if leaf is None}
    covered = set(index)
    for i, path in enumerate(ref_paths):
        if i not in covered and not any(path[:k] in absent for k in range(len(path) + 1)):
            raise ValueError(f"{what} does not match {against} at {path_str(path)}: missing")
    return index, leaves, spec


def scatter(size: int, index: Sequence[int], values: Sequence[Any]) -> list[Any]:
    """A list of ``size`` items: ``values[j]`` at ``index[j]``, ``None`` elsewhere."""
    out: list[Any] = [None] * size
    for i, v in zip(index, values):
        out[i] = v
    return out


def _prefix_mismatch(prefix: PyTree, full: PyTree, path: Path = ()) -> Path:
    """The first path at which ``prefix`` stops being a prefix of ``full`` (best effort, for messages).

    Called only where ``prefix`` is not a prefix of ``full``, so ``prefix`` is never a leaf (a leaf is a
    prefix of any tree).
    """
    if optree.tree_is_leaf(full) or type(prefix) is not type(full):
        return path
    p_children, _, p_entries, _ = optree.tree_flatten_one_level(prefix)
    f_children, _, f_entries, _ = optree.tree_flatten_one_level(full)
    if list(p_entries) != list(f_entries):
        return path
    for entry, p, f in zip(p_entries, p_children, f_children):
        try:
            optree.tree_broadcast_prefix(p, f)
        except (ValueError, TypeError):
            return _prefix_mismatch(p, f, (*path, entry))
    return path


def prefix_leaves(prefix: PyTree, full: PyTree, *, what: str, against: str) -> list[Any]:
    """Broadcast ``prefix`` (a tree with the structure of ``full`` down to some depth) to one value per leaf of ``full``.

    A leaf of ``prefix`` stands for every leaf of the subtree of ``full`` it
    covers (a single value covers the whole tree), as optax's masks and labels do.

    Raises:
      ValueError: naming the path at which ``prefix`` is not a prefix of ``full``.
    """
    try:
        broadcast = optree.tree_broadcast_prefix(prefix, full)
    except (ValueError, TypeError) as e:
        detail = str(e).split("; dict:")[0].split("; list:")[0].split("; tuple:")[0]
        raise ValueError(
            f"{what} is not a prefix of {against} at {path_str(_prefix_mismatch(prefix, full))}: {detail:.300}"
        ) from None
    return optree.tree_structure(full).flatten_up_to(broadcast)

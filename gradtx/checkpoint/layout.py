"""Walking a transform state: which pieces are per parameter, which are global, and accumulation windows.

A transform state is a pytree of (D)Tensors. A subtree shaped like the params
(one tensor per param, Adam's moments, a trace) is *per parameter*; every
other leaf is *global* (counters, the last grad norm). An accumulation
window's state (:class:`~gradtx.transforms.accumulation.AccumulateState`,
recognised by its type) is walked field by field, its running sum ``acc``
kept apart. Keys are the pieces' paths joined with ``/``. Used by
:mod:`gradtx.checkpoint.functional` and the wrapper's checkpoint format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from gradtx.core import tree as tu
from gradtx.core.base import GradientTransformation, OptState, Params
from gradtx.distributed.context_parallel import sums_over
from gradtx.transforms.accumulation import AccumulateState, Accumulation
from gradtx.transforms.combine import Chain
from gradtx.transforms.window import multi_process

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


# --- walking a state: which subtrees are per parameter -------------------------------------------


def key_of(accessor: optree.PyTreeAccessor) -> str:
    # A NamedTuple's field is keyed by its name ("1/mu"), not its position. DCP joins nested keys with "."
    # and torch's flattened optimizer dicts split on it: keep it out.
    parts = (e.field if isinstance(e, optree.NamedTupleEntry) else e.entry for e in accessor)
    return "/".join(str(c).replace(".", ":").replace("/", ":") for c in parts) or "<root>"


class Window(NamedTuple):
    """An accumulation window's state found in the walk: its key prefix and the state."""

    prefix: str
    state: Any

    def key(self, field_name: str) -> str:
        return field_name if self.prefix == "<root>" else f"{self.prefix}/{field_name}"


class Layout(NamedTuple):
    """Where every piece of a state goes: per-parameter subtrees and global leaves, by key."""

    per_param: dict[str, Any]  # key -> subtree shaped like the params
    globals_: dict[str, Any]  # key -> leaf
    windows: list[Window]
    # A global leaf inside a tree like the params with holes (a masked member's state, None where masked) or with a
    # subtree per param: key -> (the param's flat index, the key before and after the param's place in it).
    places: dict[str, tuple[int, str, str]]


def is_per_param(node: Any, p_spec: Any, p_leaves: list[torch.Tensor]) -> bool:
    leaves, spec = tu.flatten(node)
    if spec != p_spec or not leaves:
        return False
    return all(isinstance(t, torch.Tensor) and t.shape == p.shape for t, p in zip(leaves, p_leaves))


def walk(
    state: OptState, params: Params, rebuild: Callable[[str, Any, str], Any] | None = None
) -> tuple[Layout, OptState]:
    """Classify ``state``'s pieces into a :class:`Layout`; with ``rebuild``, also the state with every piece replaced.

    ``rebuild(kind, old, key)`` gives the new value of a piece (``kind`` is
    ``"param"`` for a per-parameter subtree, ``"global"`` for a leaf, ``"acc"``
    for an accumulation window's running sum). Without it, the state is returned as it is.
    """
    p_leaves, p_spec = tu.flatten(params)
    layout = Layout({}, {}, [], {})
    at = [key_of(a) for a in optree.treespec_accessors(p_spec)]  # each param's place in the params' tree

    def piece(kind: str, node: Any, key: str) -> Any:
        (layout.globals_ if kind == "global" else layout.per_param)[key] = node
        return rebuild(kind, node, key) if rebuild else node

    def placed(node: Any) -> list[Any] | None:
        """A subtree per param (None in a hole) where ``node`` is a tree like the params, else None."""
        try:
            return None if isinstance(node, torch.Tensor) or p_spec.is_leaf() else p_spec.flatten_up_to(node)
        except ValueError:
            return None

    def is_piece(node: Any) -> bool:
        return isinstance(node, AccumulateState) or placed(node) is not None

    accessors, nodes, spec = optree.tree_flatten_with_accessor(state, is_leaf=is_piece)
    new: list[Any] = []
    for accessor, node in zip(accessors, nodes):
        key = key_of(accessor)
        subtrees = placed(node)
        if subtrees is not None and not is_per_param(node, p_spec, p_leaves):  # each global leaf keeps its param
            head, rebuilt = "" if key == "<root>" else key, []
            for i, sub in enumerate(subtrees):
                sub_accessors, leaves, sub_spec = optree.tree_flatten_with_accessor(sub)
                tails = ["/" + key_of(a) if len(a) else "" for a in sub_accessors]
                keys = [f"{head}/{at[i]}{tail}".lstrip("/") for tail in tails]
                layout.places.update({k: (i, head, tail) for k, tail in zip(keys, tails)})
                rebuilt.append(optree.tree_unflatten(sub_spec, [piece("global", v, k) for v, k in zip(leaves, keys)]))
            new.append(p_spec.unflatten(rebuilt))
            continue
        if not isinstance(node, AccumulateState):
            new.append(piece("param" if is_per_param(node, p_spec, p_leaves) else "global", node, key))
            continue
        # A window is walked field by field, its running sum kept apart (placeholders where it holds nothing).
        window = Window(key, node)
        layout.windows.append(window)
        fields: list[Any] = []
        for name, value in zip(node._fields, node):
            if name == "acc":
                fields.append(piece("acc", value, window.key(name)))
            else:
                fields.append(None if value is None else piece("global", value, window.key(name)))
        new.append(type(node)(*fields))
    return layout, (tu.unflatten(spec, new) if rebuild else state)


def layout_of(state: OptState, params: Params) -> Layout:
    return walk(state, params)[0]


def param_names(params: Params) -> list[str]:
    """The name each param gets in a checkpoint: its pytree path (a dict's keys, as is, for a flat dict).

    Example:
      >>> param_names({"fc.weight": w, "fc.bias": b})
      ['fc.weight', 'fc.bias']
    """
    return ["/".join(str(c) for c in path) for path in tu.paths(params)]


# --- per-rank state: reduce on save, hand to one rank on load ------------------------------------


# A gradtx optimizer alias (gtx.adamw) is not a Chain, so it stays whole (the wrapper refuses it by name).
def members(tx: Any) -> list[Any]:
    """The chain's members, nested chains flattened, in chain order (``[tx]`` for anything else)."""
    return [m for member in tx.members for m in members(member)] if isinstance(tx, Chain) else [tx]


def window_sum_keys(layout: Layout) -> list[str]:
    """The keys of the windows' running sums in ``layout``."""
    return [w.key("acc") for w in layout.windows]


def saved_window_open(globals_: Any, sum_key: str) -> bool:
    """Whether the saved global state says the window whose running sum is ``sum_key`` was open."""
    micro_step = sum_key.removesuffix("acc") + "micro_step"  # the window's field beside its sum: "0/micro_step"
    value = globals_.get(micro_step) if isinstance(globals_, dict) else None
    return value is not None and flag(value, what=f"gradtx checkpoint: global state {micro_step!r}")  # a count >= 0


def first_only(value: torch.Tensor, on_first: bool | torch.Tensor) -> torch.Tensor:
    """``value`` on the group's rank 0, zeros on the others (per simulated rank where ``on_first`` is a tensor)."""
    if isinstance(on_first, bool):
        return value if on_first else torch.zeros_like(value)
    return torch.where(on_first.to(value.device), value, torch.zeros_like(value))


def per_rank(
    layout: Layout, tx: GradientTransformation | None, *, what: str
) -> list[tuple[str, Window, Any, Any, bool]]:
    """The per-rank pieces of ``layout``'s windows: (key, window, the comm and group they are summed over, own).

    ``own`` marks the sums of a ``reduce_grads`` window (it sums them over the ranks itself, a ``None`` grad as
    zeros). A plain one divides by micro-steps times ranks, so they are saved as their mean over the ranks,
    which a load scales by its own rank count (another world size keeps every micro-step's weight).

    A window with a ``comm`` counts its tokens and its loss per rank
    (``token_weighted``) and sums its grads per rank (``reduce_grads``, and/or a
    member after it that sums the grads over ranks, :func:`gradtx.cp_reduce`: one entry per group).
    Without ``tx`` there are none to find, which is refused while a window is
    open in several processes.
    """
    if tx is None:
        if multi_process() and any(int(w.state.micro_step) > 0 for w in layout.windows):
            raise ValueError(
                f"{what}: an accumulation window is open in a run of several processes; pass tx= (the transform), "
                "so the window's per-rank token counts and sums are summed over the data-parallel ranks, "
                "or save at a window boundary"
            )
        return []
    chain = members(tx)
    accs = [i for i, m in enumerate(chain) if isinstance(m, Accumulation)]
    if len(accs) != len(layout.windows):
        raise ValueError(
            f"{what}: tx has {len(accs)} windowed members but the state has {len(layout.windows)} "
            "window states; pass the transform this state was made by"
        )
    out = []
    for w, i in zip(layout.windows, accs):
        window = chain[i].window
        own = (window.comm, window.group) if window.comm is not None else None
        for name in ("tokens", "loss_sum", "loss_weight"):  # the window's loss is a global token mean too
            if own is not None and window.token_weighted:
                out.append((w.key(name), w, *own, False))
        if own is not None and window.reduce_grads:
            out.append((w.key("acc"), w, *own, True))
        # A cp_reduce after the window sums its sums over its group too (over both, where the window sums them).
        out += [(w.key("acc"), w, *s, False) for m in chain[i + 1 :] if (s := sums_over(m)) is not None]
    return out


# --- tensors onto a template ---------------------------------------------------------------------


def onto(value: torch.Tensor, template: torch.Tensor, *, what: str) -> torch.Tensor:
    """``value`` placed like ``template`` (a DTensor's local chunk is cut out, no communication).

    ``value`` has passed :func:`check_tensor` against ``template`` (the checkpoint loads check everything first).
    """
    if not isinstance(value, torch.Tensor):  # a number set by hand (inject_hyperparams' state), in the template's dtype
        value = torch.tensor(value, dtype=template.dtype)
    if DTensor is not None and isinstance(template, DTensor):
        if isinstance(value, DTensor):
            if value.device_mesh != template.device_mesh or tuple(value.placements) != tuple(template.placements):
                raise ValueError(
                    f"{what}: saved with placements {tuple(value.placements)}, the live state has "
                    f"{tuple(template.placements)}; load through torch.distributed.checkpoint (dcp.load), which reshards"
                )
            return value
        local = tu.local_part(value, template).to(tu.local(template).device, tu.local(template).dtype).clone()
        return tu.like(template, local)
    if DTensor is not None and isinstance(value, DTensor):
        raise ValueError(
            f"{what}: a DTensor ({tuple(value.placements)}) for an unsharded state; load through "
            "torch.distributed.checkpoint (dcp.load into a state_dict of the live state), which gathers it"
        )
    return value.to(template.device, template.dtype)


def check_tensor(value: Any, template: torch.Tensor, *, what: str) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and template.ndim == 0
    if number and (isinstance(value, int) or template.is_floating_point()):  # a float into an int would truncate
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: the checkpoint has a {type(value).__name__}, this state a tensor")
    if tuple(value.shape) != tuple(template.shape):
        raise ValueError(f"{what}: the checkpoint has shape {tuple(value.shape)}, this state {tuple(template.shape)}")
    if value.dtype != template.dtype:
        raise ValueError(f"{what}: the checkpoint has dtype {value.dtype}, this state {template.dtype}")


def check_keys(got: Any, expected: list[str], *, what: str, hint: str, optional: tuple[str, ...] = ()) -> None:
    if not isinstance(got, dict):
        raise TypeError(f"{what}: expected a dict, got {type(got).__name__}")
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected and k not in optional]
    if missing:
        raise ValueError(f"{what}: the checkpoint has no {missing[0]!r} (this state has {expected}); {hint}")
    if extra:
        raise ValueError(f"{what}: the checkpoint has {extra[0]!r}, which this state lacks (it has {expected}); {hint}")


def flag(value: Any, *, what: str) -> bool:
    """A saved 0/1 flag (a one-element tensor) as a bool."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"{what} must be a one-element tensor")
    return bool(value.reshape(()) != 0)


HINT = "the checkpoint was made by a different chain; build the same transform (members, order, k) to load it"

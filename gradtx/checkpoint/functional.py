"""Checkpoints of transform states with ``torch.distributed.checkpoint`` (DCP): sharded, resharded, validated.

A transform state is a pytree of (D)Tensors. Some of it is *per parameter*
(Adam's moments, a momentum trace, an open accumulation window's running sum):
a subtree shaped like the params, one tensor per param, each sharded like its
param. The rest is *global*: counters, the last grad norm, the window's
bookkeeping. :func:`state_dict` splits a state along that line into a plain
nested dict that DCP saves, keyed by parameter name, so each per-parameter
tensor keeps its parameter's placement and reshards to another world size or
mesh on load::

    {"state": {param_name: {"1/mu": tensor, "1/nu": tensor, ...}, ...},
     "global": {"0/micro_step": tensor, "0/k": tensor, ...}}

:func:`load_state_dict` checks a saved dict against a live state (same chain,
same ``k``, same parameter names, shapes and dtypes) before building anything
from it, and raises naming the first difference.

Accumulation windows need care, and get it here:

* ``AccumulateState.acc`` is a tree like the params from ``init`` on: an fp32
  (fp64) sum per param while a window is open, a 0-element placeholder
  (:func:`gradtx.transforms.accumulation.empty_sums`) where it holds nothing.
  The saved dict always carries the running sum (zeros where it holds
  nothing), so its keys and shapes do not depend on where the window
  stands, which is what DCP's load needs: the dict it loads into is made
  before the checkpoint is read.
* State that differs between data-parallel ranks is reduced on save: the
  window's token count and its loss's sum and weight (``token_weighted``
  with a ``comm``) and the running sum of a functional data-parallel step
  (``reduce_grads=True``, and/or a :func:`gradtx.cp_reduce` after the window) are
  summed over the group (one collective each, through the transform's ``comm``),
  and on load the group's first rank holds the total and the others zero. The
  window then closes with the same sums on any number of ranks. This needs
  ``tx=``; without it, a save or load from several processes with an open window raises.

:class:`gradtx.TransformedOptimizer` uses the same split for its own
``state_dict`` (torch.optim's layout, see ``docs/checkpointing.md``).

Example:
  >>> import torch.distributed.checkpoint as dcp
  >>> dcp.save({"model": model.state_dict(), "tx": gtx.checkpoint.state_dict(state, params, tx=tx)}, checkpoint_id=path)
  >>> # later, on any number of ranks:
  >>> sd = {"model": model.state_dict(), "tx": gtx.checkpoint.state_dict(state, params, tx=tx)}
  >>> dcp.load(sd, checkpoint_id=path)
  >>> state = gtx.checkpoint.load_state_dict(sd["tx"], state, params, tx=tx)
"""

from __future__ import annotations

from typing import Any

import torch

from gradtx.checkpoint import layout as lo
from gradtx.checkpoint.layout import param_names
from gradtx.comm.base import ReduceOp, as_comm
from gradtx.comm.local_ranks import rank_equals
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, OptState, Params
from gradtx.transforms.accumulation import empty_sums

__all__ = ["TransformState", "load_state_dict", "param_names", "state_dict", "to_torch_optimizer"]

# --- the functional API ----------------------------------------------------------------------------


def state_dict(state: OptState, params: Params, *, tx: GradientTransformation | None = None) -> dict[str, Any]:
    """A transform state as a DCP-ready dict: per-parameter state keyed by param name, the rest global.

    Per-parameter tensors keep their parameter's type and placement (a DTensor
    stays a DTensor sharded like its param), so ``dcp.save`` writes shards and
    ``dcp.load`` reshards them. An accumulation window's running sum is always
    present (zeros at a boundary), so the keys never depend on where the
    window stands. Tensors are the live ones where the state's own (as
    ``torch.optim`` does), except the running sum at a boundary and the
    per-rank reductions below.

    Per-rank state is reduced: with ``tx`` given, an open window's token count
    (``token_weighted`` with a ``comm``) and its running sum (``reduce_grads``, or
    a ``cp_reduce`` after the window) are summed over the accumulation's group, one coalesced collective each
    through its ``comm``; call this on every rank. Without ``tx``, a save from
    several processes while a window is open raises.

    Args:
      state: the transform's state.
      params: the params the state was made for (names and placements come from here).
      tx: the transform (needed for per-rank window state; recommended always).

    Returns:
      ``{"state": {name: {key: tensor}}, "global": {key: value}}``.

    Example:
      >>> sd = {"model": model.state_dict(), "tx": gtx.checkpoint.state_dict(state, params, tx=tx)}
      >>> dcp.save(sd, checkpoint_id=path)
    """
    names = param_names(params)
    if len(set(names)) != len(names):
        raise ValueError(f"gradtx.checkpoint.functional.state_dict: params have duplicate names: {names}")
    p_leaves, _ = tu.flatten(params)
    layout = lo.layout_of(state, params)
    per_param, globals_ = export_layout(layout, p_leaves, tx, what="gradtx.checkpoint.functional.state_dict")
    # A window's sum saved as its total over the ranks (reduce_grads, or a cp_reduce after it) is every param's: a
    # rank's own None pattern, which the saved flag would take from one rank, is not kept (a None adds zeros).
    summed = {key for key, *_ in lo.per_rank(layout, tx, what="gradtx.checkpoint")}
    for w in layout.windows:  # 1 where the open window holds a sum (a param whose grads were None holds none)
        sums = _per_param_leaves(layout, w.key("acc"), p_leaves)
        every = w.key("acc") in summed and int(w.state.micro_step) > 0
        per_param[w.key("held")] = [torch.tensor(float(t is not None or every)) for t in sums]
    return {
        "state": {n: {k: v[i] for k, v in per_param.items()} for i, n in enumerate(names)},
        "global": globals_,
    }


def export_layout(
    layout: lo.Layout,
    p_leaves: list[torch.Tensor],
    tx: GradientTransformation | None,
    *,
    what: str,
) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
    """Per-parameter leaves (key -> one tensor per param) and global leaves of ``layout``, per-rank parts reduced."""
    per_param = {key: [t.detach() for t in _templates(layout, key, p_leaves)] for key in layout.per_param}
    globals_ = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in layout.globals_.items()}
    for w in layout.windows:  # a plain window's loss is this rank's own; a checkpoint's global slot holds one rank's
        if lo.multi_process() and int(w.state.loss_weight) > 0 and not bool(w.state.token_weighted):
            raise ValueError(
                f"{what}: an accumulation window is open (micro-step {int(w.state.micro_step)}) and holds each rank's "
                "own loss (given as loss=), which a checkpoint cannot keep per rank: the resumed window's loss would "
                "be another rank's. Save at a window boundary, or end the window early with flush=True"
            )
    for key, w, comm, group, own in lo.per_rank(layout, tx, what=what):
        if int(w.state.micro_step) == 0:
            continue  # a window at a boundary holds nothing
        if key == w.key("acc"):
            per_param[key] = tu.all_reduce_leaves(comm, per_param[key], ReduceOp.SUM, group)
            if own and not bool(w.state.token_weighted):
                per_param[key] = tu.scale_leaves(
                    per_param[key], torch.tensor(1 / comm.size(group), dtype=torch.float64)
                )
        else:  # the tokens, the loss sum or its weight: on the params' device, as the window's own collective (NCCL)
            value = getattr(w.state, key.rsplit("/", 1)[-1])
            (total,) = comm.all_reduce([value.to(tu.device_of(p_leaves))], ReduceOp.SUM, group)
            globals_[key] = total.to(value.dtype).cpu()
    return per_param, globals_


def _per_param_leaves(layout: lo.Layout, key: str, p_leaves: list[torch.Tensor]) -> list[Any]:
    """The leaves of ``layout``'s per-parameter subtree ``key``, one per param, ``None`` for each that holds nothing.

    A window's running sum holds nothing where it is a 0-element placeholder
    (:func:`gradtx.transforms.accumulation.empty_sums`; all of it at a boundary),
    not shaped like its param.
    """
    leaves = tu.flatten(layout.per_param[key])[0] or [None] * len(p_leaves)  # a window made without params has None
    return [t if isinstance(t, torch.Tensor) and t.shape == p.shape else None for p, t in zip(p_leaves, leaves)]


def _templates(layout: lo.Layout, key: str, p_leaves: list[torch.Tensor], device: str | None = None) -> list[Any]:
    """:func:`_per_param_leaves`, with zeros like the param where a window's running sum holds nothing.

    The zeros are in the sum's dtype (at least fp32, as accumulate sums), on the param's device, or on
    ``device`` (``"meta"`` for templates read only for their shapes and dtypes).
    """
    return [
        torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32), device=device) if t is None else t
        for p, t in zip(p_leaves, _per_param_leaves(layout, key, p_leaves))
    ]


def load_state_dict(
    saved: dict[str, Any], state: OptState, params: Params, *, tx: GradientTransformation | None = None
) -> OptState:
    """The state held by ``saved`` (from :func:`state_dict`), checked against the live ``state``; pure.

    Checks before it builds anything: the same parameter names, the same
    per-parameter and global keys (the same chain), shapes and dtypes, and the
    same accumulation ``k`` and ``token_weighted``; the first difference raises a ``ValueError`` that
    names it. Tensors are placed like the live state's (a plain full tensor is
    cut to a DTensor's local shard with no communication; a DTensor must
    already have the live placement, which ``dcp.load`` into a
    :func:`state_dict` of the live state gives). Per-rank window state saved
    as a group total (see :func:`state_dict`) goes to the group's first rank.

    Args:
      saved: the dict :func:`state_dict` made (after ``dcp.load`` filled it, or from ``torch.load``).
      state: the live state (e.g. ``tx.init(params)``), the template; not modified.
      params: the params (names, shapes and placements).
      tx: the transform (needed for per-rank window state).

    Returns:
      The loaded state, of the structure of ``state`` (an accumulation
      window's ``acc`` holds the saved sums while the saved window is open,
      placeholders at a boundary).

    Example:
      >>> state = gtx.checkpoint.load_state_dict(sd["tx"], tx.init(params), params, tx=tx)
    """
    what = "gradtx.checkpoint.functional.load_state_dict"
    names = param_names(params)
    if not isinstance(saved, dict) or "state" not in saved or "global" not in saved:
        raise ValueError(
            f"{what}: expected the dict gradtx.checkpoint.functional.state_dict made ('state' and 'global')"
        )
    lo.check_keys(saved["state"], names, what=f"{what}: parameter names", hint="the params differ from the saved run's")
    layout = lo.layout_of(state, params)
    held_keys = [w.key("held") for w in layout.windows]
    for name in names:
        lo.check_keys(
            saved["state"][name], [*layout.per_param, *held_keys], what=f"{what}: state of param {name!r}", hint=lo.HINT
        )
    per_param = {key: [saved["state"][name][key] for name in names] for key in layout.per_param}
    held: dict[str, list[bool]] = {}  # a window's sum key -> per param, whether the open window held a sum for it
    for w in layout.windows:
        key = w.key("held")
        held[w.key("acc")] = [lo.flag(saved["state"][n][key], what=f"{what}: {key!r} of param {n!r}") for n in names]
    return import_layout(layout, state, params, per_param, saved["global"], tx, names, what=what, held=held)


def import_layout(
    layout: lo.Layout,
    state: OptState,
    params: Params,
    per_param: dict[str, list[Any]],
    globals_: Any,
    tx: GradientTransformation | None,
    names: list[str],
    *,
    what: str,
    held: dict[str, list[bool]] | None = None,
) -> OptState:
    """Validate everything, then build the new state (the caller commits it).

    Where a window's running sum holds nothing in ``layout``, the saved sums are
    checked and placed like the params, in the sum's dtype (at least fp32).
    ``held`` (sum key -> one flag per param) marks the params an open window
    held no sum for: they get the placeholder back.
    """
    p_leaves, p_spec = tu.flatten(params)
    lo.check_keys(globals_, list(layout.globals_), what=f"{what}: global state", hint=lo.HINT)
    for key, template in layout.globals_.items():
        if isinstance(template, torch.Tensor):
            lo.check_tensor(globals_[key], template, what=f"{what}: global state {key!r}")
    for key in layout.per_param:
        for name, value, template in zip(names, per_param[key], _templates(layout, key, p_leaves, device="meta")):
            lo.check_tensor(value, template, what=f"{what}: {key!r} of param {name!r}")
    per_rank = lo.per_rank(layout, tx, what=what) if tx is not None else []
    if tx is None and lo.multi_process() and any(lo.saved_window_open(globals_, k) for k in lo.window_sum_keys(layout)):
        raise ValueError(  # its per-rank totals would go to every rank: counted once per rank
            f"{what}: the checkpoint holds an open accumulation window, in a run of several processes; pass tx= "
            "(the transform), so the window's totals over the ranks go to one rank of each group"
        )
    for w in layout.windows:
        for name in ("k", "token_weighted"):  # the two sum different grads (summed or mean losses)
            saved, live = globals_[w.key(name)].tolist(), getattr(w.state, name).tolist()
            if saved != live:
                raise ValueError(
                    f"{what}: the accumulation window at {w.prefix!r} was saved with {name}={saved}, this transform "
                    f"has {name}={live}; resume with the same {name} (or save at a boundary and start a fresh state)"
                )
    # Everything checked: build the new state. A per-rank total saved goes to the group's first rank.
    first: dict[str, tuple[Any, int]] = {}  # key -> whether this rank is its groups' first, ranks
    for key, w, comm, group, own in per_rank:  # a key summed over two groups goes to the first rank of both
        # A bool, or on a simulated mesh a per-rank 0-d bool tensor. A comm with only all_reduce and
        # size is rank 0 of a one-rank group, and raises in a larger one.
        rank = as_comm(comm, name="gradtx.checkpoint.functional").rank(group)
        ranks = comm.size(group) if own and not bool(w.state.token_weighted) else 1  # a mean saved: their sum
        on_first, before = first.get(key, (True, 1))
        first[key] = rank_equals(rank, 0) & on_first, ranks * before

    def restore(value: Any, template: torch.Tensor, key: str, label: str) -> torch.Tensor:
        restored = lo.onto(value, template, what=f"{what}: {label}")
        return lo.first_only(restored * first[key][1], first[key][0]) if key in first else restored

    def rebuild(kind: str, old: Any, key: str) -> Any:
        if kind == "global":
            value = globals_[key]
            return restore(value, old, key, f"global state {key!r}") if isinstance(old, torch.Tensor) else value
        if kind == "acc" and not lo.saved_window_open(globals_, key):
            return empty_sums(params)
        # Placed like the live state's tensors; a window's sum that holds nothing, like the params.
        restored = [restore(v, t, key, repr(key)) for v, t in zip(per_param[key], _templates(layout, key, p_leaves))]
        if kind == "acc" and held is not None:  # a window of this layout: held has its key
            restored = [r if h else e for r, h, e in zip(restored, held[key], tu.flatten(empty_sums(params))[0])]
        return tu.unflatten(p_spec, restored)

    return lo.walk(state, params, rebuild)[1]


def to_torch_optimizer(optimizer_state_dict: dict[str, Any]) -> dict[str, Any]:
    """A :class:`gradtx.TransformedOptimizer` checkpoint as one for its bare inner ``torch.optim`` optimizer.

    The inner optimizer's state is all a plain optimizer has, so this drops the
    ``"gradtx"`` entries, which is honest only at a window boundary: an open
    window's partial sums and micro-step count would be lost, so that raises.
    The transform's own state (the clip's last norm, counters) is dropped; the
    resumed run no longer clips or accumulates unless you add that back.

    Args:
      optimizer_state_dict: ``opt.state_dict()``, or torch's ``get_optimizer_state_dict``
        of the wrapper (not flattened).

    Returns:
      A new dict in ``torch.optim``'s layout, for ``plain_optimizer.load_state_dict``
      or ``set_optimizer_state_dict``.

    Raises:
      ValueError: the checkpoint was saved with an accumulation window open.

    Example:
      >>> plain = torch.optim.AdamW(model.parameters())
      >>> plain.load_state_dict(gtx.checkpoint.to_torch_optimizer(ckpt["optim"]))
    """
    if not isinstance(optimizer_state_dict, dict) or not {"state", "param_groups"} <= optimizer_state_dict.keys():
        raise ValueError("to_torch_optimizer: expected an optimizer state dict ('state', 'param_groups')")
    state = {}
    for pid, entry in optimizer_state_dict["state"].items():
        for key, value in entry.get("gradtx", {}).get("global", {}).items():  # the first param's entry has it
            if key.rpartition("/")[2] == "micro_step" and int(value) > 0:
                raise ValueError(
                    f"to_torch_optimizer: the checkpoint was saved with an accumulation window open ({key} = "
                    f"{int(value)}); its partial sums would be lost. Save at a window boundary (opt.window_open False) "
                    "to move to a plain optimizer"
                )
        rest = {k: v for k, v in entry.items() if k != "gradtx"}
        fresh = entry.get("gradtx", {}).get("inner_fresh")
        # A stand-in is no state: the inner optimizer had not stepped the param, and a plain one starts it fresh.
        if rest and (fresh is None or not lo.flag(fresh, what=f"to_torch_optimizer: state[{pid!r}]: 'inner_fresh'")):
            state[pid] = rest
    return {"state": state, "param_groups": [dict(g) for g in optimizer_state_dict["param_groups"]]}


class TransformState:
    """A transform state as a DCP ``Stateful``: put it in the dict you give ``dcp.save`` / ``dcp.load``.

    Holds ``state`` (update it after every step) and saves and loads it through
    :func:`state_dict` / :func:`load_state_dict`. After ``dcp.load``,
    ``holder.state`` is the loaded state.

    Args:
      tx: the transform.
      state: its current state.
      params: the params the state is for.

    Example:
      >>> holder = gtx.checkpoint.TransformState(tx, state, params)
      >>> dcp.save({"model": model.state_dict(), "tx": holder}, checkpoint_id=path)
      >>> dcp.load({"model": model.state_dict(), "tx": holder}, checkpoint_id=path)
      >>> state = holder.state
    """

    def __init__(self, tx: GradientTransformation, state: OptState, params: Params) -> None:
        self.tx = check.transform(tx, arg="tx", name="TransformState")
        self.state, self.params = state, params

    def state_dict(self) -> dict[str, Any]:
        return state_dict(self.state, self.params, tx=self.tx)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = load_state_dict(state_dict, self.state, self.params, tx=self.tx)

"""The wrapper's checkpoint format, and the mirror of its state in ``optimizer.state``.

A :class:`gradtx.TransformedOptimizer` checkpoint is ``torch.optim``'s layout:
``{"state": {param_id: {...}}, "param_groups": [...]}``. Each param's entry
is the inner optimizer's (``exp_avg``, ``step``, ...) plus a ``"gradtx"`` dict:

* the transform's per-parameter state, one key per piece (``"1/trace"``), shaped
  and placed like the param (a DTensor where the param is one, so it reshards);
* with :func:`gradtx.accumulate` in the chain, the open window's partial sum
  (a copy of the param's ``.grad``; zeros at a boundary, so the keys never
  depend on where the window stands) and ``"has_grad"`` (0 where the param had
  no grad, which it gets back as ``None``);
* ``"inner_fresh"``: 1 while the inner optimizer has not stepped the param
  (its inner entries are stand-ins, see :mod:`gradtx.wrapper.inner`);
* on the first param only, ``"global"`` (counters, the window's micro-step and
  token count, the last grad norm) and, with a window, ``"amp"`` (GradScaler's record).

The wrapper's ``state`` (``opt.state``, what generic code reads) shows, for
every param and from the moment the wrapper is built, the inner optimizer's
state (or its stand-in, see :mod:`gradtx.wrapper.inner`) and the same
``"gradtx"`` entry (without the partial sums, which are ``.grad`` itself), so
an engine that rebuilds a loaded state from the keys it finds there (torch's
and torchtitan's flattened loads) carries them, and one that skips its warm-up
when a state exists skips it. The inner optimizer's own ``state`` stays its own.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import torch

from gradtx.checkpoint import functional as _ckpt
from gradtx.core import tree as tu
from gradtx.core.base import OptState
from gradtx.core.kinds import is_empty_sum
from gradtx.wrapper import amp, grads, kinds
from gradtx.wrapper.inner import GTX
from gradtx.wrapper.inner import started as inner_started

if TYPE_CHECKING:
    from gradtx.wrapper.optimizer import TransformedOptimizer

GLOBAL = "global"
AMP = "amp"
HAS_GRAD = "has_grad"
INNER_FRESH = "inner_fresh"
# Inner-optimizer state tensors shaped like their param (torch.optim's names).
_PARAM_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "ax", "prev"}
)


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype  # the wrapper's partial sums are autograd's .grad, in the params' dtype


# --- the live mirror in optimizer.state[p]["gradtx"] ---------------------------------------------


_MISSING: Any = object()


class Mirror:
    """Keeps each param's ``"gradtx"`` entry pointing at the live transform state's tensors.

    The first publish walks the state (which piece is per parameter, which is
    global) and remembers where each leaf goes; later ones rebind the
    entries' values in one pass over the leaves, with no copies.
    """

    def __init__(self) -> None:
        self.spec: Any = None
        self.targets: list[tuple[dict[str, Any], str] | None] | None = None

    def reset(self) -> None:
        self.spec, self.targets = None, None

    def publish(self, entries: dict[torch.Tensor, dict[str, Any]], state: OptState, params: grads.ParamTree) -> None:
        leaves, spec = tu.flatten(state)
        if self.targets is None or spec != self.spec:
            self._build(entries, state, params, leaves, spec)
            return
        for target, leaf in zip(self.targets, leaves):
            if target is not None:  # None: a placeholder of the window's running sum (the wrapper's is .grad)
                entry, key = target
                entry[key] = leaf

    def _build(
        self,
        by_param: dict[torch.Tensor, dict[str, Any]],
        state: OptState,
        params: grads.ParamTree,
        leaves: list[Any],
        spec: Any,
    ) -> None:
        flat = grads.flat(params)
        layout = _ckpt._layout_of(state, params)
        by_param.clear()
        entries: list[dict[str, Any]] = []
        for p in flat:
            entry: dict[str, Any] = {}
            by_param[p] = entry
            entries.append(entry)
        where: dict[int, tuple[dict[str, Any], str] | None] = {}
        for key, subtree in layout.per_param.items():
            if is_empty_sum(subtree):  # a window's placeholders (the wrapper's running sum is .grad)
                where.update((id(leaf), None) for leaf in tu.flatten(subtree)[0])
                continue
            for entry, leaf in zip(entries, tu.flatten(subtree)[0]):
                entry[key] = leaf
                where[id(leaf)] = (entry, key)
        if entries:
            glob: dict[str, Any] = {}
            entries[0][GLOBAL] = glob
            for key, leaf in layout.globals_.items():
                glob[key] = leaf
                where[id(leaf)] = (glob, key)
        targets = [where.get(id(leaf), _MISSING) for leaf in leaves]
        unique = len({id(leaf) for leaf in leaves}) == len(leaves)
        if unique and all(t is not _MISSING for t in targets):
            self.spec, self.targets = spec, targets  # type: ignore[assignment]
        else:  # shared or non-tensor leaves: walk again next time
            self.reset()


# --- the wrapper's state: the inner optimizer's, its stand-ins, and the gradtx entries --------------


class ParamState(MutableMapping[str, Any]):
    """One param's ``opt.state[p]``: the inner optimizer's state (or its stand-in) and the ``"gradtx"`` entry.

    Writes go where the key lives: to the inner optimizer's state once it has
    one, to the stand-in before (so moving a state to a device, as Lightning
    does, moves the stand-in and leaves the inner optimizer to initialise
    itself), and a ``"gradtx"`` entry is updated in place.
    """

    def __init__(self, opt: TransformedOptimizer, p: torch.Tensor) -> None:
        self._opt, self._p = opt, p

    def _inner(self) -> dict[str, Any]:
        own = self._opt.optimizer.state.get(self._p)
        if own:
            return own
        stand_in = self._opt._live.stand_ins.get(self._p)
        return stand_in if stand_in is not None else self._opt.optimizer.state[self._p]

    def _entry(self) -> dict[str, Any] | None:
        return self._opt._live.entries.get(self._p)

    def __getitem__(self, key: str) -> Any:
        entry = self._entry()
        if key == GTX and entry is not None:
            return entry
        return self._inner()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        entry = self._entry()
        if key == GTX and entry is not None:
            if value is not entry:
                entry.update(value)
            return
        self._inner()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._inner()[key]

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self._inner() if k != GTX)
        if self._entry() is not None:
            yield GTX

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self))


class StateView(MutableMapping[torch.Tensor, Any]):
    """``opt.state``: for every param the transform sees, a :class:`ParamState`; other params' inner state as is."""

    def __init__(self, opt: TransformedOptimizer) -> None:
        self._opt = opt

    def _ours(self, p: Any) -> bool:
        return p in self._opt._live.entries

    def __getitem__(self, p: torch.Tensor) -> Any:
        if self._ours(p):
            return ParamState(self._opt, p)
        return self._opt.optimizer.state[p]  # a defaultdict, as torch.optim's

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        if self._ours(p):
            view = ParamState(self._opt, p)
            for key in [k for k in view if k != GTX and k not in value]:
                del view[key]
            for key, v in value.items():
                view[key] = v
            return
        self._opt.optimizer.state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._opt.optimizer.state[p]

    def __contains__(self, p: object) -> bool:
        return self._ours(p) or p in self._opt.optimizer.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        entries = self._opt._live.entries
        yield from entries
        yield from (p for p in self._opt.optimizer.state if p not in entries)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self))


# --- state_dict ------------------------------------------------------------------------------------


def check_sums_visible(opt: TransformedOptimizer, flat: list[torch.Tensor], what: str) -> None:
    """Refuse to save an open window whose partial sums are not in ``.grad``."""
    live = opt._live
    # GradScaler saw an inf in this window: the wrapper dropped the partial sum, the window will be skipped.
    dropped = live.amp_inf is not None and bool(live.amp_inf)
    hidden = not getattr(live, "synced", True) or (bool(flat) and all(p.grad is None for p in flat) and not dropped)
    if hidden:
        micro_step, k = kinds.window_position(opt._plan, opt.tx_state)
        raise ValueError(
            f"{what}: an accumulation window is open (micro-step {micro_step} of {k}) and its partial sums are "
            "not in .grad: they sit inside DDP/FSDP2, which skipped the gradient sync (maybe_no_sync), so a "
            "checkpoint now would lose them. Save at a window boundary (when opt.emitted is True, "
            "opt.window_open is False), or end the window early: run its next micro-step inside "
            "opt.maybe_no_sync(model, flush=True) and call opt.step(flush=True)"
        )


def state_dict(opt: TransformedOptimizer) -> dict[str, Any]:
    """The wrapper's checkpoint (see the module docstring); every tensor is the state's own or a copy."""
    what = "TransformedOptimizer.state_dict"
    params = opt.param_tree()
    flat = grads.flat(params)
    state = opt.tx_state
    layout = _ckpt._layout_of(state, params)
    acc_key = kinds.acc_key(opt._plan, layout)
    has_grad: list[float] = []
    if acc_key is not None:
        open_ = kinds.window_open(opt._plan, state)
        if open_:
            check_sums_visible(opt, flat, what)
        # A copy: .grad may be a view (FSDP2's) that pickle and DCP cannot save, and it keeps changing.
        sums = [p.grad.detach().clone() if open_ and p.grad is not None else torch.zeros_like(p) for p in flat]
        has_grad = [float(open_ and p.grad is not None) for p in flat]
        layout.per_param[acc_key] = [sums]  # a one-leaf tree: _export flattens it
    per_param, globals_ = _ckpt._export(layout, flat, opt.tx, what=what, acc_dtype=_same_dtype)
    optimizer = opt.optimizer
    opt._publish(force=True)
    inner = optimizer.state_dict()
    # torch's state_dict hands out the live per-param dicts: copy them before adding to them.
    out: dict[Any, Any] = {pid: dict(s) for pid, s in inner["state"].items()}
    stand_ins = opt._live.stand_ins
    for i, (pid, p) in enumerate(zip(grads.pids(optimizer.param_groups, params), flat)):
        fresh = p in stand_ins and not inner_started(optimizer, p)
        if fresh:
            out[pid] = dict(stand_ins[p])  # the keys the inner optimizer's state will have
        entry: dict[str, Any] = {key: values[i] for key, values in per_param.items()}
        entry[INNER_FRESH] = torch.tensor(float(fresh))
        if acc_key is not None:
            entry[HAS_GRAD] = torch.tensor(has_grad[i])
        if i == 0:
            entry[GLOBAL] = globals_
            if acc_key is not None:
                entry[AMP] = amp.record(opt._live.amp_scale, opt._live.amp_inf)
        out.setdefault(pid, {})[GTX] = entry
    return {"state": out, "param_groups": inner["param_groups"]}


# --- load_state_dict -------------------------------------------------------------------------------


def _check_inner_state(state: dict[Any, Any], params_by_id: dict[Any, torch.Tensor], *, what: str) -> None:
    """Raise before loading unless every saved param state belongs to a param and is shaped like it."""
    for sid, s in state.items():
        if sid not in params_by_id:
            raise ValueError(f"{what}: the checkpoint has state for param {sid!r}, which no param group lists")
        p = params_by_id[sid]
        for key, value in s.items():
            if key in _PARAM_SHAPED and isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"{what}: state[{sid!r}][{key!r}] has shape {tuple(value.shape)}, its param {tuple(p.shape)}"
                )


def _flag(entry: dict[str, Any], key: str, default: bool, *, what: str) -> bool:
    value = entry.get(key)
    if value is None:  # a checkpoint from before the key existed
        return default
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"{what}: {key!r} must be a one-element tensor")
    return bool(value.reshape(()) != 0)


def load_state_dict(opt: TransformedOptimizer, state_dict: dict[str, Any]) -> None:
    """Restore a :func:`state_dict`, or adopt a plain ``torch.optim`` checkpoint; checks everything first."""
    what = "TransformedOptimizer.load_state_dict"
    if not isinstance(state_dict, dict):
        raise TypeError(f"{what}: state_dict must be a dict, got {type(state_dict).__name__}")
    if "inner" in state_dict or "tx_state" in state_dict:
        raise ValueError(
            f"{what}: this checkpoint has gradtx's earlier layout ('inner', 'tx_state'); to adopt its inner "
            "optimizer state with the transform starting fresh, pass checkpoint['inner'] (it is a torch.optim "
            "checkpoint), after making sure it was saved at a window boundary (checkpoint['window_open'] is False)"
        )
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"{what}: missing key {key!r} (expected torch.optim's layout: 'state', 'param_groups')")
    optimizer = opt.optimizer
    params = opt.param_tree()
    flat = grads.flat(params)
    saved_groups = state_dict["param_groups"]
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(f"{what}: the checkpoint has {len(saved_groups)} param groups, this optimizer {len(groups)}")
    saved_of: dict[int, Any] = {}
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{what}: param group {i} has {len(saved['params'])} params in the checkpoint, "
                f"{len(group['params'])} here"
            )
        for sid, p in zip(saved["params"], group["params"]):
            saved_of[id(p)] = sid
    all_params = [p for group in groups for p in group["params"]]
    names = grads.names(groups, params)
    saved_state = state_dict["state"]
    inner_state = {}
    for sid, s in saved_state.items():
        if not isinstance(s, dict):
            raise TypeError(f"{what}: state[{sid!r}] is a {type(s).__name__}, not a dict")
        rest = {k: v for k, v in s.items() if k != GTX}
        if rest:
            inner_state[sid] = rest
    _check_inner_state(inner_state, {saved_of[id(p)]: p for p in all_params}, what=what)
    entries = [saved_state.get(saved_of[id(p)], {}).get(GTX) for p in flat]
    has_grad = [True] * len(flat)
    fresh: list[torch.Tensor] = []
    if all(e is None for e in entries):  # a plain torch.optim checkpoint: adopt it, transform fresh
        new_state = opt.tx.init(params)
        sums = record = None
    else:
        layout = _ckpt._layout_of(opt.tx_state, params)
        acc_key = kinds.acc_key(opt._plan, layout)
        if acc_key is not None:
            layout.per_param[acc_key] = None  # the partial sums: shaped and typed like the params
        expected = list(layout.per_param)
        optional = [INNER_FRESH, HAS_GRAD] if acc_key is not None else [INNER_FRESH]
        per_param: dict[str, list[Any]] = {key: [] for key in expected}
        for i, (p, name, entry) in enumerate(zip(flat, names, entries)):
            first = [GLOBAL, AMP] if acc_key is not None and i == 0 else [GLOBAL] if i == 0 else []
            present = [k for k in optional if isinstance(entry, dict) and k in entry]
            _ckpt._check_keys(
                entry, expected + present + first, what=f"{what}: gradtx state of {name}", hint=_ckpt._HINT
            )
            for key in expected:
                per_param[key].append(entry[key])
            if _flag(entry, INNER_FRESH, saved_of[id(p)] not in inner_state, what=f"{what}: {name}"):
                fresh.append(p)
            has_grad[i] = _flag(entry, HAS_GRAD, True, what=f"{what}: {name}")
        loaded = _ckpt._import(
            layout, opt.tx_state, params, per_param, entries[0][GLOBAL], opt.tx, names,
            what=what, acc_dtype=_same_dtype,
        )  # fmt: skip
        new_state, taken = _ckpt._take_acc(loaded, params)
        sums = taken[0] if acc_key is not None and taken else None
        device = tu.local(flat[0]).device if flat else torch.device("cpu")
        record = amp.restore(entries[0].get(AMP), device, what=what) if acc_key is not None else None
    # A stand-in saved for a param the inner optimizer had not stepped is not its state: it starts fresh.
    for p in fresh:
        inner_state.pop(saved_of[id(p)], None)
    # Everything checked; the inner optimizer validates its own part before it changes anything.
    optimizer.load_state_dict({"state": inner_state, "param_groups": saved_groups})
    window_open = kinds.window_open(opt._plan, new_state)
    opt._commit_loaded(new_state, window_open, record)
    for i, p in enumerate(flat):
        # An open window's partial sums are the grads; at a boundary no stale partial sum survives.
        p.grad = tu.flatten(sums)[0][i] if sums is not None and window_open and has_grad[i] else None

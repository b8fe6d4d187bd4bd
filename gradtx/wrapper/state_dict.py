"""The wrapper's checkpoint format and its ``opt.state`` (its copies are in :mod:`gradtx.wrapper.copies`).

A :class:`gradtx.TransformedOptimizer` checkpoint is ``torch.optim``'s layout:
``{"state": {param_id: {...}}, "param_groups": [...]}``. Each param's entry
is the inner optimizer's (``exp_avg``, ``step``, ...) plus a ``"gradtx"`` dict:

* the transform's per-parameter state, one key per piece (``"1/trace"``), shaped
  and placed like the param (a DTensor where the param is one, so it reshards);
* ``"inner_fresh"``: 1 while the inner optimizer has not stepped the param
  (its inner entries are stand-ins, see below);
* with a window open, the window's partial sums (a copy of the param's
  ``.grad``) and ``"has_grad"`` (0 where the param had no grad, which it gets
  back as ``None``); at a window boundary nothing gradient-sized is added;
* on the first param only, ``"global"`` (counters, the window's micro-step and
  token count, the last grad norm) and, with a window, ``"amp"`` (GradScaler's record).

``opt.state`` (what generic code reads) shows, for every param the
transform sees and from the moment the wrapper is built, the inner
optimizer's state and the same ``"gradtx"`` entry (without partial sums,
which are ``.grad`` itself), read from the live state when asked for. Engines
that rebuild a loaded state from the keys they find there (torch's and
torchtitan's flattened loads) need the inner optimizer's keys before its
first step, so they are shown then with *stand-in* values: made when first
asked for, as torch's checkpoint warm-up makes them (one step on zero grads
with ``lr = 0``), and taken straight back out of the inner optimizer, which
initialises its own state at its first real step, as without the wrapper.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from gradtx.checkpoint import functional as _ckpt
from gradtx.checkpoint import layout as lo
from gradtx.core import tree as tu
from gradtx.transforms.window import empty_sums
from gradtx.wrapper import amp, grads, rules
from gradtx.wrapper.live import Live

GTX = "gradtx"  # the transform's entry in each param's state
GLOBAL = "global"
AMP = "amp"
HAS_GRAD = "has_grad"
INNER_FRESH = "inner_fresh"
# Inner-optimizer state tensors shaped like their param (torch.optim's names).
_PARAM_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "ax", "prev"}
)


# --- stand-ins for the inner state before its first step ---------------------------------------------


def stand_ins(opt: Any) -> dict[torch.Tensor, dict[str, Any]]:
    """The stand-in inner state of every param the inner optimizer holds none for (made once, when asked for).

    One step of the optimizer's own ``step`` (no hooks) on zero grads, with
    ``lr = 0`` and no weight decay in every group and every other param's grad
    hidden, so no param moves; the state it makes is taken back out, and the groups and every
    other param's state entries are put back as they were (LBFGS counts its
    evaluations on its first param, some optimizers count steps in a group).
    An optimizer that cannot step on dense zero grads (``SparseAdam``) shows
    no stand-ins.
    """
    optimizer = opt.optimizer
    missing = {p for p in opt._flat if not optimizer.state.get(p) and p not in opt._live.stand_ins}  # by identity
    if not missing:
        return opt._live.stand_ins
    every = [p for g in optimizer.param_groups for p in g["params"]]
    saved_grads = [p.grad for p in every]
    saved_groups = [dict(g) for g in optimizer.param_groups]
    saved_state = {p: dict(s) for p, s in optimizer.state.items() if p not in missing}
    try:
        for p in every:
            p.grad = torch.zeros_like(p) if p in missing else None
        for g in optimizer.param_groups:
            for k in {"lr", "weight_decay"} & g.keys():  # no step, nor decay (Adafactor's relative step ignores lr)
                g[k] = torch.tensor(0.0) if isinstance(g[k], torch.Tensor) else 0.0
        with torch.no_grad():
            rules.unwrapped(optimizer)((lambda: torch.zeros(())) if opt._needs_closure else None)
    except RuntimeError:  # e.g. SparseAdam refuses dense grads: no stand-ins to show
        pass
    finally:
        for p, grad in zip(every, saved_grads):
            p.grad = grad
        for g, saved in zip(optimizer.param_groups, saved_groups):
            g.clear()
            g.update(saved)
        made = {p: optimizer.state.pop(p, None) or {} for p in missing}
        for p in [p for p in optimizer.state if p not in saved_state]:
            del optimizer.state[p]
        for p, saved in saved_state.items():
            optimizer.state[p].clear()
            optimizer.state[p].update(saved)
    opt._live.stand_ins = {**opt._live.stand_ins, **made}
    return opt._live.stand_ins


# --- the gradtx entries, read from the live state -------------------------------------------------------


def entry(opt: Any, i: int) -> dict[str, Any]:
    """Param ``i``'s ``"gradtx"`` entry: the live state's tensors for it (and the global part on the first)."""
    # The live state's layout, kept while the state is the same object: reading every param's entry walks it once.
    cached = opt.__dict__.get("_layout_cache")
    if cached is None or cached[0] is not opt._live.tx_state:
        cached = (opt._live.tx_state, lo.layout_of(opt._live.tx_state, opt._tree))
        opt._layout_cache = cached
    layout = cached[1]
    window = lo.window_sum_keys(layout)
    out = {key: tu.flatten(sub)[0][i] for key, sub in layout.per_param.items() if key not in window}
    if i == 0:
        out[GLOBAL] = grads.in_groups(opt, layout.places, dict(layout.globals_))
    return out


def set_entry(opt: Any, i: int, value: dict[str, Any]) -> None:
    """Write param ``i``'s ``"gradtx"`` entry back into the live state (e.g. a state moved to another device)."""
    layout = lo.layout_of(opt._live.tx_state, opt._tree) if i == 0 else None  # the global entry is param 0's
    glob = grads.in_groups(opt, layout.places, value.get(GLOBAL, {}), out=False) if layout is not None else {}

    def rebuild(kind: str, node: Any, key: str) -> Any:
        if kind == "global":
            return glob.get(key, node)
        if kind == "param" and key in value:
            leaves, spec = tu.flatten(node)
            leaves[i] = value[key]
            return tu.unflatten(spec, leaves)
        return node

    opt._live.tx_state = lo.walk(opt._live.tx_state, opt._tree, rebuild)[1]


class _View(MutableMapping[Any, Any]):
    """A mapping computed from the live state on every access: counted and shown by iterating it."""

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self))


class ParamState(_View):
    """One param's ``opt.state[p]``: the inner optimizer's state (or its stand-in) and the ``"gradtx"`` entry."""

    def __init__(self, opt: Any, p: torch.Tensor) -> None:
        self._opt, self._p = opt, p

    @property
    def _i(self) -> int:  # looked up at each access: the wrapper renumbers its params when one joins or leaves
        return self._opt._position[self._p]

    def _inner(self) -> dict[str, Any]:
        """The inner optimizer's own state, or else its stand-in, or else its (empty) entry."""
        inner_state = self._opt.optimizer.state
        return inner_state.get(self._p) or stand_ins(self._opt).get(self._p) or inner_state[self._p]

    def __getitem__(self, key: str) -> Any:
        return entry(self._opt, self._i) if key == GTX else self._inner()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == GTX:
            set_entry(self._opt, self._i, value)
        else:
            self._inner()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._inner()[key]

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self._inner() if k != GTX)
        yield GTX


def plain(value: Any) -> Any:
    """``value``, or for a live :class:`ParamState` what it holds: the inner optimizer's own state (not a stand-in)
    and the ``"gradtx"`` entry, read now (``opt.state = defaultdict(dict, opt.state)`` clears the state first)."""
    if not isinstance(value, ParamState):
        return value
    return {**value._opt.optimizer.state.get(value._p, {}), GTX: value[GTX]}


class StateView(_View):
    """``opt.state``: a :class:`ParamState` for every param the transform sees; other params' inner state as is."""

    def __init__(self, opt: Any) -> None:
        self._opt = opt

    def __getitem__(self, p: torch.Tensor) -> Any:
        return ParamState(self._opt, p) if p in self._opt._position else self._opt.optimizer.state[p]

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        i = self._opt._position.get(p)
        if i is None:
            self._opt.optimizer.state[p] = value
            return
        # Into the inner optimizer's own dict, not a stand-in: a whole state set by hand is the one its next step uses,
        # and a stand-in given back (a copy of what opt.state showed before the first step) is none, as in torch.
        value, inner = plain(value), self._opt.optimizer.state[p]
        shown = {} if inner else self._opt._live.stand_ins.get(p, {})
        own = {k: v for k, v in value.items() if k != GTX and shown.get(k) is not v}
        for key in [k for k in inner if k not in own]:
            del inner[key]
        inner.update(own)
        if GTX in value:
            set_entry(self._opt, i, value[GTX])

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._opt.optimizer.state[p]

    def clear(self) -> None:
        """Drop every param's inner-optimizer state, as ``del opt.state[p]`` drops one's; the transform's stays.

        (Every param the transform sees keeps its ``"gradtx"`` entry, so the
        mapping's own ``clear``, which deletes until it is empty, would not end.)
        """
        self._opt.optimizer.state.clear()

    def __contains__(self, p: object) -> bool:
        return p in self._opt._position or p in self._opt.optimizer.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from self._opt._flat
        yield from (p for p in self._opt.optimizer.state if p not in self._opt._position)


# --- state_dict --------------------------------------------------------------------------------------


def check_sums_visible(opt: Any, what: str) -> None:
    """Refuse to save an open window whose partial sums are not in ``.grad``."""
    # GradScaler saw an inf in this window: the wrapper dropped the partial sum, the window will be skipped.
    dropped = opt._live.amp_inf is not None and bool(opt._live.amp_inf)
    flat = opt._flat
    if not opt._live.synced or (bool(flat) and all(p.grad is None for p in flat) and not dropped):
        ws = opt._plan.window_state(opt._live.tx_state)
        raise ValueError(
            f"{what}: an accumulation window is open (micro-step {int(ws.micro_step)} of {int(ws.k)}) and its "
            "partial sums are not in .grad: they sit inside DDP/FSDP2, which skipped the gradient sync "
            "(maybe_no_sync), so a checkpoint now would lose them. Save at a window boundary (when opt.emitted "
            "is True, opt.window_open is False), or end the window early: run its next micro-step inside "
            "opt.maybe_no_sync(model, flush=True) and call opt.step(flush=True)"
        )


def state_dict(opt: Any) -> dict[str, Any]:
    """The wrapper's checkpoint (see the module docstring); every tensor is the state's own or a copy."""
    what = "TransformedOptimizer.state_dict"
    flat = opt._flat
    layout = lo.layout_of(opt._live.tx_state, opt._tree)
    window = lo.window_sum_keys(layout)
    open_ = opt._live.window_open
    for key in window:
        if open_:
            check_sums_visible(opt, what)
            # A copy: .grad may be a view (FSDP2's) that pickle and DCP cannot save, and it keeps changing.
            layout.per_param[key] = [
                [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in flat]
            ]
        else:
            del layout.per_param[key]  # between windows nothing gradient-sized is saved
    per_param, globals_ = _ckpt.export_layout(layout, flat, opt.tx, what=what)
    optimizer = opt.optimizer
    inner = optimizer.state_dict()
    # torch's state_dict hands out the live per-param dicts: copy them before adding to them.
    out: dict[Any, Any] = {pid: dict(s) for pid, s in inner["state"].items()}
    shown = stand_ins(opt)
    pid_of = _saved_ids(inner["param_groups"], optimizer.param_groups, what=what)  # torch's index of each param
    for i, p in enumerate(flat):
        pid = pid_of[id(p)]
        fresh = not optimizer.state.get(p)
        if fresh:
            out[pid] = dict(shown.get(p, {}))  # the keys the inner optimizer's state will have
        gtx: dict[str, Any] = {key: values[i] for key, values in per_param.items()}
        gtx[INNER_FRESH] = torch.tensor(float(fresh))
        if window:  # at a boundary too, so a template holds the key (torch's full_state_dict loads need it)
            # Summed over the ranks (a None as zeros), an open window's sum is every param's, whatever this .grad.
            gtx[HAS_GRAD] = torch.tensor(float(open_ and (p.grad is not None or opt._plan.summed)))
        if i == 0:
            gtx[GLOBAL] = grads.in_groups(opt, layout.places, globals_)
            if window:
                gtx[AMP] = amp.record(opt._live.amp_scale, opt._live.amp_inf)
        out[pid][GTX] = gtx
    return {"state": out, "param_groups": inner["param_groups"]}


# --- load_state_dict -----------------------------------------------------------------------------------


def _flag(entry: dict[str, Any], key: str, default: bool, *, what: str) -> bool:
    value = entry.get(key)
    return default if value is None else lo.flag(value, what=f"{what}: {key!r}")


def _saved_ids(saved_groups: list[Any], groups: list[dict[str, Any]], *, what: str) -> dict[int, Any]:
    if len(saved_groups) != len(groups):
        raise ValueError(f"{what}: the checkpoint has {len(saved_groups)} param groups, this optimizer {len(groups)}")
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{what}: param group {i} has {len(saved['params'])} params in the checkpoint, "
                f"{len(group['params'])} here"
            )
    return {
        id(p): sid for saved, group in zip(saved_groups, groups) for sid, p in zip(saved["params"], group["params"])
    }


def load_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
    """Restore a :func:`state_dict`, or adopt a plain ``torch.optim`` checkpoint; checks everything first."""
    what = "TransformedOptimizer.load_state_dict"
    if not isinstance(state_dict, dict):
        raise TypeError(f"{what}: state_dict must be a dict, got {type(state_dict).__name__}")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"{what}: missing key {key!r} (expected torch.optim's layout: 'state', 'param_groups')")
    if not isinstance(state_dict["state"], dict):
        raise TypeError(f"{what}: state_dict['state'] must be a dict, got {type(state_dict['state']).__name__}")
    # An entry, or a key of one, that holds nothing is none: torch's flattened load (set_state_dict) rebuilds a key
    # the checkpoint lacks (a param frozen at the save) as {}, and reading opt.state[p] before a save stores {}.
    state = {}
    for i, s in state_dict["state"].items():
        kept = {k: v for k, v in s.items() if not isinstance(v, dict) or v} if isinstance(s, dict) else s
        if not isinstance(kept, dict) or kept:
            state[i] = kept
    state_dict = {**state_dict, "state": state}
    groups = opt.optimizer.param_groups
    saved_of = _saved_ids(state_dict["param_groups"], groups, what=what)
    saved = {id(p): state_dict["state"].get(saved_of[id(p)]) for g in groups for p in g["params"]}
    seen = {i for i, s in saved.items() if isinstance(s, dict) and GTX in s}
    # The transform's params as the saved run had them: a param frozen here that it had unfrozen joins (gradual
    # unfreezing, resumed by a script that freezes it first), and one it had never seen nor stepped (no entry:
    # frozen there, unfrozen here) leaves, to join at its first grad as it would have there.
    new = [
        [p for p in g["params"] if id(p) in seen or (p in opt._position and saved[id(p)] is not None)] for g in groups
    ]
    tree, tx_state = opt._tree, opt._live.tx_state
    if seen and [list(map(id, g)) for g in new] != [list(map(id, g)) for g in tree]:
        opt._grow(new)
    try:
        _load(opt, state_dict, saved_of, what)
    except Exception:  # as it was
        opt._set_tree(tree)
        opt._live.tx_state = tx_state
        raise


def _load(opt: Any, state_dict: dict[str, Any], saved_of: dict[int, Any], what: str) -> None:
    optimizer, params, flat = opt.optimizer, opt._tree, opt._flat
    groups = optimizer.param_groups
    saved_groups = state_dict["param_groups"]
    names = grads.names(groups, params)
    saved_state = state_dict["state"]
    params_by_id = {saved_of[id(p)]: p for g in groups for p in g["params"]}
    inner_state = {}
    for sid, s in saved_state.items():
        if not isinstance(s, dict):
            raise TypeError(f"{what}: state[{sid!r}] is a {type(s).__name__}, not a dict")
        rest = {k: v for k, v in s.items() if k != GTX}
        if not rest:
            continue
        # Every saved inner state must belong to a param and be shaped like it.
        if sid not in params_by_id:
            raise ValueError(f"{what}: the checkpoint has state for param {sid!r}, which no param group lists")
        shape = tuple(params_by_id[sid].shape)
        for key, value in rest.items():
            if key in _PARAM_SHAPED and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                raise ValueError(f"{what}: state[{sid!r}][{key!r}] has shape {tuple(value.shape)}, its param {shape}")
        inner_state[sid] = rest
    entries = [saved_state.get(saved_of[id(p)], {}).get(GTX) for p in flat]
    has_grad = [True] * len(flat)
    sums = record = None
    if all(e is None for e in entries):  # a plain torch.optim checkpoint: adopt it, transform fresh
        new_state = opt.tx.init(params)
    else:
        # The state goes where the params are, as torch's load puts the inner state: a model moved after the
        # state was made (accelerate's prepare, which round-trips the state_dict) gets it made there again.
        template = opt._live.tx_state if opt._live.device == opt._device else opt.tx.init(params)
        layout = lo.layout_of(template, params)
        window = lo.window_sum_keys(layout)
        first = entries[0] if isinstance(entries[0], dict) else {}
        if not layout.globals_ and isinstance(entries[0], dict):  # torch's flattened checkpoint drops an empty dict
            entries[0] = first = {GLOBAL: {}, **first}
        elif not any(isinstance(e, dict) and GLOBAL in e for e in entries):
            raise ValueError(  # torch drops a frozen param's state, or the saved chain had none (flattened: no key)
                f"{what}: no param's gradtx entry has the transform's {GLOBAL!r} state ({list(layout.globals_)}), "
                + (
                    "which the save put on its first trainable param. torch's set_state_dict keeps no state for a "
                    "param that does not require grad: if that param is frozen here, make it trainable for the load "
                    "and freeze it after"
                    if opt._frozen
                    else f"so {lo.HINT}"
                )
            )
        saved_open = any(lo.saved_window_open(first.get(GLOBAL), key) for key in window)
        for key in window:
            if not saved_open:
                del layout.per_param[key]
            elif not all(isinstance(e, dict) and key in e for e in entries):
                raise ValueError(
                    f"{what}: the checkpoint was saved with an accumulation window open, but the dict it was loaded "
                    f"from has no partial sums ({key!r}): it was made at a window boundary (a template for dcp.load "
                    "or torchtitan's checkpointer), which cannot know them. Save at a window boundary (opt.emitted "
                    "is True), or end the window with opt.step(flush=True) before saving; torch.save/torch.load "
                    "carries an open window"
                )
            else:  # the partial sums are autograd's .grad: checked and placed like the params, in their dtype
                layout.per_param[key] = flat
        for i, (p, name, e) in enumerate(zip(flat, names, entries)):
            top = ([GLOBAL, AMP] if window else [GLOBAL]) if i == 0 else []
            lo.check_keys(
                e,
                [*layout.per_param, *top],
                optional=(INNER_FRESH, HAS_GRAD),
                what=f"{what}: gradtx state of {name}",
                hint=lo.HINT,
            )
            # A stand-in saved for a param the inner optimizer had not stepped is not its state: it starts fresh.
            if _flag(e, INNER_FRESH, saved_of[id(p)] not in inner_state, what=f"{what}: {name}"):
                inner_state.pop(saved_of[id(p)], None)
            has_grad[i] = _flag(e, HAS_GRAD, True, what=f"{what}: {name}")
        per_param = {key: [e[key] for e in entries] for key in layout.per_param}
        saved_globals = grads.in_groups(opt, layout.places, first[GLOBAL], out=False)
        new_state = _ckpt.import_layout(layout, template, params, per_param, saved_globals, opt.tx, names, what=what)
        if saved_open and opt._plan.window is not None:  # the partial sums go to .grad, the state keeps none
            states = opt._plan.states(new_state)
            sums = tu.flatten(states[0].acc)[0]
            states[0] = states[0]._replace(acc=empty_sums(states[0].acc))
            new_state = opt._plan.join(states)
        record = amp.restore(first.get(AMP), opt._device, what=what) if window else None
    # Everything checked; the inner optimizer validates its own part before it changes anything.
    optimizer.load_state_dict({"state": inner_state, "param_groups": saved_groups})
    window_open = opt._plan.window_open(new_state)
    opt._live = live = Live(new_state, opt._device)  # a fresh record: nothing emitted, synced, no stand-ins
    live.window_open = window_open
    if record is not None and window_open:
        live.amp_scale, live.amp_inf = record
    for i, p in enumerate(flat):
        # An open window's partial sums are the grads; at a boundary no stale partial sum survives.
        p.grad = sums[i] if sums is not None and window_open and has_grad[i] else None

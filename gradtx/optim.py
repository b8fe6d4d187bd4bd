"""TransformedOptimizer: run a gradtx chain on ``p.grad`` in front of any ``torch.optim`` optimizer."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

from gradtx import checkpoint as _ckpt
from gradtx import tree as tu
from gradtx.base import GradientTransformation, metrics
from gradtx.combine import chain
from gradtx.executor import StepPlan

try:  # a CPU-only or old build may lack torch.distributed
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
except ImportError:  # pragma: no cover
    FSDPModule = DistributedDataParallel = None  # type: ignore[assignment,misc]

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

# The extra the wrapper passes itself: it owns the .grad buffers.
_RESERVED = frozenset({"inplace"})


class TransformedOptimizer(torch.optim.Optimizer):
    """Make any ``torch.optim`` optimizer apply a gradtx transform to ``p.grad`` first.

    ``step(**extra)`` reads every ``p.grad``, runs ``tx`` on them (extras such as
    ``tokens=n`` or ``flush=True`` reach every member), writes the result back
    to ``p.grad`` and calls the inner optimizer's ``step`` only when the chain
    emits. It returns whether the inner optimizer stepped.

    The wrapper owns the ``.grad`` buffers, so it runs the chain on the
    in-place path (same numbers as the pure path, no extra copies). With
    :func:`gradtx.accumulate` in the chain, autograd's own summation into
    ``.grad`` is the accumulator, so no second gradient-sized buffer is kept,
    and :meth:`zero_grad` does nothing while a window is open: the ordinary
    ``backward(); step(); zero_grad()`` loop accumulates unchanged.

    When the inner optimizer is fused (``torch.optim.Adam/AdamW/SGD(fused=True)``),
    a trailing scalar factor from the chain (the clip coefficient, the
    accumulation mean) is folded into the kernel's ``grad_scale`` instead of
    costing a pass over the grads, and a skip decided by
    :func:`gradtx.apply_if_finite` rides in its ``found_inf``, with no host
    sync (the kernel writes the scaled grads back into ``p.grad`` as it
    reads them). Other optimizers get the scaled grads written into ``p.grad``
    before their step.

    ``param_groups`` is the inner optimizer's own list, so
    ``torch.optim.lr_scheduler`` schedulers work on the wrapper.

    Data parallel (DDP or FSDP2): wrap each micro-step's forward and backward
    in :meth:`maybe_no_sync`, so only the backward whose ``step()`` will emit
    syncs the grads. For token-weighted accumulation, call
    :func:`sum_grad_reduction` on the model once, and give
    :func:`gradtx.accumulate` a ``comm`` to sum the token totals.

    Args:
      optimizer: the inner ``torch.optim.Optimizer``.
      tx: the gradient transformation to run on the grads.

    Example:
      >>> opt = TransformedOptimizer(torch.optim.AdamW(model.parameters(), fused=True),
      ...                            chain(accumulate(4), clip_by_global_norm(1.0)))
      >>> for batch in loader:
      ...     model(batch).backward()
      ...     if opt.step():
      ...         log(opt.metrics)
      ...     opt.zero_grad()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tx: GradientTransformation) -> None:
        # Deliberately no super().__init__: param_groups and state are the inner optimizer's own.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"TransformedOptimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"TransformedOptimizer: tx must be a GradientTransformation, got {type(tx).__name__}")
        self.optimizer = optimizer
        self.tx = chain(tx)
        self._plan = StepPlan.of(self.tx)
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.tx_state = self.tx.init(self.param_tree())
        self._window_open = False
        self._last_metrics: dict[str, torch.Tensor] = {}

    # torch.optim.Optimizer surface, delegated to the inner optimizer -----------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"TransformedOptimizer({self.optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        # Anything this class does not define (step/state-dict hook registries, private fields that
        # torch.optim.Optimizer's methods expect) is the inner optimizer's, since we skip its __init__.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("TransformedOptimizer: add param groups to the inner optimizer before wrapping it")

    # the tree the transform sees: one list per param group, params that require grad ----------

    def param_tree(self) -> list[list[torch.Tensor]]:
        """The params tree the transform sees: one list per param group, the params that require grad.

        Build a :func:`gradtx.mesh_groups` plan for the wrapper from this tree, so
        the plan's leaf order is the transform's.
        """
        return [[p for p in g["params"] if p.requires_grad] for g in self.optimizer.param_groups]

    def _grads(self, params: list[list[torch.Tensor]], *, emitting: bool) -> list[list[torch.Tensor]]:
        # A param without a grad contributes zeros to an emitting step; its grad stays None, so the
        # inner optimizer skips it. A held step reads no grad values (accumulate comes first and
        # only counts), so a missing grad there, as under FSDP2's no-sync, costs no allocation.
        def missing(p: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(p) if emitting else torch.empty(0, dtype=p.dtype, device=tu.local(p).device)

        return [[p.grad if p.grad is not None else missing(p) for p in group] for group in params]

    # stepping -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None, **extra: Any) -> bool:  # type: ignore[override]
        """Run the transform on the grads and step the inner optimizer if it emitted.

        Args:
          closure: not supported (gradtx needs the grads before the inner step).
          **extra: forwarded to every transform, e.g. ``tokens=n``, ``flush=True``.

        Returns:
          True when the inner optimizer's step ran. With a fused inner optimizer, a
          step that :func:`gradtx.apply_if_finite` skips is skipped inside the
          kernel (``found_inf``, no host sync), so this still returns True and
          ``metrics["skipped"]`` counts it; other optimizers return False.
        """
        if self._ckpt_dcp_init_step():  # issue 9: DCP's state warm-up runs the inner optimizer only
            return True
        if closure is not None:
            raise ValueError("TransformedOptimizer.step: closures are not supported")
        reserved = sorted(_RESERVED & extra.keys())
        if reserved:
            raise ValueError(f"TransformedOptimizer.step: {reserved} are set by the wrapper itself; do not pass them")
        params = self.param_tree()
        grads = self._grads(params, emitting=self.emits_next(flush=bool(extra.get("flush", False))))
        result = self._plan.run_owned(grads, self.tx_state, params, autograd_buffer=True, **extra)
        self.tx_state = result.state
        self._last_metrics = metrics(result.state)
        # Open while the window counts micro-steps; an emitted or skipped (empty) window closes it.
        self._window_open = self._plan.window_open(result.state)
        if result.updates is None:
            return False

        for group_params, group_updates in zip(params, result.updates):
            for p, u in zip(group_params, group_updates):
                if p.grad is not None and u is not p.grad:
                    p.grad = u

        factor, skip = result.factor, result.skip
        if self._fused:
            # torch's fused kernels read grad_scale as fp32; gradtx's factors may be fp64.
            self.optimizer.grad_scale = None if factor is None else (1.0 / factor).to(torch.float32)  # type: ignore[attr-defined]
            self.optimizer.found_inf = None if skip is None else skip.to(torch.float32)  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.grad_scale = None  # type: ignore[attr-defined]
                self.optimizer.found_inf = None  # type: ignore[attr-defined]
            return True
        if factor is not None:
            grads_now = [p.grad for group in params for p in group if p.grad is not None]
            tu.scale_leaves(grads_now, factor, inplace=True)
        if skip is not None and bool(skip):  # a non-fused optimizer cannot skip on its own
            return False
        self.optimizer.step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grads, except while an accumulation window is open (they are the accumulator)."""
        if not self._window_open:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """The last step's logged scalars: grad_norm, clip_coef, micro_step, tokens, skipped (as present)."""
        return dict(self._last_metrics)

    @property
    def window_open(self) -> bool:
        """Whether an accumulation window is open (the grads hold a partial sum)."""
        return self._window_open

    def emits_next(self, *, flush: bool = False) -> bool:
        """Whether the next :meth:`step` will emit, so its backward must sync the grads across ranks.

        True without :func:`gradtx.accumulate` in the chain (every step emits),
        on the last micro-step of a window, and when the next step will be
        passed ``flush=True``. Reads only host-side counters.

        Args:
          flush: the next ``step`` will be called with ``flush=True``.

        Returns:
          Whether the next ``step`` closes its accumulation window.
        """
        return self._plan.emits_next(self.tx_state, flush=flush)

    @contextlib.contextmanager
    def maybe_no_sync(self, model: torch.nn.Module, *, flush: bool = False) -> Iterator[None]:
        """Run one micro-step's forward and backward, syncing the grads only if the next ``step`` emits.

        The wrapper knows where its accumulation window stands, so the data-parallel
        sync (DDP's all-reduce, FSDP2's reduce-scatter) happens once per optimizer
        step, on the last micro-step, instead of ``k`` times. Wrap the forward
        *and* the backward: DDP decides in its forward whether the backward syncs.
        A model that is neither DDP nor FSDP2 runs unchanged. See :func:`no_sync`.

        Args:
          model: the DDP- or FSDP2-wrapped model whose backward runs inside.
          flush: this micro-step's ``step`` will get ``flush=True`` (a short final window).

        Example:
          >>> for x, y in micro_batches:
          ...     with opt.maybe_no_sync(model):
          ...         loss_sum = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
          ...         loss_sum.backward()
          ...     opt.step(tokens=int((y != -100).sum()))
          ...     opt.zero_grad()
        """
        sync = self.emits_next(flush=flush)
        # issue 9: after a backward that skipped the sync, the window's partial sums are not in .grad.
        self._ckpt_synced = sync or not (hasattr(model, "set_requires_gradient_sync") or hasattr(model, "no_sync"))
        with no_sync(model, sync=sync):
            yield

    # checkpoints (issue 9) ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The checkpoint in ``torch.optim``'s layout: ``state`` per parameter and ``param_groups``.

        Each parameter's entry is the inner optimizer's (``exp_avg``, ``step``, ...)
        plus a ``"gradtx"`` dict: the transform's per-parameter state (a DTensor
        where the param is one, so it reshards), the open accumulation window's
        partial sum (the param's ``.grad``; zeros at a boundary, so the keys never
        depend on where the window stands), and, on the first parameter only,
        the transform's global state under ``"global"`` (counters, the window's
        micro-step and token count, the last grad norm). So
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
        ``get_optimizer_state_dict`` (full or sharded) and ``dcp.save`` take it as
        they take any optimizer's. See ``docs/checkpointing.md``.

        Raises:
          ValueError: a window is open and its partial sums are not in ``.grad``
            (they sit inside DDP/FSDP2 after a :meth:`maybe_no_sync` backward that
            did not sync): save at a window boundary, or make the window's last
            micro-step sync (``step(flush=True)`` after ``maybe_no_sync(model, flush=True)``).
        """
        params = self.param_tree()
        flat = [p for group in params for p in group]
        layout = _ckpt._layout_of(self.tx_state, params)
        acc_key = self._ckpt_acc_key(layout)
        if acc_key is not None:
            sums = self._ckpt_partial_sums(flat)
            layout.per_param[acc_key] = [sums]  # a one-leaf tree: _export flattens it
        per_param, globals_ = _ckpt._export(
            layout, flat, self.tx, what="TransformedOptimizer.state_dict", acc_dtype=_same_dtype
        )
        inner = self.optimizer.state_dict()
        # torch's state_dict hands out the live per-param dicts: copy them before adding to them.
        state: dict[Any, Any] = {pid: {k: v for k, v in s.items() if k != _GTX} for pid, s in inner["state"].items()}
        for i, pid in enumerate(self._ckpt_pids(params)):
            entry = state.setdefault(pid, {})
            entry[_GTX] = {key: values[i] for key, values in per_param.items()}
            if i == 0:
                entry[_GTX][_GLOBAL] = globals_
        return {"state": state, "param_groups": inner["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`, or adopt a plain ``torch.optim`` checkpoint; checks everything first.

        Accepts what :meth:`state_dict` made, also after torch's
        ``set_optimizer_state_dict`` / ``dcp.load`` re-keyed it by parameter name.
        A checkpoint of the bare inner optimizer class (no ``"gradtx"`` entries)
        loads too: the inner state is restored and the transform starts fresh
        (``tx.init``), as when a running project adopts gradtx.

        Before anything changes it checks the param groups and counts, the
        inner state's shapes, and the transform's: the same chain (keys), the
        same accumulation ``k``, shapes and dtypes. The first difference raises a
        ``ValueError`` naming it, and the optimizer is left as it was. A window
        that was open when saved is open again, its partial sums in ``.grad``;
        one saved at a boundary leaves every ``.grad`` ``None``.
        """
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
                raise ValueError(
                    f"{what}: missing key {key!r} (expected torch.optim's layout: 'state', 'param_groups')"
                )
        params = self.param_tree()
        flat = [p for group in params for p in group]
        saved_groups = state_dict["param_groups"]
        groups = self.optimizer.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(
                f"{what}: the checkpoint has {len(saved_groups)} param groups, this optimizer {len(groups)}"
            )
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
        names = self._ckpt_names(params)
        saved_state = state_dict["state"]
        inner_state = {}
        for sid, s in saved_state.items():
            if not isinstance(s, dict):
                raise TypeError(f"{what}: state[{sid!r}] is a {type(s).__name__}, not a dict")
            rest = {k: v for k, v in s.items() if k != _GTX}
            if rest:
                inner_state[sid] = rest
        _check_inner_state(inner_state, {saved_of[id(p)]: p for p in all_params}, what=what)
        entries = [saved_state.get(saved_of[id(p)], {}).get(_GTX) for p in flat]
        if all(e is None for e in entries):
            entries = self._ckpt_flattened_entries(flat) or entries
        if all(e is None for e in entries):  # a plain torch.optim checkpoint: adopt it, transform fresh
            new_state = self.tx.init(params)
            sums = None
        else:
            layout = _ckpt._layout_of(self.tx_state, params)
            acc_key = self._ckpt_acc_key(layout)
            if acc_key is not None:
                layout.per_param[acc_key] = None  # the partial sums: shaped and typed like the params
            expected = list(layout.per_param)
            per_param: dict[str, list[Any]] = {key: [] for key in expected}
            for i, (name, entry) in enumerate(zip(names, entries)):
                keys = expected + ([_GLOBAL] if i == 0 else [])
                _ckpt._check_keys(entry, keys, what=f"{what}: gradtx state of {name}", hint=_ckpt._HINT)
                for key in expected:
                    per_param[key].append(entry[key])
            loaded = _ckpt._import(
                layout, self.tx_state, params, per_param, entries[0][_GLOBAL], self.tx, names,
                what=what, acc_dtype=_same_dtype,
            )  # fmt: skip
            new_state, taken = _ckpt._take_acc(loaded, params)
            sums = taken[0] if acc_key is not None and taken else None
        # Everything checked; the inner optimizer validates its own part before it changes anything.
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": saved_groups})
        self.tx_state = new_state
        self._window_open = self._plan.window_open(new_state)
        self._ckpt_synced = True
        for i, p in enumerate(flat):
            # An open window's partial sums are the grads; at a boundary no stale partial sum survives.
            p.grad = tu.flatten(sums)[0][i] if sums is not None and self._window_open else None
        self._last_metrics = metrics(self.tx_state)

    def _ckpt_acc_key(self, layout: Any) -> str | None:
        """The checkpoint key of the leading window's partial sums (autograd's ``.grad``), or ``None``."""
        if self._plan.window is None or not layout.windows:
            return None
        return _ckpt._child(layout.windows[0][0], _ckpt._ACC)  # the leading window's, the first in the walk

    def _ckpt_pids(self, params: list[list[torch.Tensor]]) -> list[int]:
        """torch.optim's state_dict index of each param of :meth:`param_tree`, in order."""
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        return [index[id(p)] for group in params for p in group]

    def _ckpt_names(self, params: list[list[torch.Tensor]]) -> list[str]:
        return [
            f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
            for i, g in enumerate(self.optimizer.param_groups)
            for j, p in enumerate(g["params"])
            if p.requires_grad
        ]

    def _ckpt_partial_sums(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """The open window's partial sums (the grads), or zeros at a boundary; refuses sums it cannot see."""
        if not self._plan.window_open(self.tx_state):
            return [torch.zeros_like(p) for p in flat]
        hidden = not getattr(self, "_ckpt_synced", True) or (flat and all(p.grad is None for p in flat))
        if hidden:
            window_state, window = self._plan.window_state(self.tx_state), self._plan.window
            assert window_state is not None and window is not None  # the window is open
            raise ValueError(
                f"TransformedOptimizer.state_dict: an accumulation window is open (micro-step "
                f"{int(window_state.micro_step)} of {window.k}) and its partial sums are not in .grad: they sit inside DDP/FSDP2, which skipped "
                "the gradient sync (maybe_no_sync), so a checkpoint now would lose them. Save at a window boundary "
                "(when step() returned True, opt.window_open is False), or end the window early: run its next "
                "micro-step inside opt.maybe_no_sync(model, flush=True) and call opt.step(flush=True)"
            )
        return [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in flat]

    def _ckpt_flattened_entries(self, flat: list[torch.Tensor]) -> list[Any] | None:
        """The transform's entries from the flattened dict torch's ``set_optimizer_state_dict`` is loading, if any.

        With ``flatten_optimizer_state_dict=True`` (torchtitan's setting) torch
        rebuilds the optimizer dict from the live optimizer's own state keys, so
        the ``"gradtx"`` entries are dropped on the way; read them back from the
        flattened dict it was given (``state.<fqn>.gradtx.<key>``).
        """
        frame = sys._getframe(2)
        if frame is None or frame.f_code.co_name != "_load_optim_state_dict":
            return None
        flat_sd, info = frame.f_locals.get("state_dict"), frame.f_locals.get("info")
        mapping = getattr(info, "fqn_param_mapping", None)
        if not isinstance(flat_sd, dict) or "state" in flat_sd or mapping is None:
            return None
        entries: list[Any] = []
        for p in flat:
            fqns = mapping.get(p) or ()
            prefix = f"state.{next(iter(fqns))}.{_GTX}." if fqns else ""
            entry: dict[str, Any] = {}
            for key, value in flat_sd.items() if prefix else ():
                if isinstance(key, str) and key.startswith(prefix):
                    *outer, leaf = key[len(prefix) :].split(".")
                    node = entry
                    for part in outer:
                        node = node.setdefault(part, {})
                    node[leaf] = value
            entries.append(entry or None)
        return entries if any(e is not None for e in entries) else None

    def _ckpt_dcp_init_step(self) -> bool:
        """Whether this ``step()`` is torch DCP's state warm-up (``_init_optim_state``); if so, run only the inner step.

        DCP materialises a fresh optimizer's state by stepping it once on zero
        grads with ``lr = 0``. That must not count as a micro-step nor advance
        the transform, so the inner optimizer alone takes it.
        """
        frame: Any = sys._getframe(1)
        for _ in range(6):  # step's own frame and its decorators' (no_grad), then its caller
            if frame is None:
                return False
            if frame.f_code.co_name == "_init_optim_state" and frame.f_globals.get("__name__", "").startswith(
                "torch.distributed.checkpoint"
            ):
                self.optimizer.step()
                return True
            frame = frame.f_back
        return False


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype  # the wrapper's partial sums are autograd's .grad, in the params' dtype


_GTX = "gradtx"  # issue 9: the transform's entry in each param's state
_GLOBAL = "global"
# Inner-optimizer state tensors shaped like their param (torch.optim's names).
_PARAM_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "ax", "prev"}
)


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


@contextlib.contextmanager
def no_sync(model: torch.nn.Module, *, sync: bool) -> Iterator[None]:
    """Skip the data-parallel gradient sync of one backward unless ``sync`` is True.

    Works for FSDP2 (``set_requires_gradient_sync``) and DDP (``no_sync``); a
    no-op for any other module. Use ``sync=True`` on the last micro-step of an
    accumulation window, so the sync happens once per optimizer step. Wrap the
    forward too: DDP reads the flag in its forward. With a
    :class:`TransformedOptimizer`, :meth:`TransformedOptimizer.maybe_no_sync`
    works out ``sync`` for you.

    Args:
      model: the DDP- or FSDP2-wrapped model.
      sync: whether this backward syncs the grads across ranks.

    Example:
      >>> with no_sync(model, sync=(micro_step == k - 1)):
      ...     loss.backward()
    """
    wrapped: Any = model  # FSDP2's and DDP's methods are not on nn.Module's type
    if sync:
        yield
    elif hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    elif hasattr(wrapped, "no_sync"):  # DDP
        with wrapped.no_sync():
            yield
    else:
        yield


def sum_grad_reduction(model: ModuleT) -> ModuleT:
    """Make a DDP or FSDP2 model *sum* its grads across data-parallel ranks instead of averaging them.

    Token-weighted accumulation needs the raw sum ``sum over ranks of grad``:
    gradtx divides it by the global token total (see :func:`gradtx.accumulate`).
    The wrappers average by default, which would divide a second time, by the
    world size, and weight every rank equally however many tokens it saw.

    * FSDP2: every ``fully_shard``-ed module gets ``set_gradient_divide_factor(1.0)``
      and ``set_force_sum_reduction_for_comms(True)``, so the reduce-scatter
      (and HSDP's all-reduce) is a plain SUM with no pre- or post-scaling
      (gloo has no ``PREMUL_SUM``, and NCCL's zero-copy paths need plain SUM).
    * DDP: :func:`gradtx.comm.torch_dist.ddp_sum_hook` replaces DDP's
      averaging all-reduce with a summing one. DDP takes one comm hook; call
      this before the first backward, and not on a model that has one.
    * Pipelining (``torch.distributed.pipelining``) is configured elsewhere:
      build the schedule with ``scale_grads=False``.

    Args:
      model: the DDP-wrapped model, or a model containing FSDP2 (``fully_shard``) modules.

    Returns:
      ``model``, configured in place.

    Raises:
      TypeError: ``model`` is neither DDP nor holds FSDP2 modules (a one-process
        model sums nothing; do not call this on ``ddp.module`` either).

    References:
      xorl, "Gradient Accumulation & Token Normalization" (FSDP2 ``set_gradient_divide_factor(1.0)``).

    Example:
      >>> model = gtx.sum_grad_reduction(fully_shard(model))
      >>> tx = gtx.chain(gtx.accumulate(4, token_weighted=True, comm=comm, group="dp"), gtx.adamw(3e-4))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sum_grad_reduction: model must be a torch.nn.Module, got {type(model).__name__}")
    fsdp = [m for m in model.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]
    if fsdp:
        # Both setters act on one module's own state, not recursively, so each is visited.
        for module in fsdp:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        return model
    if DistributedDataParallel is not None and isinstance(model, DistributedDataParallel):
        from gradtx.comm.torch_dist import ddp_sum_hook  # the comm layer issues the collective

        model.register_comm_hook(model.process_group, ddp_sum_hook)
        return model
    raise TypeError(
        f"sum_grad_reduction: model must be DistributedDataParallel or contain fully_shard (FSDP2) modules, "
        f"got {type(model).__name__}; a one-process model needs no call"
    )

"""TransformedOptimizer: run a gradtx chain on ``p.grad`` in front of any ``torch.optim`` optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

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
        with no_sync(model, sync=self.emits_next(flush=flush)):
            yield

    # checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict, the transform state, and the partial grads of an open window."""
        leaves, _ = tu.flatten(self.tx_state)
        out: dict[str, Any] = {
            "inner": self.optimizer.state_dict(),
            "tx_state": leaves,
            "window_open": self._window_open,
        }
        if self._window_open:
            out["grads"] = [[None if p.grad is None else p.grad.detach().clone() for p in g] for g in self.param_tree()]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore what :meth:`state_dict` saved; a run resumed mid-window continues it exactly."""
        for key in ("inner", "tx_state", "window_open"):
            if key not in state_dict:
                raise ValueError(f"TransformedOptimizer.load_state_dict: missing key {key!r}")
        leaves, spec = tu.flatten(self.tx_state)
        saved = state_dict["tx_state"]
        if len(saved) != len(leaves):
            raise ValueError(
                f"TransformedOptimizer.load_state_dict: tx_state has {len(saved)} tensors, this transform has {len(leaves)}"
            )
        for path, s, cur in zip(tu.paths(self.tx_state), saved, leaves):
            if not isinstance(s, torch.Tensor) or s.shape != cur.shape or s.dtype != cur.dtype:
                got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(
                    f"TransformedOptimizer.load_state_dict: tx_state at {tu.path_str(path)} is {got}, "
                    f"this transform has {cur.dtype} {tuple(cur.shape)}"
                )
        params = self.param_tree()
        grads = state_dict.get("grads")
        if grads is not None and [len(g) for g in grads] != [len(g) for g in params]:
            raise ValueError("TransformedOptimizer.load_state_dict: saved grads do not match the param groups")
        self.optimizer.load_state_dict(state_dict["inner"])
        self.tx_state = tu.unflatten(spec, [s.to(cur.device) for s, cur in zip(saved, leaves)])
        self._window_open = bool(state_dict["window_open"])
        # The grads are part of the window: restore an open one, and drop any partial sum otherwise.
        for i, group in enumerate(params):
            for j, p in enumerate(group):
                g = grads[i][j] if grads is not None else None
                p.grad = None if g is None else g.to(p.device).clone()
        self._last_metrics = metrics(self.tx_state)


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

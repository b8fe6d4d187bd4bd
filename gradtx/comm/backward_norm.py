"""BackwardNorm: the global norm of DDP grads, measured in the backward as each bucket's all-reduce completes.

DDP's grads are replicated once they are reduced, so each rank can measure
the global norm alone: no collective is needed for it. Measured at
``step()``, that pass over every grad runs after the backward has ended.
:func:`gradtx.comm.torch_dist.backward_norm_hook`, a DDP comm hook, measures
each bucket instead, its grads as views of the reduced bucket buffer, as soon as its
all-reduce is done, while autograd is still computing the earlier layers'
grads. This object is the hook's state and the declared channel to the
clip: the user passes the same object to ``register_comm_hook`` (or gets it
from :func:`gradtx.norm_in_backward`) and to
``gtx.clip_by_global_norm(..., precomputed=...)``.

A value is handed over once: the clip takes the value of the last completed
sync and marks it consumed, and takes it only if the grads it is given are
the very tensors (same storage, same sizes) DDP synced into. Anything else
(no sync since the last step, grads of other params, a transform before the
clip that made new tensors, a step under ``torch.compile``) makes the clip
compute the norm itself, as it would without this object, and counts a
fallback. No host sync: every check is on Python-side metadata.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from gradtx.comm.base import PendingReduce, ReduceOp, start_all_reduce
from gradtx.core import norms
from gradtx.core import tree as tu

__all__ = ["BackwardNorm"]


class BackwardNorm:
    """The state of :func:`gradtx.comm.torch_dist.backward_norm_hook`: per-bucket norm parts, handed to the clip.

    Args:
      norm_type: the order of the norm: any ``p > 0`` or ``inf``; the clip
        given this object must use the same.
      process_group: DDP's process group (``None``: the default group).
      engine: ``"ddp"`` (the comm hook measures whole buckets; no collective at
        ``step()``) or ``"fsdp2"`` (each sharded param's post-accumulate-grad
        hook measures its local shard; the plan's reductions remain at ``step()``).
      sum_state: a :class:`gradtx.comm.torch_dist.DDPSumState` to *sum* the
        grads across ranks (what :func:`gradtx.sum_grad_reduction` does),
        instead of DDP's mean; :func:`gradtx.norm_in_backward` with
        ``sum_reduction=True`` sets it up, with its grad hooks.

    Attributes:
      generation: the number of syncs measured so far.
      buckets: how many DDP buckets the last measured sync had.
      used: how many times a clip took a measured value.
      fallbacks: how many times a clip found no value for its grads and computed the norm itself.
      early: how many steps took the all-reduce the last hook started (FSDP2 under a flat plan:
        one reduction over the whole mesh), leaving only a wait at ``step()``.

    Example:
      >>> bn = gtx.BackwardNorm(2.0)
      >>> ddp_model.register_comm_hook(bn, gtx.comm.torch_dist.backward_norm_hook)
      >>> tx = gtx.chain(gtx.clip_by_global_norm(1.0, precomputed=bn), gtx.adamw(3e-4))
    """

    def __init__(
        self, norm_type: float = 2.0, *, process_group: Any = None, sum_state: Any = None, engine: str = "ddp"
    ) -> None:
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ValueError(f"BackwardNorm: norm_type must be a number > 0 or inf, got {norm_type!r}")
        if engine not in ("ddp", "fsdp2"):
            raise ValueError(f"BackwardNorm: engine must be 'ddp' or 'fsdp2', got {engine!r}")
        self.engine = engine
        self.norm_type = float(norm_type)
        self.process_group = process_group
        self.sum_state = sum_state
        self.generation = 0
        self.used = 0
        self.fallbacks = 0
        self.buckets = 0
        self.early = 0
        self._lock = threading.Lock()  # gloo and NCCL run completion callbacks on their own threads
        self._reset()

    @property
    def is_ddp(self) -> bool:
        """Whether the value is DDP's whole norm (else FSDP2's per-leaf local parts)."""
        return self.engine == "ddp"

    def _reset(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._params: list[torch.Tensor] = []
        self._numel = 0
        self._inflight = 0
        self._last_issued = False
        self._ready: tuple[list[torch.Tensor], list[torch.Tensor], int] | None = None
        # FSDP2: each sharded param's latest local contribution, from its post-accumulate-grad hook:
        # id(param) -> (the grad's key, see _grad_key; the part; the param). One entry per param.
        self._measured: dict[int, tuple[tuple[Any, int], torch.Tensor, torch.Tensor]] = {}
        self._taken: list[torch.Tensor | None] = []  # the params of the leaves the last take matched
        self._taken_all: list[torch.Tensor] = []  # every param the hooks measured for that take
        # FSDP2 under a flat plan (one all-reduce over the mesh): see take_flat
        self._recipe: _FlatRecipe | None = None
        self._partial: dict[int, torch.Tensor | None] = {}  # this backward's weighted parts so far
        self._issued: PendingReduce | None = None  # the reduction the last hook started, not yet taken
        self._early: PendingReduce | None = None  # the one the current step may take (take_flat)

    # --- the hook's side -------------------------------------------------------------------

    def bucket_started(self, index: int, is_last: bool, params: Sequence[torch.Tensor]) -> None:
        """Called by the hook as it issues a bucket's all-reduce; bucket 0 opens a new sync."""
        with self._lock:
            if index == 0:  # DDP issues buckets in index order, and waits for all of them before the next backward
                self._parts, self._params, self._numel, self._inflight = [], [], 0, 0
                self._last_issued = False
            self._inflight += 1
            self._params.extend(params)
            self._last_issued = self._last_issued or is_last

    def bucket_done(self, grads: Sequence[torch.Tensor], numel: int) -> None:
        """Called by the hook once a bucket is reduced, with its grads: measure them; the last bucket publishes."""
        sums = norms.tensor_powsums(list(grads), self.norm_type)  # one pass, one kernel per (device, dtype) group
        part = norms.total(sums, self.norm_type) if sums else torch.zeros((), dtype=torch.float64)
        with self._lock:
            self._parts.append(part)
            self._numel += numel
            self._inflight -= 1
            if self._last_issued and self._inflight == 0:
                self._ready = (self._parts, self._params, self._numel)
                self.buckets = len(self._parts)
                self._parts, self._params = [], []
                self.generation += 1

    def param_done(self, param: torch.Tensor) -> None:
        """Called by a param's post-accumulate-grad hook (FSDP2: once its sharded grad is final): measure it."""
        grad = param.grad
        if grad is None:
            return
        (part,) = norms.tensor_powsums([grad], self.norm_type)
        key = _grad_key(grad)
        start: list[torch.Tensor] | None = None
        with self._lock:
            self._measured[id(param)] = (key, part, param)
            recipe = self._recipe
            if recipe is not None and id(param) in recipe.weights:
                if id(param) in self._partial:  # a backward that measured only some params: start again
                    self._partial = {}
                weight = recipe.weights[id(param)]
                self._partial[id(param)] = None if weight is None else part if weight == 1.0 else part * weight
                if len(self._partial) == len(recipe.weights):  # the last hook of this backward
                    start = [v for v in self._partial.values() if v is not None]
                    self._partial = {}
        if recipe is not None and start is not None:
            # Every rank's recipe names the same params, whose hooks run in the same order on every
            # rank (empty shards included): each rank starts this reduction at the same point.
            mine = norms.total(start, self.norm_type).to(norms.partial_dtype(part.device))
            op = ReduceOp.MAX if math.isinf(self.norm_type) else ReduceOp.SUM
            pending = start_all_reduce(recipe.comm, [mine], op, recipe.group)
            with self._lock:
                stale, self._issued = self._issued, pending
            if stale is not None:  # an earlier backward's, never taken (accumulation, or no step): drop it
                stale.wait()

    # --- the clip's side -------------------------------------------------------------------

    def take(self, leaves: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The sum of p-th powers (max for ``inf``) of ``leaves``, as the last sync measured them, or ``None``.

        Consumes the value: a second call before the next sync returns
        ``None``. The value is returned only if ``leaves`` are the ``.grad``
        tensors of exactly the params DDP synced (compared by storage
        address and size, on the host). Returns a 0-d fp64 tensor.
        """
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is not None and torch.compiler.is_compiling():
            ready = None
        if ready is not None:
            _, params, numel = ready
            synced = {(g.data_ptr(), g.numel()) for p in params if (g := p.grad) is not None and g.numel()}
            given = [tu.local(t) for t in leaves]
            if (
                numel < sum(t.numel() for t in given)
                or {(t.data_ptr(), t.numel()) for t in given if t.numel()} != synced
            ):
                ready = None
        if ready is None:
            self.fallbacks += 1
            return None
        self.used += 1
        return norms.total(ready[0], self.norm_type)

    def take_leafwise(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each leaf's local contribution, as the hooks measured it since the last take, or ``None`` (FSDP2).

        Consumes every measured value. Returns ``None`` unless every leaf with
        elements is a grad a hook measured (matched by its local shard's
        storage address and size); the caller then reduces the contributions
        over the mesh as the plan says.
        """
        with self._lock:
            measured, self._measured = self._measured, {}
            issued, self._issued = self._issued, None
            complete = not self._partial  # no backward measured only some of the recipe's params since
            self._partial = {}
        if self._early is not None:  # the last step's, if its norm did not take it
            self._early.wait()
        self._early = issued if complete else None
        if issued is not None and not complete:
            issued.wait()
        by_key = {key: (part, param) for key, part, param in measured.values()}
        out: list[torch.Tensor] | None = [] if measured and not torch.compiler.is_compiling() else None
        taken: list[torch.Tensor | None] = []
        for t in leaves:
            if out is None:
                break
            key = _grad_key(t)
            empty = key[1] == 0
            part, param = by_key.get(key, (None, None))
            if empty:  # an empty shard (FSDP2, fewer rows than ranks) adds 0; empty grads share addresses
                local = tu.local(t)
                part, param = torch.zeros((), dtype=norms.partial_dtype(local.device), device=local.device), None
            if part is None:
                out = None
            else:
                out.append(part)
                taken.append(param)
        self._taken = taken if out is not None else []
        self._taken_all = [param for _, _, param in measured.values()] if out is not None else []
        if out is None:
            if self._early is not None:
                self._early.wait()
            self._early = None
            with self._lock:
                self._recipe = None  # the hooks stop reducing until a step takes their values again
            self.fallbacks += 1
        else:
            self.used += 1
        return out

    # --- FSDP2 under a flat plan: the one reduction started by the last hook -------------------

    def take_flat(self, comm: Any, group: Any, weights: Sequence[float | None]) -> PendingReduce | None:
        """The flat plan's all-reduce the last hook started for this step's leaves, or ``None``; and arms the next.

        Called by the norm after :meth:`take_leafwise` matched the leaves:
        ``weights[i]`` is what leaf ``i``'s part is multiplied by in the sum
        over the mesh (``1 / replicas``), or ``None`` for a leaf every rank
        holds whole, which is added after the reduction. The recipe names every
        param the hooks measured, empty local shards included (FSDP2 runs their
        hooks too, with a 0-element grad), so it is the same on every rank; it
        is made only if those params are exactly the leaves' params.

        The reduction in flight is returned only if the recipe armed before is
        this one (the same comm, group, params and weights); else it is waited
        for and dropped, and the caller starts the reduction itself (``None``).
        Either way the recipe is armed: from the next backward on, the hooks add
        the weighted parts as the grads arrive and the last one starts
        ``comm``'s all-reduce over ``group``, so what is left at ``step()`` is a wait.
        """
        want = self._recipe_for(comm, group, weights)
        early, self._early = self._early, None
        armed = self._recipe
        if want is not None and (armed is None or armed.key != want.key):
            with self._lock:
                self._recipe = want
        if early is None:
            return None
        if want is not None and armed is not None and armed.key == want.key:
            self.early += 1
            return early
        early.wait()
        return None

    def _recipe_for(self, comm: Any, group: Any, weights: Sequence[float | None]) -> _FlatRecipe | None:
        """The recipe for the leaves the last take matched, or ``None`` unless they are every measured param's grad."""
        params, measured = self._taken, self._taken_all
        if len(params) != len(weights) or len(measured) != len(weights):
            return None
        members: dict[int, float | None] = {}
        for p, w in zip(params, weights):
            if p is not None:
                if id(p) in members:  # one grad given twice: the plan counts it twice, a recipe cannot
                    return None
                members[id(p)] = w
        for p in measured:  # the params of the empty shards, whose grads cannot be told apart: they add 0
            members.setdefault(id(p), 0.0)
        if len(members) != len(weights):
            return None
        return _FlatRecipe(comm, group, members, measured)

    def norm(self, leaves: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """:meth:`take`, as the norm itself (fp32, or fp64 for fp64 grads), or ``None``."""
        power = self.take(leaves)
        if power is None:
            return None
        return norms.power_to_norm(power, self.norm_type).to(norms.norm_dtype(list(leaves)))

    # --- pickling: a checkpointed transform keeps the settings, never a measured value ----------

    def __getstate__(self) -> dict[str, Any]:
        return {"norm_type": self.norm_type, "engine": self.engine}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["norm_type"], engine=state.get("engine", "ddp"))  # type: ignore[misc]

    def __repr__(self) -> str:
        p = "inf" if math.isinf(self.norm_type) else f"{self.norm_type:g}"
        return (
            f"BackwardNorm(norm_type={p}, generation={self.generation}, used={self.used}, fallbacks={self.fallbacks})"
        )


def _grad_key(grad: torch.Tensor) -> tuple[Any, int]:
    """A grad's identity whatever tensor object holds it: its local shard's storage address and size.

    Under :func:`gradtx.testing.simulated_mesh` the local shard is torch's
    ``LocalTensor``, one tensor per simulated rank: the addresses of all of
    them, and their total size.
    """
    return _address(tu.local(grad))


def _address(t: torch.Tensor) -> tuple[Any, int]:
    per_rank = getattr(t, "_local_tensors", None)
    if per_rank is None:
        return t.data_ptr(), t.numel()
    shards = [(r, _address(x)) for r, x in sorted(per_rank.items())]
    return tuple((r, a) for r, (a, _) in shards), sum(n for _, (_, n) in shards)


class _FlatRecipe:
    """What the hooks of :class:`BackwardNorm` sum and reduce for a flat plan (see :meth:`BackwardNorm.take_flat`)."""

    def __init__(self, comm: Any, group: Any, weights: dict[int, float | None], params: Sequence[torch.Tensor]) -> None:
        self.comm = comm
        self.group = group
        self.weights = weights  # id(param) -> its part's weight in the sum, or None: added after the reduction
        self.params = list(params)  # held, so that no id above is reused while the recipe lives
        self.key = (id(comm), group, tuple(sorted(weights.items(), key=lambda kv: kv[0])))

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
        # FSDP2: each sharded param's local contribution, from its post-accumulate-grad hook, keyed by
        # the grad's (storage address, size): the latest sync's value of the grad the param now holds.
        self._by_grad: dict[tuple[int, int], torch.Tensor] = {}

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
        local = tu.local(grad)
        (part,) = norms.tensor_powsums([grad], self.norm_type)
        with self._lock:
            self._by_grad[(local.data_ptr(), local.numel())] = part

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
            measured, self._by_grad = self._by_grad, {}
        out: list[torch.Tensor] | None = [] if measured and not torch.compiler.is_compiling() else None
        for t in leaves:
            if out is None:
                break
            local = tu.local(t)
            part = measured.get((local.data_ptr(), local.numel()))
            if part is None and local.numel() == 0:  # an empty shard (FSDP2, fewer rows than ranks) adds 0
                part = torch.zeros((), dtype=norms.partial_dtype(local.device), device=local.device)
            if part is None:
                out = None
            else:
                out.append(part)
        if out is None:
            self.fallbacks += 1
        else:
            self.used += 1
        return out

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

"""Transform kinds: what the executor, the wrapper and the checkpoint may know about a transform, declared.

A transform is plain ``init``/``update``, and running it member by member is
always correct. A caller that owns its buffers (:func:`gradtx.update_and_apply`
with ``donate=True``, :class:`gradtx.TransformedOptimizer`) can do better when
a transform says what it is. It says so through the small protocols below and
nothing else: no code reads another module's state fields by name or position.
Each is optional; a transform that declares none is run as it is, correctly.

* **Fresh updates** (:func:`declare_fresh`, :func:`returns_fresh`): the updates
  ``update`` returns never share storage with its state or its params. A caller
  may then write into those updates (pass them on with ``inplace=True``, scale
  them in place) without a check. A transform that does not declare it is
  checked by storage after every update, and a leaf that is also held by its
  state or params is copied first, so optax's way of writing a transform
  (``new = decay * trace + g; return new, State(new)``) is safe everywhere.
* **A trailing scalar factor** (:class:`ScalarFactor`): ``update`` multiplies every
  leaf by one scalar, and ``factor`` returns that scalar, so a run of them folds
  into one multiply or into a fused kernel's ``grad_scale``.
* **A guard with a verdict** (:class:`Verdict`): the transform may veto a step;
  ``verdict(state)`` reads the veto of the step that made ``state``, so a caller
  whose terminal would still move on zero updates (a torch optimizer's moments)
  skips that terminal.
* **A window** (:class:`Windowed`): the transform holds updates back over a window
  of micro-steps and emits their normalised sum, so the wrapper can let autograd's
  ``.grad`` be the running sum and count only.
* **A fusable optimizer** (:class:`FusableOptimizer`): a trailing optimizer whose
  whole step a donated step may run as one fused torch kernel.
* **Extras for what follows** (:class:`DownstreamExtra`): the transform changes
  the extras (``loss=``, ...) the members after it see, as a window hands on the
  loss of the whole window once it emits.
* **Tied weights** (:func:`declare_ties`): the transform reads a norm over a
  pipeline plan's tied weights, which an earlier member must have summed, or it
  is that member (:func:`gradtx.pp_reduce`). A chain checks the order when it
  is built.

See ``docs/transforms.md`` for how to declare them on your own transforms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from gradtx.core import tree as tu

__all__ = [
    "DownstreamExtra",
    "FusableOptimizer",
    "ScalarFactor",
    "Verdict",
    "Windowed",
    "declare_fresh",
    "declare_ties",
    "emptied",
    "empty_sum",
    "held_storages",
    "is_empty_sum",
    "owned_updates",
    "returns_fresh",
    "storages",
    "ties_read",
    "ties_reduced",
    "window_fields",
    "window_state",
]

_FRESH = "fresh_updates"
_T = TypeVar("_T")


def declare_fresh(tx: _T, fresh: bool = True) -> _T:
    """Declare that ``tx.update`` returns updates sharing no storage with its state or params; returns ``tx``.

    A declared transform skips the storage check a caller that writes in place
    runs after an undeclared one. Declare only what holds for every call:
    :func:`gradtx.testing.assert_pure` fails a transform that declares it and
    returns a tensor its state or params hold.

    Args:
      tx: the transform (a :class:`gradtx.GradientTransformation`).
      fresh: the declaration; ``False`` takes it back.

    Returns:
      ``tx`` itself, declared.

    Example:
      >>> tx = declare_fresh(GradientTransformation(init_fn, update_fn))
    """
    if not isinstance(fresh, bool):
        raise TypeError(f"declare_fresh: fresh must be a bool, got {type(fresh).__name__}")
    vars(tx)[_FRESH] = fresh
    return tx


_TIES_READ = "tied_plans_read"
_TIES_REDUCED = "tied_plans_reduced"


def declare_ties(tx: _T, *, reads: tuple[Any, ...] = (), reduces: tuple[Any, ...] = ()) -> _T:
    """Declare the pipeline plans whose tied weights ``tx`` reads a norm over, or sums the grads of; returns ``tx``.

    ``reads``: plans (:func:`gradtx.mesh_groups` with ``tied=``) whose tied
    copies' grads must be summed before ``tx`` runs, as a norm over unsummed
    copies is wrong. ``reduces``: plans whose tied grads ``tx`` sums
    (:func:`gradtx.pp_reduce`). :func:`gradtx.chain` checks, when it is built,
    that every plan a member reads is reduced by an earlier member, and raises
    a ``ValueError`` otherwise; a chain declares what its members reduce, and
    what they read that none of them reduced.

    Example:
      >>> tx = declare_ties(GradientTransformation(init_fn, update_fn), reads=(plan,))
    """
    vars(tx)[_TIES_READ] = tuple(reads)
    vars(tx)[_TIES_REDUCED] = tuple(reduces)
    return tx


def ties_read(tx: Any) -> tuple[Any, ...]:
    """The plans whose tied weights ``tx`` reads a norm over, unsummed by ``tx`` itself (see :func:`declare_ties`)."""
    return tuple(getattr(tx, "__dict__", {}).get(_TIES_READ, ()))


def ties_reduced(tx: Any) -> tuple[Any, ...]:
    """The plans whose tied weights' grads ``tx`` sums (see :func:`declare_ties`)."""
    return tuple(getattr(tx, "__dict__", {}).get(_TIES_REDUCED, ()))


def returns_fresh(tx: Any) -> bool:
    """Whether ``tx`` declared (:func:`declare_fresh`) that its updates share no storage with its state or params."""
    return getattr(tx, "__dict__", {}).get(_FRESH, False) is True


def storages(tree: Any) -> set[int]:
    """The storages (by address) of every tensor in ``tree``, through DTensors' local shards.

    Empty while ``torch.compile`` traces (a traced tensor has no storage): :func:`owned_updates`
    then copies every leaf instead of comparing.
    """
    out: set[int] = set()
    if torch.compiler.is_compiling():
        return out
    for leaf in tu.flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            local = tu.local(leaf)
            if local.device.type != "meta":
                out.add(local.untyped_storage().data_ptr())
    return out


def held_storages(new_state: Any, state: Any, params: Any, given: Any) -> set[int]:
    """The storages a transform's returned updates must not share: its states', and the params' it was not given as updates.

    A leaf passed through from the updates it was given (``identity``) belongs to the
    caller like the updates do, even when the caller gave the params as updates too.
    """
    return storages(new_state) | storages(state) | (storages(params) - storages(given))


def owned_updates(updates: Any, held: set[int]) -> Any:
    """``updates`` with every leaf whose storage is in ``held`` (see :func:`held_storages`) replaced by a copy.

    What a caller runs after a transform that did not :func:`declare_fresh`,
    before it writes into the updates it returned. Traced by ``torch.compile``
    (no storage to compare), every leaf is copied.
    """
    if updates is None:
        return None
    leaves, spec = tu.flatten(updates)
    if torch.compiler.is_compiling():
        return tu.unflatten(
            spec, [tu.like(u, tu.local(u).clone()) if isinstance(u, torch.Tensor) else u for u in leaves]
        )
    taken = set(held)
    out = []
    for u in leaves:
        if isinstance(u, torch.Tensor):
            local = tu.local(u)
            ptr = local.untyped_storage().data_ptr() if local.device.type != "meta" else None
            if ptr in taken:
                u = tu.like(u, local.clone())
            elif ptr is not None:
                taken.add(ptr)  # two leaves on one buffer: the second is copied too
        out.append(u)
    return tu.unflatten(spec, out)


@runtime_checkable
class ScalarFactor(Protocol):
    """A transform whose ``update`` is ``updates * factor``, with the factor exposed (:class:`gradtx.ScalarTransformation`).

    ``factor(updates, state, params=None, *, scale=None, **extra) -> (factor, new_state)``
    returns the 0-d fp32 tensor the updates are multiplied by. ``scale`` (a 0-d
    tensor or ``None``) says the given updates still carry a pending multiplier:
    the true updates are ``updates * scale``; a factor that reads the updates (a
    clip reads their norm) accounts for it, one that does not ignores it.
    Build one with :func:`gradtx.scalar_transformation`.
    """

    def factor(
        self, updates: Any, state: Any, params: Any = None, *, scale: Any = None, **extra: Any
    ) -> tuple[torch.Tensor, Any]: ...


@runtime_checkable
class Verdict(Protocol):
    """A guard: a transform that may veto a step (returning zero updates, its inner state left as it was).

    ``verdict(state)`` is the 0-d bool tensor that says whether the step that
    produced ``state`` was vetoed; no host sync. Build one with
    :class:`gradtx.Guard` (``Guard(init, update, verdict)``).
    """

    def verdict(self, state: Any) -> torch.Tensor: ...


@runtime_checkable
class Windowed(Protocol):
    """A transform that holds its updates over a window of micro-steps, then emits their normalised sum.

    Every method takes the transform's own state and reads only the host:

    * ``emits_next(state, *, flush=False)``: whether the next micro-step closes the window;
    * ``is_open(state)``: whether micro-steps have been counted and not emitted;
    * ``count_step(state, *, tokens=None, flush=False, device=None) -> (factor | None, new_state)``:
      count one micro-step whose gradient the caller sums itself (autograd's ``.grad``);
      on the closing one, ``factor`` is ``1 / denominator``, else ``None`` (hold);
    * ``reduce(leaves)``: the caller's summed leaves, summed over the data-parallel
      ranks in place where the window says so (else returned as they are);
    * ``sum_window(updates, state, params=None, *, tokens=None, flush=False) ->
      (sum | None, factor | None, new_state)``: the pure function ``update`` is
      built on: the window's running sum in a new tree and its normaliser, or
      ``None`` while the window holds;
    * ``rank_local()``: what of the state differs between data-parallel ranks
      (a :class:`gradtx.transforms.accumulation.RankLocal`), for a checkpoint to sum on save;
    * ``k``: the window length (for messages).

    Its state is a NamedTuple declared with :func:`window_state` (as
    :class:`gradtx.AccumulateState`, which :class:`gradtx.Window` makes, is).

    :func:`gradtx.accumulate` is one; :class:`gradtx.Window` does the counting
    for a windowed transform of yours.
    """

    k: int

    def emits_next(self, state: Any, *, flush: bool = False) -> bool: ...

    def is_open(self, state: Any) -> bool: ...

    def count_step(
        self, state: Any, *, tokens: Any = None, flush: bool = False, device: torch.device | None = None
    ) -> tuple[torch.Tensor | None, Any]: ...

    def reduce(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def sum_window(
        self, updates: Any, state: Any, params: Any = None, *, tokens: Any = None, flush: bool = False
    ) -> tuple[Any, torch.Tensor | None, Any]: ...

    def rank_local(self) -> Any: ...


@runtime_checkable
class DownstreamExtra(Protocol):
    """A transform that changes the extras the members after it in a chain see.

    ``downstream_extra(state, extra) -> extra``: given the transform's new
    state, after an ``update`` that returned updates, and the step's extras,
    the extras the next members get. :func:`gradtx.accumulate` declares it: a
    ``loss`` given on the micro-steps becomes the window's loss, reduced as its
    grads were, so a loss-based guard after the window judges the whole window.
    A chain reads it when it is built, and the step plan when it is made.
    """

    def downstream_extra(self, state: Any, extra: dict[str, Any]) -> dict[str, Any]: ...


_WINDOW_FIELDS = "_gradtx_window_fields"
_S = TypeVar("_S", bound=type)


def empty_sum(params: Any) -> Any:
    """The running sum of a window that holds nothing: a tree like ``params``, every leaf a 0-element tensor.

    A window's state keeps its running sum from ``init`` on, so the state's
    structure never changes between steps; outside a window (and where a
    param got no gradient in the open one) a leaf is this 0-element
    placeholder, in the sum's dtype (``torch.promote_types(param.dtype, torch.float32)``)
    on the param's (local) device, and costs no memory. ``None`` gives ``None``.

    Example:
      >>> empty_sum({"w": torch.zeros(3)})["w"].shape
      torch.Size([0])
    """
    if params is None:
        return None
    return tu.tree_map(
        lambda p: (
            torch.empty(0, dtype=torch.promote_types(p.dtype, torch.float32), device=tu.local(p).device)
            if isinstance(p, torch.Tensor)
            else p
        ),
        params,
    )


def is_empty_sum(tree: Any) -> bool:
    """Whether a window's running sum holds nothing (``None``, or every tensor leaf a 0-element placeholder)."""
    return all(not isinstance(t, torch.Tensor) or t.numel() == 0 for t in tu.flatten(tree)[0])


def emptied(tree: Any) -> Any:
    """``tree`` with every tensor leaf replaced by the placeholder of :func:`empty_sum` (kept where it is one)."""
    return tu.tree_map(
        lambda t: (
            t
            if not isinstance(t, torch.Tensor) or t.numel() == 0 and t.dim() == 1 and not _is_dtensor(t)
            else torch.empty(0, dtype=t.dtype, device=tu.local(t).device)
        ),
        tree,
    )


def _is_dtensor(t: torch.Tensor) -> bool:
    return tu.DTensor is not None and isinstance(t, tu.DTensor)


def window_state(*, running_sum: str, micro_step: str, tokens: str, k: str) -> Any:
    """Class decorator: declare which fields of a window's state NamedTuple hold what, for the checkpoint.

    The checkpoint keeps ``running_sum`` (a tree like the params, each leaf in
    ``torch.promote_types(param.dtype, torch.float32)``: the sum while the
    window is open, the 0-element placeholder of :func:`empty_sum` where it
    holds nothing, which is saved as zeros) by parameter, refuses a load under another
    ``k``, and sums ``tokens`` and ``running_sum`` over the data-parallel ranks
    where the window's ``rank_local()`` says they are per rank.
    :class:`gradtx.AccumulateState` is declared with it.

    Example:
      >>> @window_state(running_sum="acc", micro_step="micro_step", tokens="tokens", k="k")
      ... class MyWindowState(NamedTuple): ...
    """
    fields = {"running_sum": running_sum, "micro_step": micro_step, "tokens": tokens, "k": k}

    def decorate(cls: _S) -> _S:
        names = getattr(cls, "_fields", None)
        if names is None:
            raise TypeError(f"window_state: decorates a NamedTuple class, got {cls!r}")
        missing = [f for f in fields.values() if f not in names]
        if missing:
            raise ValueError(f"window_state: {cls.__name__} has no field(s) {missing}; its fields are {names}")
        setattr(cls, _WINDOW_FIELDS, dict(fields))
        return cls

    return decorate


_ADDED_FIELDS = "_gradtx_added_fields"


def added_fields(**defaults: Callable[[], Any]) -> Callable[[_S], _S]:
    """Class decorator: fields a state NamedTuple gained after a release, each with a factory for its fresh value.

    A file written before the field existed still loads: a pickle or
    ``torch.save`` of the shorter tuple gets the fresh values (the class's
    ``__new__`` takes them as defaults), and :mod:`gradtx.checkpoint` (and the
    wrapper's ``load_state_dict``) fill a missing key with the live state's
    value. New fields go last.

    Example:
      >>> @added_fields(windows=lambda: torch.zeros((), dtype=torch.int64))
      ... class MyState(NamedTuple): ...
    """

    def decorate(cls: _S) -> _S:
        names = getattr(cls, "_fields", ())
        if list(names[len(names) - len(defaults) :]) != list(defaults):
            raise ValueError(f"added_fields: {list(defaults)} must be the last fields of {cls.__name__}, in order")
        original = cls.__new__
        n_required = len(names) - len(defaults)

        def __new__(klass: Any, *args: Any, **kwargs: Any) -> Any:
            if len(args) + len(kwargs) < len(names):
                filled = {name: make() for name, make in defaults.items() if name not in kwargs}
                for name in names[n_required : len(args)]:
                    filled.pop(name, None)
                kwargs = {**filled, **kwargs}
            return original(klass, *args, **kwargs)

        cls.__new__ = staticmethod(__new__)  # type: ignore[assignment,method-assign]
        setattr(cls, _ADDED_FIELDS, tuple(defaults))
        return cls

    return decorate


def added_field_names(state: Any) -> tuple[str, ...]:
    """The fields of ``state`` declared with :func:`added_fields` (empty when none)."""
    return tuple(getattr(type(state), _ADDED_FIELDS, ())) if isinstance(state, tuple) else ()


def window_fields(state: Any) -> dict[str, str] | None:
    """The fields a window's state declared with :func:`window_state` (``running_sum``, ...), or ``None``."""
    fields = getattr(type(state), _WINDOW_FIELDS, None)
    return dict(fields) if isinstance(state, tuple) and fields is not None else None


@runtime_checkable
class FusableOptimizer(Protocol):
    """A trailing optimizer a donated step may run as one fused torch kernel.

    ``fused_step(state, updates, params, factor)`` returns ``(launch, new_state)``,
    where ``launch()`` writes the step into ``params`` and the state's buffers
    with the pending ``factor`` (or ``None``) applied to the updates, or
    ``None`` when a leaf or the state does not suit the kernel (the caller
    then runs ``update`` as usual).
    """

    def fused_step(
        self, state: Any, updates: Any, params: Any, factor: torch.Tensor | None
    ) -> tuple[Any, Any] | None: ...

"""TRANSITIONAL: the capability protocols that gradtx no longer uses, kept only for files other streams own.

Readers at the time of writing: runtime/executor.py, testing/__init__.py,
checkpoint/functional.py, transforms/{clipping,accumulation,conditionals}.py,
distributed/{pipeline,context_parallel}.py. Delete this module (and its import
in kinds.py) once they are gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from gradtx.core import tree as tu

_FRESH = "fresh_updates"
_T = TypeVar("_T")
_S = TypeVar("_S", bound=type)


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


def _memo(self: Any, key: str, make: Callable[[Any], Any]) -> Any:
    """``make(self)``, computed once per transform object and kept on it (the executor's step plan)."""
    store = self.__dict__.setdefault("_gradtx_memo", {})
    if key not in store:
        store[key] = make(self)
    return store[key]


def _install_memo() -> None:
    from gradtx.core.base import GradientTransformation

    GradientTransformation.memo = _memo  # type: ignore[attr-defined]


_install_memo()

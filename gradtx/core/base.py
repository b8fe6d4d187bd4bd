"""The gradient-transformation protocol, the empty state, and the identity transform.

A :class:`GradientTransformation` is a pair of pure functions:

* ``init(params) -> state`` builds the transform's state, a pytree of tensors;
* ``update(updates, state, params=None, **extra) -> (updates, state)`` turns
  gradients (or updates from an earlier transform) into new updates.

``update`` never mutates ``updates``, ``state`` or ``params``; it returns new
trees. The updates it returns may be tensors its state holds (optax's ``trace``
returns its new trace): a caller that writes into updates copies those first,
unless the transform declared they never are (:func:`gradtx.core.kinds.declare_fresh`).
Extra keyword arguments (``tokens=...``, ``flush=...``) flow to every
member of a chain, and a transform ignores the ones it does not use.

A transform may also return ``None`` as its updates: that means "hold", the
step produced no update (an open accumulation window). A chain stops at a hold,
so nothing after it runs and nothing after it changes its state.

One extra keyword is documented for every transform: ``inplace=True`` says the
caller donates the ``updates`` buffers, so a transform may write its result into
them (the numbers are the pure path's). :func:`gradtx.update_and_apply` with
``donate=True`` and :class:`gradtx.TransformedOptimizer` pass it; a transform
may ignore it.

Beyond that the protocol has nothing to learn. Speed comes from
:mod:`gradtx.runtime.executor`, which reads a chain's *structure*: a few transforms are
built as subclasses of :class:`GradientTransformation` that also expose what
they are (:class:`ScalarTransformation` multiplies every update by one scalar
and exposes that scalar as a pure function; :class:`Chain` keeps its members),
and the executor uses that to fold scalars into one fused kernel. A transform
that does not say anything about itself is simply run.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, Self, TypeVar

import torch

from gradtx.core import kinds
from gradtx.core import tree as tu

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = PyTree
Schedule = Callable[[torch.Tensor], Any]


class InitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates | None, OptState]: ...


class _TransformationFields(NamedTuple):
    init: InitFn
    update: UpdateFn


class GradientTransformation(_TransformationFields):
    """A pure gradient transformation: ``init(params)`` and ``update(updates, state, params, **extra)``.

    What gradtx's factories return pickles as the call that built it
    (``adamw(3e-4)``), since its functions are closures; see :func:`factory`.
    One built directly from two module-level functions pickles them by name.
    ``copy.copy`` and ``copy.deepcopy`` share the functions, as for any
    NamedTuple of functions, and copy the attributes a subclass adds.
    """

    # No __slots__: an instance has a __dict__, for the serial number of its creation and, where a
    # factory built it, the call that did.
    _created = 0

    def __new__(cls, init: InitFn, update: UpdateFn) -> Self:
        self = super().__new__(cls, init, update)
        if not torch.compiler.is_compiling():  # nothing traced is pickled
            GradientTransformation._created += 1
            self.__dict__[_SERIAL] = GradientTransformation._created
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        recipe = self.__dict__.get(_RECIPE)
        if recipe is None:
            reduced = super().__reduce_ex__(protocol)
            if isinstance(reduced, tuple) and len(reduced) > 2 and isinstance(reduced[2], dict):
                kept = {k: v for k, v in reduced[2].items() if k != _MEMO}  # a memo is rebuilt, never stored
                reduced = (*reduced[:2], kept, *reduced[3:])
            return reduced
        return (_rebuild, recipe)

    def __copy__(self) -> Self:
        new = tuple.__new__(type(self), self)
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k != _MEMO})
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        new = tuple.__new__(type(self), [copy.deepcopy(f, memo) for f in self])  # functions copy as themselves
        memo[id(self)] = new
        # The recipe is for pickling: it is shared, since its arguments may not copy (a process group).
        new.__dict__.update(
            {k: v if k == _RECIPE else copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != _MEMO}
        )
        return new

    def memo(self, key: str, make: Callable[[Self], _M]) -> _M:
        """``make(self)``, computed once per transform object and kept on it (a step plan, say).

        The value lives as long as the transform does (no module-level cache keeps
        either alive), and is never pickled or copied: a copy makes its own.
        """
        store = self.__dict__.setdefault(_MEMO, {})
        if key not in store:
            store[key] = make(self)
        return store[key]


_RECIPE = "_gradtx_recipe"
_MEMO = "_gradtx_memo"
_M = TypeVar("_M")
_SERIAL = "_gradtx_serial"
_Factory = TypeVar("_Factory", bound=Callable[..., Any])


def _rebuild(build: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return build(*args, **kwargs)


class BuiltSchedule:
    """A schedule a gradtx factory built: call it with the count; it pickles as the call that built it."""

    def __init__(self, fn: Callable[[Any], torch.Tensor], recipe: tuple[Any, tuple[Any, ...], dict[str, Any]]):
        self.fn = fn
        self.recipe = recipe

    def __call__(self, count: Any) -> torch.Tensor:
        return self.fn(count)

    def __reduce__(self) -> Any:
        return (_rebuild, self.recipe)

    def __repr__(self) -> str:
        build, args, kwargs = self.recipe
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        return f"{build.__name__}({', '.join(shown)})"


def factory(fn: _Factory) -> _Factory:
    """Decorator for a factory of transforms or schedules: what it builds pickles as the call that built it.

    A transform's ``init`` and ``update`` (and a schedule) are closures, which
    pickle cannot store. What the factory builds remembers the call instead,
    and pickling stores that call and makes it again: the arguments must
    pickle (numbers, tensors, other transforms and schedules, module-level
    functions). The arguments' containers are copied when the call is
    remembered, so changing a dict afterwards does not change what unpickles.
    A transform the factory did not build (one it was given, however deep in
    its arguments) keeps its own way of pickling. Every public gradtx factory
    is decorated; decorate your own factory to make what it returns picklable
    too.

    Example:
      >>> @factory
      ... def halve():
      ...     return scale(0.5)
      >>> tx = pickle.loads(pickle.dumps(halve()))
    """

    @functools.wraps(fn)
    def build(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # nothing traced is pickled, and reading the counter would be a guard
            return fn(*args, **kwargs)
        since = GradientTransformation._created + 1  # the serial of the first transform this call creates
        return remember(fn(*args, **kwargs), build, args, kwargs, since=since)

    return build  # type: ignore[return-value]


def remember(
    out: Any, build: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, since: int | None = None
) -> Any:
    """``out``, made to pickle as ``build(*args, **kwargs)``: see :func:`factory`.

    A transform is marked only if it was created by this call (its serial is
    at least ``since``; ``None``: the caller just created it). The outermost
    call wins, so a factory built from other factories pickles as itself.
    """
    if torch.compiler.is_compiling():  # nothing traced is pickled; tracing leaves the result alone
        return out
    recipe = (build, _copy_containers(args), _copy_containers(kwargs))
    if isinstance(out, GradientTransformation):
        if since is None or out.__dict__.get(_SERIAL, 0) >= since:
            out.__dict__[_RECIPE] = recipe
        return out
    if isinstance(out, BuiltSchedule):
        return BuiltSchedule(out.fn, recipe)
    if callable(out) and not isinstance(out, torch.Tensor):
        return BuiltSchedule(out, recipe)
    return out


def _copy_containers(value: Any) -> Any:
    """``value`` with its plain dicts, lists and tuples copied, all the way down; everything else as it is."""
    if type(value) is dict:
        return {k: _copy_containers(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copy_containers(v) for v in value)
    return value


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


@factory
def identity() -> GradientTransformation:
    """Return the updates unchanged.

    Returns:
      A stateless :class:`GradientTransformation`.

    Example:
      >>> tx = identity()
      >>> updates, _ = tx.update({"w": torch.ones(2)}, tx.init(None))
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        return updates, state

    return kinds.declare_fresh(GradientTransformation(init_fn, update_fn))


class FactorFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, *, scale: Any = None, **extra: Any
    ) -> tuple[torch.Tensor, OptState]: ...


class ScalarTransformation(GradientTransformation):
    """A transform whose update multiplies every leaf by one scalar, with that scalar exposed.

    ``factor(updates, state, params, *, scale=None, **extra) -> (factor, new_state)``
    is a pure function returning the 0-d fp32 tensor the updates are multiplied
    by, and the new state; ``update`` is exactly ``updates * factor``. ``scale``
    (a 0-d tensor or ``None``) says the given updates still carry a pending
    multiplier: the true updates are ``updates * scale``. A factor that reads the
    updates (a clip reads their norm) must account for it; one that does not
    (a learning rate) ignores it. This is what lets :mod:`gradtx.runtime.executor` fold
    a run of scalar transforms into one multiply, or into a fused optimizer
    kernel's ``grad_scale``, without a pass over memory for each.
    """

    factor: FactorFn

    def __new__(cls, init: InitFn, update: UpdateFn, factor: FactorFn) -> Self:
        self = super().__new__(cls, init, update)
        self.factor = factor
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle rebuild it with every field
        return (self.init, self.update, self.factor)


@factory
def scalar_transformation(init: InitFn, factor: FactorFn) -> ScalarTransformation:
    """Build a :class:`ScalarTransformation` from ``init`` and its ``factor`` function.

    The ``update`` it gets multiplies every leaf by the factor (through
    DTensors' local shards, keeping each leaf's dtype, in place when the
    caller passes ``inplace=True``).

    Example:
      >>> def factor(updates, state, params=None, *, scale=None, **extra):
      ...     return torch.tensor(0.5), state
      >>> halve = scalar_transformation(lambda params: EmptyState(), factor)
    """

    def update_fn(updates, state, params=None, **extra):
        f, new_state = factor(updates, state, params, **extra)
        leaves, spec = tu.flatten(updates)
        tu.check_tensors(leaves, tree=updates, what="updates")
        return tu.unflatten(spec, tu.scale_leaves(leaves, f, inplace=bool(extra.get("inplace", False)))), new_state

    return kinds.declare_fresh(ScalarTransformation(init, update_fn, factor))


class VerdictFn(Protocol):
    def __call__(self, state: OptState) -> torch.Tensor: ...


class Guard(GradientTransformation):
    """A transform that may veto a step, with the verdict read from its state by ``verdict(state)``.

    A vetoed step returns zero updates and leaves the guarded state as it was
    (see :func:`gradtx.apply_if_finite`). ``verdict(state)`` is a pure function
    returning the 0-d bool tensor that says whether the step that produced
    ``state`` was vetoed (the :class:`gradtx.core.kinds.Verdict` kind). A caller
    that applies updates through something that would still move (a torch
    optimizer's moments decay even on a zero gradient) reads it:
    :mod:`gradtx.runtime.executor` hands it on as ``found_inf`` to a fused kernel, or
    skips the inner optimizer's step.

    Example:
      >>> guard = Guard(init_fn, update_fn, lambda state: state.vetoed)
    """

    verdict: VerdictFn

    def __new__(cls, init: InitFn, update: UpdateFn, verdict: VerdictFn) -> Self:
        if not callable(verdict):
            raise TypeError(f"Guard: verdict must be a function of the state, got {type(verdict).__name__}")
        self = super().__new__(cls, init, update)
        self.verdict = verdict
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle rebuild it with every field
        return (self.init, self.update, self.verdict)


_StateType = TypeVar("_StateType", bound=type)


def export_metrics(*pairs: tuple[str, str]) -> Callable[[_StateType], _StateType]:
    """Class decorator: declare which fields of a state NamedTuple :func:`metrics` reports.

    It sets the ``_metrics`` class attribute that :func:`metrics` reads. Written
    as ``_metrics = ...`` in the class body, the same attribute works at run time,
    but type checkers refuse it: a name in a NamedTuple body is a field, and a
    field may not start with an underscore.

    Args:
      *pairs: ``(field name, metric name)`` pairs; each field must be one of the
        NamedTuple's fields.

    Returns:
      A decorator that returns the class itself, with ``_metrics`` set.

    Example:
      >>> @export_metrics(("count", "updates_seen"))
      ... class CountState(NamedTuple):
      ...     count: torch.Tensor
    """
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise TypeError(f"export_metrics: each pair must be a (field name, metric name) tuple of str, got {pair!r}")

    def decorate(cls: _StateType) -> _StateType:
        fields = getattr(cls, "_fields", None)
        if not (isinstance(cls, type) and issubclass(cls, tuple) and fields is not None):
            raise TypeError(f"export_metrics: decorates a NamedTuple class, got {cls!r}")
        missing = [field for field, _ in pairs if field not in fields]
        if missing:
            raise ValueError(f"export_metrics: {cls.__name__} has no field(s) {missing}; its fields are {fields}")
        setattr(cls, "_metrics", tuple(pairs))  # noqa: B010 (an attribute the NamedTuple does not declare)
        return cls

    return decorate


def metrics(state: OptState) -> dict[str, torch.Tensor]:
    """Named scalars found anywhere in a (chain) state: ``{"grad_norm": ..., "clip_coef": ...}``.

    A state NamedTuple declares what it exports with :func:`export_metrics`
    (which sets a ``_metrics`` class attribute: a tuple of ``(field name, metric
    name)`` pairs). A metric name of ``"*"`` exports every item of a dict field
    under its own key (what :class:`gradtx.InjectHyperparamsState` does with its
    hyperparameters). When two members export the same name, the first one in
    chain order wins. Values are tensors; nothing is read to the host.

    Example:
      >>> updates, state = tx.update(grads, state, params)
      >>> float(metrics(state)["grad_norm"])
    """
    found: dict[str, torch.Tensor] = {}

    def walk(node: Any) -> None:
        exported = getattr(type(node), "_metrics", None)
        if isinstance(node, tuple) and exported:
            for field, name in exported:
                value = getattr(node, field)
                if name == "*" and isinstance(value, dict):
                    for key, item in value.items():
                        found.setdefault(str(key), item)
                else:
                    found.setdefault(name, value)
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (tuple, list)):
            for v in node:
                walk(v)

    walk(state)
    return found

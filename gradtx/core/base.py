"""The gradient-transformation protocol, the empty state, and the identity transform.

A :class:`GradientTransformation` is a pair of pure functions:

* ``init(params) -> state`` builds the transform's state, a pytree of tensors;
* ``update(updates, state, params=None, **extra) -> (updates, state)`` turns
  gradients (or updates from an earlier transform) into new updates.

``update`` never mutates ``updates``, ``state`` or ``params``; it returns new
trees (which may be tensors its new state holds, as optax's ``trace`` returns
its new trace). Extra keyword arguments (``tokens=...``, ``flush=...``) flow to
every member of a chain, and a transform ignores the ones it does not use.

A transform may also return ``None`` as its updates: that means "hold", the
step produced no update (an open accumulation window). A chain stops at a hold,
so nothing after it runs and nothing after it changes its state.

That is the whole protocol. A few of gradtx's own transforms are built as
subclasses that also say what they are (:class:`ScalarTransformation` exposes
its scalar, :class:`Guard` its verdict), so the wrapper can fold them into a
fused optimizer kernel; a transform that is neither is simply run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Self, TypeVar

import torch

from gradtx.core import foreach as fe
from gradtx.core import leafwise as lw
from gradtx.core import tree as tu

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = PyTree
Schedule = Callable[[torch.Tensor], Any]


InitFn = Callable[[Params], OptState]
UpdateFn = Callable[..., tuple[Updates | None, OptState]]  # (updates, state, params=None, **extra)
FactorFn = Callable[..., tuple[torch.Tensor, OptState]]  # (updates, state, params=None, *, scale=None, **extra)
VerdictFn = Callable[[OptState], torch.Tensor]


class _TransformationFields(NamedTuple):
    init: InitFn
    update: UpdateFn


_RECIPE = "_gradtx_recipe"


class GradientTransformation(_TransformationFields):
    """A pure gradient transformation: ``init(params)`` and ``update(updates, state, params, **extra)``.

    What gradtx's factories return pickles as the call that built it
    (``adamw(3e-4)``), since its functions are closures; see :func:`factory`.
    A copy (``copy.copy`` or ``copy.deepcopy``) shares the functions, which
    are immutable, and the attributes a subclass adds.
    """

    # No __slots__: a subclass keeps what it adds (``members``, ``factor``) and a factory its call in __dict__.

    def __reduce_ex__(self, protocol: Any) -> Any:
        recipe = self.__dict__.get(_RECIPE)  # else every field, and what a subclass adds
        return (_rebuild, recipe) if recipe is not None else (_restore, (type(self), tuple(self), self.__dict__))

    def __copy__(self) -> Self:
        return _restore(type(self), tuple(self), self.__dict__)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self.__copy__()  # the recipe's arguments may not copy (a process group), and nothing here mutates


def _rebuild(build: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return build(*args, **kwargs)


def _restore(cls: type[Any], fields: tuple[Any, ...], attrs: dict[str, Any]) -> Any:
    """A ``cls`` with the fields ``(init, update)`` and the attributes ``attrs``: how a transform is built, copied
    and unpickled (by this name: a pickle stores it)."""
    new = tuple.__new__(cls, fields)
    new.__dict__.update(attrs)
    return new


_Factory = TypeVar("_Factory", bound=Callable[..., Any])


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
    The outermost call wins (a factory built from other factories pickles as
    itself), and a transform that was passed in as an argument and comes back
    keeps its own recipe. Decorate your own factory to make what it returns
    picklable too.

    Example:
      >>> @factory
      ... def halve():
      ...     return scale(0.5)
      >>> tx = pickle.loads(pickle.dumps(halve()))
    """

    @functools.wraps(fn)
    def build(*args: Any, **kwargs: Any) -> Any:
        # A one-shot iterator (sgdr_schedule's cycles as a generator) is read here, so the call remembered keeps it.
        args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
        kwargs = {k: list(v) if isinstance(v, Iterator) else v for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # nothing traced is pickled (inject_hyperparams builds inside a step)
            return out
        return remember(out, build, args, kwargs)

    return build  # type: ignore[return-value]


def remember(out: Any, build: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``out``, made to pickle as ``build(*args, **kwargs)`` unless it was one of the arguments: see :func:`factory`."""
    held: list[Any] = []
    recipe = (build, _copy_containers(args, held), _copy_containers(kwargs, held))
    if isinstance(out, GradientTransformation):
        if not any(x is out for x in held):
            out.__dict__[_RECIPE] = recipe
        return out
    if callable(out) and not isinstance(out, torch.Tensor):
        return BuiltSchedule(out.fn if isinstance(out, BuiltSchedule) else out, recipe)
    return out


def built_from(tx: GradientTransformation) -> list[GradientTransformation]:
    """The transforms among the arguments of the factory call that built ``tx`` (``gtx.adamw(...)`` in
    ``apply_if_finite(gtx.adamw(...), 5)``), in lists, tuples and dicts too, as ``tx`` pickles: see :func:`factory`."""
    found: list[GradientTransformation] = []
    todo = list(tx.__dict__.get(_RECIPE, ())[1:])
    while todo:
        x = todo.pop()
        if isinstance(x, GradientTransformation):
            found.append(x)
        elif type(x) in (dict, list, tuple):
            todo.extend(x.values() if isinstance(x, dict) else x)
    return found


def _copy_containers(value: Any, held: list[Any]) -> Any:
    """``value`` with its plain dicts, lists and tuples copied, all the way down; what they hold goes to ``held``."""
    if type(value) is dict:
        return {k: _copy_containers(v, held) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copy_containers(v, held) for v in value)
    held.append(value)
    return value


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def init_empty_state(params: Params) -> EmptyState:
    """The ``init`` of every stateless transform: an :class:`EmptyState`, whatever the params."""
    return EmptyState()


@factory
def identity() -> GradientTransformation:
    """Return the updates unchanged.

    Returns:
      A stateless :class:`GradientTransformation`.

    Example:
      >>> tx = identity()
      >>> updates, _ = tx.update({"w": torch.ones(2)}, tx.init(None))
    """
    return GradientTransformation(init_empty_state, lambda updates, state, params=None, **extra: (updates, state))


class ScalarTransformation(GradientTransformation):
    """A transform whose update multiplies every leaf by one scalar, with that scalar exposed.

    ``factor(updates, state, params, *, scale=None, **extra) -> (factor, new_state)``
    is a pure function returning the 0-d fp32 tensor the updates are multiplied
    by, and the new state; ``update`` is exactly ``updates * factor``. ``scale``
    (a 0-d tensor or ``None``) says the given updates still carry a pending
    multiplier: the true updates are ``updates * scale``. A factor that reads the
    updates (a clip reads their norm) must account for it; one that does not
    (a learning rate) ignores it. This lets the wrapper fold the factor into a
    fused optimizer kernel's ``grad_scale``, without a pass over memory.
    """

    factor: FactorFn

    def __new__(cls, init: InitFn, update: UpdateFn, factor: FactorFn) -> Self:
        return _restore(cls, (init, update), {"factor": factor})


@factory
def scalar_transformation(init: InitFn, factor: FactorFn) -> ScalarTransformation:
    """Build a :class:`ScalarTransformation` from ``init`` and its ``factor`` function.

    The ``update`` it gets multiplies every leaf by the factor (through
    DTensors' local shards, keeping each leaf's dtype).

    Example:
      >>> def factor(updates, state, params=None, *, scale=None, **extra):
      ...     return torch.tensor(0.5), state
      >>> halve = scalar_transformation(init_empty_state, factor)
    """
    for arg, fn in (("init", init), ("factor", factor)):  # (as Guard checks its verdict)
        if not callable(fn):
            raise TypeError(f"scalar_transformation: {arg} must be a function, got {type(fn).__name__}")

    def update_fn(updates, state, params=None, **extra):
        f, new_state = factor(updates, state, params, **extra)
        leaves, spec = tu.flatten(updates)
        key = None if torch.compiler.is_compiling() else lw.one_group(leaves)
        if key is not None and key[1] in (torch.float32, torch.float64) and not _records(leaves, f):
            return tu.unflatten(spec, fe.mul(leaves, f.to(*key))), new_state  # one launch, no loop per leaf
        tu.check_tensors(leaves, tree=updates, what="updates")
        return tu.unflatten(spec, tu.scale_leaves(leaves, f, write_back=False)), new_state

    return ScalarTransformation(init, update_fn, factor)


def _records(leaves: list[torch.Tensor], factor: torch.Tensor) -> bool:
    """Whether autograd records the multiply (a hypergradient, or grads through the step): scale_leaves' case."""
    return torch.is_grad_enabled() and (factor.requires_grad or any(tu.attrs(leaves, "requires_grad")))


class Guard(GradientTransformation):
    """A transform that may veto a step, with the verdict read from its state by ``verdict(state)``.

    A vetoed step returns zero updates and leaves the guarded state as it was
    (see :func:`gradtx.apply_if_finite`). ``verdict(state)`` is a pure function
    returning the 0-d bool tensor that says whether the step that produced
    ``state`` was vetoed. A caller that applies updates through something that
    would still move (a torch optimizer's moments decay even on a zero
    gradient) reads it: the wrapper hands it on as ``found_inf`` to a fused
    kernel, or skips the inner optimizer's step.

    Example:
      >>> guard = Guard(init_fn, update_fn, lambda state: state.vetoed)
    """

    verdict: VerdictFn

    def __new__(cls, init: InitFn, update: UpdateFn, verdict: VerdictFn) -> Self:
        if not callable(verdict):
            raise TypeError(f"Guard: verdict must be a function of the state, got {type(verdict).__name__}")
        return _restore(cls, (init, update), {"verdict": verdict})


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
        children = node.values() if isinstance(node, dict) else node if isinstance(node, (tuple, list)) else ()
        for v in children:
            walk(v)

    walk(state)
    return found

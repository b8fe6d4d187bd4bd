"""Helpers for testing gradient transformations, yours included, in one process.

Example:
  >>> from gradtx import testing
  >>> testing.assert_pure(my_tx, grads, params)
  >>> testing.assert_trees_close(got, expected, rtol=1e-6)
  >>> comm = testing.RecordingComm()
  >>> tx = clip_by_global_norm(1.0, mesh_groups=plan_using(comm))
  >>> assert [c.op for c in comm.calls] == ["sum"]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from gradtx.comm.base import Comm, GroupKey, LocalComm, ReduceOp, as_comm, check_comm
from gradtx.comm.local_ranks import LocalTensor, enabled_local_tensor_mode
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, PyTree


def _leaves(tree: PyTree) -> tuple[list[tuple[str, Any]], Any]:
    """``tree``'s ``(path, leaf)`` pairs and its structure, from one flatten."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return [(tu.path_str(p), leaf) for p, leaf in zip(paths, leaves)], spec


def _mode_off() -> contextlib.AbstractContextManager:
    mode = enabled_local_tensor_mode()
    return mode.disable() if mode is not None else contextlib.nullcontext()


def _values(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s (local) values as plain tensors, one per simulated rank: a ``LocalTensor``'s ``torch.equal`` reads rank
    0's alone, and torch's ``assert_close`` fails on one with an internal error. Compare them with the mode off."""
    t = tu.local(t).detach()
    if LocalTensor is not None and isinstance(t, LocalTensor):
        return [v for _, v in sorted(t._local_tensors.items())]
    mode = enabled_local_tensor_mode()
    return [t] * (len(mode.ranks) if mode is not None else 1)


def _snapshot(tree: PyTree) -> Callable[[str], None]:
    """A check that ``tree`` is as it is now: its structure, its leaf objects (one replaced in a container
    shows by identity), and its tensors' version counters (a DTensor's and its local tensor's) and values (every
    simulated rank's); it fails naming ``what`` and the path."""
    entries, spec = _leaves(tree)
    leaves = [leaf for _, leaf in entries]
    tensors = [(path, t, (t._version, tu.local(t)._version), _values(t)) for path, t in entries if torch.is_tensor(t)]
    with _mode_off():
        tensors = [(path, t, version, [v.clone() for v in values]) for path, t, version, values in tensors]

    def check_unchanged(what: str) -> None:
        entries_now, spec_now = _leaves(tree)
        if spec_now != spec:
            raise AssertionError(f"{what} changed structure in place: {spec} became {spec_now}")
        for (path, now), before in zip(entries_now, leaves):
            if now is not before:
                raise AssertionError(f"{what} at {path} was replaced in place (its container was modified)")
        for path, t, version, copies in tensors:
            if (t._version, tu.local(t)._version) != version:
                raise AssertionError(f"{what} at {path} was modified in place (its version counter moved)")
            values = _values(t)
            with _mode_off():
                if not all(torch.equal(torch.nan_to_num(v), torch.nan_to_num(c)) for v, c in zip(values, copies)):
                    raise AssertionError(f"{what} at {path} changed value")  # (NaNs equal)

    return check_unchanged


def _check_unaliased(what: str, state: PyTree, inputs: PyTree) -> None:
    """Fail where ``state`` holds the memory of an input tensor, which its caller may write in place (a backward
    accumulating into ``.grad``, an optimizer stepping a param) behind the transform's back."""

    def memory(t: torch.Tensor) -> int:  # its storage, or on a simulated mesh (no storage to read) the object
        local = tu.local(t)
        simulated = LocalTensor is not None and isinstance(local, LocalTensor)
        return id(t) if simulated else local.untyped_storage().data_ptr()

    held = {memory(t) for t in optree.tree_leaves(inputs) if torch.is_tensor(t)}
    for path, t in _leaves(state)[0]:
        if torch.is_tensor(t) and t.numel() and memory(t) in held:
            raise AssertionError(f"{what} at {path} shares memory with an input (updates or params): copy it")


def assert_pure(
    tx: GradientTransformation,
    updates: PyTree,
    params: PyTree | None = None,
    state: PyTree | None = None,
    *,
    steps: int = 2,
    **extra: Any,
) -> tuple[PyTree, PyTree]:
    """Check that ``tx`` mutates none of its inputs and is deterministic.

    Runs ``init`` (unless ``state`` is given) and ``steps`` updates with the
    same inputs, and fails if any input tensor's version counter moved or its
    value changed, or if running the same update twice gives different results.

    Returns:
      The ``(updates, state)`` of the last step.
    """
    steps = check.integer(steps, arg="steps", name="assert_pure", minimum=1)
    check.transform(tx, arg="tx", name="assert_pure")
    params_check, updates_check = _snapshot(params), _snapshot(updates)
    if state is None:
        state = tx.init(params if params is not None else updates)
        params_check("init: params")
        updates_check("init: updates")  # init(updates) when params is None
        _check_unaliased("init: the state", state, (params, updates))
    result: tuple[PyTree, PyTree] = (None, state)
    for _ in range(steps):
        snaps = [(_snapshot(updates), "update: updates"), (_snapshot(state), "update: state"), (params_check, "params")]
        first = tx.update(updates, state, params, **extra)
        _check_unaliased("update: the new state", first[1], (updates, params))
        snaps.append((_snapshot(first), "the first run's result (a buffer kept between calls),"))
        again = tx.update(updates, state, params, **extra)
        for check_unchanged, what in snaps:
            check_unchanged(what)
        assert_trees_equal(first, again, msg="update is not deterministic: ")
        result, state = first, first[1]
    return result


def assert_trees_close(
    actual: PyTree, expected: PyTree, *, rtol: float = 1e-6, atol: float = 0.0, msg: str = ""
) -> None:
    """Assert two trees have the same structure and every leaf is close (NaNs equal)."""
    rtol, atol = (check.non_negative(v, arg=a, name="assert_trees_close") for v, a in ((rtol, "rtol"), (atol, "atol")))
    where = tu.first_mismatch(expected, actual)
    if where is not None:
        raise AssertionError(f"{msg}actual tree does not match expected tree at {where}")
    for (path, a), (_, e) in zip(_leaves(actual)[0], _leaves(expected)[0]):
        if not (torch.is_tensor(a) and torch.is_tensor(e)):  # a Python number, a string, ...: equal, of one type
            both_nan = isinstance(a, float) and isinstance(e, float) and math.isnan(a) and math.isnan(e)
            if type(a) is not type(e) or not (both_nan or a == e):
                raise AssertionError(f"{msg}{path}: {a!r} ({type(a).__name__}) != {e!r} ({type(e).__name__})")
            continue
        pairs = list(enumerate(zip(_values(a), _values(e))))
        with _mode_off():
            for rank, (a, e) in pairs:
                try:  # (it checks dtypes too: "The values for attribute 'dtype' do not match")
                    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
                except AssertionError as err:
                    where = f" (simulated rank {rank})" if len(pairs) > 1 else ""
                    raise AssertionError(f"{msg}{path}{where}: {err}") from None


def assert_trees_equal(actual: PyTree, expected: PyTree, *, msg: str = "") -> None:
    """Assert two trees are exactly equal, leaf by leaf (NaNs equal; ``0.0`` equals ``-0.0``)."""
    assert_trees_close(actual, expected, rtol=0.0, atol=0.0, msg=msg)


class Collective(NamedTuple):
    """One collective a :class:`RecordingComm` saw."""

    op: str
    group: GroupKey
    num_tensors: int
    shapes: tuple[tuple[int, ...], ...]


class RecordingComm:
    """A :class:`~gradtx.comm.Comm` that logs every collective, then forwards it.

    Tests use it to assert how many collectives a step issues, over which
    groups; wrap a ``TorchComm`` to count real ones, or use it alone (it
    forwards to a :class:`LocalComm`).
    """

    def __init__(self, inner: Comm | None = None) -> None:
        self.inner: Comm = inner if inner is not None else LocalComm()
        check_comm(self.inner, name="RecordingComm")
        self.calls: list[Collective] = []

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: GroupKey) -> list[torch.Tensor]:
        self._log(ReduceOp(op).value, group, tensors)
        return self.inner.all_reduce(tensors, op, group)

    def _log(self, op: str, group: GroupKey, tensors: Sequence[torch.Tensor]) -> None:
        self.calls.append(Collective(op, group, len(tensors), tuple(tuple(t.shape) for t in tensors)))

    def size(self, group: GroupKey) -> int:
        return self.inner.size(group)

    def rank(self, group: GroupKey) -> int:
        return as_comm(self.inner, name="RecordingComm").rank(group)

    def group_id(self, group: GroupKey) -> Hashable:
        return as_comm(self.inner, name="RecordingComm").group_id(group)

    def all_to_all(
        self, tensors: Sequence[torch.Tensor], recv_numels: Sequence[int], group: GroupKey
    ) -> list[torch.Tensor]:
        """Log an exchange (``shapes`` are what goes to each rank), then forward it to the inner comm."""
        self._log("all_to_all", group, tensors)
        return self.inner.all_to_all(tensors, recv_numels, group)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:  # forward the rest of a richer inner comm
        if name == "inner":  # unpickling and copy look attributes up before there is one
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.calls.clear()


# --- simulated meshes: distributed transforms tested in one process (torch's LocalTensorMode) ----------

with contextlib.suppress(ImportError):  # a torch build without distributed support has no simulated meshes
    from gradtx.testing.simulated import assert_matches_single_device, distribute, simulated_mesh  # noqa: F401

"""Muon's transforms: :func:`orthogonalize`, :func:`scale_by_muon` and :func:`scale_by_shape`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from gradtx.comm.base import ExchangeComm
from gradtx.core import foreach as fe
from gradtx.core import leafwise as lw
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import EmptyState, GradientTransformation, Params, PyTree, factory, init_empty_state
from gradtx.distributed.global_norm import PlanSlot, planned
from gradtx.optimizers.muon.exchange import _make_orthogonalizer
from gradtx.optimizers.muon.iteration import _DEFAULT_NS_COEFFS, Preconditioning, Scalar, _Matrices, _selector
from gradtx.optimizers.standard import _debiased


def _filling(update_fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``update_fn`` on updates that cover the DTensor params (see :func:`planned`): one with no update on this rank
    (``None``) is fed zeros, so every rank exchanges the same matrices (its part of the matrix is what a zero grad
    gives); its update stays ``None`` and its momentum as it was, as for any ``None`` update."""
    slot = PlanSlot()

    def filled(updates, state, params=None, **extra):
        leaves, spec = tu.flatten(updates)
        full, _, index = planned(leaves, updates, params, None, name, slot, spec)
        if index is None:
            return update_fn(updates, state, params, **extra)
        out, new = update_fn(tu.unflatten(tu.flatten(params)[1], full), state, params, **extra)
        if isinstance(new, MuonState):
            (mu, mu_spec), given = tu.flatten(new.mu), set(index)
            kept = [m if j in given else old for j, (m, old) in enumerate(zip(mu, tu.flatten(state.mu)[0]))]
            new = new._replace(mu=tu.unflatten(mu_spec, kept))
        return tu.unflatten(spec, [tu.flatten(out)[0][i] for i in index]), new

    return filled


def _on_matrices(
    fn: Callable[[list[Any], list[torch.Tensor], _Matrices], Sequence[torch.Tensor]], dims: Any, *, name: str
) -> GradientTransformation:
    """The stateless transform that replaces the Muon leaves (``dims`` selects them) by ``fn(leaves, locals, mats)``.

    ``fn`` gets the Muon leaves, their local values and their :class:`_Matrices`,
    and returns the new local values; the other leaves pass through.
    """
    select = _selector(dims, name=name)

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, EmptyState, name=name)
        leaves, spec = tu.flatten(updates)
        tu.check_tensors(leaves, tree=updates, what=f"{name}: updates")  # integer, bool and sparse grads too
        mats = select(updates, leaves, spec)
        xs = [leaves[j] for j in mats.idx]
        out = list(leaves)
        for j, y in zip(mats.idx, fn(xs, [tu.local(x) for x in xs], mats)):
            out[j] = tu.like(leaves[j], y)
        return tu.unflatten(spec, out), state

    return GradientTransformation(init_empty_state, _filling(update_fn, name))


@factory
def orthogonalize(
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    eps: Scalar = 1e-8,
    *,
    preconditioning: Preconditioning = "frobenius",
    weight_dimension_numbers: Any = None,
    ns_dtype: torch.dtype | None = None,
    comm: ExchangeComm | None = None,
    ns_batch: int = 16,
) -> GradientTransformation:
    """Replace each matrix update by its Newton–Schulz orthogonalization (Muon's step without the momentum).

    Chain it after a momentum of your own (``chain(trace(0.9), orthogonalize(), ...)``).
    Sharded DTensor updates are orthogonalized whole, each on one owner rank
    (see the module docstring), so the result equals the single-device one.

    Args:
      ns_coeffs: ``(a, b, c)``, one triple per iteration, or a preset (``"standard"``, ``"dion"``).
      ns_steps: Newton–Schulz iterations.
      eps: added to the normalising norm; ``>= 0``, or a 0-d tensor.
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or ``"schatten"``.
      weight_dimension_numbers: a :class:`MuonDimensionNumbers` for every
        leaf, a tree of them (``None`` leaves pass through unchanged), or a
        function of the updates returning such a tree. ``None``: every 2-d leaf is an
        ``(out, in)`` matrix, and the other leaves pass through.
      ns_dtype: iterate in this dtype (``torch.bfloat16`` as ``torch.optim.Muon``); ``None``: the update's.
      comm: the :class:`~gradtx.comm.ExchangeComm` for sharded leaves; ``None``
        derives one from the DTensors' meshes.
      ns_batch: at most this many local matrices of one shape and dtype are
        stacked into one batched iteration (``bmm``: a few kernels for the
        group, not a few per matrix; the same operations on every matrix); it
        costs one copy of each stack. ``1`` iterates them one at a time.

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024.

    Example:
      >>> tx = chain(trace(0.95), orthogonalize(), scale_by_learning_rate(0.02))
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    name = "orthogonalize"
    run = _make_orthogonalizer(ns_coeffs, ns_steps, eps, preconditioning, ns_dtype, comm, ns_batch, False, name=name)
    return _on_matrices(run, weight_dimension_numbers, name=name)


class MuonState(NamedTuple):
    """Muon's step count (0-d int64) and momentum (a tree mirroring the params)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    mu: PyTree


@factory
def scale_by_muon(
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Scalar = 0.95,
    eps: Scalar = 1e-8,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    weight_dimension_numbers: Any = None,
    bias_correction: bool = True,
    ns_dtype: torch.dtype | None = None,
    comm: ExchangeComm | None = None,
    ns_batch: int = 16,
) -> GradientTransformation:
    """Orthogonalize the momentum of each matrix: optax's ``scale_by_muon`` on PyTorch layouts and DTensors.

    With ``t`` the step, ``mu = beta * mu + (1 - beta) * g``; the direction is
    ``mu / (1 - beta**t)`` or, with ``nesterov``,
    ``beta * mu / (1 - beta**(t+1)) + (1 - beta) * g / (1 - beta**t)``
    (``bias_correction=False`` drops the denominators, as ``torch.optim.Muon``);
    the update is its Newton–Schulz orthogonalization (see :func:`newton_schulz`),
    times ``<direction, update>`` with ``adaptive``.

    Args:
      ns_coeffs: ``(a, b, c)``, one triple per iteration, or a preset (``"standard"``, ``"dion"``).
      ns_steps: Newton–Schulz iterations.
      beta: the momentum decay; in ``[0, 1)``, or a 0-d tensor.
      eps: added to the normalising norm; ``>= 0``, or a 0-d tensor.
      mu_dtype: the dtype the momentum is stored in (the step computes in the grads' precision, as optax);
        ``None``: fp32 for fp16/bf16 params, the param's otherwise.
      nesterov: use Nesterov momentum.
      adaptive: scale each leaf's update by the dual norm of its direction (Bernstein & Newhouse).
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or ``"schatten"``.
      weight_dimension_numbers: a :class:`MuonDimensionNumbers` for every
        leaf, a tree of them (a ``None`` leaf passes through untouched; its
        momentum stays zero, yet takes a param's memory: give this transform the
        matrices alone, as :func:`muon` does), or a function of the updates returning one.
        ``None``: every 2-d leaf is an ``(out, in)`` matrix, and the other leaves pass through.
      bias_correction: divide the momentum by ``1 - beta**t`` (optax); False as ``torch.optim.Muon``.
      ns_dtype: iterate in this dtype (``torch.bfloat16`` as ``torch.optim.Muon``); ``None``: the direction's
        (the momentum's dtype, or the grads' where higher: fp32 for bf16/fp16 params).
      comm: the :class:`~gradtx.comm.ExchangeComm` for sharded leaves; ``None``
        derives one from the DTensors' meshes.
      ns_batch: at most this many local matrices of one shape and dtype are
        stacked into one batched iteration (``bmm``: a few kernels for the
        group, not a few per matrix; the same operations on every matrix); it
        costs one copy of each stack. ``1`` iterates them one at a time.

    Returns:
      A :class:`GradientTransformation` with state :class:`MuonState`.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024;
      Bernstein & Newhouse, "Old Optimizer, New Norm: An Anthology", 2024;
      Liu et al., "Muon is Scalable for LLM Training", 2025.

    Example:
      >>> tx = chain(scale_by_muon(), scale_by_learning_rate(0.02))
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    name = "scale_by_muon"
    adaptive = check.flag(adaptive, arg="adaptive", name=name)
    run = _make_orthogonalizer(ns_coeffs, ns_steps, eps, preconditioning, ns_dtype, comm, ns_batch, adaptive, name=name)
    beta = check.beta(beta, arg="beta", name=name, tensor=True)
    nesterov = check.flag(nesterov, arg="nesterov", name=name)
    bias_correction = check.flag(bias_correction, arg="bias_correction", name=name)
    check.dtype(mu_dtype, arg="mu_dtype", name=name, floating=True)
    select = _selector(weight_dimension_numbers, name=name)

    def init_fn(params: Params) -> MuonState:
        return MuonState(count=lw.zero_count(params), mu=lw.zeros_moments(params, mu_dtype, what=f"{name}: params"))

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, MuonState, name=name)
        ms = lw.Moments(updates, (state.mu,), name=name, against="its momentum")
        mats = select(updates, ms.leaves, ms.spec)
        count = state.count + 1
        slot = {j: k for k, j in enumerate(mats.idx)}  # an update leaf's place among the Muon leaves
        directions: list[Any] = [None] * len(mats.idx)

        def step(key, idx, g, trees):  # foreach ops per device and dtype, on the group's Muon leaves
            ks = [i for i, j in enumerate(idx) if j in slot]
            if not ks:
                return
            mu, g = [trees[0][i] for i in ks], [g[i] for i in ks]
            if mu_dtype is not None:  # as optax: mu_dtype only stores the momentum, computed in the grads' precision
                g, mu = lw.promoted([tu.local(ms.leaves[idx[i]]) for i in ks], mu)
            b = lw.as_tensor(beta, mu[0])  # a tensor beta (inject_hyperparams) stays on the device
            m = fe.lerp(mu, g, 1 - b)  # (1 - beta) g + beta mu, as torch.optim.Muon's buffer
            if bias_correction:
                d = _debiased(m, g, beta, count.to(key[0], tu.acc_dtype(m[0].dtype)), nesterov)
            else:
                d = fe.lerp(g, m, b) if nesterov else m
            ms.put(0, [idx[i] for i in ks], m if mu_dtype is None else [x.to(key[1]) for x in m])
            for i, dk in zip(ks, d):
                directions[slot[idx[i]]] = dk

        ms.each(step)
        ms.put_updates(mats.idx, run([ms.leaves[j] for j in mats.idx], directions, mats))
        return ms.updates(), MuonState(count=count, mu=ms.tree(0))

    return GradientTransformation(init_fn, _filling(update_fn, name))


@factory
def scale_by_shape(
    weight_dimension_numbers: Any = None, consistent_rms: Scalar | None = None
) -> GradientTransformation:
    """Scale each matrix update by a factor of its shape: Muon's width scaling, or consistent RMS.

    ``sqrt(max(1, fan_out / fan_in))`` (Keller Jordan's, ``torch.optim.Muon``'s
    ``adjust_lr_fn="original"``), or ``consistent_rms * sqrt(max(fan_in, fan_out))``
    (Moonshot's; ``0.2`` is ``adjust_lr_fn="match_rms_adamw"``). ``fan_in`` is
    the size of the reduction axes and ``fan_out`` of the output axes, from
    the global (unsharded) shape. Elementwise, so DTensors scale through their shards.

    Args:
      weight_dimension_numbers: as for :func:`scale_by_muon`.
      consistent_rms: ``None`` for width scaling, else the target RMS (a number or a 0-d tensor).

    Returns:
      A stateless :class:`GradientTransformation`.

    References:
      Liu et al., "Muon is Scalable for LLM Training", 2025.

    Example:
      >>> tx = scale_by_shape(consistent_rms=0.2)
    """
    if consistent_rms is not None:
        consistent_rms = check.non_negative(consistent_rms, arg="consistent_rms", name="scale_by_shape", tensor=True)

    def scaled(xs: list[Any], locs: list[torch.Tensor], mats: _Matrices) -> list[torch.Tensor]:
        if consistent_rms is None:  # sqrt(max(1, fan_out / fan_in))
            factors = [math.sqrt(max(1.0, lay.flat[2] / max(lay.flat[1], 1))) for lay in mats.layouts]  # (8, 0): 1
        else:  # a tensor rms stays on the device
            factors = [
                lw.as_tensor(consistent_rms, x) * math.sqrt(max(lay.flat[1:])) for x, lay in zip(locs, mats.layouts)
            ]
        return fe.mul(locs, factors) if locs else []

    return _on_matrices(scaled, weight_dimension_numbers, name="scale_by_shape")

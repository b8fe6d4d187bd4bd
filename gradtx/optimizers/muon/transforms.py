"""Muon's transforms: :func:`orthogonalize`, :func:`scale_by_muon`, :func:`scale_by_shape` and :func:`muon`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from gradtx.comm.base import ExchangeComm, check_exchange_comm
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import EmptyState, GradientTransformation, Params, PyTree, factory
from gradtx.optimizers.muon.exchange import _make_orthogonalizer
from gradtx.optimizers.muon.iteration import (
    _DEFAULT_NS_COEFFS,
    _NS_COEFFS_PRESETS,
    _PRECONDITIONINGS,
    MuonDimensionNumbers,
    Preconditioning,
    Scalar,
    _coeff_rows,
    _is_dn,
    _layout,
    _resolve_dims,
)
from gradtx.optimizers.standard import (
    OptimizerChain,
    OptimizerSpec,
    ScaleByAdamState,
    _bias_correction,
    _moment_dtype,
    add_decayed_weights,
    scale_by_learning_rate,
)
from gradtx.transforms.combine import chain, partition

# --- the transforms ------------------------------------------------------------------------------


def _check_common(
    ns_coeffs: Any, ns_steps: Any, eps: Any, preconditioning: Any, ns_dtype: Any, comm: Any, *, name: str
):
    if isinstance(ns_steps, torch.Tensor):
        raise TypeError(
            f"{name}: ns_steps must be an int, got a tensor (under inject_hyperparams pass static_args=('ns_steps',))"
        )
    ns_steps = check.integer(ns_steps, arg="ns_steps", name=name, minimum=0)
    rows = _coeff_rows(ns_coeffs, ns_steps, name=name)
    eps = check.non_negative(eps, arg="eps", name=name, tensor=True)
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"{name}: preconditioning must be one of {_PRECONDITIONINGS}, got {preconditioning!r}")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
        raise TypeError(f"{name}: ns_dtype must be a floating torch.dtype or None, got {ns_dtype!r}")
    if comm is not None:
        check_exchange_comm(comm, name=name)
    return rows, eps


def _dims_resolver(dims_arg: Any, *, name: str) -> Callable[..., tuple[list[Any], Callable[[], list[str]]]]:
    """``resolve(updates, leaves, spec)``: each leaf's dimension numbers (None: not Muon's), and its paths lazily.

    The answer depends on the tree's structure and shapes alone (a function
    given as the dimension numbers is called once per structure and shapes, as
    optax's is once per trace), so it is cached: a step does not rebuild it.
    """
    cache: dict[Any, list[Any]] = {}

    def resolve(updates: PyTree, leaves: list[Any], spec: Any) -> tuple[list[Any], Callable[[], list[str]]]:
        paths = lambda: [tu.path_str(p) for p in tu.paths(updates)]
        key = (spec, tuple(x.shape for x in leaves))
        dims = cache.get(key)
        if dims is None:
            dims = _resolve_dims(dims_arg, updates, name=name)
            if len(cache) > 8:
                cache.clear()
            cache[key] = dims
        return dims, paths

    return resolve


def _muon_leaves(updates: PyTree, resolve: Callable[..., Any], *, name: str):
    """The updates' leaves with their dimension numbers; a leaf whose entry is None passes through."""
    leaves, spec = tu.flatten(updates)
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        tu.check_tensors(leaves, tu.paths(updates), what=f"{name}: updates")
    dims, paths = resolve(updates, leaves, spec)
    return leaves, spec, dims, paths


def _momentum(
    m0s: list[torch.Tensor],
    gls: list[torch.Tensor],
    beta: Any,
    count: torch.Tensor,
    *,
    nesterov: bool,
    bias_correction: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The new momentum and the direction of every (local) leaf: foreach ops per device and dtype.

    ``m = mu.lerp(g, 1 - beta)`` is ``(1 - beta) g + beta mu``, as torch.optim.Muon's buffer.
    """
    ms: list[Any] = [None] * len(m0s)
    ds: list[Any] = [None] * len(m0s)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, m0 in enumerate(m0s):
        groups.setdefault((m0.device, m0.dtype), []).append(k)
    for (dev, dt), ks in groups.items():
        mu, g = [m0s[k] for k in ks], [gls[k] for k in ks]
        # A tensor beta (inject_hyperparams) stays on the device: foreach's scalar weight would read it on the host.
        b = beta.to(dev, dt) if isinstance(beta, torch.Tensor) else beta
        if isinstance(b, torch.Tensor):
            m = [x.lerp(y, 1 - b) for x, y in zip(mu, g)]
        else:
            m = list(torch._foreach_lerp(mu, g, 1 - b))
        if not bias_correction:
            if not nesterov:
                d = m
            elif isinstance(b, torch.Tensor):
                d = [y.lerp(x, b) for x, y in zip(m, g)]
            else:
                d = list(torch._foreach_lerp(g, m, b))
        else:
            t = count.to(dev, tu.acc_dtype(dt))
            if nesterov:
                c1 = (b / _bias_correction(beta, t + 1)).to(dt)
                c2 = ((1 - b) / _bias_correction(beta, t)).to(dt)
                d = list(torch._foreach_add(torch._foreach_mul(m, c1), torch._foreach_mul(g, c2)))
            else:
                d = list(torch._foreach_div(m, _bias_correction(beta, t).to(dt)))
        for k, mk, dk in zip(ks, m, d):
            ms[k], ds[k] = mk, dk
    return ms, ds


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
    rows, eps = _check_common(ns_coeffs, ns_steps, eps, preconditioning, ns_dtype, comm, name="orthogonalize")
    ns_batch = check.integer(ns_batch, arg="ns_batch", name="orthogonalize", minimum=1)
    run = _make_orthogonalizer(rows, preconditioning, eps, ns_dtype, comm, name="orthogonalize", ns_batch=ns_batch)
    resolve = _dims_resolver(weight_dimension_numbers, name="orthogonalize")

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, EmptyState, name="orthogonalize")
        leaves, spec, dims, paths = _muon_leaves(updates, resolve, name="orthogonalize")
        idx = [j for j, d in enumerate(dims) if d is not None]
        out = list(leaves)
        sub_paths = lambda: [paths()[j] for j in idx]
        for j, o in zip(idx, run([leaves[j] for j in idx], [dims[j] for j in idx], sub_paths, False)):
            out[j] = o
        return tu.unflatten(spec, out), state

    return GradientTransformation(init_fn, update_fn)


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
      mu_dtype: the momentum's dtype; ``None``: fp32 for fp16/bf16 params, the param's otherwise.
      nesterov: use Nesterov momentum.
      adaptive: scale each leaf's update by the dual norm of its direction (Bernstein & Newhouse).
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or ``"schatten"``.
      weight_dimension_numbers: a :class:`MuonDimensionNumbers` for every
        leaf, a tree of them (a ``None`` leaf passes through untouched, and its
        momentum is not kept), or a function of the updates returning one.
        ``None``: every 2-d leaf is an ``(out, in)`` matrix, and the other leaves pass through.
      bias_correction: divide the momentum by ``1 - beta**t`` (optax); False as ``torch.optim.Muon``.
      ns_dtype: iterate in this dtype (``torch.bfloat16`` as ``torch.optim.Muon``); ``None``: the update's.
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
    rows, eps = _check_common(ns_coeffs, ns_steps, eps, preconditioning, ns_dtype, comm, name=name)
    beta = check.beta(beta, arg="beta", name=name, tensor=True)
    nesterov = check.flag(nesterov, arg="nesterov", name=name)
    adaptive = check.flag(adaptive, arg="adaptive", name=name)
    bias_correction = check.flag(bias_correction, arg="bias_correction", name=name)
    if mu_dtype is not None and not (isinstance(mu_dtype, torch.dtype) and mu_dtype.is_floating_point):
        raise TypeError(f"{name}: mu_dtype must be a floating torch.dtype or None, got {mu_dtype!r}")
    ns_batch = check.integer(ns_batch, arg="ns_batch", name=name, minimum=1)
    run = _make_orthogonalizer(rows, preconditioning, eps, ns_dtype, comm, name=name, ns_batch=ns_batch)
    resolve = _dims_resolver(weight_dimension_numbers, name=name)

    def init_fn(params: Params) -> MuonState:
        leaves, spec = tu.flatten(params)
        tu.check_tensors(leaves, tu.paths(params), what=f"{name}: params")
        mu = [torch.zeros_like(p, dtype=mu_dtype or _moment_dtype(p.dtype), requires_grad=False) for p in leaves]
        device = tu.local(leaves[0]).device if leaves else torch.device("cpu")
        return MuonState(count=torch.zeros((), dtype=torch.int64, device=device), mu=tu.unflatten(spec, mu))

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, MuonState, name=name)
        index, leaves, spec = tu.align(state.mu, updates, what=f"{name}: updates", against="the state's momentum")
        mu_leaves, mu_spec = tu.flatten(state.mu)
        tu.check_devices(
            [mu_leaves[i] for i in index], leaves, updates, what=f"{name}: updates", against="its momentum"
        )
        dims, paths = resolve(updates, leaves, spec)
        count = state.count + 1
        idx = [j for j, d in enumerate(dims) if d is not None]
        new_mu = list(mu_leaves)
        out: list[torch.Tensor] = list(leaves)
        if idx:
            m0s = [tu.local(mu_leaves[index[j]]) for j in idx]
            gls = [_cast(tu.local(leaves[j]), m0.dtype) for j, m0 in zip(idx, m0s)]
            ms, ds = _momentum(m0s, gls, beta, count, nesterov=nesterov, bias_correction=bias_correction)
            for j, m in zip(idx, ms):
                new_mu[index[j]] = tu.like(mu_leaves[index[j]], m)
            directions = [tu.like(leaves[j], d) for j, d in zip(idx, ds)]
            sub_paths = lambda: [paths()[j] for j in idx]
            for j, o in zip(idx, run(directions, [dims[j] for j in idx], sub_paths, adaptive)):
                out[j] = tu.like(leaves[j], _cast(tu.local(o), leaves[j].dtype))
        return tu.unflatten(spec, out), MuonState(count=count, mu=tu.unflatten(mu_spec, new_mu))

    return GradientTransformation(init_fn, update_fn)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


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

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    resolve = _dims_resolver(weight_dimension_numbers, name="scale_by_shape")
    factors_cache: dict[Any, list[float]] = {}

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, EmptyState, name="scale_by_shape")
        leaves, spec, dims, paths = _muon_leaves(updates, resolve, name="scale_by_shape")
        idx = [j for j, dn in enumerate(dims) if dn is not None]
        key = (spec, tuple(x.shape for x in leaves))
        sizes = factors_cache.get(key)
        if sizes is None:  # the width factors depend on the shapes alone
            where = paths()
            lays = [_layout(tuple(leaves[j].shape), dims[j], where=where[j]) for j in idx]
            if consistent_rms is None:
                sizes = [math.sqrt(max(1.0, lay.fan_out / lay.fan_in)) for lay in lays]
            else:
                sizes = [math.sqrt(max(lay.fan_in, lay.fan_out)) for lay in lays]
            if len(factors_cache) > 8:
                factors_cache.clear()
            factors_cache[key] = sizes
        out = list(leaves)
        locs = [tu.local(leaves[j]) for j in idx]
        if isinstance(consistent_rms, torch.Tensor):
            scaled = [x * (consistent_rms.to(x.device, x.dtype) * f) for x, f in zip(locs, sizes)]
        else:
            rms = 1.0 if consistent_rms is None else consistent_rms
            scaled = list(torch._foreach_mul(locs, [f * rms for f in sizes])) if locs else []
        for j, y in zip(idx, scaled):
            out[j] = tu.like(leaves[j], y)
        return tu.unflatten(spec, out), state

    return GradientTransformation(init_fn, update_fn)


def _scale_by_adam_nesterov(
    b1: Scalar, b2: Scalar, eps: Scalar, eps_root: Scalar, mu_dtype: torch.dtype | None, nesterov: bool
) -> GradientTransformation:
    """optax's ``scale_by_adam`` with ``eps_root`` and ``nesterov``: Muon's fallback for the other leaves."""

    def init_fn(params: Params) -> ScaleByAdamState:
        leaves, spec = tu.flatten(params)
        zeros = lambda: [
            torch.zeros_like(p, dtype=mu_dtype or _moment_dtype(p.dtype), requires_grad=False) for p in leaves
        ]
        device = tu.local(leaves[0]).device if leaves else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int64, device=device)
        return ScaleByAdamState(count=count, mu=tu.unflatten(spec, zeros()), nu=tu.unflatten(spec, zeros()))

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        tu.require_state(state, ScaleByAdamState, name="muon (adam)")
        index, leaves, spec = tu.align(state.mu, updates, what="muon (adam): updates", against="the state's moments")
        mu_leaves, mu_spec = tu.flatten(state.mu)
        nu_leaves, nu_spec = tu.flatten(state.nu)
        count = state.count + 1
        new_mu, new_nu, out = list(mu_leaves), list(nu_leaves), list(leaves)
        for j, (g, i) in enumerate(zip(leaves, index)):
            m0, v0 = tu.local(mu_leaves[i]), tu.local(nu_leaves[i])
            gl = tu.local(g).to(m0.dtype)
            dev, dt = m0.device, m0.dtype

            def c(v: Scalar, dev: torch.device = dev, dt: torch.dtype = dt) -> Scalar:
                return v.to(dev, dt) if isinstance(v, torch.Tensor) else v

            m = m0.lerp(gl, 1 - c(b1))
            v = v0 * c(b2) + (1 - c(b2)) * gl * gl
            t = count.to(dev, tu.acc_dtype(dt))
            if nesterov:
                m_hat = m * (c(b1) / _bias_correction(b1, t + 1)).to(dt) + gl * (
                    (1 - c(b1)) / _bias_correction(b1, t)
                ).to(dt)
            else:
                m_hat = m / _bias_correction(b1, t).to(dt)
            v_hat = v / _bias_correction(b2, t).to(dt)
            u = m_hat / (torch.sqrt(v_hat + c(eps_root)) + c(eps))
            new_mu[i], new_nu[i] = tu.like(mu_leaves[i], m), tu.like(nu_leaves[i], v)
            out[j] = tu.like(g, u.to(g.dtype))
        return tu.unflatten(spec, out), ScaleByAdamState(
            count, tu.unflatten(mu_spec, new_mu), tu.unflatten(nu_spec, new_nu)
        )

    return GradientTransformation(init_fn, update_fn)


@factory
def muon(
    learning_rate: Any,
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Scalar = 0.95,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
    weight_decay_mask: PyTree | Callable[[Params], PyTree] | None = None,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    adam_b1: Scalar = 0.9,
    adam_b2: Scalar = 0.999,
    adam_eps_root: Scalar = 0.0,
    adam_weight_decay: Scalar = 0.0,
    adam_learning_rate: Any = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: Scalar | None = None,
    bias_correction: bool = True,
    ns_dtype: torch.dtype | None = None,
    comm: ExchangeComm | None = None,
    ns_batch: int = 16,
) -> GradientTransformation:
    """Muon for the matrices, AdamW for the rest: optax's ``contrib.muon``, on PyTorch layouts and DTensors.

    The Muon leaves run ``chain(scale_by_muon(...), scale_by_shape(...),
    add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_learning_rate(learning_rate))``; the others run AdamW (Nesterov
    when ``nesterov``, as optax) with ``adam_*`` and ``eps``. Which leaves are
    Muon's: ``muon_weight_dimension_numbers`` (``None`` entries go to Adam),
    or, when it is ``None``, every 2-d leaf, read as an ``(out, in)`` weight.

    With ``beta=momentum, eps=1e-7, weight_decay=wd, bias_correction=False,
    ns_dtype=torch.bfloat16`` (and ``consistent_rms=0.2`` for
    ``adjust_lr_fn="match_rms_adamw"``) it is ``torch.optim.Muon(lr=lr,
    momentum=momentum, weight_decay=wd)`` on 2-d params.

    Args:
      learning_rate: a number ``>= 0``, a 0-d tensor or a schedule.
      ns_coeffs: as for :func:`scale_by_muon`, or a preset (``"standard"``, ``"dion"``).
      ns_steps: Newton–Schulz iterations.
      beta: the momentum decay.
      eps: added to the normalising norm, and Adam's denominator.
      mu_dtype: the moments' dtype (both members).
      nesterov: Nesterov momentum (both members, as optax).
      adaptive: as for :func:`scale_by_muon`.
      preconditioning: as for :func:`scale_by_muon`.
      bias_correction: as for :func:`scale_by_muon` (the Muon leaves only).
      ns_dtype: as for :func:`scale_by_muon`.
      comm: as for :func:`scale_by_muon`.
      ns_batch: as for :func:`scale_by_muon`.
      weight_decay: decoupled decay of the Muon leaves, scaled by the learning rate.
      weight_decay_mask: which Muon leaves decay (a tree of bools, a prefix, or a function).
      adam_b1: the fallback AdamW's first-moment decay.
      adam_b2: its second-moment decay.
      adam_eps_root: added inside its square root.
      adam_weight_decay: its decoupled decay.
      adam_learning_rate: the fallback's learning rate; ``None``: ``learning_rate``.
      muon_weight_dimension_numbers: a tree of :class:`MuonDimensionNumbers`
        (``None`` for Adam leaves), a prefix of the params, or a function of
        the params returning one.
      consistent_rms: ``None`` for width scaling, else the target RMS (see :func:`scale_by_shape`).

    Returns:
      An :class:`~gradtx.OptimizerChain` of one :func:`gradtx.partition` (labels ``"muon"`` and ``"adam"``);
      its state is ``(PartitionState,)``. Its output is an update, so
      :class:`gradtx.TransformedOptimizer` refuses it; in front of a torch
      optimizer chain :func:`scale_by_muon` and :func:`scale_by_shape` instead
      (``docs/muon.md``).

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024;
      Liu et al., "Muon is Scalable for LLM Training", 2025.

    Example:
      >>> tx = muon(0.02, weight_decay=0.01, adam_learning_rate=3e-4)
      >>> updates, state = tx.update(grads, tx.init(params), params)
    """
    learning_rate = check.learning_rate(learning_rate, name="muon")
    adam_lr = learning_rate if adam_learning_rate is None else check.learning_rate(adam_learning_rate, name="muon")
    weight_decay = check.non_negative(weight_decay, arg="weight_decay", name="muon", tensor=True)
    adam_b1 = check.beta(adam_b1, arg="adam_b1", name="muon", tensor=True)
    adam_b2 = check.beta(adam_b2, arg="adam_b2", name="muon", tensor=True)
    adam_eps_root = check.non_negative(adam_eps_root, arg="adam_eps_root", name="muon", tensor=True)
    adam_weight_decay = check.non_negative(adam_weight_decay, arg="adam_weight_decay", name="muon", tensor=True)
    dims_arg = muon_weight_dimension_numbers
    if isinstance(ns_coeffs, str):
        _coeff_rows(ns_coeffs, ns_steps if isinstance(ns_steps, int) else 5, name="muon")
        ns_coeffs = _NS_COEFFS_PRESETS[ns_coeffs]

    def per_leaf(tree: PyTree) -> list[MuonDimensionNumbers | None]:
        if dims_arg is None:
            return [MuonDimensionNumbers() if x.ndim == 2 else None for x in tu.flatten(tree)[0]]
        return _resolve_dims(dims_arg, tree, name="muon")

    def labels(params: PyTree) -> PyTree:
        _, spec = tu.flatten(params)
        return tu.unflatten(spec, ["muon" if d is not None else "adam" for d in per_leaf(params)])

    def inner_dims(updates: PyTree) -> PyTree:
        # The Muon member sees None at the Adam leaves; what remains are Muon leaves.
        if dims_arg is None:
            return MuonDimensionNumbers()
        return dims_arg(updates) if callable(dims_arg) and not _is_dn(dims_arg) else dims_arg

    muon_tx = scale_by_muon(
        ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
        preconditioning=preconditioning, weight_dimension_numbers=inner_dims, bias_correction=bias_correction,
        ns_dtype=ns_dtype, comm=comm, ns_batch=ns_batch,
    )  # fmt: skip
    members = [muon_tx, scale_by_shape(inner_dims, consistent_rms)]
    if isinstance(weight_decay, torch.Tensor) or weight_decay != 0.0:
        members.append(add_decayed_weights(weight_decay, weight_decay_mask))
    members.append(scale_by_learning_rate(learning_rate))
    adam_members = [_scale_by_adam_nesterov(adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, nesterov)]
    if isinstance(adam_weight_decay, torch.Tensor) or adam_weight_decay != 0.0:
        adam_members.append(add_decayed_weights(adam_weight_decay))
    adam_members.append(scale_by_learning_rate(adam_lr))
    inner = partition({"muon": chain(*members), "adam": chain(*adam_members)}, labels)
    # An OptimizerChain: its output is an update (-learning_rate times a direction), so the wrapper refuses
    # it in front of a torch optimizer, and no fused kernel claims it.
    spec = OptimizerSpec("muon", learning_rate, weight_decay, b1=adam_b1, b2=adam_b2, eps=eps, fusable=False)
    return OptimizerChain(*_as_chain(inner), [inner], spec)


def _as_chain(inner: GradientTransformation) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``init`` and ``update`` of ``chain(inner)``: the state is a 1-tuple, as every chain's."""

    def init_fn(params: Params) -> tuple[Any]:
        return (inner.init(params),)

    def update_fn(updates, state, params=None, **extra):
        if not isinstance(state, tuple) or len(state) != 1:
            raise TypeError(f"muon: expected the state that init() returned (a 1-tuple), got {type(state).__name__}")
        updates, inner_state = inner.update(updates, state[0], params, **extra)
        return updates, (inner_state,)

    return init_fn, update_fn

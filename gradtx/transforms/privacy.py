"""Per-example clipping, gradient noise and DP-SGD, with optax's names and numbers.

Per-example gradients come from ``torch.func.vmap(torch.func.grad(loss))``:
every leaf has a leading example dim. :func:`per_example_global_norm_clip`
and :func:`per_example_layer_norm_clip` clip each example and sum them, as
optax's functions of the same names do. Any other transform whose math is
per tensor or per tree (clips, norms, optimizers) also runs under
``torch.func.vmap`` directly; see ``docs/functional.md``.

Randomness is a seed, where optax takes a key: the state carries the state of
a ``torch.Generator`` as a ``uint8`` tensor, so the same seed gives the same
noise, a restored checkpoint continues the same sequence, and nothing global
(torch's default generator) is read or advanced.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Params, PyTree, factory, identity
from gradtx.optimizers.standard import scale_by_learning_rate, trace
from gradtx.transforms.combine import chain


def _batched_leaves(grads: PyTree, *, name: str) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = tu.tensor_leaves(grads, what=f"{name}: grads")
    if not leaves:
        raise ValueError(f"{name}: grads has no tensors")
    first = leaves[0].shape[0] if leaves[0].ndim else None
    for path, t in zip(tu.paths(grads), leaves):
        if t.is_complex():  # (the per-example norms and sums below are real)
            raise TypeError(f"{name}: grads leaf at {tu.path_str(path)} is complex; it takes real grads")
        if t.ndim == 0 or t.shape[0] != first:
            raise ValueError(
                f"{name}: grads must be per-example, every leaf with the same leading example dim; the leaf at "
                f"{tu.path_str(path)} has shape {tuple(t.shape)}, the first leaf {tuple(leaves[0].shape)}"
            )
    return leaves, spec


def _clip_and_sum(leaves: list[torch.Tensor], limit: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    # Each example's L2 norm over all the leaves, in fp32 (fp64 for fp64 grads).
    acc = torch.float64 if any(tu.acc_dtype(t.dtype) == torch.float64 for t in leaves) else torch.float32
    rows = [t.reshape(t.shape[0], math.prod(t.shape[1:])) for t in leaves]  # (-1 is ambiguous with 0 examples)
    squares = [torch.linalg.vector_norm(r, 2, dim=1, dtype=acc) ** 2 for r in rows]
    norms = torch.stack(squares).sum(0).sqrt()
    limit = limit.to(norms.device, norms.dtype) if isinstance(limit, torch.Tensor) else limit
    # optax's multiplier: min(clip / norm, 1), and 1 where that is 0/0 (a zero gradient with a zero clip).
    multipliers = torch.nan_to_num(torch.clamp(limit / norms, max=1.0), nan=1.0)
    clipped = (multipliers < 1.0).sum()
    sums = [
        torch.tensordot(multipliers.to(tu.acc_dtype(t.dtype)), t.to(tu.acc_dtype(t.dtype)), dims=1).to(t.dtype)
        for t in leaves
    ]
    return sums, clipped


def per_example_global_norm_clip(grads: PyTree, l2_norm_clip: float | torch.Tensor) -> tuple[PyTree, torch.Tensor]:
    """Clip each example's gradient to global L2 norm ``l2_norm_clip``, then sum over examples.

    Each leaf of ``grads`` has a leading example dim (what
    ``torch.func.vmap(torch.func.grad(loss))`` returns). An example's norm is
    taken over all its leaves together, in fp32 (fp64 for fp64 grads), and its
    multiplier is ``min(l2_norm_clip / norm, 1)``, as in optax.

    Args:
      grads: a tree of per-example gradients, each leaf ``(batch, *shape)``.
      l2_norm_clip: the largest norm an example's gradient keeps; ``>= 0``
        (``inf`` keeps every example as it is), or a 0-d tensor.

    Returns:
      ``(summed, clipped)``: the tree of the sums over examples of the clipped
      gradients (each leaf ``shape``, in the grads' dtype), and the number of
      examples that were clipped (a 0-d int64 tensor).

    References:
      Abadi et al., "Deep Learning with Differential Privacy", 2016.

    Example:
      >>> grads = {"w": torch.tensor([[0.0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])}
      >>> per_example_global_norm_clip(grads, 1.25)
      ({'w': tensor([1.7500, 1.7500, 1.7500])}, tensor(3))
    """
    name = "per_example_global_norm_clip"
    l2_norm_clip = check.non_negative(l2_norm_clip, arg="l2_norm_clip", name=name, finite=False, tensor=True)
    leaves, spec = _batched_leaves(grads, name=name)
    sums, clipped = _clip_and_sum(leaves, l2_norm_clip)
    return tu.unflatten(spec, sums), clipped


def per_example_layer_norm_clip(
    grads: PyTree, global_l2_norm_clip: float | torch.Tensor, uniform: bool = True
) -> tuple[PyTree, PyTree]:
    """Clip each example's gradient leaf by leaf (layer by layer), then sum over examples.

    With ``K`` leaves and ``C = global_l2_norm_clip``, each leaf is clipped on
    its own to ``C / sqrt(K)`` (``uniform``), or to ``C * sqrt(D_i / D)``, where
    ``D_i`` is the leaf's number of elements per example and ``D`` the total
    (not ``uniform``). Either way an example's clipped gradient has global norm
    at most ``C``. This is optax's ``per_example_layer_norm_clip``.

    Args:
      grads: a tree of per-example gradients, each leaf ``(batch, *shape)``.
      global_l2_norm_clip: the overall clip norm ``C``; ``>= 0``.
      uniform: split ``C`` evenly over the leaves (True) or by their sizes.

    Returns:
      ``(summed, clipped)``: a tree of the sums of the clipped gradients, and a
      tree (the same structure) of the number of examples clipped in each leaf.

    References:
      McMahan et al., "Learning Differentially Private Recurrent Language Models", 2018.

    Example:
      >>> summed, clipped = per_example_layer_norm_clip(per_example_grads, 1.0)
    """
    name = "per_example_layer_norm_clip"
    global_l2_norm_clip = check.non_negative(
        global_l2_norm_clip, arg="global_l2_norm_clip", name=name, finite=False, tensor=True
    )
    uniform = check.flag(uniform, arg="uniform", name=name)
    leaves, spec = _batched_leaves(grads, name=name)
    sizes = [1] * len(leaves) if uniform else [math.prod(t.shape[1:]) for t in leaves]
    results = [_clip_and_sum([t], global_l2_norm_clip * math.sqrt(s / sum(sizes))) for t, s in zip(leaves, sizes)]
    return tu.unflatten(spec, [s for (s,), _ in results]), tu.unflatten(spec, [c for _, c in results])


# --- noise ----------------------------------------------------------------------------------


def _normal_like(
    leaves: list[torch.Tensor], rng_state: torch.Tensor, tree: PyTree, name: str
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Standard normal noise shaped like each leaf (in its dtype, on its device), and the generator's next state.

    The noise is drawn on the CPU, from the generator the state holds, and moved
    to each leaf's device: the same seed gives the same numbers on any device. A
    DTensor's shard gets its part of the whole tensor's noise (the single-device
    noise; each rank draws the whole leaf's), not a copy of every other shard's.
    A ``Partial`` one (a pending sum, whose every rank would add the whole noise) is
    refused, naming its path in ``tree``.
    """
    tu.check_placed(f"{name}: updates", tree, range(len(leaves)), leaves)  # each rank would add the whole noise
    gen = torch.Generator()
    gen.set_state(rng_state)
    out = []
    for t in leaves:
        x = tu.local(t)  # complex noise for complex x
        n = torch.randn(t.shape, generator=gen, dtype=x.dtype if x.is_complex() else tu.acc_dtype(x.dtype))
        out.append((n if x is t else tu.local_part(n, t)).to(x.device, non_blocking=True))
    return out, gen.get_state()


class AddNoiseState(NamedTuple):
    """The step count (for annealing) and the noise generator's state (``uint8``, on the CPU)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count(), as in optax
    rng_state: torch.Tensor


def _seeded(seed: Any, *, name: str) -> torch.Tensor:
    """The state of a ``torch.Generator`` seeded with ``seed`` (checked), what a noise state starts from."""
    seed = check.integer(seed, arg="seed", name=name, minimum=0)  # optax takes a key here
    if seed >= 2**64:  # what torch.Generator.manual_seed takes
        raise ValueError(f"{name}: seed must be < 2**64, got {seed}")
    return torch.Generator().manual_seed(seed).get_state()


@factory
def add_noise(eta: float, gamma: float, seed: int) -> GradientTransformation:
    """Add annealed Gaussian noise to the updates: variance ``eta / (1 + t)**gamma`` at step ``t`` (from 0).

    optax's ``add_noise``, with an int ``seed`` where optax takes a key: the
    same seed gives the same noise. The state holds the generator's state, so
    the noise neither reads nor advances torch's global generator, and a
    restored state continues the same sequence. On DTensor grads each shard
    gets its part of the single-device noise.

    Args:
      eta: the base variance; ``>= 0``.
      gamma: the decay exponent of the variance; ``>= 0``.
      seed: the seed of the noise generator; an int ``>= 0``.

    Returns:
      A :class:`GradientTransformation` with state :class:`AddNoiseState`.

    References:
      Neelakantan et al., "Adding Gradient Noise Improves Learning for Very Deep Networks", 2015.

    Example:
      >>> tx = chain(add_noise(0.01, 0.55, seed=0), scale_by_learning_rate(0.003))
      >>> updates, state = tx.update(grads, tx.init(params))
    """
    name = "add_noise"
    eta = check.non_negative(eta, arg="eta", name=name)
    gamma = check.non_negative(gamma, arg="gamma", name=name)
    seeded = _seeded(seed, name=name)

    def init_fn(params: Params) -> AddNoiseState:
        return AddNoiseState(count=torch.zeros((), dtype=torch.int64), rng_state=seeded.clone())

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, AddNoiseState, name=name)
        leaves, spec = tu.tensor_leaves(updates, what=f"{name}: updates")
        count = state.count + 1
        noise, rng_state = _normal_like(leaves, state.rng_state, updates, name)
        std = torch.sqrt(eta / count.to(torch.float64) ** gamma)
        out = [
            tu.like(t, (tu.local(t).to(n.dtype) + std.to(n.device, n.dtype, non_blocking=True) * n).to(t.dtype))
            for t, n in zip(leaves, noise)
        ]
        return tu.unflatten(spec, out), AddNoiseState(count=count, rng_state=rng_state)

    return GradientTransformation(init_fn, update_fn)


# --- DP-SGD ---------------------------------------------------------------------------------


class DifferentiallyPrivateAggregateState(NamedTuple):
    """The noise generator's state (``uint8``, on the CPU)."""

    rng_state: torch.Tensor


@factory
def differentially_private_aggregate(l2_norm_clip: float, noise_multiplier: float, seed: int) -> GradientTransformation:
    """Clip per-example gradients, sum them, add Gaussian noise, and divide by the batch size (DP-SGD's aggregation).

    The update is ``(sum_i clip(g_i) + l2_norm_clip * noise_multiplier * N(0, I)) / batch``,
    with ``clip`` as in :func:`per_example_global_norm_clip`. This is optax's
    ``contrib.differentially_private_aggregate``, with an int ``seed`` where
    optax takes a key. The updates it takes are per-example (each leaf
    ``(batch, *shape)``, from ``torch.func.vmap(torch.func.grad(loss))``), and
    the updates it returns are not, so it goes first in a chain. Privacy
    accounting (the epsilon a run spends) is not part of gradtx.

    Args:
      l2_norm_clip: the largest norm an example's gradient keeps; ``> 0``.
      noise_multiplier: the noise's standard deviation relative to ``l2_norm_clip``; ``>= 0``.
      seed: the seed of the noise generator; an int ``>= 0``.

    Returns:
      A :class:`GradientTransformation` with state :class:`DifferentiallyPrivateAggregateState`.

    References:
      Abadi et al., "Deep Learning with Differential Privacy", 2016.

    Example:
      >>> tx = differentially_private_aggregate(1.0, 1.1, seed=0)
      >>> updates, state = tx.update(per_example_grads, tx.init(params))
    """
    name = "differentially_private_aggregate"
    l2_norm_clip = check.positive(l2_norm_clip, arg="l2_norm_clip", name=name)
    noise_multiplier = check.non_negative(noise_multiplier, arg="noise_multiplier", name=name)
    seeded = _seeded(seed, name=name)
    noise_std = l2_norm_clip * noise_multiplier

    def init_fn(params: Params) -> DifferentiallyPrivateAggregateState:
        return DifferentiallyPrivateAggregateState(rng_state=seeded.clone())

    def update_fn(updates, state, params=None, **extra):
        tu.require_state(state, DifferentiallyPrivateAggregateState, name=name)
        leaves, spec = _batched_leaves(updates, name=name)
        batch = leaves[0].shape[0]
        summed, _ = _clip_and_sum(leaves, l2_norm_clip)
        noise, rng_state = _normal_like(summed, state.rng_state, updates, name)
        out = [((s.to(n.dtype) + noise_std * n) / batch).to(s.dtype) for s, n in zip(summed, noise)]
        return tu.unflatten(spec, out), DifferentiallyPrivateAggregateState(rng_state=rng_state)

    return GradientTransformation(init_fn, update_fn)


@factory
def dpsgd(
    learning_rate: Any,
    l2_norm_clip: float,
    noise_multiplier: float,
    seed: int,
    momentum: float | None = None,
    nesterov: bool = False,
) -> GradientTransformation:
    """DP-SGD: :func:`differentially_private_aggregate`, optional momentum, then ``-learning_rate``.

    optax's ``contrib.dpsgd``, with the same parameters and order. The updates
    are per-example gradients (each leaf ``(batch, *shape)``).

    Args:
      learning_rate: a number, a 0-d tensor or a schedule.
      l2_norm_clip: the largest norm an example's gradient keeps; ``> 0``.
      noise_multiplier: the noise's standard deviation relative to ``l2_norm_clip``; ``>= 0``.
      seed: the seed of the noise generator; an int ``>= 0``.
      momentum: the momentum decay (:func:`gradtx.trace`), or ``None`` for none.
      nesterov: use Nesterov momentum.

    Returns:
      A :class:`GradientTransformation` (a chain).

    References:
      Abadi et al., "Deep Learning with Differential Privacy", 2016.

    Example:
      >>> tx = dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=1.1, seed=0)
      >>> per_example_grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
      >>> updates, state = tx.update(per_example_grads, state, params)
    """
    if momentum is not None:  # checked here, so an error names dpsgd's own argument
        check.non_negative(momentum, arg="momentum", name="dpsgd")
    check.flag(nesterov, arg="nesterov", name="dpsgd")
    return chain(
        differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed),
        trace(momentum, nesterov=nesterov) if momentum is not None else identity(),
        scale_by_learning_rate(learning_rate),
    )

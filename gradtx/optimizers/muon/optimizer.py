"""``muon``: Muon for the matrices, AdamW (optax's, with Nesterov) for the other leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradtx.comm.base import ExchangeComm
from gradtx.core import tree as tu
from gradtx.core import validate as check
from gradtx.core.base import GradientTransformation, Params, PyTree, factory
from gradtx.optimizers.aliases import _alias, _checked, _decay
from gradtx.optimizers.muon.iteration import (
    _DEFAULT_NS_COEFFS,
    MuonDimensionNumbers,
    Preconditioning,
    Scalar,
    _resolve_dims,
)
from gradtx.optimizers.muon.transforms import scale_by_muon, scale_by_shape
from gradtx.optimizers.standard import _scale_by_adam, scale_by_learning_rate
from gradtx.transforms.combine import chain, partition


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
      mu_dtype: the dtype both members store their first moment in (Adam's second moment keeps the default);
        the step computes in the grads' precision, as optax.
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
        the params returning one. The Muon member calls a function (this one or
        ``weight_decay_mask``) with ``None`` at the Adam leaves, as optax with its
        ``MaskedNode``: map over the tree (``gtx.tree.tree_map`` skips ``None``).
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
    learning_rate, weight_decay = _checked("muon", learning_rate, weight_decay)
    adam_lr = learning_rate if adam_learning_rate is None else adam_learning_rate
    adam_lr = check.learning_rate(adam_lr, name="muon", arg="adam_learning_rate")
    adam_b1 = check.beta(adam_b1, arg="adam_b1", name="muon", tensor=True)
    adam_b2 = check.beta(adam_b2, arg="adam_b2", name="muon", tensor=True)
    adam_eps_root = check.non_negative(adam_eps_root, arg="adam_eps_root", name="muon", tensor=True)
    adam_weight_decay = check.non_negative(adam_weight_decay, arg="adam_weight_decay", name="muon", tensor=True)
    dims_arg = muon_weight_dimension_numbers

    def labels(params: PyTree) -> PyTree:
        if dims_arg is None:  # the 2-d rule leaf by leaf: no tree of constants for dynamo to unflatten
            # (a leaf that is no tensor goes to adam, whose init names it)
            return tu.tree_map(lambda x: "muon" if getattr(x, "ndim", 0) == 2 else "adam", params)
        _, spec = tu.flatten(params)
        dims = _resolve_dims(dims_arg, params, name="muon")  # None: every 2-d leaf
        return tu.unflatten(spec, ["muon" if d is not None else "adam" for d in dims])

    # The Muon member sees None at the Adam leaves: every leaf it sees is a Muon leaf.
    inner_dims = MuonDimensionNumbers() if dims_arg is None else dims_arg
    muon_tx = scale_by_muon(
        ns_coeffs,
        ns_steps,
        beta,
        eps,
        mu_dtype,
        nesterov=nesterov,
        adaptive=adaptive,
        preconditioning=preconditioning,
        weight_dimension_numbers=inner_dims,
        bias_correction=bias_correction,
        ns_dtype=ns_dtype,
        comm=comm,
        ns_batch=ns_batch,
    )
    adam_tx = _scale_by_adam(
        adam_b1, adam_b2, eps, adam_eps_root, nesterov=nesterov, mu_dtype=mu_dtype, name="muon (adam)"
    )
    shaped = [muon_tx, scale_by_shape(inner_dims, consistent_rms)]
    muon_chain = chain(*shaped, *_decay(weight_decay, weight_decay_mask), scale_by_learning_rate(learning_rate))
    adam_chain = chain(adam_tx, *_decay(adam_weight_decay), scale_by_learning_rate(adam_lr))
    inner = partition({"muon": muon_chain, "adam": adam_chain}, labels)
    # An OptimizerChain: its output is an update (-learning_rate times a direction), so the wrapper refuses
    # it in front of a torch optimizer.
    return _alias([inner], "muon", learning_rate, weight_decay, b1=adam_b1, b2=adam_b2, eps=eps)

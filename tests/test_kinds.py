"""A user's own windowed transform and guard, in the wrapper and the functional step; a member's extras for those after it.

References: plain torch (autograd sums micro-batch grads into .grad, SGD steps every k-th call, and a
vetoed step is a step not taken), and the pure functional path.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple, Self

import torch

import gradtx as gtx
from gradtx.core import kinds
from gradtx.core import tree as tu
from gradtx.testing import assert_trees_close

K, LR, MOMENTUM, THRESHOLD = 3, 1e-3, 0.9, 80.0


class SumWindow(gtx.GradientTransformation):
    """Emit the plain *sum* of k micro-batch grads (torch's own accumulation), counting with gtx.Window."""

    def __new__(cls, k: int) -> Self:
        window = gtx.Window(k)

        def init(params):
            return window.init(params)  # its running sum: empty placeholders shaped like the params

        def sum_window(updates, state, params=None, *, tokens=None, flush=False):
            leaves, spec = tu.flatten(updates)
            acc = leaves if kinds.is_empty_sum(state.acc) else [a + g for a, g in zip(tu.flatten(state.acc)[0], leaves)]
            acc = [a.to(torch.promote_types(a.dtype, torch.float32)) for a in acc]  # the declared sum dtype
            stepped = window.step(state, tokens=tokens, flush=flush)
            if stepped.factor is None:
                return None, None, stepped.state._replace(acc=tu.unflatten(spec, acc))
            return tu.unflatten(spec, acc), torch.ones((), dtype=torch.float64), stepped.state

        def update(updates, state, params=None, *, tokens=None, flush=False, **extra):
            total, factor, new_state = sum_window(updates, state, params, tokens=tokens, flush=flush)
            if total is None:
                return None, new_state
            return tu.tree_map(lambda s, g: (s * factor).to(g.dtype), total, updates), new_state

        self = super().__new__(cls, init, update)
        self.window, self.sum_window = window, sum_window
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self.window.k,)

    # gradtx.core.kinds.Windowed
    @property
    def k(self) -> int:
        return self.window.k

    def emits_next(self, state, *, flush=False):
        return self.window.emits_next(state, flush=flush)

    def is_open(self, state):
        return self.window.is_open(state)

    def count_step(self, state, *, tokens=None, flush=False, device=None):
        stepped = self.window.step(state, tokens=tokens, flush=flush, device=device)
        return (None if stepped.factor is None else torch.ones((), dtype=torch.float64)), stepped.state

    def reduce(self, leaves):
        return leaves

    def rank_local(self):
        return gtx.transforms.accumulation.RankLocal(None, "dp", False, False)


class VetoState(NamedTuple):
    vetoed: torch.Tensor
    inner: Any


def veto_large(inner: gtx.GradientTransformation, threshold: float) -> gtx.Guard:
    """A user's guard: zero updates, inner state kept, when the update's global norm exceeds ``threshold``."""

    def init(params):
        return VetoState(torch.zeros((), dtype=torch.bool), inner.init(params))

    def update(updates, state, params=None, **extra):
        veto = gtx.global_norm(updates) > threshold
        new, inner_state = inner.update(updates, state.inner, params, **extra)
        out = tu.tree_map(lambda u: torch.where(veto, torch.zeros_like(u), u), new)
        kept = tu.tree_map(lambda n, o: torch.where(veto, o, n), inner_state, state.inner)
        return out, VetoState(veto, kept)

    return gtx.Guard(init, update, lambda state: state.vetoed)


def _batches(n):
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        out.append((torch.randn(8, 4, generator=g) * (3.0 if i % 4 == 2 else 1.0), torch.randn(8, 2, generator=g)))
    return out


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y, reduction="sum")


def _torch_reference(n):
    """Plain torch: grads summed by autograd over K micro-batches; skip the step when their norm is large."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    vetoed = []
    for i, batch in enumerate(_batches(n)):
        _loss(model, batch).backward()
        if (i + 1) % K == 0:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            vetoed.append(bool(norm > THRESHOLD))
            if not vetoed[-1]:
                opt.step()
            opt.zero_grad()
    return model, vetoed


def _wrapper(model):
    tx = gtx.chain(SumWindow(K), veto_large(gtx.identity(), THRESHOLD))
    return gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), tx)


def test_a_users_window_and_guard_in_the_wrapper_match_plain_torch_across_a_mid_window_checkpoint():
    n, cut = 4 * K, K + 1  # the checkpoint is taken one micro-step into the second window
    expected, vetoed = _torch_reference(n)
    assert any(vetoed[1:]) and not all(vetoed[1:])  # the resumed part both steps and skips
    model = _model()
    opt = _wrapper(model)
    batches = _batches(n)
    for batch in batches[:cut]:
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    assert opt.window_open
    saved = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    model = _model()
    model.load_state_dict(saved["model"])
    opt = _wrapper(model)
    opt.load_state_dict(saved["optim"])
    assert opt.window_open
    for batch in batches[cut:]:
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    assert_trees_close(dict(model.state_dict()), dict(expected.state_dict()), rtol=1e-5, atol=1e-6)


def _params():
    model = _model()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _grads(n):
    params = _params()
    out = []
    for batch in _batches(n):
        out.append(torch.func.grad(lambda p, b=batch: _functional_loss(p, b))(params))
    return out


def _functional_loss(params, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(x @ params["weight"].T + params["bias"], y, reduction="sum")


def test_a_users_window_and_guard_in_the_functional_step_match_plain_torch():
    tx = gtx.chain(SumWindow(K), veto_large(gtx.sgd(LR, momentum=MOMENTUM), THRESHOLD))
    grads = _grads(4 * K)
    params = _params()
    state = tx.init(params)
    for g in grads:
        params, state = gtx.update_and_apply(tx, g, state, params)
    # and the numbers are plain torch's for fixed grads: sum each window, skip a large one
    ref = {k: torch.nn.Parameter(v) for k, v in _params().items()}
    opt = torch.optim.SGD(ref.values(), lr=LR, momentum=MOMENTUM)
    vetoed = []
    for w in range(4):
        window = grads[w * K : (w + 1) * K]
        total = {k: sum(g[k] for g in window) for k in ref}
        vetoed.append(bool(gtx.global_norm(total) > THRESHOLD))
        if not vetoed[-1]:
            for k, p in ref.items():
                p.grad = total[k].clone()
            opt.step()
    assert any(vetoed) and not all(vetoed)
    assert_trees_close(params, {k: v.detach() for k, v in ref.items()}, rtol=1e-5, atol=1e-6)


def test_a_users_window_checkpointed_mid_window_resumes_as_the_uninterrupted_run():
    tx = gtx.chain(SumWindow(K), veto_large(gtx.sgd(LR, momentum=MOMENTUM), THRESHOLD))
    grads = _grads(3 * K)
    params = _params()
    state = tx.init(params)
    cut = K + 1
    for g in grads[:cut]:
        params, state = gtx.update_and_apply(tx, g, state, params)
    saved = copy.deepcopy(gtx.checkpoint.state_dict(state, params, tx=tx))
    resumed = gtx.checkpoint.load_state_dict(saved, tx.init(params), params, tx=tx)
    assert kinds.window_fields(resumed[0]) is not None and not kinds.is_empty_sum(resumed[0].acc)
    a_params, a_state = params, state
    b_params, b_state = params, resumed
    for g in grads[cut:]:
        a_params, a_state = gtx.update_and_apply(tx, g, a_state, a_params)
        b_params, b_state = gtx.update_and_apply(tx, g, b_state, b_params)
    assert_trees_close(b_params, a_params, rtol=1e-6, atol=1e-7)


class _HalveLoss(gtx.GradientTransformation):
    """A user's transform that hands the members after it half the step's loss (a ``downstream_extra`` method)."""

    def __new__(cls) -> Self:
        return super().__new__(cls, lambda params: (), lambda updates, state, params=None, **extra: (updates, state))

    def downstream_extra(self, state, extra):
        return {**extra, "loss": extra["loss"] / 2}


def _scale_by_loss():
    """Multiply the updates by the ``loss`` it is given (reads the extra the member before it handed on)."""

    def update(updates, state, params=None, *, loss, **extra):
        return tu.tree_map(lambda u: u * loss, updates), state

    return gtx.GradientTransformation(lambda params: (), update)


def test_a_users_transform_changes_the_extras_the_members_after_it_see():
    tx = gtx.chain(_HalveLoss(), _scale_by_loss(), gtx.sgd(0.5))
    params = {"w": torch.tensor([1.0, -2.0])}
    grads = {"w": torch.tensor([4.0, 8.0])}
    expected = {"w": params["w"] - 0.5 * grads["w"] * (6.0 / 2)}  # the loss 6, halved, scales the grads
    pure, _ = gtx.update_and_apply(tx, grads, tx.init(params), params, loss=torch.tensor(6.0))
    assert_trees_close(pure, expected)

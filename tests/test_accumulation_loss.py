"""A loss given on every micro-step is reduced as the window reduces its grads, and that is what guards after it see.

The reference for the bad-micro-batch run is the same training with the bad
window left out (its micro-batches never fed), computed with plain torch math.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

import gradtx as gtx
from gradtx.testing import assert_trees_close

K = 4
WINDOWS = 20
BAD_WINDOW, BAD_MICRO = 15, 1


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def micro_batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for w in range(WINDOWS):
        window = []
        for m in range(K):
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            if (w, m) == (BAD_WINDOW, BAD_MICRO):
                y = y * 100  # a garbage micro-batch: a loss far above the others
            window.append((x, y))
        out.append(window)
    return out


def guarded(lr=0.05):
    return gtx.chain(gtx.accumulate(K), gtx.skip_spikes(gtx.sgd(lr, momentum=0.9), warmup_steps=5, metric="loss"))


def reference(model, windows, skip, lr=0.05):
    """Plain torch: SGD with momentum on the mean gradient of each window not in ``skip``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for w, window in enumerate(windows):
        if w in skip:
            continue
        opt.zero_grad()
        for x, y in window:
            (F.mse_loss(model(x), y) / K).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def test_functional_guard_skips_the_window_with_a_bad_micro_batch():
    model = make_model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = guarded()
    state = tx.init(params)

    def loss_fn(p, x, y):
        return F.mse_loss(functional_call(model, p, (x,)), y)

    skipped = []
    for w, window in enumerate(micro_batches()):
        for x, y in window:
            grads, loss = grad_and_value(loss_fn)(params, x, y)
            updates, state = tx.update(grads, state, params, loss=loss)
            params = gtx.apply_updates(params, updates)
        if bool(state[1].skipped):
            skipped.append(w)
        # The guard judged the window's mean loss, which the window's state also holds.
        assert float(state[1].value) == pytest.approx(float(state[0].last_loss), rel=1e-6)
    assert skipped == [BAD_WINDOW]
    assert_trees_close(params, reference(make_model(), micro_batches(), {BAD_WINDOW}), rtol=1e-5, atol=1e-6)


def test_wrapper_guard_skips_the_window_with_a_bad_micro_batch():
    model = make_model()
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        gtx.chain(gtx.accumulate(K), gtx.skip_spikes(gtx.identity(), warmup_steps=5, metric="loss")),
    )
    skipped, total = [], 0
    for w, window in enumerate(micro_batches()):
        for x, y in window:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
        if int(opt.metrics["skipped"]) > total:  # the metric counts the skipped steps so far
            skipped.append(w)
            total = int(opt.metrics["skipped"])
    assert skipped == [BAD_WINDOW]
    got = {k: v.detach() for k, v in model.named_parameters()}
    assert_trees_close(got, reference(make_model(), micro_batches(), {BAD_WINDOW}), rtol=1e-5, atol=1e-6)


def test_window_loss_is_the_mean_or_the_token_mean_of_the_micro_step_losses():
    params = {"w": torch.zeros(3)}
    losses = [1.0, 4.0, 2.5]
    tokens = [2, 5, 3]
    seen = []

    def record(updates, state, params=None, **extra):
        seen.append(extra.get("loss"))
        return updates, state

    spy = gtx.GradientTransformation(lambda p: gtx.EmptyState(), record)
    for token_weighted in (False, True):
        seen.clear()
        tx = gtx.chain(gtx.accumulate(3, token_weighted=token_weighted), spy)
        state = tx.init(params)
        for loss, n in zip(losses, tokens):
            extra = {"tokens": n} if token_weighted else {}
            _, state = tx.update({"w": torch.ones(3)}, state, params, loss=torch.tensor(loss), **extra)
        want = sum(losses) / sum(tokens) if token_weighted else sum(losses) / 3
        assert len(seen) == 1 and float(seen[0]) == pytest.approx(want)
        assert float(state[0].last_loss) == pytest.approx(want)


def test_a_window_nested_in_a_chain_hands_its_loss_on_as_a_flat_one_does():
    """chain(chain(accumulate, clip), guard): what follows the inner chain sees the window's loss, not the last one."""
    seen = []

    def record(updates, state, params=None, **extra):
        seen.append(float(extra["loss"]))
        return updates, state

    spy = gtx.GradientTransformation(lambda p: gtx.EmptyState(), record)
    flat = gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0), spy)
    nested = gtx.chain(gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0)), spy)
    for tx in (flat, nested):
        state = tx.init({"w": torch.zeros(2)})
        for loss in (1.0, 3.0):
            _, state = tx.update({"w": torch.ones(2)}, state, loss=torch.tensor(loss))
    assert seen == [2.0, 2.0]


def test_a_loss_given_on_some_micro_steps_only_is_their_mean():
    params = {"w": torch.zeros(2)}
    tx = gtx.accumulate(3)
    state = tx.init(params)
    for loss in (None, 3.0, 5.0):
        _, state = tx.update({"w": torch.ones(2)}, state, params, loss=loss)
    assert float(state.last_loss) == pytest.approx(4.0)


def test_a_bad_loss_raises_naming_it_and_leaves_the_state():
    params = {"w": torch.zeros(2)}
    tx = gtx.accumulate(2)
    state = tx.init(params)
    with pytest.raises(ValueError, match="loss must be a scalar"):
        tx.update({"w": torch.ones(2)}, state, params, loss=torch.ones(2))
    with pytest.raises(TypeError, match="loss"):
        tx.update({"w": torch.ones(2)}, state, params, loss="high")
    assert int(state.micro_step) == 0 and float(state.loss_sum) == 0.0


def test_a_nan_loss_given_as_a_number_is_data_as_a_nan_tensor_is():
    """A diverged micro-batch's loss.item() is NaN: the window takes it as it takes the NaN tensor, and the guard after
    it skips that window (a ValueError would stop the run on the very batch the guard is there for)."""
    params = {"w": torch.ones(3)}
    g = {"w": torch.full((3,), 0.5)}
    runs = {}
    nans = {"number": float("nan"), "numpy": np.float32("nan"), "tensor": torch.tensor(float("nan"))}
    for kind, nan in nans.items():
        tx = gtx.chain(gtx.accumulate(2), gtx.skip_spikes(gtx.sgd(0.1), metric="loss"))
        p, state = params, tx.init(params)
        for loss in (1.0, nan, 1.0, 1.0):  # the first window holds the NaN, the second does not
            updates, state = tx.update(g, state, p, loss=loss)
            p = gtx.apply_updates(p, updates)
        runs[kind] = (p, state)
    assert_trees_close(runs["number"], runs["tensor"], rtol=0, atol=0)
    assert_trees_close(runs["numpy"], runs["tensor"], rtol=0, atol=0)  # np.float32 is not a float: it raised
    assert torch.allclose(runs["number"][0]["w"], params["w"] - 0.1 * 0.5)  # the NaN window stepped nothing

"""TransformedOptimizer under torch.amp.GradScaler, against plain torch running torch's own AMP recipes.

On CPU in fp32, with a fixed power-of-two initial scale, scaling is exact, so the wrapper
and the reference must agree to rounding. One step gets an inf injected into a grad: it
must be skipped (params and optimizer state unchanged) and the scale must back off.
"""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal
from tests.test_wrapper_vs_torch_optim import batches, make_model

INIT_SCALE = 1024.0
MAX_NORM = 0.5

OPTS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def scaler(growth_interval=10_000):
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=growth_interval)


def inject_inf(model):
    model[0].weight.grad[0, 0] = float("inf")


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_gradscaler_clip_equals_torch_unscale_clip_step(opt_name):
    """torch's recipe: scale(loss).backward(); unscale_; clip_grad_norm_; step; update."""
    ref, ours = make_model(), make_model()
    ref_opt = OPTS[opt_name](ref.parameters())
    opt = gtx.TransformedOptimizer(OPTS[opt_name](ours.parameters()), gtx.clip_by_global_norm(MAX_NORM))
    ref_scaler, our_scaler = scaler(), scaler()
    bad_step = 2
    for i, (x, y) in enumerate(batches(6)):
        ref_scaler.scale(F.cross_entropy(ref(x), y)).backward()
        our_scaler.scale(F.cross_entropy(ours(x), y)).backward()
        if i == bad_step:
            inject_inf(ref)
            inject_inf(ours)
            before = params_of(ours)
            inner_before = copy.deepcopy(opt.optimizer.state_dict())
            tx_before = copy.deepcopy(opt.tx_state)
        ref_scaler.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()

        assert our_scaler.step(opt) is None  # torch's protocol: no closure, no loss
        our_scaler.update()
        opt.zero_grad()
        if i == bad_step:
            assert_trees_equal(params_of(ours), before)
            assert_trees_equal(opt.optimizer.state_dict()["state"], inner_before["state"])
            assert_trees_equal(opt.tx_state, tx_before)  # the clip state did not see the inf step
        else:
            # Clipping saw the unscaled grads: its norm is torch's after unscale_.
            torch.testing.assert_close(opt.metrics["grad_norm"], ref_norm, rtol=1e-5, atol=0)
        assert our_scaler.get_scale() == ref_scaler.get_scale()
        assert_trees_close(params_of(ours), params_of(ref), rtol=1e-5, atol=1e-6)
    assert our_scaler.get_scale() == INIT_SCALE / 2  # backed off once, at the inf step


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_gradscaler_keeps_a_hyperparameter_set_by_hand_as_a_python_number(opt_name):
    """inject_hyperparams takes a Python number set by hand in its state; GradScaler's steps, the skipped one
    included (the old state is kept leaf by leaf), run with it and match torch's unscale, clip, step recipe."""
    ref, ours = make_model(), make_model()
    ref_opt = OPTS[opt_name](ref.parameters())
    tx = gtx.inject_hyperparams(gtx.clip_by_global_norm)(max_norm=1.0)
    opt = gtx.TransformedOptimizer(OPTS[opt_name](ours.parameters()), tx)
    opt.tx_state[0].hyperparams["max_norm"] = MAX_NORM  # a float, not a tensor
    ref_scaler, our_scaler = scaler(), scaler()
    for i, (x, y) in enumerate(batches(4)):
        ref_scaler.scale(F.cross_entropy(ref(x), y)).backward()
        our_scaler.scale(F.cross_entropy(ours(x), y)).backward()
        if i == 1:
            inject_inf(ref)
            inject_inf(ours)
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        our_scaler.step(opt)
        our_scaler.update()
        opt.zero_grad()
        assert opt.tx_state[0].hyperparams["max_norm"] == MAX_NORM
        assert_trees_close(params_of(ours), params_of(ref), rtol=1e-5, atol=1e-6)
    assert our_scaler.get_scale() == ref_scaler.get_scale() == INIT_SCALE / 2


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_gradscaler_without_a_chain_scale_matches_torch(opt_name):
    """No clip: the wrapper is an identity around the inner optimizer, scaled or not."""
    ref, ours = make_model(), make_model()
    ref_opt = OPTS[opt_name](ref.parameters())
    opt = gtx.TransformedOptimizer(OPTS[opt_name](ours.parameters()), gtx.identity())
    ref_scaler, our_scaler = scaler(), scaler()
    for i, (x, y) in enumerate(batches(4)):
        for model, o, s in ((ref, ref_opt, ref_scaler), (ours, opt, our_scaler)):
            s.scale(F.cross_entropy(model(x), y)).backward()
            if i == 1:
                inject_inf(model)
            s.step(o)
            s.update()
            o.zero_grad()
        assert our_scaler.get_scale() == ref_scaler.get_scale()
        assert_trees_close(params_of(ours), params_of(ref), rtol=1e-6, atol=1e-7)


def _torch_accumulation_recipe(opt_name, data, k, bad, growth_interval=10_000):
    """torch's AMP + accumulation recipe: loss / k, step and update once per window, clip after unscale_."""
    model = make_model()
    opt = OPTS[opt_name](model.parameters())
    s = scaler(growth_interval)
    after_window = []
    for i, (x, y) in enumerate(data):
        s.scale(F.cross_entropy(model(x), y) / k).backward()
        if i == bad:
            inject_inf(model)
        if (i + 1) % k == 0:
            s.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            s.step(opt)
            s.update()
            opt.zero_grad()
            after_window.append((params_of(model), s.get_scale()))
    return after_window


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_gradscaler_every_micro_step_with_accumulate_equals_torch_recipe(opt_name):
    """The natural loop, scaler.step(opt); scaler.update() on every micro-step, with accumulate(k) in the chain."""
    k, windows = 3, 4
    data = batches(k * windows)
    bad = k + 1  # the middle micro-step of the second window
    expected = _torch_accumulation_recipe(opt_name, data, k, bad)

    model = make_model()
    opt = gtx.TransformedOptimizer(
        OPTS[opt_name](model.parameters()), gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(MAX_NORM))
    )
    s = scaler()
    got = []
    for i, (x, y) in enumerate(data):
        s.scale(F.cross_entropy(model(x), y)).backward()  # no / k: gradtx divides by the real count
        if i == bad:
            inject_inf(model)
        s.step(opt)
        s.update()
        assert opt.emitted == ((i + 1) % k == 0)
        opt.zero_grad()
        if opt.emitted:
            got.append((params_of(model), s.get_scale()))
    assert len(got) == windows
    for (p_got, scale_got), (p_ref, scale_ref) in zip(got, expected):
        assert_trees_close(p_got, p_ref, rtol=1e-5, atol=1e-6)
        assert scale_got == scale_ref
    assert_trees_equal(got[1][0], got[0][0])  # the window with the inf was skipped
    assert got[-1][1] == INIT_SCALE / 2


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_gradscaler_only_on_emitting_micro_steps_with_accumulate(opt_name):
    """torch's recipe verbatim: scaler.step/update once per window; plain opt.step() on the others."""
    k, windows = 2, 3
    data = batches(k * windows)
    bad = 2  # the first micro-step of the second window
    expected = _torch_accumulation_recipe(opt_name, data, k, bad)
    model = make_model()
    opt = gtx.TransformedOptimizer(
        OPTS[opt_name](model.parameters()), gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(MAX_NORM))
    )
    s = scaler()
    got = []
    for i, (x, y) in enumerate(data):
        s.scale(F.cross_entropy(model(x), y)).backward()
        if i == bad:
            inject_inf(model)
        if opt.emits_next():
            s.step(opt)
            s.update()
            got.append((params_of(model), s.get_scale()))
        else:
            opt.step()
        opt.zero_grad()
    for (p_got, scale_got), (p_ref, scale_ref) in zip(got, expected, strict=True):
        assert_trees_close(p_got, p_ref, rtol=1e-5, atol=1e-6)
        assert scale_got == scale_ref


def test_gradscaler_scale_change_inside_a_window_skips_it():
    """Growth between micro-steps mixes two scales in .grad: that window is skipped, not applied wrong."""
    k = 3
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(k))
    s = scaler(growth_interval=2)  # grows after the 2nd update: inside the first window
    before = params_of(model)
    for x, y in batches(k):
        s.scale(F.cross_entropy(model(x), y)).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert opt.emitted and not opt.window_open
    assert_trees_equal(params_of(model), before)
    assert all(p.grad is None for p in model.parameters())  # the next window starts clean


def test_unscale_on_a_held_micro_step_is_refused():
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(2))
    s = scaler()
    x, y = batches(1)[0]
    s.scale(F.cross_entropy(model(x), y)).backward()
    s.unscale_(opt)
    with pytest.raises(ValueError, match=r"unscale_\(opt\) was called on a micro-step that does not emit"):
        s.step(opt)


def test_gradscaler_with_apply_if_finite_counts_only_its_own_skips():
    """GradScaler's inf is GradScaler's: apply_if_finite's counters and state stay as they were."""
    model = make_model()
    tx = gtx.apply_if_finite(gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.trace(0.9)), 3)
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), tx)
    s = scaler()
    for i, (x, y) in enumerate(batches(3)):
        s.scale(F.cross_entropy(model(x), y)).backward()
        if i == 1:
            inject_inf(model)
            state_before = copy.deepcopy(opt.tx_state)
        s.step(opt)
        s.update()
        opt.zero_grad()
        if i == 1:
            assert_trees_equal(opt.tx_state, state_before)
    assert int(opt.metrics["skipped"]) == 0
    assert s.get_scale() == INIT_SCALE / 2


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_explicit_unscale_then_torch_clip_works_through_the_wrapper(opt_name):
    """A user who keeps torch's unscale_ + clip_grad_norm_ and wraps for other transforms gets torch's numbers."""
    ref, ours = make_model(), make_model()
    ref_opt = OPTS[opt_name](ref.parameters())
    opt = gtx.TransformedOptimizer(OPTS[opt_name](ours.parameters()), gtx.identity())
    ref_scaler, our_scaler = scaler(), scaler()
    for i, (x, y) in enumerate(batches(4)):
        for model, o, s in ((ref, ref_opt, ref_scaler), (ours, opt, our_scaler)):
            s.scale(F.cross_entropy(model(x), y)).backward()
            if i == 2:
                inject_inf(model)
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            s.step(o)
            s.update()
            o.zero_grad()
        assert our_scaler.get_scale() == ref_scaler.get_scale()
        assert_trees_close(params_of(ours), params_of(ref), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize(
    ("build", "declared"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), True),
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True), True),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2), False),
    ],
    ids=["adamw-fused", "sgd-fused", "adamw"],
)
def test_a_copy_takes_gradscalers_scale_as_the_original_does(how, build, declared):
    """GradScaler hands its scale to a wrapper around a fused optimizer, and to its copies: torch's copy of the
    inner optimizer drops the flag that says it is fused (its groups still say so)."""
    opt = gtx.TransformedOptimizer(build(list(make_model().parameters())), gtx.clip_by_global_norm(1.0))
    other = pickle.loads(pickle.dumps(opt)) if how == "pickle" else copy.deepcopy(opt)
    assert opt._step_supports_amp_scaling is other._step_supports_amp_scaling is declared


@pytest.mark.parametrize("opt_name", ["sgd_fused", "adamw_fused"])
def test_the_inner_optimizer_is_left_for_gradscaler_as_torch_leaves_it(opt_name):
    """A fused step through the wrapper hands the kernel grad_scale and found_inf as attributes of the inner
    optimizer; GradScaler, which multiplies a grad_scale it finds there into its own, must later step that
    optimizer (training on without the wrapper) exactly as one that was never wrapped."""
    ref, ours = make_model(), make_model()
    ref_opt = OPTS[opt_name](ref.parameters())
    inner = OPTS[opt_name](ours.parameters())
    opt = gtx.TransformedOptimizer(inner, gtx.clip_by_global_norm(MAX_NORM))
    opt.optimizer.register_step_pre_hook(lambda *a: None)  # so the wrapper steps through inner.step()
    (x, y), *rest = batches(3)
    F.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    ref_opt.step()
    ref_opt.zero_grad()
    F.cross_entropy(ours(x), y).backward()
    opt.step()
    opt.zero_grad()
    s_ref, s_ours = scaler(), scaler()
    for x, y in rest:
        for model, o, s in ((ref, ref_opt, s_ref), (ours, inner, s_ours)):
            s.scale(F.cross_entropy(model(x), y)).backward()
            s.step(o)
            s.update()
            o.zero_grad()
    assert_trees_close(params_of(ours), params_of(ref), rtol=1e-5, atol=1e-6)

"""TransformedOptimizer against plain torch.optim loops."""

import copy
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def batches(n, seed=1, size=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g) * 3, torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


OPTS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_wrapper_clip_equals_torch_clip_then_step(opt_name):
    ref, ours = make_model(), make_model()
    ref_opt = OPTS[opt_name](ref.parameters())
    opt = gtx.TransformedOptimizer(OPTS[opt_name](ours.parameters()), gtx.clip_by_global_norm(0.5))
    for x, y in batches(15):
        F.cross_entropy(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        assert opt.step() is None  # torch's protocol: the closure's loss, or None
        assert opt.emitted
        torch.testing.assert_close(opt.metrics["grad_norm"], ref_norm, rtol=1e-5, atol=0)
        opt.zero_grad()
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_wrapper_accumulation_equals_torch_loop_with_scaled_loss(opt_name):
    k = 4
    ref, ours = make_model(), make_model()
    ref_opt = OPTS[opt_name](ref.parameters())
    opt = gtx.TransformedOptimizer(
        OPTS[opt_name](ours.parameters()), gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(1.0))
    )
    data = batches(3 * k)
    structure = optree.tree_structure(opt.tx_state)
    for i, (x, y) in enumerate(data):
        (F.cross_entropy(ref(x), y) / k).backward()
        if (i + 1) % k == 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
        F.cross_entropy(ours(x), y).backward()  # no 1/k: gradtx normalises by the real count
        opt.step()
        stepped = opt.emitted
        assert stepped == ((i + 1) % k == 0)
        assert opt.window_open == (not stepped)
        opt.zero_grad()  # a no-op while the window is open: .grad is the accumulator
        # No second gradient-sized buffer: the transform's accumulator stays empty, and its structure the same.
        assert all(t.numel() == 0 for t in optree.tree_leaves(opt.tx_state[0][0].acc))
        assert optree.tree_structure(opt.tx_state) == structure
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-5, atol=1e-6)


def test_wrapper_token_weighted_equals_full_batch_token_mean():
    k = 3
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.5), gtx.accumulate(k, token_weighted=True))
    data = batches(k, size=10)
    masks = [torch.arange(10) < n for n in (10, 3, 0)]  # unequal valid counts, one micro-batch all padding
    x_all = torch.cat([x for x, _ in data])
    y_all = torch.cat([torch.where(m, y, -100) for (_, y), m in zip(data, masks)])
    F.cross_entropy(ref(x_all), y_all, ignore_index=-100).backward()
    ref_opt.step()
    for (x, y), m in zip(data, masks):
        y = torch.where(m, y, -100)
        F.cross_entropy(ours(x), y, ignore_index=-100, reduction="sum").backward()
        opt.step(tokens=int(m.sum()))
        opt.zero_grad()
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-5, atol=1e-7)
    assert int(opt.metrics["tokens"]) == 13


def test_fused_fold_equals_materialised_clip():
    a, b = make_model(), make_model()
    tx = gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(0.3))
    fused = gtx.TransformedOptimizer(torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True), tx)
    plain = gtx.TransformedOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2, fused=False, foreach=False), tx)
    for x, y in batches(8):
        for m, o in ((a, fused), (b, plain)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_trees_close(state_of(a), state_of(b), rtol=1e-5, atol=1e-7)


def test_lr_scheduler_drives_the_wrapper():
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.2), gtx.clip_by_global_norm(1.0))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert opt.param_groups is opt.optimizer.param_groups
    for x, y in batches(6):
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        F.cross_entropy(ours(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5**3)
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_resume_mid_window_matches_uninterrupted_run(fused):
    k = 3
    data = batches(4 * k)

    def build(model):
        tx = gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(0.5))
        return gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused), tx)

    def train(model, opt, steps):
        for x, y in steps:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    full = make_model()
    train(full, build(full), data)

    first = make_model()
    opt = build(first)
    train(first, opt, data[:7])  # stop in the middle of the third window
    assert opt.window_open
    checkpoint = copy.deepcopy({"model": first.state_dict(), "opt": opt.state_dict()})
    del first, opt

    resumed = make_model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    opt = build(resumed)
    opt.load_state_dict(checkpoint["opt"])
    train(resumed, opt, data[7:])
    assert_trees_equal(state_of(resumed), state_of(full))


def test_params_without_grads_are_skipped():
    model = make_model()
    unused = torch.nn.Parameter(torch.ones(4))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    params = list(model.parameters()) + [unused, frozen]
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(params, lr=0.1), gtx.clip_by_global_norm(1.0))
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.emitted
    assert unused.grad is None and torch.equal(unused, torch.ones(4)) and torch.equal(frozen, torch.ones(2))
    assert unused not in opt.optimizer.state


def test_metrics_has_the_logged_scalars():
    model = make_model()
    tx = gtx.chain(gtx.accumulate(2, token_weighted=True), gtx.apply_if_finite(gtx.clip_by_global_norm(1.0), 3))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tx)
    for x, y in batches(2):
        F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step(tokens=len(y))
    assert {"grad_norm", "clip_coef", "micro_step", "tokens", "skipped"} <= set(opt.metrics)
    assert int(opt.metrics["tokens"]) == 16 and int(opt.metrics["skipped"]) == 0


@pytest.mark.parametrize("fused", [False, True])
def test_non_finite_grads_skip_the_inner_step(fused):
    model = make_model()
    opt = gtx.TransformedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1, fused=fused),
        gtx.apply_if_finite(gtx.clip_by_global_norm(1.0), max_consecutive_errors=5),
    )
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    before = state_of(model)
    inner_before = copy.deepcopy(opt.optimizer.state_dict())
    F.cross_entropy(model(x), y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    opt.step()
    assert opt.emitted  # the step closed; fused: the kernel skipped it via found_inf, without a host sync
    assert_trees_equal(state_of(model), before)
    after = opt.optimizer.state_dict()
    for i, s in inner_before["state"].items():
        assert_trees_equal(dict(after["state"][i]), dict(s))
    assert int(opt.metrics["skipped"]) == 1


def test_wrapper_rejects_bad_arguments():
    model = make_model()
    with pytest.raises(TypeError, match="optimizer"):
        gtx.TransformedOptimizer(model.parameters(), gtx.identity())
    with pytest.raises(TypeError, match="tx"):
        gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "clip")
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.identity())
    with pytest.raises(ValueError, match="missing key 'param_groups'"):
        opt.load_state_dict({"state": {}})


@pytest.mark.parametrize("fused", [False, True])
def test_wrapper_requires_accumulate_first(fused):
    model = make_model()
    tx = gtx.chain(gtx.scale(0.5), gtx.accumulate(2))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, fused=fused), tx)
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="must be the first transform"):
        opt.step()
    assert_trees_equal([p.grad for p in model.parameters()], before)


def test_params_without_grads_in_an_accumulation_window():
    model = make_model()
    unused = torch.nn.Parameter(torch.ones(4))
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD([*model.parameters(), unused], lr=0.1),
        gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0)),
    )
    assert [len(g) for g in opt.param_tree()] == [5]
    for x, y in batches(2):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert unused.grad is None and torch.equal(unused, torch.ones(4))
    assert float(opt.metrics["grad_norm"]) > 0


def test_wrapper_skips_an_empty_token_window_and_starts_a_clean_one():
    ref, ours = make_model(), make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.5), gtx.accumulate(2, token_weighted=True))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (x0, y0), (x1, _), (x2, y2), (x3, y3) = batches(4)
    padded = torch.full_like(y0, -100)
    for x in (x0, x1):  # a window with no valid token
        F.cross_entropy(ours(x), padded, ignore_index=-100, reduction="sum").backward()
        opt.step(tokens=0)
        assert not opt.emitted
        opt.zero_grad()
    assert not opt.window_open and all(p.grad is None for p in ours.parameters())
    assert int(opt.metrics["empty_windows"]) == 1
    for x, y in ((x2, y2), (x3, y3)):
        F.cross_entropy(ours(x), y, reduction="sum").backward()
        opt.step(tokens=len(y))
        opt.zero_grad()
    F.cross_entropy(ref(torch.cat([x2, x3])), torch.cat([y2, y3])).backward()
    ref_opt.step()
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-5, atol=1e-7)


def test_load_state_dict_rejects_a_mismatched_state_and_clears_stale_grads():
    model = make_model()
    tx = gtx.chain(gtx.accumulate(2), gtx.trace(0.9))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tx)
    checkpoint = opt.state_dict()  # saved at a window boundary
    other = torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.GELU(), torch.nn.Linear(17, 3))
    other_opt = gtx.TransformedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), tx)
    with pytest.raises(ValueError, match=r"the checkpoint has shape \(16, 6\), this state \(17, 6\)"):
        other_opt.load_state_dict(checkpoint)
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()  # opens a window: .grad holds a partial sum
    assert opt.window_open
    opt.load_state_dict(checkpoint)
    assert not opt.window_open and all(p.grad is None for p in model.parameters())


# --- a drop-in torch.optim.Optimizer: closure, atomic steps, param groups, requires_grad, pickle ----------


def test_step_with_a_closure_follows_torch_protocol():
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), gtx.identity())
    calls = []
    for x, y in batches(3):

        def closure(model=ours, o=opt, x=x, y=y):
            calls.append(torch.is_grad_enabled())
            o.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        def ref_closure(x=x, y=y):
            ref_opt.zero_grad()
            loss = F.cross_entropy(ref(x), y)
            loss.backward()
            return loss

        with torch.no_grad():  # torch calls the closure under enable_grad even so
            loss = opt.step(closure)
        ref_loss = ref_opt.step(ref_closure)
        assert opt.emitted
        torch.testing.assert_close(loss, ref_loss)
    assert calls == [True, True, True]  # once per step
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="closure must be callable"):
        opt.step(1.0)


def test_closure_with_accumulate_is_refused_naming_the_alternative():
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(2))
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="accumulate_grad_batches|own gradient accumulation"):
        opt.step(lambda: F.cross_entropy(model(x), y).backward())
    assert all(p.grad is None for p in model.parameters())  # the closure never ran


def _boom_transform():
    """A plain user transform that raises when the step is given boom=True (after accumulate divided)."""

    def init_fn(params):
        return gtx.EmptyState()

    def update_fn(updates, state, params=None, *, boom=False, **extra):
        if boom:
            raise RuntimeError("boom")
        return updates, state

    return gtx.GradientTransformation(init_fn, update_fn)


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_that_raises_leaves_grads_and_state_as_they_were(fused):
    k = 2
    tx = gtx.chain(gtx.accumulate(k), _boom_transform(), gtx.trace(0.9), gtx.clip_by_global_norm(0.5))
    ref, ours = make_model(), make_model()
    ref_opt = gtx.TransformedOptimizer(torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused), tx)
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=fused), tx)
    for i, (x, y) in enumerate(batches(3 * k)):
        for model, o in ((ref, ref_opt), (ours, opt)):
            F.cross_entropy(model(x), y).backward()
        if i % k == k - 1:  # the emitting micro-step raises once, then is retried
            grads = [p.grad.clone() for p in ours.parameters()]
            tx_state = copy.deepcopy(opt.tx_state)
            inner = copy.deepcopy(opt.optimizer.state_dict())
            with pytest.raises(RuntimeError, match="boom"):
                opt.step(boom=True)
            assert_trees_equal([p.grad for p in ours.parameters()], grads)
            assert_trees_equal(opt.tx_state, tx_state)
            assert_trees_equal(opt.optimizer.state_dict()["state"], inner["state"])
            assert opt.window_open
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    assert_trees_equal(state_of(ours), state_of(ref))


@pytest.mark.parametrize("clip", [False, True])
def test_a_step_retried_after_the_inner_step_raised_equals_a_run_that_never_raised(clip):
    # A non-fused inner optimizer gets the window's mean (and the clip's coefficient) multiplied into .grad before
    # its step: when that step raised (here a step pre-hook), .grad stayed scaled and the retry scaled it again.
    k = 2
    tx = gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(0.5)) if clip else gtx.accumulate(k)
    ref, ours = make_model(), make_model()
    ref_opt = gtx.TransformedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), tx)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), tx)
    failing = []

    def hook(*_: Any) -> None:
        if failing:
            raise RuntimeError(failing.pop())

    opt.optimizer.register_step_pre_hook(hook)
    for i, (x, y) in enumerate(batches(3 * k)):
        for model, o in ((ref, ref_opt), (ours, opt)):
            F.cross_entropy(model(x), y).backward()
        if i % k == k - 1:  # the emitting micro-step raises once, then is retried
            grads = [p.grad.clone() for p in ours.parameters()]
            failing.append("pre-hook")
            with pytest.raises(RuntimeError, match="pre-hook"):
                opt.step()
            # The mean of 2 is divided back out exactly; a clip's coefficient to an ulp.
            assert_trees_close([p.grad for p in ours.parameters()], grads, rtol=1.2e-7 if clip else 0, atol=0)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-6 if clip else 0, atol=1e-9 if clip else 0)


def test_a_step_with_bad_extras_leaves_the_window_as_it_was():
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(2, token_weighted=True))
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y, reduction="sum").backward()
    state = copy.deepcopy(opt.tx_state)
    with pytest.raises(ValueError, match="tokens"):
        opt.step()  # token-weighted needs tokens=n
    assert_trees_equal(opt.tx_state, state)
    assert not opt.window_open
    opt.step(tokens=8)
    assert opt.window_open


def test_add_param_group_grows_the_transform_state():
    """clip + trace(0.9) + SGD equals clip_grad_norm_ + SGD(momentum=0.9), before and after a second group."""
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref[0].parameters(), lr=0.1, momentum=0.9)
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(ours[0].parameters(), lr=0.1), gtx.chain(gtx.clip_by_global_norm(0.5), gtx.trace(0.9))
    )
    for i, (x, y) in enumerate(batches(6)):
        if i == 3:
            ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 0.05})
            opt.add_param_group({"params": list(ours[2].parameters()), "lr": 0.05})
            assert [len(g) for g in opt.param_tree()] == [2, 2]
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]], 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        ref.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        opt.step()
        opt.zero_grad()
        ours.zero_grad()
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-5, atol=1e-6)


def test_add_param_group_is_refused_mid_window_and_behind_the_wrappers_back():
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), gtx.accumulate(2))
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match="window is open"):
        opt.add_param_group({"params": list(model[2].parameters())})
    assert len(opt.param_groups) == 1
    opt.optimizer.add_param_group({"params": list(model[2].parameters())})
    with pytest.raises(ValueError, match=r"opt.add_param_group \(the wrapper's\)"):
        opt.step()


def test_requires_grad_changes_after_wrapping_follow_torch():
    """Gradual unfreezing (frozen when wrapped, unfrozen later) and freezing later, against plain torch."""
    ref, ours = make_model(), make_model()
    for m in (ref, ours):
        m[0].weight.requires_grad_(False)
        m[0].bias.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(ours.parameters(), lr=1e-2), gtx.clip_by_global_norm(0.5))
    schedule = {2: lambda m: m[0].bias.requires_grad_(True), 4: lambda m: m[0].weight.requires_grad_(True),
                6: lambda m: m[2].bias.requires_grad_(False)}  # fmt: skip
    for i, (x, y) in enumerate(batches(8)):
        for model, o in ((ref, ref_opt), (ours, opt)):
            if i in schedule:
                schedule[i](model)
            F.cross_entropy(model(x), y).backward()
            if o is ref_opt:  # torch's recipe: clip over the params that have grads
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.5)
            o.step()
            o.zero_grad()
        assert_trees_close(state_of(ours), state_of(ref), rtol=1e-6, atol=1e-7)
    assert {id(p) for p in gtx_flat(opt.param_tree())} == {id(p) for p in ours.parameters()}


@pytest.mark.parametrize("fused", [False, True])
def test_a_param_frozen_when_wrapped_that_holds_a_grad_is_stepped_as_torch_steps_it(fused):
    """torch.optim steps every param with a grad, whatever its requires_grad: a grad left from before the freeze."""
    ref, ours = make_model(), make_model()
    x, y = batches(1, seed=5)[0]
    for model in (ref, ours):
        F.cross_entropy(model(x), y).backward()  # a grad from before the freeze (zero_grad(set_to_none=False) too)
        model[0].weight.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.5, fused=fused)
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.5, fused=fused), gtx.clip_by_global_norm(0.5)
    )
    for x, y in batches(4):
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.5)
        ref_opt.step()
        F.cross_entropy(ours(x), y).backward()
        opt.step()
        assert_trees_close(state_of(ours), state_of(ref), rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours[0].weight, make_model()[0].weight)  # it was stepped


@pytest.mark.parametrize("edit", ["append", "remove", "replace"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_params_added_to_or_taken_from_a_group_by_hand_are_stepped_as_torch_steps_them(opt_name, edit):
    """A model that grows a param appends it to a group's list (torch.optim steps it from its first grad); one taken
    out is no longer stepped, and one put in another's place is stepped instead of it. Against torch's accumulation
    recipe, clipping over the groups' params."""
    k = 2
    ref, ours = make_model(), make_model()
    grown = {id(m): torch.nn.Parameter(torch.ones(3)) for m in (ref, ours)}
    ref_opt = OPTS[opt_name](ref.parameters())
    opt = gtx.TransformedOptimizer(
        OPTS[opt_name](ours.parameters()), gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(0.5))
    )
    for i, (x, y) in enumerate(batches(8)):
        for model, o in ((ref, ref_opt), (ours, opt)):
            if i == 4 and edit == "append":
                o.param_groups[0]["params"].append(grown[id(model)])
            if i == 4 and edit == "remove":
                assert o.param_groups[0]["params"].pop(1) is model[0].bias
            if i == 4 and edit == "replace":  # the list keeps its length; the bias still gets grads, unstepped
                o.param_groups[0]["params"][1] = grown[id(model)]
            out = model(x) * grown[id(model)] if edit != "remove" and i >= 4 else model(x)
            if o is ref_opt:
                (F.cross_entropy(out, y) / k).backward()
                if (i + 1) % k == 0:
                    torch.nn.utils.clip_grad_norm_(o.param_groups[0]["params"], 0.5)
                    o.step()
                    o.zero_grad()
            else:
                F.cross_entropy(out, y).backward()
                o.step()
                o.zero_grad()
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-6, atol=1e-7)
    assert_trees_close(grown[id(ours)], grown[id(ref)], rtol=1e-6, atol=1e-7)
    assert [list(map(id, g)) for g in opt.param_tree()] == [list(map(id, opt.param_groups[0]["params"]))]


def test_a_param_taken_from_a_group_by_hand_then_add_param_group_leaves_the_transform():
    """add_param_group after a hand edit: the param taken out is neither clipped with the others nor saved."""
    ref, ours = make_model(), make_model()
    ref_opt = OPTS["sgd"](ref.parameters())
    opt = gtx.TransformedOptimizer(OPTS["sgd"](ours.parameters()), gtx.clip_by_global_norm(0.5))
    for model, o in ((ref, ref_opt), (ours, opt)):
        assert o.param_groups[0]["params"].pop(1) is model[0].bias
        o.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    for x, y in batches(3):
        for model, o in ((ref, ref_opt), (ours, opt)):
            F.cross_entropy(model(x), y).backward()
            if o is ref_opt:
                torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 0.5)
            o.step()
            o.zero_grad(set_to_none=False)  # the bias keeps a grad, stepped by neither
    assert_trees_close(state_of(ours), state_of(ref), rtol=1e-6, atol=1e-7)
    assert [list(map(id, g)) for g in opt.param_tree()] == [list(map(id, g["params"])) for g in opt.param_groups]
    assert len(opt.state_dict()["state"]) == 4  # every listed param (three of the model, the new one)


def gtx_flat(tree):
    return [p for group in tree for p in group]


def _picklable_init(params):
    return gtx.EmptyState()


def _picklable_halve(updates, state, params=None, **extra):
    return [[u * 0.5 for u in group] for group in updates], state


def test_pickle_round_trips_with_a_picklable_transform():
    import pickle

    data = batches(6)
    tx = gtx.GradientTransformation(_picklable_init, _picklable_halve)
    full = make_model()
    full_opt = gtx.TransformedOptimizer(torch.optim.AdamW(full.parameters(), lr=1e-2), tx)
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tx)
    for i, (x, y) in enumerate(data):
        if i == 3:
            model, opt = pickle.loads(pickle.dumps((model, opt)))
            assert opt.param_groups[0]["params"][0] is next(model.parameters())
        for m, o in ((full, full_opt), (model, opt)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_trees_equal(state_of(model), state_of(full))
    assert_trees_equal(copy.deepcopy(opt).optimizer.state_dict(), opt.optimizer.state_dict())


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_pickle_round_trips_with_gradtx_transforms_mid_window(how):
    """pickle.dumps(opt) as a user writes it: gradtx's own chain, an open accumulation window, a schedule."""
    import pickle

    def make_tx():
        lr = gtx.linear_schedule(1.0, 0.5, 4)
        return gtx.chain(
            gtx.accumulate(2), gtx.clip_by_global_norm(0.5), gtx.scale_by_learning_rate(lr, flip_sign=False)
        )

    data = batches(7)
    full = make_model()
    full_opt = gtx.TransformedOptimizer(torch.optim.AdamW(full.parameters(), lr=1e-2), make_tx())
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), make_tx())
    for i, (x, y) in enumerate(data):
        if i == 3:  # the window holds one micro-batch in .grad
            pair = (model, opt)
            model, opt = pickle.loads(pickle.dumps(pair)) if how == "pickle" else copy.deepcopy(pair)
            assert opt.param_groups[0]["params"][0] is next(model.parameters()) and opt.window_open
        for m, o in ((full, full_opt), (model, opt)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_trees_equal(state_of(model), state_of(full))
    assert_trees_equal(opt.tx_state, full_opt.tx_state)


def test_pickle_of_a_closure_transform_says_what_to_do():
    import pickle

    model = make_model()
    user_tx = gtx.GradientTransformation(lambda params: gtx.EmptyState(), lambda u, s, p=None, **e: (u, s))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), user_tx)
    with pytest.raises(TypeError, match=r"state_dict\(\).*deepcopy"):
        pickle.dumps(opt)
    clone = copy.deepcopy(opt)
    assert clone.optimizer is not opt.optimizer and clone.tx is opt.tx


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copy_with_its_lr_scheduler_trains_itself_not_the_original(how):
    """An lr scheduler patches opt.step with a wrapper of the original optimizer: a copy must not keep it."""
    import pickle

    def make():
        model = make_model()
        opt = gtx.TransformedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(0.5))
        )
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    data = batches(10)
    twin, twin_opt, twin_sched = make()
    model, opt, sched = make()
    original = state_of(model)
    for i, (x, y) in enumerate(data):
        if i == 3:  # mid-window
            trio = (model, opt, sched)
            model, opt, sched = pickle.loads(pickle.dumps(trio)) if how == "pickle" else copy.deepcopy(trio)
            original = state_of(trio[0])
        for m, o, s in ((twin, twin_opt, twin_sched), (model, opt, sched)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            if o.emitted:
                s.step()
            o.zero_grad()
    assert_trees_equal(state_of(model), state_of(twin))
    assert opt.param_groups[0]["lr"] == twin_opt.param_groups[0]["lr"] == 1e-2 * 0.5**2
    assert_trees_equal(state_of(trio[0]), original)  # the original did not move after the copy


@pytest.mark.parametrize(
    "opt_tx",
    [
        gtx.sgd(0.1),
        gtx.adamw(1e-2),
        gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adam(1e-3)),
        gtx.inject_hyperparams(gtx.adamw)(1e-2),  # built anew on every update, an optimizer all the same
        gtx.chain(gtx.clip_by_global_norm(1.0), gtx.inject_hyperparams(gtx.sgd)(lambda count: 0.1)),
        gtx.inject_hyperparams(gtx.muon)(0.02),
        gtx.apply_if_finite(gtx.adamw(1e-2), 5),  # inside another transform, as optax users write it
        gtx.chain(gtx.clip(1.0), gtx.masked(gtx.adam(1e-3), lambda groups: [[True for _ in g] for g in groups])),
        gtx.partition({"a": gtx.sgd(0.1), "b": gtx.identity()}, lambda groups: [["a" for _ in g] for g in groups]),
    ],
)
def test_an_optimizer_in_the_chain_is_refused_naming_it(opt_tx):
    """gtx.adamw's output is an update, not a gradient: the inner optimizer would step against it (ascent)."""
    model = make_model()
    with pytest.raises(TypeError, match=r"the chain holds gtx\.(sgd|adamw|adam|muon)\(\.\.\.\), an optimizer"):
        gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), opt_tx)

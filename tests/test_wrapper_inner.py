"""The inner optimizer: its stand-in state, SparseAdam, closure-driven inner optimizers (LBFGS), hooks, resets."""

import copy
import pickle
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

import gradtx as gtx
from gradtx.testing import assert_trees_close
from gradtx.wrapper.grads import needs_closure


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 5, generator=g), torch.randn(16, 2, generator=g)


def closure_of(model):
    """A closure that evaluates ``model`` on the data again, as LBFGS's step needs."""
    x, y = data()

    def closure():
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("name", ["adamw", "sgd", "rmsprop", "adagrad", "lbfgs", "hf_adafactor"])
def test_stand_ins_leave_the_optimizer_as_it_was_and_show_torchs_keys(name):
    from transformers.optimization import Adafactor

    build = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
        "lbfgs": lambda p: torch.optim.LBFGS(p, lr=0.1),
        # sizes its step itself (relative_step, lr=None), so lr 0 does not stop its weight decay
        "hf_adafactor": lambda p: Adafactor(p, weight_decay=0.1),
    }[name]
    model, ref = make_model(), make_model()
    opt, ref_opt = build(list(model.parameters())), build(list(ref.parameters()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapper = gtx.TransformedOptimizer(opt, gtx.identity())
    made = {p: {k: v for k, v in wrapper.state[p].items() if k != "gradtx"} for p in model.parameters()}
    assert_trees_close(dict(model.state_dict()), before, rtol=0, atol=0)  # no param moved
    assert all(p.grad is None for p in model.parameters())
    # untouched: the state it had (Adagrad makes its own in __init__), nothing more
    assert [set(opt.state.get(p, {})) for p in model.parameters()] == [
        set(ref_opt.state.get(p, {})) for p in ref.parameters()
    ]
    closure = closure_of(ref)
    if name != "lbfgs":
        closure()  # transformers' Adafactor calls a closure under no_grad
    ref_opt.step(closure if name == "lbfgs" else None)
    for p, q in zip(model.parameters(), ref.parameters()):  # the stand-ins have the keys torch's first step makes
        mine = set(made[p])
        theirs = set(ref_opt.state.get(q, {}))
        # LBFGS stops at once on zero grads: its stand-in has the counters, not the search history.
        assert mine <= theirs if name == "lbfgs" else mine == theirs


def test_lbfgs_with_a_clip_equals_lbfgs_whose_closure_clips():
    """The chain runs on the grads of every closure evaluation LBFGS makes."""
    # fp64: LBFGS's line search amplifies rounding, and gradtx's norm sums in another order than torch's
    x, y = (t.double() for t in data())
    ref = make_model().double()
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=5, history_size=4)

    def ref_closure():
        ref_opt.zero_grad()
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        return loss

    model = make_model().double()
    opt = gtx.TransformedOptimizer(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=4), gtx.clip_by_global_norm(0.05)
    )

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        ref_loss = ref_opt.step(ref_closure)
        loss = opt.step(closure)
        assert_trees_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
        assert_trees_close(dict(model.state_dict()), dict(ref.state_dict()), rtol=1e-9, atol=1e-12)
        assert opt.emitted
    assert opt.metrics["clip_coef"] < 1  # the clip did act
    with pytest.raises(TypeError, match="needs a closure"):
        opt.step()


def test_a_closure_driven_optimizer_refuses_accumulate_at_construction():
    model = make_model()
    with pytest.raises(ValueError, match=r"LBFGS.*gtx.accumulate"):
        gtx.TransformedOptimizer(
            torch.optim.LBFGS(model.parameters()), gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0))
        )


def test_needs_closure_reads_the_step_signature():
    p = [torch.nn.Parameter(torch.ones(2))]
    assert needs_closure(torch.optim.LBFGS(p))
    assert not needs_closure(torch.optim.AdamW(p))


def test_sparse_adam_wraps_and_steps_as_in_torch():
    """SparseAdam refuses dense grads: nothing may step it before the first backward (issue 27)."""

    def make():
        torch.manual_seed(0)
        return torch.nn.Embedding(10, 4, sparse=True)

    emb, ref = make(), make()
    opt = gtx.TransformedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1), gtx.identity())
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    assert "gradtx" in opt.state[emb.weight]  # asking for the state shows the transform's entry, and no stand-in
    for step in range(3):
        idx = torch.tensor([step, 3, 7])
        for m, o in ((emb, opt), (ref, ref_opt)):
            m(idx).pow(2).sum().backward()
            o.step()
            o.zero_grad()
        assert opt.emitted
    assert_trees_close(emb.weight.detach(), ref.weight.detach(), rtol=0, atol=0)
    assert_trees_close(
        {k: v for k, v in opt.state[emb.weight].items() if k != "gradtx"},
        dict(ref_opt.state[ref.weight]),
        rtol=0,
        atol=0,
    )


def test_step_hooks_on_the_wrapper_and_global_ones_run_as_torch_runs_them():
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(2))
    seen = []

    def pre(optimizer, args, kwargs):
        seen.append(("pre", optimizer is opt, kwargs))
        return args, {**kwargs, "flush": True}  # a pre hook may replace the step's arguments

    handles = [
        opt.register_step_pre_hook(pre),
        opt.register_step_post_hook(lambda optimizer, args, kwargs: seen.append(("post", kwargs))),
        register_optimizer_step_post_hook(lambda optimizer, *_: seen.append(("global", type(optimizer).__name__))),
    ]
    try:
        x, y = data()
        F.mse_loss(model(x), y).backward()
        opt.step()
    finally:
        for h in handles:
            h.remove()
    # the inner SGD's own step runs the global hook too, as it does without the wrapper
    assert seen == [
        ("pre", True, {}),
        ("global", "SGD"),
        ("post", {"flush": True}),
        ("global", "TransformedOptimizer"),
    ]
    assert opt.emitted  # the pre hook's flush=True reached the step: a window of 2 emitted after one micro-step


def test_state_dict_hooks_on_the_wrapper_run_as_torch_runs_them():
    """The four state-dict hooks torch.optim.Optimizer offers, registered on the wrapper and on a bare AdamW."""
    calls = {}
    for name in ("wrapper", "torch"):
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.1)
        opt = gtx.TransformedOptimizer(inner, gtx.clip_by_global_norm(1.0)) if name == "wrapper" else inner
        seen = calls[name] = []
        opt.register_state_dict_pre_hook(lambda o, seen=seen, opt=opt: seen.append(("sd_pre", o is opt)))
        opt.register_state_dict_post_hook(lambda o, sd, seen=seen: seen.append("sd_post") or {**sd, "note": 7})
        opt.register_load_state_dict_pre_hook(
            lambda o, sd, seen=seen: (
                seen.append(("load_pre", sd.get("note"))) or {k: v for k, v in sd.items() if k != "note"}
            )
        )
        opt.register_load_state_dict_post_hook(lambda o, seen=seen: seen.append("load_post"))
        x, y = data()
        F.mse_loss(model(x), y).backward()
        opt.step()
        sd = opt.state_dict()
        assert sd["note"] == 7  # what the post hook returned is the checkpoint
        opt.load_state_dict(sd)  # the load pre hook took "note" out again: a plain torch.optim dict loads
        assert "note" in sd  # the caller's dict is left as it was
    assert calls["wrapper"] == calls["torch"] == [("sd_pre", True), "sd_post", ("load_pre", 7), "load_post"]


RESETS = {
    "opt.state.clear()": lambda opt, params: opt.state.clear(),
    "opt.state = defaultdict(dict)": lambda opt, params: setattr(opt, "state", defaultdict(dict)),
    "opt.state[p] = {}": lambda opt, params: [opt.state.__setitem__(p, {}) for p in params],
    "del opt.state[p]": lambda opt, params: [opt.state.__delitem__(p) for p in params],
    "a new exp_avg": lambda opt, params: [opt.state[p].__setitem__("exp_avg", torch.zeros_like(p)) for p in params],
    # behind the wrapper's back: the inner optimizer's own state, as torch.optim code that holds it would write
    "a new exp_avg in opt.optimizer.state": lambda opt, params: [
        getattr(opt, "optimizer", opt).state[p].__setitem__("exp_avg", torch.zeros_like(p)) for p in params
    ],
}


def _adam_beside_torch(fused, at, change):
    """Six Adam steps through the wrapper (identity chain) and on a bare Adam, ``change(opt, model)`` before step
    ``at``: ``[(model, inner optimizer)]`` for the wrapper's run, then torch's."""
    runs = []
    for name in ("wrapper", "torch"):
        model = make_model()
        inner = torch.optim.Adam(model.parameters(), lr=0.05, fused=fused)
        opt = gtx.TransformedOptimizer(inner, gtx.identity()) if name == "wrapper" else inner
        x, y = data()
        for step in range(6):
            if step == at:
                change(opt, model)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, inner))
    return runs


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reset", list(RESETS))
def test_resetting_the_inner_state_midway_steps_as_torch_does(reset, fused):
    """The ways torch users reset or replace an optimizer's state, each done to the wrapper and to a bare Adam."""
    (model, inner), (ref, ref_inner) = _adam_beside_torch(
        fused, 3, lambda opt, model: RESETS[reset](opt, list(model.parameters()))
    )
    assert_trees_close(list(model.parameters()), list(ref.parameters()), rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_trees_close(dict(inner.state[p]), dict(ref_inner.state[q]), rtol=0, atol=0)


def _inner_only(state):
    return {p: {k: v for k, v in s.items() if k != "gradtx"} for p, s in state.items()}


RESTORES = {
    # the forum idiom after a load (discuss.pytorch.org/t/saving-and-loading-sgd-optimizer/2536): a no-op in torch
    "opt.state = defaultdict(dict, opt.state)": lambda opt: setattr(opt, "state", defaultdict(dict, opt.state)),
    "opt.state = a copy of it": lambda opt: setattr(opt, "state", defaultdict(dict, _inner_only(opt.state))),
    "opt.state.clear(); opt.state[p] = saved": lambda opt: [
        saved := _inner_only(opt.state),
        opt.state.clear(),
        [opt.state.__setitem__(p, s) for p, s in saved.items()],
    ],
    # the usual loop moving the state to the params' device: on a fresh optimizer (no state in torch) it stays fresh
    "state[k] = v.to(device)": lambda opt: [
        s.__setitem__(k, v.to(p.device)) for p, s in opt.state.items() for k, v in s.items() if torch.is_tensor(v)
    ],
}


@pytest.mark.parametrize("at", [0, 3])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("restore", list(RESTORES))
def test_a_state_assigned_through_opt_state_is_the_one_the_next_step_uses(restore, fused, at):
    """State written back through opt.state, into params whose inner state is empty (cleared first), is kept;
    on a fresh optimizer, what it shows before its first step is no state."""

    def reload_then_restore(opt, model):
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        RESTORES[restore](opt)

    (model, inner), (ref, ref_inner) = _adam_beside_torch(fused, at, reload_then_restore)
    assert_trees_close(list(model.parameters()), list(ref.parameters()), rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert int(inner.state[p]["step"]) == int(ref_inner.state[q]["step"]) == 6
        assert_trees_close(dict(inner.state[p]), dict(ref_inner.state[q]), rtol=0, atol=0)


def test_sparse_adam_behind_a_window_and_another_member_steps_on_the_window_mean():
    """SparseAdam's sparse grads pass a chain with no norm (accumulate, then identity) as torch would take them."""

    def make():
        torch.manual_seed(0)
        return torch.nn.Embedding(10, 4, sparse=True)

    emb, ref = make(), make()
    opt = gtx.TransformedOptimizer(
        torch.optim.SparseAdam(emb.parameters(), lr=0.1), gtx.chain(gtx.accumulate(2), gtx.identity())
    )
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for step in range(3):
        for micro in range(2):
            idx = torch.tensor([step, 3 + micro, 7])
            emb(idx).pow(2).sum().backward()
            opt.step()
            (ref(idx).pow(2).sum() / 2).backward()  # torch's own accumulation: each micro-batch's loss / k
        ref_opt.step()
        assert opt.emitted
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_trees_close(emb.weight.detach(), ref.weight.detach(), rtol=1e-6, atol=1e-7)


def test_reading_the_state_leaves_lbfgs_counters_as_torch_has_them():
    """LBFGS keeps its counters on its first param: making the other params' stand-ins must not advance them."""
    model, ref = make_model(), make_model()
    opt = gtx.TransformedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.1), gtx.identity())
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.1)
    opt.step(closure_of(model))
    ref_opt.step(closure_of(ref))
    opt.state_dict()
    dict(opt.state[list(model.parameters())[-1]])
    first, ref_first = next(iter(model.parameters())), next(iter(ref.parameters()))
    for key in ("func_evals", "n_iter"):
        assert opt.optimizer.state[first][key] == ref_opt.state[ref_first][key]


class _GroupCounting(torch.optim.Optimizer):
    """SGD that counts its steps in the param group, as timm's Lamb and Lars do."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * group["step"])
                    self.state[p]["seen"] = group["step"]


def test_stand_ins_leave_no_key_in_the_param_groups():
    model, ref = make_model(), make_model()
    opt = gtx.TransformedOptimizer(_GroupCounting(model.parameters()), gtx.identity())
    ref_opt = _GroupCounting(ref.parameters())
    opt.state_dict()  # a checkpoint template before the first step: the stand-ins are made
    assert opt.param_groups[0].keys() == ref_opt.param_groups[0].keys()
    x, y = data()
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert opt.param_groups[0]["step"] == ref_opt.param_groups[0]["step"] == 2
    assert_trees_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=0, atol=0)


@pytest.mark.parametrize(
    "build",
    [
        lambda ps: torch.optim.Adam(ps[:2], lr=0.1, fused=True),
        lambda ps: torch.optim.SGD(ps[:2], lr=0.1, momentum=0.9, fused=True),
    ],
    ids=["adam", "sgd"],
)
def test_a_group_added_unfused_to_a_fused_optimizer_steps_as_in_torch(build):
    """torch steps a group added with fused=False by its non-fused code: the clip cannot be its grad_scale.

    (A param that gets no grad takes the wrapper off its own Adam kernel call, onto ``optimizer.step()``.)"""
    model, ref = make_model(), make_model()
    unused = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    ps, ref_ps = [*model.parameters(), unused[0]], [*ref.parameters(), unused[1]]
    opt = gtx.TransformedOptimizer(build(ps), gtx.clip_by_global_norm(0.1))
    ref_opt = build(ref_ps)
    opt.add_param_group({"params": ps[2:], "fused": False})
    ref_opt.add_param_group({"params": ref_ps[2:], "fused": False})
    x, y = data()
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            F.mse_loss(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_trees_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_first_step_of_sgd_momentum_is_no_step(fused):
    """torch's fused SGD given found_inf on its first step leaves the momentum it made unwritten: the wrapper
    skips that step on the host, so the run equals SGD without the bad step."""
    model, ref = make_model(), make_model()
    build = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=fused)
    opt = gtx.TransformedOptimizer(build(model), gtx.apply_if_finite(gtx.identity(), max_consecutive_errors=5))
    ref_opt = build(ref)
    x, y = data()
    F.mse_loss(model(x), y).backward()
    next(iter(model.parameters())).grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_trees_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copies_leave_the_hooks_behind_as_torch_copies_do(how):
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(1.0))
    ref = torch.optim.SGD(make_model().parameters(), lr=0.1)
    for o in (opt, ref):
        o.register_step_pre_hook(lambda *a: None)  # a lambda: pickle cannot store it
        o.register_state_dict_post_hook(lambda *a: None)
    copies = [pickle.loads(pickle.dumps(o)) if how == "pickle" else copy.deepcopy(o) for o in (opt, ref)]
    hooks = [(len(c._optimizer_step_pre_hooks), len(c._optimizer_state_dict_post_hooks)) for c in copies]
    assert hooks[0] == hooks[1] == (0, 0)
    x, y = data()
    F.mse_loss(model(x), y).backward()
    copies[0].step()  # the copy steps with empty hook dicts


def test_fused_adam_with_a_complex_group_added_unfused_steps_as_in_torch():
    """The wrapper's own call of Adam's fused kernel is for fused groups only: complex params refuse it."""
    torch.manual_seed(0)
    w, z = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    ref_w, ref_z = (torch.nn.Parameter(t.detach().clone()) for t in (w, z))
    opt = gtx.TransformedOptimizer(torch.optim.Adam([w], lr=0.1, fused=True), gtx.identity())
    ref = torch.optim.Adam([ref_w], lr=0.1, fused=True)
    opt.add_param_group({"params": [z], "fused": False})
    ref.add_param_group({"params": [ref_z], "fused": False})
    for _ in range(3):
        for o, a, b in ((opt, w, z), (ref, ref_w, ref_z)):
            (a.square().sum() + (b * b.conj()).real.sum()).backward()
            o.step()
            o.zero_grad()
    assert torch.equal(w, ref_w) and torch.equal(z, ref_z)

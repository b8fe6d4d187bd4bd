"""A torch.compile'd training step that calls TransformedOptimizer.step(), against eager and plain torch."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.optim.optimizer import register_optimizer_step_pre_hook

import gradtx as gtx
from gradtx.testing import assert_trees_close

MAX_NORM = 0.5

OPTS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def run_wrapper(opt_name, tx, *, compiled, fullgraph=False, steps=4):
    model = make_model()
    opt = gtx.TransformedOptimizer(OPTS[opt_name](model.parameters()), tx)

    def optimizer_step():
        opt.step()
        opt.zero_grad()

    fn = torch.compile(optimizer_step, fullgraph=fullgraph) if compiled else optimizer_step
    history = []
    for x, y in batches(steps):
        F.cross_entropy(model(x), y).backward()
        fn()
        history.append((opt.emitted, {k: v.clone() for k, v in opt.metrics.items()}))
    return model, opt, history


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_fullgraph_step_equals_eager_and_keeps_state(opt_name):
    tx = gtx.chain(gtx.clip_by_global_norm(MAX_NORM), gtx.trace(0.9))
    eager_model, eager_opt, eager_history = run_wrapper(opt_name, tx, compiled=False)
    model, opt, history = run_wrapper(opt_name, tx, compiled=True, fullgraph=True)  # raises on any graph break
    assert graph_breaks() == 0
    assert_trees_close(params_of(model), params_of(eager_model), rtol=1e-5, atol=1e-6)
    # The transform state survived the graph: trace momentum and the logged norm are eager's.
    assert_trees_close(opt.tx_state, eager_opt.tx_state, rtol=1e-5, atol=1e-6)
    for (emitted, m), (eager_emitted, eager_m) in zip(history, eager_history):
        assert emitted and eager_emitted
        assert set(m) == {"grad_norm", "clip_coef"}
        assert_trees_close(m, eager_m, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_compiled_clip_step_equals_compiled_torch_recipe(opt_name):
    """Against plain torch: clip_grad_norm_ then the same inner optimizer, compiled the same way."""
    model, _, _ = run_wrapper(opt_name, gtx.clip_by_global_norm(MAX_NORM), compiled=True)
    ref = make_model()
    ref_opt = OPTS[opt_name](ref.parameters())

    @torch.compile
    def ref_step():
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()

    for x, y in batches(4):
        F.cross_entropy(ref(x), y).backward()
        ref_step()
    assert_trees_close(params_of(model), params_of(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_whole_training_step_breaks_no_more_than_plain_torch(opt_name):
    """forward + backward + step compiled: backward breaks the graph in torch itself; the wrapper adds none."""

    def count(build):
        torch._dynamo.reset()
        counters.clear()
        model = make_model()
        opt = build(model)

        @torch.compile
        def train_step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        for x, y in batches(3):
            train_step(x, y)
        return graph_breaks(), model

    ours, model = count(lambda m: gtx.TransformedOptimizer(OPTS[opt_name](m.parameters()), gtx.identity()))
    theirs, ref = count(lambda m: OPTS[opt_name](m.parameters()))
    assert ours <= theirs
    assert_trees_close(params_of(model), params_of(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_compiled_accumulation_equals_eager(opt_name):
    """accumulate's window is host-side control flow (graph breaks allowed); the numbers and state are eager's."""
    tx = gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(MAX_NORM))
    eager_model, eager_opt, eager_history = run_wrapper(opt_name, tx, compiled=False, steps=6)
    model, opt, history = run_wrapper(opt_name, tx, compiled=True, steps=6)
    assert [e for e, _ in history] == [e for e, _ in eager_history] == [False, True] * 3
    assert_trees_close(params_of(model), params_of(eager_model), rtol=1e-5, atol=1e-6)
    assert_trees_close(opt.metrics, eager_opt.metrics, rtol=1e-5, atol=1e-6)
    assert not opt.window_open


def test_compiled_step_runs_global_step_hooks_and_zero_grad_zeroes_every_group():
    """As eager: a global step pre-hook runs on each compiled step, and compiled zero_grad zeroes all groups' grads."""

    def run(compiled):
        model = make_model()
        first, second = list(model[0].parameters()), list(model[2].parameters())
        inner = torch.optim.SGD([{"params": first}, {"params": second, "lr": 0.05}], lr=0.1)
        opt = gtx.TransformedOptimizer(inner, gtx.clip_by_global_norm(MAX_NORM))
        calls = []
        handle = register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(type(o).__name__))
        try:

            def optimizer_step():
                opt.step()
                opt.zero_grad(set_to_none=False)

            step = torch.compile(optimizer_step) if compiled else optimizer_step
            for x, y in batches(2):
                F.cross_entropy(model(x), y).backward()
                step()
        finally:
            handle.remove()
        assert all(p.grad is not None and not p.grad.any() for p in first + second)
        return calls, params_of(model)

    eager_calls, eager_params = run(compiled=False)
    calls, params = run(compiled=True)
    assert calls == eager_calls and calls.count("TransformedOptimizer") == 2  # one a step (the inner SGD runs them too)
    assert_trees_close(params, eager_params, rtol=1e-5, atol=1e-6)

"""The step executor: a user's transform that knows nothing of it chains, folds where it can, and runs in the wrapper."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.nn.functional as F

import gradtx as gtx
from gradtx.testing import assert_donated_matches_pure, assert_trees_close


def centralize() -> gtx.GradientTransformation:
    """Gradient centralization: subtract each output unit's mean (a user's plain transform)."""

    def init(params):
        return gtx.EmptyState()

    def update(updates, state, params=None, **extra):
        def one(g):
            return g - g.mean(dim=tuple(range(1, g.ndim)), keepdim=True) if g.ndim > 1 else g

        return optree.tree_map(one, updates), state

    return gtx.GradientTransformation(init, update)


def halve_every_step() -> gtx.ScalarTransformation:
    """A user's scalar transform: multiplies by 0.5**t; built with scalar_transformation so it is folded."""

    def init(params):
        return torch.zeros((), dtype=torch.int64)

    def factor(updates, state, params=None, *, scale=None, **extra):
        return 0.5 ** state.to(torch.float32), state + 1

    return gtx.scalar_transformation(init, factor)


def _tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def test_plan_reads_the_structure():
    tx = gtx.chain(gtx.accumulate(2), centralize(), gtx.clip_by_global_norm(1.0), halve_every_step(), gtx.adamw(1e-2))
    plan = gtx.StepPlan.of(tx)
    assert plan.window is not None and plan.window.k == 2
    assert repr(plan) == (
        "StepPlan(window(k=2), GradientTransformation, scalar:ScalarTransformation, scalar:ScalarTransformation, "
        "terminal:OptimizerChain)"
    )
    assert gtx.StepPlan.of(tx) is plan  # built once per transform


def test_a_users_transforms_fold_and_fuse_in_a_donated_step(monkeypatch):
    from gradtx.optimizers import fused as fused_kernels

    fused = []
    original = fused_kernels.launch_for

    def spy(spec, state, updates, params, factor):
        fused.append(factor)
        return original(spec, state, updates, params, factor)

    monkeypatch.setattr(fused_kernels, "launch_for", spy)
    tx = gtx.chain(centralize(), gtx.clip_by_global_norm(0.5), halve_every_step(), gtx.adamw(1e-2, weight_decay=0.1))
    assert_donated_matches_pure(tx, _tree(0), [_tree(10 + step) for step in range(4)])
    # One fused launch per step, carrying clip coefficient * 0.5**t as one factor.
    assert len(fused) == 4 and all(f is not None and f.ndim == 0 for f in fused)


def _loss(params, model, x, y):
    names = [n for n, _ in model.named_parameters()]
    return F.cross_entropy(torch.func.functional_call(model, dict(zip(names, params[0])), (x,)), y)


@pytest.mark.parametrize("fused", [False, True])
def test_a_users_transforms_run_in_the_wrapper_like_the_functional_chain(fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, fused=fused),
        gtx.chain(centralize(), gtx.clip_by_global_norm(0.5), halve_every_step()),
    )
    tx = gtx.chain(centralize(), gtx.clip_by_global_norm(0.5), halve_every_step(), gtx.sgd(0.1))
    params = [[p.detach().clone() for p in ref.parameters()]]
    state = tx.init(params)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        grads = torch.func.grad(_loss)(params, ref, x, y)
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
    assert_trees_close([[p.detach() for p in model.parameters()]], params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: gtx.chain(gtx.clip(1.0), gtx.scale(0.5)),
        lambda: gtx.named_chain(("clip", gtx.clip_by_global_norm(1.0)), ("opt", gtx.sgd(0.1))),
        lambda: gtx.accumulate(2, token_weighted=True),
        lambda: gtx.adamw(1e-3),
    ],
)
def test_structural_transforms_survive_copy_and_deepcopy(make):
    tx = make()
    for clone in (copy.copy(tx), copy.deepcopy(tx)):
        assert type(clone) is type(tx)
        assert repr(gtx.StepPlan(clone)) == repr(gtx.StepPlan(tx))
        params = {"w": torch.ones(3)}
        grads = {"w": torch.full((3,), 2.0)}
        out, _ = clone.update(grads, clone.init(params), params, tokens=1, flush=True)
        expected, _ = tx.update(grads, tx.init(params), params, tokens=1, flush=True)
        assert_trees_close(out, expected)


def test_a_step_plan_lives_on_its_transform_and_does_not_keep_a_dropped_chain_alive():
    import gc
    import pickle
    import weakref

    from gradtx.runtime.executor import StepPlan

    comm = gtx.comm.LocalComm()  # what a transform holds (a process group's comm, say)
    tx = gtx.chain(gtx.accumulate(2, token_weighted=True, comm=comm), gtx.clip_by_global_norm(1.0), gtx.sgd(0.1))
    params = {"w": torch.ones(3)}
    params, _ = gtx.update_and_apply(tx, {"w": torch.ones(3)}, tx.init(params), params, donate=True, tokens=2)
    plan = StepPlan.of(tx)
    assert StepPlan.of(tx) is plan and plan.tx is tx  # built once per transform object
    copied = copy.copy(tx)
    assert StepPlan.of(copied) is not plan and StepPlan.of(copied).tx is copied  # a copy plans itself
    again = pickle.loads(pickle.dumps(tx))
    assert StepPlan.of(again).tx is again
    held = weakref.ref(comm)
    del tx, copied, plan, comm
    gc.collect()
    assert held() is None  # nothing module-level kept the chain (and what it holds) alive

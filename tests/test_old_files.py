"""Files written by gradtx 0.1.0 (pickled transforms, ``torch.save`` states, checkpoint dicts) load and step now.

The fixtures in ``tests/fixtures/v0_1_0/`` were written by ``tests/fixtures/make_v0_1_0.py`` on the 0.1.0
code. The reference for each is a transform built fresh by today's code from the same call, run over
the same gradients: the old file must step exactly as it does.
"""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal, without_added_fields

HERE = Path(__file__).resolve().parent / "fixtures"
OLD = HERE / "v0_1_0"
_spec = importlib.util.spec_from_file_location("make_v0_1_0", HERE / "make_v0_1_0.py")
assert _spec is not None and _spec.loader is not None
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

MORE = 4  # steps taken after loading


def _continue(tx, params, state, first_seed):
    for seed in range(first_seed, first_seed + MORE):
        updates, state = tx.update(make.grads(seed), state, params)
        params = gtx.apply_updates(params, updates)
    return params, without_added_fields(state)  # a 0.1.0 file cannot know the fields added since


def _fresh(name):
    build, steps = make.CASES[name]
    tx = build()
    params, state = make.run(tx, steps)
    return tx, params, state, steps


@pytest.mark.parametrize("name", sorted(make.CASES))
def test_an_old_pickled_transform_steps_as_a_fresh_one(name):
    old = pickle.loads((OLD / f"{name}.tx.pkl").read_bytes())
    tx, params, state, steps = _fresh(name)
    old_params, old_state = make.run(old, steps)
    assert_trees_equal(old_params, params)
    assert_trees_equal(_continue(old, old_params, old_state, steps), _continue(tx, params, state, steps))


@pytest.mark.parametrize("name", sorted(make.CASES))
def test_an_old_saved_state_steps_as_a_fresh_one(name):
    saved = torch.load(OLD / f"{name}.state.pt")  # weights_only=True: the state types are allow-listed
    tx, params, state, steps = _fresh(name)
    assert_trees_close(saved["params"], params, rtol=1e-6, atol=1e-8)  # saved by 0.1.0: rounding may differ
    expected = _continue(tx, params, state, steps)
    # fp32 rounding may differ between releases (a norm summed in another order): structure exact, values close
    assert_trees_close(_continue(tx, saved["params"], saved["state"], steps), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(make.CASES))
def test_an_old_checkpoint_dict_loads_and_steps_as_a_fresh_one(name):
    saved = torch.load(OLD / f"{name}.dcp.pt")
    tx, params, state, steps = _fresh(name)
    loaded = gtx.checkpoint.load_state_dict(saved, tx.init(params), params, tx=tx)
    expected = _continue(tx, params, state, steps)
    assert_trees_close(_continue(tx, params, loaded, steps), expected, rtol=1e-5, atol=1e-7)


def test_an_old_pickled_schedule_computes_what_a_fresh_one_does():
    old = pickle.loads((OLD / "schedule.pkl").read_bytes())
    fresh = make.SCHEDULE()
    for count in range(12):
        torch.testing.assert_close(old(torch.tensor(count)), fresh(torch.tensor(count)), rtol=0, atol=0)


def _restrict(new, old):
    """``new`` cut down to the keys ``old`` has."""
    if isinstance(old, dict):
        return {k: _restrict(new[k], v) for k, v in old.items()}
    return new


def test_an_old_wrapper_state_dict_loads_mid_window_and_steps_as_the_run_that_saved_it():
    saved = torch.load(OLD / "wrapper.pt")
    expected = make.wrapper_state_dict()  # today's code, the same recipe
    # Today's format holds everything 0.1.0's did, with the same values (it may hold more, e.g. has_grad).
    # To fp32 rounding: the fixture's grads came from another machine's matmul kernels.
    assert_trees_close(saved["optim"], _restrict(expected["optim"], saved["optim"]), rtol=1e-5, atol=1e-6)

    def resumed(sd):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        model.load_state_dict(sd["model"])
        opt = gtx.TransformedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(0.5)),
        )
        opt.load_state_dict(sd["optim"])
        assert opt.window_open
        for seed in range(3, 6):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return dict(model.state_dict())

    assert_trees_close(resumed(saved), resumed(expected), rtol=1e-5, atol=1e-7)

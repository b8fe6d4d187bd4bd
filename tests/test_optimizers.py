"""Tests for gradtx.optimizers.standard: parity with torch.optim, hand-worked numbers, errors, purity, dtypes, extras."""

from __future__ import annotations

import copy
import math

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradtx.core.base import EmptyState, ScalarTransformation
from gradtx.optimizers import (
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    adam,
    adamw,
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    sgd,
    trace,
)
from gradtx.transforms.averaging import ema
from gradtx.transforms.combine import apply_updates

STEPS = 100
RTOL = 1e-5
ATOL = 1e-6  # for elements near zero; params are O(0.1)


# --- models and data -------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.LayerNorm([4, 6, 6])
        self.head = nn.Linear(4 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x))).flatten(1))


def _data(model_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=gen) if model_name == "mlp" else torch.randn(256, 1, 6, 6, generator=gen)
    y = torch.randint(0, 4, (256,), generator=gen)
    return x, y


def _model(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if model_name == "mlp" else TinyConvNet()


def _batch(x: torch.Tensor, y: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = (step * 32) % x.shape[0]
    return x[i : i + 32], y[i : i + 32]


def _train_torch(model: nn.Module, make_opt, x, y, *, lr_lambda=None) -> dict[str, torch.Tensor]:
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    for step in range(STEPS):
        xb, yb = _batch(x, y, step)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _train_gradtx(model: nn.Module, tx, x, y) -> dict[str, torch.Tensor]:
    def loss_fn(params, xb, yb):
        return F.cross_entropy(torch.func.functional_call(model, params, (xb,)), yb)

    grad_fn = torch.func.grad(loss_fn)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    for step in range(STEPS):
        xb, yb = _batch(x, y, step)
        grads = grad_fn(params, xb, yb)
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
    return params


def _assert_trees_close(got, expected, *, rtol=RTOL, atol=ATOL) -> None:
    assert optree.tree_structure(got) == optree.tree_structure(expected)
    for path, g, e in zip(optree.tree_paths(expected), optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol, msg=lambda m, path=path: f"at {path}: {m}")


# --- parity with torch.optim over 100 steps ----------------------------------------------------

PARITY_CASES = {
    "sgd": (lambda: sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_momentum": (lambda: sgd(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "sgd_nesterov": (
        lambda: sgd(0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    ),
    "sgd_weight_decay": (
        lambda: sgd(0.1, weight_decay=1e-2),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-2),
    ),
    "sgd_momentum_weight_decay": (
        lambda: sgd(0.05, momentum=0.8, nesterov=True, weight_decay=5e-3),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=5e-3),
    ),
    "adam": (lambda: adam(1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)),
    "adam_hparams": (
        lambda: adam(3e-3, b1=0.8, b2=0.99, eps=1e-6),
        lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6),
    ),
    "adam_weight_decay": (
        lambda: adam(1e-3, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1),
    ),
    "adamw": (lambda: adamw(1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3)),
    "adamw_strong_decay": (
        lambda: adamw(2e-3, b1=0.85, b2=0.98, eps=1e-7, weight_decay=0.3),
        lambda p: torch.optim.AdamW(p, lr=2e-3, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.3),
    ),
    "adamw_no_decay": (lambda: adamw(1e-3, weight_decay=0.0), lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0)),
}


@pytest.mark.parametrize("model_name", ["mlp", "conv"])
@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_matches_torch_optim_over_100_steps(case: str, model_name: str) -> None:
    make_tx, make_opt = PARITY_CASES[case]
    x, y = _data(model_name)
    model = _model(model_name)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    ours = _train_gradtx(copy.deepcopy(model), make_tx(), x, y)
    ref = _train_torch(model, make_opt, x, y)
    _assert_trees_close(ours, ref)
    # The run must have moved the params, or the comparison proves nothing.
    assert all((ref[k] - start[k]).abs().max() > 1e-3 for k in ref)


def _warmup_decay_torch(step: int) -> float:
    return min(1.0, (step + 1) / 10) * 0.97**step


def _warmup_decay_gradtx(lr: float):
    # The same schedule written with tensor ops on the count, so no host sync.
    return lambda count: lr * torch.clamp((count + 1) / 10, max=1.0) * 0.97**count


SCHEDULE_CASES = {
    "sgd_momentum": (
        lambda: sgd(_warmup_decay_gradtx(0.1), momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "adamw": (
        lambda: adamw(_warmup_decay_gradtx(3e-3), weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
    ),
    "adam_weight_decay": (
        lambda: adam(_warmup_decay_gradtx(3e-3), weight_decay=0.05),
        lambda p: torch.optim.Adam(p, lr=3e-3, weight_decay=0.05),
    ),
}


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_scheduled_learning_rate_matches_lambda_lr(case: str) -> None:
    make_tx, make_opt = SCHEDULE_CASES[case]
    x, y = _data("mlp")
    model = _model("mlp")
    ours = _train_gradtx(copy.deepcopy(model), make_tx(), x, y)
    ref = _train_torch(model, make_opt, x, y, lr_lambda=_warmup_decay_torch)
    _assert_trees_close(ours, ref)


def test_constant_and_scheduled_learning_rate_differ() -> None:
    # Guards the schedule test: the schedule really changes the trajectory.
    x, y = _data("mlp")
    model = _model("mlp")
    constant = _train_gradtx(copy.deepcopy(model), sgd(0.1, momentum=0.9), x, y)
    scheduled = _train_gradtx(copy.deepcopy(model), sgd(_warmup_decay_gradtx(0.1), momentum=0.9), x, y)
    assert not torch.allclose(constant["fc1.weight"], scheduled["fc1.weight"], rtol=1e-3)


def test_schedule_sees_the_count_from_zero() -> None:
    seen = []

    def schedule(count: torch.Tensor) -> torch.Tensor:
        seen.append(count.clone())
        return 0.5**count

    tx = scale_by_schedule(schedule)
    grads = {"w": torch.tensor([8.0])}
    state = tx.init(grads)
    assert isinstance(state, ScaleByScheduleState)
    assert state.count.dtype == torch.int64 and state.count.ndim == 0
    outs = []
    for _ in range(3):
        u, state = tx.update(grads, state)
        outs.append(float(u["w"]))
    assert [int(c) for c in seen] == [0, 1, 2]
    assert outs == [8.0, 4.0, 2.0]
    assert int(state.count) == 3


def test_scheduled_learning_rate_flips_sign_and_accepts_python_numbers() -> None:
    grads = {"w": torch.tensor([1.0, -2.0])}
    tx = scale_by_learning_rate(lambda count: 0.25)
    u, _ = tx.update(grads, tx.init(grads))
    assert torch.equal(u["w"], torch.tensor([-0.25, 0.5]))
    tx = scale_by_learning_rate(lambda count: 0.25, flip_sign=False)
    u, _ = tx.update(grads, tx.init(grads))
    assert torch.equal(u["w"], torch.tensor([0.25, -0.5]))


# --- hand-worked numbers --------------------------------------------------------------------------


def test_scale_hand_worked() -> None:
    tx = scale(0.5)
    updates = {"a": torch.tensor([2.0, -4.0]), "b": (torch.tensor(3.0),)}
    out, state = tx.update(updates, tx.init(None))
    assert state == EmptyState()
    assert torch.equal(out["a"], torch.tensor([1.0, -2.0]))
    assert torch.equal(out["b"][0], torch.tensor(1.5))
    out, _ = scale(-3.0).update({"a": torch.tensor([1.0, -2.0])}, EmptyState())
    assert torch.equal(out["a"], torch.tensor([-3.0, 6.0]))


def test_scale_by_learning_rate_constant_hand_worked() -> None:
    g = {"w": torch.tensor([1.0, -2.0])}
    out, _ = scale_by_learning_rate(0.1).update(g, EmptyState())
    torch.testing.assert_close(out["w"], torch.tensor([-0.1, 0.2]))
    out, _ = scale_by_learning_rate(0.1, flip_sign=False).update(g, EmptyState())
    torch.testing.assert_close(out["w"], torch.tensor([0.1, -0.2]))


@pytest.mark.parametrize(
    ("nesterov", "expected"),
    [
        # trace_1 = g1 = 1; trace_2 = 0.5*1 + 2 = 2.5; trace_3 = 0.5*2.5 - 1 = 0.25
        (False, [1.0, 2.5, 0.25]),
        # updates are g + 0.5 * trace: 1 + 0.5, 2 + 1.25, -1 + 0.125
        (True, [1.5, 3.25, -0.875]),
    ],
)
def test_trace_hand_worked(nesterov: bool, expected: list[float]) -> None:
    tx = trace(0.5, nesterov=nesterov)
    state = tx.init({"w": torch.zeros(1)})
    got = []
    for g in (1.0, 2.0, -1.0):
        u, state = tx.update({"w": torch.tensor([g])}, state)
        got.append(float(u["w"]))
    assert got == expected
    assert isinstance(state, TraceState)
    assert float(state.trace["w"]) == 0.25


def test_add_decayed_weights_hand_worked() -> None:
    tx = add_decayed_weights(0.1)
    out, _ = tx.update({"w": torch.tensor([1.0, 1.0])}, tx.init(None), {"w": torch.tensor([10.0, -20.0])})
    torch.testing.assert_close(out["w"], torch.tensor([2.0, -1.0]))


def test_scale_by_adam_hand_worked() -> None:
    tx = scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)
    state = tx.init({"w": torch.zeros(2)})
    # Step 1: m = 0.1 g, v = 0.001 g^2, so the bias-corrected update is g / (|g| + eps).
    u, state = tx.update({"w": torch.tensor([2.0, -0.5])}, state)
    torch.testing.assert_close(u["w"], torch.tensor([2.0 / (2.0 + 1e-8), -0.5 / (0.5 + 1e-8)]))
    # Step 2 with g = 1: m = 0.9*0.2 + 0.1 = 0.28, v = 0.999*0.004 + 0.001 = 0.004996;
    # update = (0.28 / 0.19) / (sqrt(0.004996) / sqrt(1 - 0.999**2) + 1e-8).
    u, state = tx.update({"w": torch.tensor([1.0, 1.0])}, state)
    expected = (0.28 / 0.19) / (math.sqrt(0.004996) / math.sqrt(1 - 0.999**2) + 1e-8)
    torch.testing.assert_close(u["w"][0], torch.tensor(expected))
    assert int(state.count) == 2
    torch.testing.assert_close(state.mu["w"][0], torch.tensor(0.28))
    torch.testing.assert_close(state.nu["w"][0], torch.tensor(0.004996))


def test_scale_by_adam_with_zero_b1_is_rmsprop_like() -> None:
    tx = scale_by_adam(b1=0.0, b2=0.5, eps=0.0)
    state = tx.init({"w": torch.zeros(1)})
    u, state = tx.update({"w": torch.tensor([3.0])}, state)
    torch.testing.assert_close(u["w"], torch.tensor([1.0]))
    # v = 0.5*4.5 + 0.5*1 = 2.75 after g = 1; bias correction 1 - 0.25 = 0.75.
    u, state = tx.update({"w": torch.tensor([1.0])}, state)
    torch.testing.assert_close(u["w"], torch.tensor([1.0 / math.sqrt(2.75 / 0.75)]))


# --- bad hyperparameters ---------------------------------------------------------------------------

nan, inf = float("nan"), float("inf")

BAD_HPARAMS = [
    (scale, {"step_size": nan}, "step_size"),
    (scale, {"step_size": inf}, "step_size"),
    (scale_by_learning_rate, {"learning_rate": -0.1}, "learning_rate"),
    (scale_by_learning_rate, {"learning_rate": nan}, "learning_rate"),
    (scale_by_learning_rate, {"learning_rate": inf}, "learning_rate"),
    (scale_by_adam, {"b1": -0.1}, "b1"),
    (scale_by_adam, {"b1": 1.0}, "b1"),
    (scale_by_adam, {"b1": nan}, "b1"),
    (scale_by_adam, {"b2": 1.0}, "b2"),
    (scale_by_adam, {"b2": -1e-3}, "b2"),
    (scale_by_adam, {"b2": nan}, "b2"),
    (scale_by_adam, {"eps": -1e-8}, "eps"),
    (scale_by_adam, {"eps": nan}, "eps"),
    (add_decayed_weights, {"weight_decay": -0.1}, "weight_decay"),
    (add_decayed_weights, {"weight_decay": nan}, "weight_decay"),
    (trace, {"decay": -0.9}, "decay"),
    (trace, {"decay": nan}, "decay"),
    (sgd, {"learning_rate": -1.0}, "learning_rate"),
    (sgd, {"learning_rate": nan}, "learning_rate"),
    (sgd, {"learning_rate": 0.1, "momentum": -0.5}, "momentum"),
    (sgd, {"learning_rate": 0.1, "momentum": nan}, "momentum"),
    (sgd, {"learning_rate": 0.1, "nesterov": True}, "momentum"),
    (sgd, {"learning_rate": 0.1, "weight_decay": -1e-4}, "weight_decay"),
    (adam, {"learning_rate": -1e-3}, "learning_rate"),
    (adam, {"learning_rate": 1e-3, "b1": 1.0}, "b1"),
    (adam, {"learning_rate": 1e-3, "b2": 1.5}, "b2"),
    (adam, {"learning_rate": 1e-3, "eps": -1.0}, "eps"),
    (adam, {"learning_rate": 1e-3, "weight_decay": -0.1}, "weight_decay"),
    (adam, {"learning_rate": 1e-3, "weight_decay": nan}, "weight_decay"),
    (adamw, {"learning_rate": nan}, "learning_rate"),
    (adamw, {"learning_rate": 1e-3, "b1": nan}, "b1"),
    (adamw, {"learning_rate": 1e-3, "b2": -0.1}, "b2"),
    (adamw, {"learning_rate": 1e-3, "eps": nan}, "eps"),
    (adamw, {"learning_rate": 1e-3, "weight_decay": -0.01}, "weight_decay"),
]


@pytest.mark.parametrize(("factory", "kwargs", "arg"), BAD_HPARAMS, ids=lambda v: getattr(v, "__name__", None))
def test_bad_hyperparameters_raise_value_error(factory, kwargs, arg) -> None:
    if factory is trace and "decay" not in kwargs:
        kwargs = {"decay": 0.9, **kwargs}
    with pytest.raises(ValueError, match=rf"{factory.__name__}: .*{arg}"):
        factory(**kwargs)


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (scale, {"step_size": "0.1"}),
        (scale_by_learning_rate, {"learning_rate": None}),
        (scale_by_adam, {"b1": True}),
        (trace, {"decay": 0.9, "nesterov": 1}),
        (sgd, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": "yes"}),
        (scale_by_schedule, {"step_size_fn": 0.1}),
    ],
)
def test_wrong_hyperparameter_types_raise_type_error(factory, kwargs) -> None:
    with pytest.raises(TypeError, match=factory.__name__):
        factory(**kwargs)


def test_edge_hyperparameters_are_accepted() -> None:
    for tx in (
        scale(0.0),
        scale(-2.0),
        scale_by_learning_rate(0.0),
        scale_by_adam(b1=0.0, b2=0.0, eps=0.0),
        trace(0.0),
        add_decayed_weights(0.0),
        sgd(0.0),
        adamw(1e-3, weight_decay=0.0),
    ):
        assert tx.init({"w": torch.zeros(1)}) is not None


# --- errors on update ------------------------------------------------------------------------------

ALL_TRANSFORMS = {
    "scale": lambda: scale(0.5),
    "scale_by_learning_rate": lambda: scale_by_learning_rate(0.1),
    "scale_by_learning_rate_schedule": lambda: scale_by_learning_rate(lambda c: 0.1 * 0.9**c),
    "scale_by_schedule": lambda: scale_by_schedule(lambda c: 1.0 / (c + 1)),
    "scale_by_adam": lambda: scale_by_adam(),
    "add_decayed_weights": lambda: add_decayed_weights(0.1),
    "trace": lambda: trace(0.9),
    "trace_nesterov": lambda: trace(0.9, nesterov=True),
    "sgd": lambda: sgd(0.1),
    "sgd_full": lambda: sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda: adam(1e-3, weight_decay=1e-2),
    "adamw": lambda: adamw(1e-3),
    "adamw_schedule": lambda: adamw(lambda c: 1e-3 * 0.99**c, weight_decay=0.1),
    "ema": lambda: ema(0.9, debias=False),
    "ema_debias": lambda: ema(0.9),
}


def _tree(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layer": {"weight": torch.randn(3, 4, generator=gen), "bias": torch.randn(3, generator=gen)},
        "scalars": [torch.randn((), generator=gen)],
    }


@pytest.mark.parametrize("name", list(ALL_TRANSFORMS))
def test_update_with_none_state_raises(name: str) -> None:
    tx = ALL_TRANSFORMS[name]()
    with pytest.raises(ValueError, match="state is None"):
        tx.update(_tree(1), None, _tree(0))


@pytest.mark.parametrize(
    "factory", [scale_by_adam, lambda: trace(0.9), lambda: scale_by_schedule(lambda c: 1.0), lambda: scale(1.0)]
)
def test_update_with_another_transforms_state_raises(factory) -> None:
    tx = factory()
    other = scale_by_adam() if not isinstance(tx.init(_tree(0)), ScaleByAdamState) else trace(0.9)
    with pytest.raises(TypeError, match="expected state of type"):
        tx.update(_tree(1), other.init(_tree(0)), _tree(0))


@pytest.mark.parametrize("name", ["scale_by_adam", "trace", "add_decayed_weights", "sgd_full", "adam", "adamw"])
def test_mismatched_updates_structure_names_the_path(name: str) -> None:
    tx = ALL_TRANSFORMS[name]()
    params = _tree(0)
    state = tx.init(params)

    renamed = _tree(1)
    renamed["layer"]["scale"] = renamed["layer"].pop("weight")
    with pytest.raises(ValueError, match=r"\['layer'\]\['(scale|weight)'\]"):
        tx.update(renamed, state, params)

    reshaped = _tree(1)
    reshaped["layer"]["bias"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"\['layer'\]\['bias'\].*shape"):
        tx.update(reshaped, state, params)

    missing = _tree(1)
    del missing["scalars"]
    with pytest.raises(ValueError, match=r"\['scalars'\]"):
        tx.update(missing, state, params)


@pytest.mark.parametrize("name", ["add_decayed_weights", "sgd_full", "adam", "adamw"])
def test_weight_decay_without_params_raises(name: str) -> None:
    tx = ALL_TRANSFORMS[name]()
    with pytest.raises(ValueError, match="add_decayed_weights: .*params"):
        tx.update(_tree(1), tx.init(_tree(0)), None)


def test_non_tensor_leaf_raises_type_error_naming_the_path() -> None:
    tx = scale_by_adam()
    state = tx.init({"w": torch.zeros(2)})
    with pytest.raises(TypeError, match=r"\['w'\]"):
        tx.update({"w": [1.0, 2.0]}, state)


# --- purity and extras -----------------------------------------------------------------------------


def _snapshot(tree):
    return [(t, t.detach().clone(), t._version) for t in optree.tree_leaves(tree)]


def _assert_untouched(snapshot) -> None:
    for t, values, version in snapshot:
        assert t._version == version, "a tensor was mutated in place"
        assert torch.equal(t, values)


@pytest.mark.parametrize("name", list(ALL_TRANSFORMS))
def test_update_is_pure(name: str) -> None:
    tx = ALL_TRANSFORMS[name]()
    params = _tree(0)
    state = tx.init(params)
    for step in range(3):
        updates = _tree(10 + step)
        before = _snapshot((updates, state, params))
        new_updates, new_state = tx.update(updates, state, params, tokens=7, flush=False, unknown_extra=object())
        _assert_untouched(before)
        # Nothing handed out may share storage with the inputs or the new state.
        inputs = {t.untyped_storage().data_ptr() for t in optree.tree_leaves((updates, state, params))}
        kept = {t.untyped_storage().data_ptr() for t in optree.tree_leaves(new_state)}
        for u in optree.tree_leaves(new_updates):
            assert u.untyped_storage().data_ptr() not in kept
            assert u.untyped_storage().data_ptr() not in inputs
        state = new_state


@pytest.mark.parametrize("name", list(ALL_TRANSFORMS))
def test_update_is_deterministic_given_the_same_inputs(name: str) -> None:
    tx = ALL_TRANSFORMS[name]()
    params = _tree(0)
    state = tx.init(params)
    u1, s1 = tx.update(_tree(3), state, params)
    u2, s2 = tx.update(_tree(3), state, params)
    _assert_trees_close(u1, u2, rtol=0, atol=0)
    _assert_trees_close(s1, s2, rtol=0, atol=0)


SCALAR_TRANSFORMS = {
    "scale": (lambda: scale(-0.25), lambda step: -0.25),
    "scale_by_learning_rate": (lambda: scale_by_learning_rate(0.1), lambda step: -0.1),
    "scale_by_learning_rate_schedule": (
        lambda: scale_by_learning_rate(lambda c: 0.1 * 0.5**c),
        lambda step: -0.1 * 0.5**step,
    ),
}


@pytest.mark.parametrize("name", list(SCALAR_TRANSFORMS))
def test_exposed_factor_matches_the_pure_path(name: str) -> None:
    make_tx, factor_at = SCALAR_TRANSFORMS[name]
    tx = make_tx()
    assert isinstance(tx, ScalarTransformation)
    pure_state = factor_state = tx.init(_tree(0))
    for step in range(3):
        grads = _tree(20 + step)
        pure, pure_state = tx.update(grads, pure_state)
        _assert_trees_close(pure, optree.tree_map(lambda g, s=step: g * factor_at(s), grads))

        factor, factor_state = tx.factor(grads, factor_state)
        assert factor.ndim == 0
        torch.testing.assert_close(factor, torch.tensor(factor_at(step)), check_dtype=False)
        _assert_trees_close(
            optree.tree_map(lambda g, f=factor: (g * f.float()).to(g.dtype), grads), pure, rtol=0, atol=0
        )
    _assert_trees_close(factor_state, pure_state, rtol=0, atol=0)


# --- dtypes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["scale_by_adam", "trace", "trace_nesterov", "sgd_full", "adam", "adamw"])
def test_bf16_params_get_bf16_updates_and_fp32_moments(name: str) -> None:
    tx = ALL_TRANSFORMS[name]()
    params32 = _tree(0)
    params = optree.tree_map(lambda t: t.to(torch.bfloat16), params32)
    state, state32 = tx.init(params), tx.init(params32)
    for leaf in optree.tree_leaves(state):
        if leaf.is_floating_point():
            assert leaf.dtype == torch.float32
        else:
            assert leaf.dtype == torch.int64 and leaf.ndim == 0
    for step in range(3):
        grads = optree.tree_map(lambda t: t.to(torch.bfloat16), _tree(40 + step))
        updates, state = tx.update(grads, state, params)
        # The fp32 reference sees the same bf16 values, upcast.
        ref, state32 = tx.update(
            optree.tree_map(lambda t: t.float(), grads), state32, optree.tree_map(lambda t: t.float(), params)
        )
        for u, r in zip(optree.tree_leaves(updates), optree.tree_leaves(ref)):
            assert u.dtype == torch.bfloat16
            torch.testing.assert_close(u.float(), r, rtol=1e-2, atol=1e-2)
    for m in optree.tree_leaves(state):
        assert m.dtype in (torch.float32, torch.int64)
    if name in ("scale_by_adam", "trace", "trace_nesterov", "adamw"):
        # No bf16 arithmetic before the moments: they are exact fp32 arithmetic on the bf16 grads.
        _assert_trees_close(state, state32, rtol=0, atol=0)
    else:  # L2 decay adds bf16 params to bf16 grads in bf16 first, as torch.optim does
        _assert_trees_close(state, state32, rtol=1e-2, atol=1e-2)


def test_fp64_params_keep_fp64_moments() -> None:
    params = optree.tree_map(lambda t: t.double(), _tree(0))
    tx = scale_by_adam()
    state = tx.init(params)
    assert all(m.dtype == torch.float64 for m in optree.tree_leaves((state.mu, state.nu)))
    updates, state = tx.update(optree.tree_map(lambda t: t.double(), _tree(1)), state)
    assert all(u.dtype == torch.float64 for u in optree.tree_leaves(updates))


def test_bf16_sgd_with_scale_keeps_bf16() -> None:
    grads = {"w": torch.tensor([1.0, -3.0], dtype=torch.bfloat16)}
    out, _ = scale_by_learning_rate(0.5).update(grads, EmptyState())
    assert out["w"].dtype == torch.bfloat16
    assert torch.equal(out["w"], torch.tensor([-0.5, 1.5], dtype=torch.bfloat16))


def test_state_counts_are_0d_int_tensors_and_moments_mirror_params() -> None:
    params = _tree(0)
    state = scale_by_adam().init(params)
    assert state.count.dtype == torch.int64 and state.count.ndim == 0 and int(state.count) == 0
    assert optree.tree_structure(state.mu) == optree.tree_structure(params)
    assert optree.tree_structure(state.nu) == optree.tree_structure(params)
    assert all(m.shape == p.shape for m, p in zip(optree.tree_leaves(state.mu), optree.tree_leaves(params)))

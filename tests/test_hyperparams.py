"""inject_hyperparams against optax's, under torch.compile and in the wrapper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_pure, assert_trees_close, assert_trees_equal

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
jax.config.update("jax_platforms", "cpu")

STEPS = 12


def _problem(seed: int = 0, *, matrices: bool = True):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "b": (3,), "s": ()} if matrices else {"b": (5,), "c": (2,)}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) * (1 + 2 * (i % 3)) for k, s in shapes.items()} for i in range(STEPS)]
    return params, grads


def _j(tree):
    return {k: jnp.asarray(v.numpy()) for k, v in tree.items()}


def _t(tree):
    return {k: torch.from_numpy(np.array(v)) for k, v in tree.items()}


def _schedule(count):
    # Written once for both frameworks: count is a jax int32 or a torch int64 0-d array.
    return 0.05 * 0.9**count


CASES = [  # (alias, keyword arguments for both libraries, the hyperparameter changed mid-run, its new value)
    ("sgd", {"learning_rate": _schedule, "momentum": 0.9}, "momentum", 0.5),
    ("sgd", {"learning_rate": 0.1}, "learning_rate", 0.02),
    ("adam", {"learning_rate": _schedule, "b1": 0.8}, "b2", 0.9),
    ("adamw", {"learning_rate": _schedule, "weight_decay": 0.1}, "weight_decay", 0.5),
    ("adamw", {"learning_rate": 0.01, "weight_decay": 0.1}, "learning_rate", 0.003),
    ("lamb", {"learning_rate": 0.01, "weight_decay": 0.1}, "eps_root", 1e-2),  # its defaults all injected
]


@pytest.mark.parametrize("alias, kw, changed, new_value", CASES)
def test_inject_hyperparams_matches_optax_and_takes_changes_on_the_next_step(alias, kw, changed, new_value):
    params, grads = _problem()
    tx = gtx.inject_hyperparams(getattr(gtx, alias))(**kw)
    ref = optax.inject_hyperparams(getattr(optax, alias))(**kw)
    state, ref_state = tx.init(params), ref.init(_j(params))
    p, rp = params, _j(params)
    for i, g in enumerate(grads):
        if i == STEPS // 2:  # change one hyperparameter by name, in both
            state.hyperparams[changed] = torch.tensor(new_value)
            ref_state.hyperparams[changed] = jnp.asarray(new_value)
        updates, state = tx.update(g, state, p)
        ref_updates, ref_state = ref.update(_j(g), ref_state, rp)
        p, rp = gtx.apply_updates(p, updates), optax.apply_updates(rp, ref_updates)
        assert_trees_close(p, _t(rp), rtol=2e-5, atol=1e-6, msg=f"step {i}: ")
        for name, value in ref_state.hyperparams.items():
            if name not in state.hyperparams:  # optax has a few more (adam's eps_root, sgd's nesterov flag)
                continue
            assert float(state.hyperparams[name]) == pytest.approx(float(value), rel=1e-6), name
    assert int(state.count) == STEPS
    assert float(gtx.metrics(state)["learning_rate"]) == pytest.approx(float(ref_state.hyperparams["learning_rate"]))


def test_a_changed_value_is_used_on_the_next_step_only():
    params, grads = _problem()
    tx = gtx.inject_hyperparams(gtx.sgd)(learning_rate=0.1)
    state = tx.init(params)
    u1, state = tx.update(grads[0], state, params)
    assert_trees_close(u1, {k: -0.1 * v for k, v in grads[0].items()})
    state = state._replace(hyperparams={**state.hyperparams, "learning_rate": torch.tensor(0.5)})
    u2, state = tx.update(grads[1], state, params)
    assert_trees_close(u2, {k: -0.5 * v for k, v in grads[1].items()})
    assert float(gtx.metrics(state)["learning_rate"]) == 0.5


def test_a_scheduled_value_cannot_be_overridden_as_in_optax():
    params, grads = _problem()
    tx = gtx.inject_hyperparams(gtx.sgd)(learning_rate=lambda c: 0.1 * (c + 1))
    state = tx.init(params)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)  # the value the first update uses
    state.hyperparams["learning_rate"] = torch.tensor(9.0)
    u, state = tx.update(grads[0], state, params)
    assert_trees_close(u, {k: -0.1 * v for k, v in grads[0].items()})
    u, state = tx.update(grads[1], state, params)
    assert_trees_close(u, {k: -0.2 * v for k, v in grads[1].items()}, rtol=1e-6)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.2)


@pytest.mark.parametrize("max_norm", [0.5, 2.0])
def test_injected_clip_by_global_norm_matches_optax(max_norm):
    params, grads = _problem()
    tx = gtx.inject_hyperparams(gtx.clip_by_global_norm)(max_norm=max_norm)
    ref = optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=max_norm)
    state, ref_state = tx.init(params), ref.init(_j(params))
    for i, g in enumerate(grads):
        if i == 3:
            state.hyperparams["max_norm"] = torch.tensor(max_norm * 3)
            ref_state.hyperparams["max_norm"] = jnp.asarray(max_norm * 3)
        u, state = tx.update(g, state, params)
        ru, ref_state = ref.update(_j(g), ref_state)
        assert_trees_close(u, _t(ru), rtol=1e-5, atol=1e-7)
    assert float(gtx.metrics(state)["max_norm"]) == max_norm * 3
    assert "grad_norm" in gtx.metrics(state)  # the inner clip's own metrics still come through


def test_injected_adaptive_clip_matches_optax_in_torch_layout():
    params, grads = _problem(matrices=True)
    tx = gtx.inject_hyperparams(gtx.adaptive_clip)(clipping=0.05)
    ref = optax.inject_hyperparams(optax.adaptive_grad_clip)(clipping=0.05)

    def to_jax_layout(tree):  # optax's units are the last axis of an (in, out) matrix; ours dim 0 of (out, in)
        return {k: jnp.asarray(v.numpy().T if v.ndim == 2 else v.numpy()) for k, v in tree.items()}

    state, ref_state = tx.init(params), ref.init(to_jax_layout(params))
    for i, g in enumerate(grads):
        if i == 4:
            state.hyperparams["clipping"] = torch.tensor(0.5)
            ref_state.hyperparams["clipping"] = jnp.asarray(0.5)
        u, state = tx.update(g, state, params)
        ru, ref_state = ref.update(to_jax_layout(g), ref_state, to_jax_layout(params))
        ru = {k: np.array(v).T if v.ndim == 2 else np.array(v) for k, v in ru.items()}
        assert_trees_close(u, _t(ru), rtol=1e-5, atol=1e-7)


def test_values_are_checked_when_the_wrapper_is_called():
    with pytest.raises(ValueError, match="learning_rate must be >= 0"):
        gtx.inject_hyperparams(gtx.adamw)(-1.0)
    with pytest.raises(ValueError, match="b1 must be in"):
        gtx.inject_hyperparams(gtx.adam)(0.1, b1=1.5)
    with pytest.raises(ValueError, match="static_args"):
        gtx.inject_hyperparams(gtx.adam, static_args="nope")
    with pytest.raises(TypeError, match="inner_factory must be callable"):
        gtx.inject_hyperparams("adam")
    tx = gtx.inject_hyperparams(gtx.sgd)(0.1)
    state = tx.init({"w": torch.ones(2)})
    with pytest.raises(TypeError, match="expected state of type InjectHyperparamsState"):
        tx.update({"w": torch.ones(2)}, state.inner_state)
    with pytest.raises(ValueError, match=r"must hold \['learning_rate', 'momentum', 'weight_decay'\]"):
        tx.update({"w": torch.ones(2)}, state._replace(hyperparams={"learning_rate": torch.tensor(0.1)}))
    with pytest.raises(ValueError, match="0-d tensor"):
        bad = state._replace(hyperparams={**state.hyperparams, "learning_rate": torch.ones(2)})
        tx.update({"w": torch.ones(2)}, bad)


def test_which_arguments_are_injected():
    tx = gtx.inject_hyperparams(gtx.clip_by_global_norm)(1.0, norm_type=float("inf"))
    state = tx.init({"w": torch.ones(2)})
    assert set(state.hyperparams) == {"max_norm"}  # keyword-only structural options stay fixed
    tx = gtx.inject_hyperparams(gtx.sgd)(0.1, momentum=0.9, nesterov=True)
    assert set(tx.init({"w": torch.ones(2)}).hyperparams) == {"learning_rate", "momentum", "weight_decay"}
    tx = gtx.inject_hyperparams(gtx.adamw, static_args="mask")(0.1, mask=lambda p: {k: k != "b" for k in p})
    state = tx.init({"w": torch.ones(2), "b": torch.ones(2)})
    assert "mask" not in state.hyperparams and state.hyperparams["weight_decay"].dtype == torch.float32
    tx = gtx.inject_hyperparams(gtx.sgd)(0.1)
    assert tx.init({"w": torch.ones(2, dtype=torch.float64)}).hyperparams["learning_rate"].dtype == torch.float64


def test_an_argument_that_takes_no_tensor_says_to_make_it_static():
    """clip's max_delta is a number only: the error names static_args, and with it the transform is clip's own."""
    grads = {"w": torch.tensor([-3.0, 0.5, 2.0])}
    hint = r"clip: max_delta must be a number.*as a number and name it in static_args=\('max_delta',\)"
    with pytest.raises(TypeError, match=hint):
        gtx.inject_hyperparams(gtx.clip)(max_delta=1.0).init(grads)
    tx = gtx.inject_hyperparams(gtx.clip, static_args=("max_delta",))(max_delta=1.0)
    state = tx.init(grads)
    assert state.hyperparams == {}
    assert_trees_equal(tx.update(grads, state)[0], {"w": torch.tensor([-1.0, 0.5, 1.0])})


def test_an_injected_count_says_to_make_it_static():
    """A count (reduce_on_plateau's patience, injected from its default) takes no tensor: the error says the fix."""
    params = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match=r"reduce_on_plateau: patience must be an int.*static_args=\('patience',\)"):
        gtx.inject_hyperparams(gtx.reduce_on_plateau, static_args=("factor",))().init(params)
    with pytest.raises(TypeError, match=r"zclip: warmup_steps must be an int.*static_args=\('warmup_steps',\)"):
        gtx.inject_hyperparams(gtx.zclip, static_args=("alpha", "z_thresh", "max_grad_norm", "eps"))().init(params)


@pytest.mark.parametrize("factory", [gtx.adam, gtx.sgd])
def test_an_injected_default_weight_decay_needs_params_unless_static(factory):
    """The injected default weight_decay (0) may be changed in the state, so the L2 term stays and needs params."""
    params, grads = _problem()
    tx = gtx.inject_hyperparams(factory)(learning_rate=0.1)
    with pytest.raises(ValueError, match="needs params.*static_args"):
        tx.update(grads[0], tx.init(params))
    fixed = gtx.inject_hyperparams(factory, static_args="weight_decay")(learning_rate=0.1)
    ref = factory(0.1)
    state, ref_state = fixed.init(params), ref.init(params)
    for g in grads[:3]:
        updates, state = fixed.update(g, state)  # no params: as factory(0.1) runs
        ref_updates, ref_state = ref.update(g, ref_state)
        assert_trees_close(updates, ref_updates, rtol=1e-6, atol=1e-7)  # tensor betas: optax's arithmetic, to rounding


def test_injected_adamw_with_a_mask_matches_optax():
    params, grads = _problem()
    mask = {"w": True, "b": False, "s": False}
    tx = gtx.inject_hyperparams(gtx.adamw)(learning_rate=0.01, weight_decay=0.5, mask=mask)
    ref = optax.inject_hyperparams(optax.adamw)(learning_rate=0.01, weight_decay=0.5, mask=mask)
    state, ref_state = tx.init(params), ref.init(_j(params))
    p, rp = params, _j(params)
    for g in grads:
        u, state = tx.update(g, state, p)
        ru, ref_state = ref.update(_j(g), ref_state, rp)
        p, rp = gtx.apply_updates(p, u), optax.apply_updates(rp, ru)
    assert_trees_close(p, _t(rp), rtol=2e-5, atol=1e-6)


def test_pure_and_checkpointable(tmp_path):
    params, grads = _problem()
    tx = gtx.chain(
        gtx.inject_hyperparams(gtx.clip_by_global_norm)(1.0),
        gtx.inject_hyperparams(gtx.adamw)(_schedule, weight_decay=0.1),
    )
    _, state = assert_pure(tx, grads[0], params)
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt")  # weights_only, torch's default
    assert_trees_equal(loaded, state)
    a, _ = tx.update(grads[1], state, params)
    b, _ = tx.update(grads[1], loaded, params)
    assert_trees_equal(a, b)


def test_wrapper_with_an_injected_clip_matches_torch():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ref_model = torch.nn.Linear(4, 3)
    ref_model.load_state_dict(model.state_dict())
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.inject_hyperparams(gtx.clip_by_global_norm)(max_norm=0.5)
    )
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    max_norm = 0.5
    for i in range(8):
        if i == 4:  # change the clip threshold mid-run, by name
            max_norm = 0.05
            opt.tx_state[0].hyperparams["max_norm"] = torch.tensor(max_norm)  # tx_state: the wrapper's chain(tx)
        x = torch.randn(5, 4)
        for m in (model, ref_model):
            m.zero_grad()
            (m(x) ** 2).sum().mul(3).backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        ref_opt.step()
        opt.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"step {i}: {m}")
    assert float(opt.metrics["max_norm"]) == pytest.approx(0.05)


def test_compiled_step_has_no_graph_break_and_a_changed_value_does_not_recompile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    params, grads = _problem()
    tx = gtx.inject_hyperparams(gtx.adamw)(
        learning_rate=lambda c: 0.01 * torch.clamp((c + 1) / 4, max=1.0), weight_decay=0.1
    )

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return gtx.apply_updates(params, updates), state

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    state_c = state_e = tx.init(params)
    p_c = p_e = params
    for i, g in enumerate(grads):
        if i == 6:  # change a value between steps, in both runs
            for s in (state_c, state_e):
                s.hyperparams["weight_decay"] = torch.tensor(0.7)
        p_c, state_c = compiled(p_c, g, state_c)
        p_e, state_e = step(p_e, g, state_e)
        assert_trees_close(p_c, p_e, rtol=1e-5, atol=1e-7, msg=f"step {i}: ")
    assert sum(counters["graph_break"].values()) == 0
    assert len(compiles) == 1, f"recompiled: {len(compiles)} graphs"
    assert float(state_c.hyperparams["learning_rate"]) == pytest.approx(0.01)


def test_a_held_step_of_the_inner_transform_advances_no_schedule():
    """``inject_hyperparams`` around a chain that accumulates: a held micro-step is no step, as the schedule counts
    them; the same as injecting into the optimizer behind the window."""
    schedule = gtx.linear_schedule(0.1, 0.0, 4)
    outer = gtx.inject_hyperparams(lambda learning_rate: gtx.chain(gtx.accumulate(2), gtx.sgd(learning_rate)))(
        learning_rate=schedule
    )
    inner = gtx.chain(gtx.accumulate(2), gtx.inject_hyperparams(gtx.sgd)(learning_rate=schedule))
    params = {"w": torch.zeros(())}
    states = [outer.init(params), inner.init(params)]
    for step in range(4):
        grads = {"w": torch.tensor(float(step + 1))}
        (u_outer, states[0]), (u_inner, states[1]) = (
            tx.update(grads, s, params) for tx, s in zip((outer, inner), states)
        )
        if step % 2 == 0:
            assert u_outer is None and u_inner is None
        else:  # the window's mean times the schedule's value at the optimizer step (0, then 1)
            lr = 0.1 - 0.025 * (step // 2)
            assert float(u_outer["w"]) == pytest.approx(-lr * (2 * step + 1) / 2)
            assert_trees_equal(u_outer, u_inner)
    assert int(states[0].count) == 2


@pytest.mark.parametrize(
    "params_dtype, hyperparam_dtype, expected",
    [
        (torch.float64, None, torch.float64),
        (torch.float32, None, torch.float32),
        (torch.float64, torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("value", [0.1, 0])  # 0: an int (to stop), which became an int64 lr
def test_a_number_set_by_hand_keeps_the_dtype_init_gave(params_dtype, hyperparam_dtype, expected, value):
    """A Python number written into the state becomes a tensor of init's float dtype (fp64 for fp64 params, or
    hyperparam_dtype), not fp32: an fp64 run keeps 0.1 exact to fp64, as plain sgd(0.1) does. (An int64 one made
    the wrapper's checkpoint unloadable: 'the checkpoint has dtype torch.int64, this state torch.float32'.)"""
    params = {"w": torch.randn(5, dtype=params_dtype)}
    grads = {"w": torch.randn(5, dtype=params_dtype)}
    tx = gtx.inject_hyperparams(gtx.sgd, hyperparam_dtype=hyperparam_dtype)(learning_rate=0.5)
    state = tx.init(params)
    assert state.hyperparams["learning_rate"].dtype == expected
    state.hyperparams["learning_rate"] = value
    updates, state = tx.update(grads, state, params)
    assert state.hyperparams["learning_rate"].dtype == expected
    lr = torch.tensor(value, dtype=expected).to(params_dtype)
    torch.testing.assert_close(updates["w"], -lr * grads["w"], rtol=0, atol=0)


@pytest.mark.parametrize(("params_dtype", "hyperparam_dtype"), [(torch.float64, None), (torch.float32, torch.bfloat16)])
def test_a_tensor_set_by_hand_takes_inits_dtype_and_its_checkpoint_loads(params_dtype, hyperparam_dtype):
    """optax casts every float hyperparameter to hyperparam_dtype (else the params' dtype) at each update. A tensor set
    by hand kept its own (fp32 in an fp64 run, fp32 under hyperparam_dtype=bf16), and every later checkpoint failed to
    load into a fresh state: 'the checkpoint has dtype torch.float32, this state torch.float64'."""
    params = {"w": torch.randn(5, dtype=params_dtype)}
    tx = gtx.inject_hyperparams(gtx.sgd, hyperparam_dtype=hyperparam_dtype)(learning_rate=0.5)
    state = tx.init(params)
    expected = state.hyperparams["learning_rate"].dtype
    state.hyperparams["learning_rate"] = torch.tensor(0.1)  # fp32, torch's default
    updates, state = tx.update(params, state, params)
    assert state.hyperparams["learning_rate"].dtype == expected
    lr = torch.tensor(0.1).to(expected).to(params_dtype)  # optax's cast, then sgd's into the params' dtype
    torch.testing.assert_close(updates["w"], -lr * params["w"], rtol=0, atol=0)
    loaded = gtx.checkpoint.load_state_dict(gtx.checkpoint.state_dict(state, params), tx.init(params), params)
    assert_trees_equal(loaded, state)


def test_a_scheduled_value_written_by_hand_leaves_the_dtype_init_gave():
    """Writing a scheduled hyperparameter has no effect, as in optax; but update took the schedule's dtype from the
    value written, so after a number written there an fp64 run's lr was fp32 for good, and every later checkpoint
    failed to load: 'the checkpoint has dtype torch.float32, this state torch.float64'."""
    params = {"w": torch.randn(5, dtype=torch.float64)}
    tx = gtx.inject_hyperparams(gtx.sgd)(learning_rate=gtx.exponential_decay(0.1, 10, 0.5))
    state = tx.init(params)
    state.hyperparams["learning_rate"] = 0.05
    for step in range(3):
        updates, state = tx.update(params, state, params)
        assert state.hyperparams["learning_rate"].dtype == torch.float64
        lr = torch.tensor(0.1 * 0.5 ** (step / 10), dtype=torch.float32).to(torch.float64)  # the fp32 schedule's value
        torch.testing.assert_close(updates["w"], -lr * params["w"])
    loaded = gtx.checkpoint.load_state_dict(gtx.checkpoint.state_dict(state, params), tx.init(params), params)
    assert_trees_equal(loaded, state)


def test_a_number_set_by_hand_and_saved_before_the_next_update_loads(tmp_path):
    """optax users write numbers into the state. Saved before the next update made them tensors (set the lr at an
    epoch's end, save, resume), the checkpoint held a float where a fresh state holds a tensor and did not load:
    "global state '0/hyperparams/learning_rate': the checkpoint has a float, this state a tensor"."""
    torch.manual_seed(0)

    def make():
        model = torch.nn.Linear(3, 2).double()
        tx = gtx.inject_hyperparams(gtx.clip_by_global_norm)(max_norm=1)  # an int: int64 in the state
        return model, gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tx)

    _, opt = make()
    opt.tx_state[0].hyperparams["max_norm"] = 3  # an int for an int
    torch.save(opt.state_dict(), tmp_path / "a.pt")
    _, opt2 = make()
    opt2.load_state_dict(torch.load(tmp_path / "a.pt"))
    assert_trees_equal(opt2.tx_state, (opt.tx_state[0]._replace(hyperparams={"max_norm": torch.tensor(3)}),))

    params = {"w": torch.randn(5, dtype=torch.float64)}
    tx = gtx.inject_hyperparams(gtx.sgd)(learning_rate=0.5, momentum=0.9)
    state = tx.init(params)
    state.hyperparams["learning_rate"] = 0.1
    state.hyperparams["momentum"] = 0  # an int for a float: 0.0
    torch.save(gtx.checkpoint.state_dict(state, params), tmp_path / "b.pt")
    loaded = gtx.checkpoint.load_state_dict(torch.load(tmp_path / "b.pt"), tx.init(params), params)
    assert (
        loaded.hyperparams["learning_rate"].dtype == torch.float64 and float(loaded.hyperparams["learning_rate"]) == 0.1
    )
    for a, b in zip(tx.update(params, state, params), tx.update(params, loaded, params)):
        assert_trees_equal(a, b)  # resumed, it steps as the run it was saved from

    opt.tx_state[0].hyperparams["max_norm"] = (
        0.5  # a float for an int is refused: truncated to 0, it would stop the run
    )
    with pytest.raises(TypeError, match=r"'0/hyperparams/max_norm': the checkpoint has a float, this state a tensor"):
        opt2.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("later", [0.5, torch.tensor(0.5)])
def test_a_schedule_that_gives_an_int_then_a_float_is_not_truncated(later):
    """init stored the schedule's first value, an int, as int64; the later 0.5 was cast into that dtype: 0, and the
    run silently stopped. By hand: lr 1 for two steps, then 0.5 (as sgd with the same schedule, and optax)."""
    params = {"w": torch.tensor([1.0, -2.0])}
    tx = gtx.inject_hyperparams(gtx.sgd)(learning_rate=lambda count: 1 if count < 2 else later)
    state = tx.init(params)
    for lr in (1.0, 1.0, 0.5, 0.5):
        updates, state = tx.update(params, state, params)
        torch.testing.assert_close(updates["w"], -lr * params["w"], rtol=0, atol=0)


def test_an_update_without_params_keeps_the_dtype_init_gave():
    """init reads fp64 from the params; an update without params read the grads, where the fp64 param's grad was None,
    and made the hyperparameter fp32: the state changed dtype and its checkpoint no longer loaded into init's."""
    params = {"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2)}
    tx = gtx.inject_hyperparams(gtx.clip_by_global_norm)(max_norm=1.0)
    state = tx.init(params)
    assert state.hyperparams["max_norm"].dtype == torch.float64
    updates, state = tx.update({"a": None, "b": torch.full((2,), 3.0)}, state)
    assert state.hyperparams["max_norm"].dtype == torch.float64
    ref = torch.nn.Parameter(torch.zeros(2))
    ref.grad = torch.full((2,), 3.0)
    torch.nn.utils.clip_grad_norm_([ref], 1.0)  # torch's clip of the one grad there is
    torch.testing.assert_close(updates["b"], ref.grad)
    loaded = gtx.checkpoint.load_state_dict(gtx.checkpoint.state_dict(state, params), tx.init(params), params)
    assert_trees_equal(loaded, state)

"""accumulate: exactness against a full-batch step, gating, token weighting, flush, and errors."""

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal


def test_mean_of_1_2_3_4_emits_2_5_only_on_the_4th_step():
    tx = gtx.accumulate(4)
    state = tx.init({"w": torch.zeros(())})
    outs = []
    for v in (1.0, 2.0, 3.0, 4.0):
        out, state = tx.update({"w": torch.tensor(v)}, state)
        outs.append(out)
    assert outs[:3] == [None, None, None]
    assert float(outs[3]["w"]) == 2.5
    assert bool(state.emitted) and int(state.micro_step) == 0


def _lm_model(seed=0, vocab=11, dim=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Tanh(), torch.nn.Linear(dim, vocab))


def _batch(seed, n=16, seq=6, vocab=11, pad_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    y = torch.randint(0, vocab, (n, seq), generator=g)
    if pad_frac:
        y[torch.rand(n, seq, generator=g) < pad_frac] = -100
    return x, y


def _loss(model, params, x, y, reduction):
    logits = functional_call(model, params, (x,))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction=reduction)


def _loss_fn(model, x, y, reduction):
    return lambda p: _loss(model, p, x, y, reduction)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_plain_mean_over_k_microbatches_equals_full_batch_step():
    model = _lm_model()
    params = _params(model)
    x, y = _batch(1)
    k = 4
    full = grad(lambda p: _loss(model, p, x, y, "mean"))(params)
    tx = gtx.accumulate(k)
    state = tx.init(params)
    for xi, yi in zip(x.chunk(k), y.chunk(k)):
        out, state = tx.update(grad(_loss_fn(model, xi, yi, "mean"))(params), state)
    assert_trees_close(out, full, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_token_weighted_with_unequal_padding_then_optimizer_equals_full_batch_step(optimizer):
    model = _lm_model()
    params = _params(model)
    x, y = _batch(2, pad_frac=0.4)
    y[:4] = -100  # the first micro-batch is all padding: it must contribute zero, not NaN
    k = 4
    make = (lambda: gtx.sgd(0.1)) if optimizer == "sgd" else (lambda: gtx.adamw(1e-2, weight_decay=0.1))

    # Reference: one step on the token mean over the whole batch.
    ref_tx = make()
    full = grad(lambda p: _loss(model, p, x, y, "mean"))(params)
    ref_updates, _ = ref_tx.update(full, ref_tx.init(params), params)
    expected = gtx.apply_updates(params, ref_updates)

    tx = gtx.chain(gtx.accumulate(k, token_weighted=True), make())
    state = tx.init(params)
    new_params = params
    for i, (xi, yi) in enumerate(zip(x.chunk(k), y.chunk(k))):
        g = grad(_loss_fn(model, xi, yi, "sum"))(params)
        updates, state = tx.update(g, state, params, tokens=int((yi != -100).sum()))
        assert (updates is None) == (i < k - 1)
        new_params = gtx.apply_updates(new_params, updates)
    assert_trees_close(new_params, expected, rtol=1e-5, atol=1e-6)
    assert int(gtx.metrics(state)["tokens"]) == int((y != -100).sum())


def test_downstream_does_not_run_or_change_state_on_held_steps():
    calls = []

    def spy_update(updates, state, params=None, **extra):
        calls.append(extra)
        return updates, state + 1

    spy = gtx.GradientTransformation(lambda p: torch.zeros((), dtype=torch.int64), spy_update)
    tx = gtx.chain(gtx.accumulate(3), spy, gtx.adam(0.1))
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    init_adam = state[2]
    for step in range(2):
        updates, state = tx.update({"w": torch.ones(2)}, state, params)
        assert updates is None
    assert calls == [] and int(state[1]) == 0
    assert_trees_equal(state[2], init_adam)
    updates, state = tx.update({"w": torch.ones(2)}, state, params)
    assert updates is not None and len(calls) == 1 and int(state[1]) == 1
    assert gtx.apply_updates(params, None) is params


def test_flush_emits_a_short_window_normalised_by_its_real_size():
    tx = gtx.accumulate(4)
    state = tx.init({"w": torch.zeros(())})
    _, state = tx.update({"w": torch.tensor(1.0)}, state)
    out, state = tx.update({"w": torch.tensor(5.0)}, state, flush=True)
    assert float(out["w"]) == 3.0
    assert int(state.micro_step) == 0

    tok = gtx.accumulate(4, token_weighted=True)
    state = tok.init({"w": torch.zeros(())})
    _, state = tok.update({"w": torch.tensor(2.0)}, state, tokens=1)
    out, state = tok.update({"w": torch.tensor(6.0)}, state, tokens=3, flush=True)
    assert float(out["w"]) == 2.0  # (2 + 6) / (1 + 3)


def test_low_precision_grads_accumulate_in_fp32_and_emit_their_dtype():
    k = 64
    tx = gtx.accumulate(k)
    g = {"w": torch.full((8,), 1.0 + 2**-7, dtype=torch.bfloat16)}
    state = tx.init(g)
    for i in range(k - 1):
        _, state = tx.update({"w": g["w"] * (1 if i % 2 else -1) + 1}, state)
        assert state.acc["w"].dtype == torch.float32
    out, _ = tx.update({"w": g["w"] + 1}, state)
    assert out["w"].dtype == torch.bfloat16
    # Exact mean computed in fp64 from the same bf16 inputs, then rounded once to bf16.
    inputs = [(g["w"] * (1 if i % 2 else -1) + 1).double() for i in range(k - 1)] + [(g["w"] + 1).double()]
    assert_trees_equal(out["w"], (sum(inputs) / k).to(torch.bfloat16))


def test_accumulator_holds_no_memory_between_windows_and_keeps_its_structure():
    tx = gtx.accumulate(2)
    params = {"w": torch.zeros(1000)}
    state = tx.init(params)
    structure = optree.tree_structure(state)
    assert state.acc["w"].numel() == 0  # a placeholder: no buffer while no window is open
    _, state = tx.update({"w": torch.ones(1000)}, state)
    assert state.acc["w"].numel() == 1000 and state.acc["w"].dtype == torch.float32
    assert optree.tree_structure(state) == structure
    out, state = tx.update({"w": torch.ones(1000)}, state)
    assert out is not None and state.acc["w"].numel() == 0
    assert optree.tree_structure(state) == structure


def test_chain_state_structure_is_the_same_at_init_mid_window_and_after_emit():
    # A param with no gradient (None) in the window: the structure still holds, and the window emits None there.
    tx = gtx.chain(gtx.accumulate(3), gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2))
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    state = tx.init(params)
    structure = optree.tree_structure(state)
    outs = []
    for i in range(7):
        out, state = tx.update({"a": torch.full((3,), float(i + 1)), "b": None}, state, params)
        assert optree.tree_structure(state) == structure, f"step {i}"
        outs.append(out)
    emitted = [o for o in outs if o is not None]
    assert len(emitted) == 2 and all(o["b"] is None for o in emitted)
    # Against the hand-written loop: the mean of each window, clipped, then AdamW.
    ref = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.adamw(1e-2))
    ref_state = ref.init(params)
    for window in ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]):
        expected, ref_state = ref.update({"a": torch.full((3,), sum(window) / 3), "b": None}, ref_state, params)
    assert_trees_close(emitted[-1]["a"], expected["a"], rtol=1e-6, atol=1e-7)


def test_a_window_refuses_a_grad_it_holds_no_sum_of_and_adds_zeros_for_a_none_where_it_holds_one():
    tx = gtx.accumulate(3)
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    state = tx.init(params)
    _, state = tx.update({"a": torch.ones(3), "b": None}, state, params)
    with pytest.raises(ValueError, match=r"\['b'\]: unexpected"):
        tx.update({"a": torch.ones(3), "b": torch.ones(2)}, state, params)
    with pytest.raises(ValueError, match=r"\['a'\]: missing \(pass update\(\.\.\., params\)"):
        tx.update({"a": None, "b": None}, state)  # no params: no dtype for a's zeros
    # A micro-batch that does not reach "a" adds nothing to its sum, as autograd keeps a .grad: the reference is
    # three backward passes into .grad (the last not reaching "a") and their mean.
    xs, ys = torch.randn(3, 3), torch.randn(3, 2)
    ref = {n: p.clone().requires_grad_() for n, p in params.items()}
    state, outs = tx.init(params), []
    for i in range(3):
        p = {n: v.clone().requires_grad_() for n, v in params.items()}
        losses = [(ref["b"] * ys[i]).sum() ** 2, (p["b"] * ys[i]).sum() ** 2]
        if i < 2:
            losses = [loss + (q["a"] * xs[i]).sum() ** 2 for loss, q in zip(losses, (ref, p))]
        losses[0].backward()
        out, state = tx.update(
            dict(zip(p, torch.autograd.grad(losses[1], list(p.values()), allow_unused=True))), state, params
        )
        outs.append(out)
    assert outs[:2] == [None, None]
    assert_trees_close(outs[2], {n: v.grad / 3 for n, v in ref.items()}, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [0, -1])
def test_bad_k_raises(k):
    with pytest.raises(ValueError, match="k must be >= 1"):
        gtx.accumulate(k)


def test_k_must_be_an_int():
    with pytest.raises(TypeError, match="k must be an int"):
        gtx.accumulate(2.0)


@pytest.mark.parametrize(
    "tokens, err, match",
    [
        (None, ValueError, "needs update"),
        (-1, ValueError, ">= 0"),
        (2.5, ValueError, "whole number"),
        (torch.tensor(2.0), TypeError, "integer count"),
        (torch.tensor([1, 2]), ValueError, "scalar"),
        ("3", TypeError, "integer count"),
        (True, TypeError, "integer count"),
    ],
)
def test_bad_tokens_raise_and_leave_state_untouched(tokens, err, match):
    tx = gtx.accumulate(2, token_weighted=True)
    state = tx.init({"w": torch.zeros(2)})
    _, state = tx.update({"w": torch.ones(2)}, state, tokens=3)
    before = (state.micro_step.clone(), state.tokens.clone(), state.acc["w"].clone())
    with pytest.raises(err, match=match):
        tx.update({"w": torch.ones(2)}, state, tokens=tokens)
    assert_trees_equal((state.micro_step, state.tokens, state.acc["w"]), before)


def test_zero_token_window_is_skipped_not_nan():
    tx = gtx.chain(gtx.accumulate(2, token_weighted=True), gtx.sgd(0.1, momentum=0.9))
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    before = state[1]
    _, state = tx.update({"w": torch.zeros(2)}, state, params, tokens=0)
    out, state = tx.update({"w": torch.zeros(2)}, state, params, tokens=0)
    assert out is None  # no token mean exists: the window is skipped, nothing downstream moves
    assert int(state[0].micro_step) == 0 and int(gtx.metrics(state)["empty_windows"]) == 1
    assert_trees_equal(state[1], before)
    # The next window starts afresh and emits normally.
    _, state = tx.update({"w": torch.full((2,), 2.0)}, state, params, tokens=1)
    out, state = tx.update({"w": torch.full((2,), 4.0)}, state, params, tokens=2)
    assert_trees_close(out, {"w": torch.full((2,), -0.2)}, rtol=1e-6)


def test_shape_mismatch_names_the_path_on_every_micro_step():
    tx = gtx.accumulate(3)
    params = {"a": {"w": torch.zeros(2, 2)}}
    state = tx.init(params)
    # The first micro-step checks against the params; later ones against the open window's sum.
    with pytest.raises(ValueError, match=r"\['a'\]\['w'\].*\(2, 1\).*expected \(2, 2\)"):
        tx.update({"a": {"w": torch.zeros(2, 1)}}, state, params)
    _, state = tx.update({"a": {"w": torch.zeros(2, 2)}}, state)
    with pytest.raises(ValueError, match=r"\['a'\]\['w'\]"):
        tx.update({"a": {"w": torch.zeros(1)}}, state)


def test_integer_tensor_tokens_accepted():
    tx = gtx.accumulate(1, token_weighted=True)
    out, _ = tx.update({"w": torch.tensor(6.0)}, tx.init({"w": torch.zeros(())}), tokens=torch.tensor(3))
    assert float(out["w"]) == 2.0


def test_structure_mismatch_names_the_path():
    tx = gtx.accumulate(2)
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"\['c'\]"):
        tx.update({"a": torch.zeros(2), "c": torch.zeros(2)}, state, params)
    _, state = tx.update(params, state)
    with pytest.raises(ValueError, match=r"\['c'\]"):
        tx.update({"a": torch.zeros(2), "c": torch.zeros(2)}, state)
    with pytest.raises(ValueError, match="call init"):
        tx.update({"a": torch.zeros(2)}, None)


def test_transforms_before_accumulate_clip_each_micro_batch():
    grads = [{"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([0.3, 0.4])}]
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.accumulate(2))
    expected = {"w": (torch.tensor([3.0, 4.0]) / (5 + 1e-6) + torch.tensor([0.3, 0.4])) / 2}
    state = tx.init(grads[0])
    for g in grads:
        out, state = tx.update(g, state)
    assert_trees_close(out, expected, rtol=1e-6)

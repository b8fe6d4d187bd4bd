"""gradtx.wrapper.state_dict: the checkpoint format, and the state shown in opt.state."""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import gradtx as gtx
from gradtx.core import tree as tu
from gradtx.testing import assert_trees_close, assert_trees_equal


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(2)))
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.1),
        gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(0.5), gtx.trace(0.9)),
    )
    return model, opt


def micro_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    F.mse_loss(model(torch.randn(5, 4, generator=g)), torch.randn(5, 3, generator=g)).backward()
    opt.step()
    opt.zero_grad()


def test_opt_state_shows_the_transform_state_from_the_start():
    model, opt = make()
    params = list(model.parameters())
    assert set(opt.state) == set(params)  # before any step: what "state already exists" checks read
    for p in params:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "gradtx"}  # stand-ins for AdamW's own
    assert not opt.optimizer.state  # the inner optimizer is untouched: it initialises itself
    for seed in range(3):
        micro_step(model, opt, seed)
    # the entries are the live state's tensors: trace's buffer per param, the counters on the first
    trace = opt.tx_state[0][2].trace[0]
    for p, t in zip(params, trace):
        assert opt.state[p]["gradtx"]["0/2/trace"] is t
    assert int(opt.state[params[0]]["gradtx"]["global"]["0/0/micro_step"]) == 1


def test_a_view_of_opt_state_held_while_a_param_joins_still_shows_its_own_param():
    """opt.state[p] held across a step at which a param earlier in the groups joins the transform (unfrozen)."""
    model, opt = make()
    weight, bias = model[0].weight, model[0].bias
    weight.requires_grad_(False)
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), gtx.trace(0.9))
    micro_step(model, opt, 0)
    held = opt.state[bias]
    weight.requires_grad_(True)
    micro_step(model, opt, 1)  # the weight joins, ahead of the bias in the group
    assert [v.shape for v in held["gradtx"].values()] == [bias.shape]  # trace's buffer: the bias's, not the weight's
    assert_trees_equal(held["gradtx"], opt.state[bias]["gradtx"])


def test_the_saved_partial_sums_are_copies_and_a_missing_grad_stays_missing():
    model, opt = make()
    micro_step(model, opt, 0)
    sd = opt.state_dict()
    params = list(model.parameters())
    pid_unused = next(i for i, p in enumerate(params) if p is model.unused)
    weight = model[0].weight
    saved = sd["state"][next(i for i, p in enumerate(params) if p is weight)]["gradtx"]["0/0/acc"]
    assert torch.equal(saved, weight.grad) and saved.data_ptr() != weight.grad.data_ptr()
    assert float(sd["state"][pid_unused]["gradtx"]["has_grad"]) == 0.0
    model2, opt2 = make()
    opt2.load_state_dict(sd)
    assert model2.unused.grad is None and model2[0].weight.grad is not None
    assert_trees_equal(opt2.tx_state, opt.tx_state)


def test_a_checkpoint_before_the_first_step_resumes_as_a_fresh_run():
    """The stand-ins are saved marked as such: the resumed AdamW starts its own state, as the fresh run does."""
    model, opt = make()
    sd = opt.state_dict()
    assert all(float(s["gradtx"]["inner_fresh"]) == 1.0 for s in sd["state"].values())
    resumed_model, resumed = make()
    resumed.load_state_dict(sd)
    for seed in range(4):
        micro_step(model, opt, seed)
        micro_step(resumed_model, resumed, seed)
    assert_trees_close(dict(resumed_model.named_parameters()), dict(model.named_parameters()), rtol=0, atol=0)


def _elements(sd):
    return sum(t.numel() for s in sd["state"].values() for t in _tensors(s))


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


@pytest.mark.parametrize("fused", [False, True])
def test_a_checkpoint_between_windows_holds_nothing_gradient_sized(fused):
    """Issue 29: at a window boundary the wrapper saves AdamW's state and scalars, no partial sums."""
    model, ref = _mlp(), _mlp()
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused),
        gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0)),
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step % 2:
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert not opt.window_open
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    n_params = len(list(model.parameters()))
    # AdamW's own state, plus a handful of scalars per param (flags) and the global counters
    assert _elements(sd) - _elements(ref_sd) < 2 * n_params + 32
    # mid-window the partial sums are there (a copy of .grad), and the window resumes exactly
    x = torch.randn(16, 32, generator=g)
    F.mse_loss(model(x), torch.zeros(16, 8)).backward()
    opt.step()
    assert opt.window_open
    assert _elements(opt.state_dict()) >= _elements(ref_sd) + sum(p.numel() for p in model.parameters())


def test_a_run_resumed_after_gradual_unfreezing_goes_on_as_the_uninterrupted_run():
    """The script freezes a layer, builds the optimizer, unfreezes the layer later and saves; resumed, the same
    script freezes it again before building the optimizer. torch's optimizer loads that; so does the wrapper:
    the layer's saved transform state joins it, and the run goes on as if it had not stopped."""

    def script():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        model[0].weight.requires_grad_(False)  # the run's initial freezing
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, gtx.TransformedOptimizer(inner, gtx.chain(gtx.clip_by_global_norm(0.5), gtx.trace(0.5)))

    def step(model, opt, seed):
        g = torch.Generator().manual_seed(seed)
        F.mse_loss(model(torch.randn(5, 4, generator=g)), torch.randn(5, 3, generator=g)).backward()
        opt.step()
        opt.zero_grad()

    model, opt = script()
    for seed in range(4):
        if seed == 2:
            model[0].weight.requires_grad_(True)  # unfrozen "at epoch 1"
        step(model, opt, seed)
    saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    resumed_model, resumed = script()
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    resumed_model[0].weight.requires_grad_(True)  # the schedule says it is unfrozen by now
    for seed in range(4, 7):
        step(model, opt, seed)
        step(resumed_model, resumed, seed)
    assert_trees_close(dict(resumed_model.named_parameters()), dict(model.named_parameters()), rtol=0, atol=0)
    assert_trees_equal(resumed.tx_state, opt.tx_state)


def _trace_in_pairs(decay):
    """gtx.trace written with a tuple per param in its state (a user's transform may): a tree like the params with a
    subtree per param, whose keys end in the place of a param and then the tuple's index."""

    def update(updates, state, params=None, **extra):
        new = tu.tree_map(lambda u, s: (decay * s[0] + u,), updates, state)
        return tu.tree_map(lambda u, s: s[0], updates, new), new

    return gtx.GradientTransformation(lambda params: tu.tree_map(lambda p: (torch.zeros_like(p),), params), update)


@pytest.mark.parametrize("route", ["torch.save", "dcp"])
@pytest.mark.parametrize("masking", ["masked", "partition", "pairs"])
def test_a_masked_members_state_follows_its_param_when_a_layer_unfreezes_and_across_a_resume(masking, route, tmp_path):
    """A masked (partitioned) member keeps no state for its masked params, so its state for the others is not
    shaped like the params and is keyed by each param's place. A layer unfrozen in the middle shifts the places after
    it in the transform's tree: each param keeps its own momentum (not the one of the param that had its place, nor
    a fresh one), as in torch.optim.SGD with momentum on the weights only; also across a resume by a script that
    freezes the layer again before it builds the optimizer. Through torch.save the layer joins with its saved state;
    through dcp.load into a template of that optimizer (torchtitan's flattened dicts) its state is dropped and it
    restarts fresh (docs/wrapper.md), and every other param keeps its own."""
    data = [torch.Generator().manual_seed(s) for s in range(7)]

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        model[1].requires_grad_(False)  # unfrozen at step 2: its params join between layer 0's and layer 2's
        return model

    def weights(model, on):
        return [p for n, p in model.named_parameters() if n.endswith("weight") == on]

    def wrap(model):
        on_weights = lambda ps: [[p.ndim == 2 for p in g] for g in ps]
        labels = lambda ps: [["w" if p.ndim == 2 else "b" for p in g] for g in ps]
        tx = (
            gtx.masked(gtx.trace(0.9) if masking == "masked" else _trace_in_pairs(0.9), on_weights)
            if masking != "partition"
            else gtx.partition({"w": gtx.trace(0.9), "b": gtx.scale(1.0)}, labels)
        )
        return gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tx)

    def step(model, opt, g):
        model(torch.randn(8, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    ref = make()
    ref_opt = torch.optim.SGD(
        [{"params": weights(ref, True), "momentum": 0.9}, {"params": weights(ref, False)}], lr=0.1
    )
    model = make()
    opt = wrap(model)
    for t, g in enumerate(data):
        if t == 2:
            ref[1].requires_grad_(True)
            model[1].requires_grad_(True)
        if t == 4:  # resumed by the same script, which freezes the layer before building the optimizer
            if route == "torch.save":
                saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
                model = make()
                opt = wrap(model)
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
            else:
                options = StateDictOptions(flatten_optimizer_state_dict=True)
                dcp.save(
                    dict(zip(("model", "optim"), get_state_dict(model, opt, options=options))), checkpoint_id=tmp_path
                )
                model = make()
                opt = wrap(model)
                state = dict(zip(("model", "optim"), get_state_dict(model, opt, options=options)))
                dcp.load(state, checkpoint_id=tmp_path)
                set_state_dict(
                    model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
                )
                del ref_opt.state[ref[1].weight]  # the layer restarts fresh
            model[1].requires_grad_(True)
        step(ref, ref_opt, copy.deepcopy(g))
        step(model, opt, g)
    assert_trees_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("read", [False, True])  # opt.state[p] read for every param first: {} for the frozen one
@pytest.mark.parametrize("stop", [2, 3])  # at a window boundary, and with the window open
def test_a_checkpoint_saved_while_a_layer_was_frozen_loads_where_it_is_trainable(stop, read):
    """Saved before the layer was unfrozen, resumed by a script that builds the optimizer with it trainable (its
    schedule says it is by now): torch's optimizer loads that, and so does the wrapper; the layer joins at its first
    grad as it would have in the saved run. Against torch: the same run, unfreezing the layer at the resume point."""
    k = 2

    def make_model(frozen):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        model[0].weight.requires_grad_(not frozen)
        return model

    def wrap(model):
        inner = torch.optim.AdamW(model.parameters(), lr=0.1)
        return gtx.TransformedOptimizer(inner, gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(0.5)))

    def loss(model, seed):
        g = torch.Generator().manual_seed(seed)
        return F.mse_loss(model(torch.randn(5, 4, generator=g)), torch.randn(5, 3, generator=g))

    ref = make_model(frozen=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    model = make_model(frozen=True)
    opt = wrap(model)
    for seed in range(8):
        if seed == stop:
            ref[0].weight.requires_grad_(True)
            if read:  # as generic checkpoint code does; torch's state then holds an empty entry for the frozen one
                states = [dict(opt.state[p]) for g in opt.param_groups for p in g["params"]]
                assert states[0] == {}
            saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
            model = make_model(frozen=False)
            opt = wrap(model)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        (loss(ref, seed) / k).backward()
        if (seed + 1) % k == 0:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        loss(model, seed).backward()
        opt.step()
        opt.zero_grad()
    assert_trees_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-6, atol=1e-7)


def test_a_bad_checkpoint_for_a_frozen_param_leaves_the_wrapper_as_it_was():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model[0].weight.requires_grad_(False)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.trace(0.9))
    sd = opt.state_dict()
    sd["state"][0] = {"gradtx": {"nonsense": torch.zeros(())}}  # the frozen weight's id
    seen, state = list(map(id, opt.state)), opt.tx_state
    with pytest.raises(ValueError, match="gradtx state of"):
        opt.load_state_dict(sd)
    assert list(map(id, opt.state)) == seen and opt.tx_state is state

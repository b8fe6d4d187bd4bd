"""gradtx.wrapper.state_dict: the checkpoint format, the state shown in opt.state, and files from earlier versions."""

import importlib.util
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal, without_added_fields

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture_recipe():
    spec = importlib.util.spec_from_file_location("make_wrapper_fixture", FIXTURES / "make_wrapper_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _continue_both(loaded_model_params, loaded_opt, recipe):
    """Run the fixture's recipe uninterrupted with today's code; continue the loaded wrapper alongside."""
    model, opt, data = recipe.recipe()
    for batch in data[: recipe.STEPS]:
        recipe.micro_step(model, opt, batch)
    # 0.1.0's states had no loss fields: they start fresh on load (gtx.kinds.added_fields)
    assert_trees_close(without_added_fields(loaded_opt.tx_state), without_added_fields(opt.tx_state), rtol=0, atol=0)
    assert loaded_opt.window_open and opt.window_open
    loaded_model = torch.nn.Linear(3, 2).double()
    with torch.no_grad():
        for p, q in zip(loaded_model.parameters(), loaded_model_params):
            p.copy_(q)
    # the loaded wrapper steps the params it holds: a model sharing them continues the run
    loaded_model.weight, loaded_model.bias = loaded_model_params
    for batch in data[recipe.STEPS :]:
        recipe.micro_step(model, opt, batch)
        recipe.micro_step(loaded_model, loaded_opt, batch)
    assert_trees_close(list(loaded_model.parameters()), list(model.parameters()), rtol=1e-12, atol=0)


def test_a_wrapper_pickled_by_the_earlier_module_loads_and_continues():
    """The fixture was pickled when the class lived at gradtx.optim.TransformedOptimizer, mid-window."""
    opt = pickle.loads((FIXTURES / "wrapper_v1.pkl").read_bytes())
    assert isinstance(opt, gtx.TransformedOptimizer)
    params = opt.param_groups[0]["params"]
    assert all(p.grad is not None for p in params)  # the open window's partial sums came back
    assert "gradtx" in opt.state[params[0]]
    _continue_both(params, opt, _fixture_recipe())


def test_a_state_dict_saved_by_the_earlier_version_loads():
    recipe = _fixture_recipe()
    model, opt, data = recipe.recipe()
    reference, ref_opt, _ = recipe.recipe()
    for batch in data[: recipe.STEPS]:
        recipe.micro_step(reference, ref_opt, batch)
    with torch.no_grad():  # the model's weights travel in their own checkpoint
        for p, q in zip(model.parameters(), reference.parameters()):
            p.copy_(q)
    opt.load_state_dict(torch.load(FIXTURES / "wrapper_v1_state.pt", weights_only=True))
    assert_trees_close(without_added_fields(opt.tx_state), without_added_fields(ref_opt.tx_state), rtol=0, atol=0)
    assert_trees_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()], rtol=0, atol=0)
    for batch in data[recipe.STEPS :]:
        recipe.micro_step(model, opt, batch)
        recipe.micro_step(reference, ref_opt, batch)
    assert_trees_close(list(model.parameters()), list(reference.parameters()), rtol=1e-12, atol=0)


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

"""Checkpoints in one process: the wrapper's torch.optim layout, the functional state dict, validation, migration.

Every resume is checked against the same run uninterrupted; every refused load
is checked to leave the optimizer (inner state, transform state, grads) as it was.
"""

from __future__ import annotations

import copy
import io

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import gradtx as gtx
from gradtx.core import tree as tu

K = 3


def make_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 3))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


DATA = batches(4 * K)


def wrapper(model: torch.nn.Module, k: int = K, opt_cls=torch.optim.AdamW, **kw) -> gtx.TransformedOptimizer:
    tx = gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(0.5))
    return gtx.TransformedOptimizer(opt_cls(model.parameters(), lr=1e-2, **kw), tx)


def train(model, opt, data) -> None:
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def uninterrupted(k: int = K, **kw) -> list[torch.Tensor]:
    model = make_model()
    train(model, wrapper(model, k, **kw), DATA)
    return params_of(model)


def snapshot(opt: gtx.TransformedOptimizer, model) -> tuple:
    return (
        copy.deepcopy(opt.optimizer.state_dict()),
        copy.deepcopy(opt.tx_state),
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        opt.window_open,
    )


def assert_unchanged(before: tuple, opt, model) -> None:
    after = snapshot(opt, model)
    torch.testing.assert_close(after[0]["state"], before[0]["state"], rtol=0, atol=0)
    assert after[0]["param_groups"] == before[0]["param_groups"]
    for a, b in zip(tu.flatten(after[1])[0], tu.flatten(before[1])[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(after[2], before[2], strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert after[3] == before[3]


# --- the wrapper's layout ----------------------------------------------------------------------


def test_state_dict_has_torch_optim_layout_with_gradtx_beside_the_inner_state():
    model = make_model()
    opt = wrapper(model)
    train(model, opt, DATA[:7])  # mid-window
    sd = opt.state_dict()
    plain = opt.optimizer.state_dict()
    assert set(sd) == {"state", "param_groups"} and sd["param_groups"] == plain["param_groups"]
    assert sorted(sd["state"]) == sorted(plain["state"]) == [0, 1, 2, 3]
    for pid, p in enumerate(model.parameters()):
        entry = sd["state"][pid]
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq", "gradtx"}
        assert torch.equal(entry["exp_avg"], plain["state"][pid]["exp_avg"])
        assert torch.equal(entry["gradtx"]["0/0/acc"], p.grad)  # the open window's partial sum
        assert ("global" in entry["gradtx"]) == (pid == 0)
    glob = sd["state"][0]["gradtx"]["global"]
    assert int(glob["0/0/micro_step"]) == 1 and int(glob["0/0/k"]) == K and "0/1/grad_norm" in glob
    assert "gradtx" not in plain["state"][0]  # the inner optimizer's own dict is untouched


def test_keys_at_every_boundary_are_the_same_and_an_open_window_adds_its_sums():
    """Between windows nothing gradient-sized is saved (issue 29); an open window adds its partial sums."""
    model = make_model()
    opt = wrapper(model)

    def keys():
        sd = opt.state_dict()
        return {pid: sorted(e["gradtx"]) for pid, e in sd["state"].items()}, sd

    fresh, _ = keys()
    train(model, opt, DATA[:K])
    boundary, sd = keys()
    assert fresh == boundary
    assert all("0/0/acc" not in e["gradtx"] for e in sd["state"].values())
    train(model, opt, DATA[K : K + 1])
    mid, sd = keys()
    assert all(set(mid[pid]) == set(boundary[pid]) | {"0/0/acc"} for pid in mid)
    assert all(torch.count_nonzero(e["gradtx"]["0/0/acc"]) > 0 for e in sd["state"].values())


@pytest.mark.parametrize("stop", [6, 7, 8])
@pytest.mark.parametrize("fused", [False, True])
def test_torch_save_resume_matches_uninterrupted(stop, fused):
    model = make_model()
    opt = wrapper(model, fused=fused)
    train(model, opt, DATA[:stop])
    assert opt.window_open == (stop % K != 0)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed = make_model(seed=99)
    resumed.load_state_dict(ckpt["model"])
    opt2 = wrapper(resumed, fused=fused)
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.window_open == (stop % K != 0)
    train(resumed, opt2, DATA[stop:])
    assert_same(params_of(resumed), uninterrupted(fused=fused))


# flatten + full_state_dict fails inside torch for a plain AdamW too (KeyError 'param_groups.0.params.0').
@pytest.mark.parametrize(("flatten", "full"), [(False, False), (True, False), (False, True)])
def test_get_and_set_state_dict_round_trip_mid_window(flatten, full):
    options = StateDictOptions(flatten_optimizer_state_dict=flatten, full_state_dict=full)
    model = make_model()
    opt = wrapper(model)
    train(model, opt, DATA[:7])
    msd, osd = get_state_dict(model, opt, options=options)
    ckpt = copy.deepcopy((msd, osd))
    resumed = make_model(seed=5)
    opt2 = wrapper(resumed)
    set_state_dict(resumed, opt2, model_state_dict=ckpt[0], optim_state_dict=ckpt[1], options=options)
    assert opt2.window_open
    train(resumed, opt2, DATA[7:])
    assert_same(params_of(resumed), uninterrupted())


def test_dcp_warm_up_does_not_advance_the_transform():
    # torch's _init_optim_state steps a fresh optimizer on zero grads to create its state.
    model = make_model()
    opt = wrapper(model)
    osd = get_optimizer_state_dict(model, opt)
    assert not opt.window_open and all(p.grad is None for p in model.parameters())
    assert int(gtx.metrics(opt.tx_state)["micro_step"]) == 0
    assert set(osd["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq", "gradtx"}  # the inner state exists
    set_optimizer_state_dict(model, opt, osd)
    train(model, opt, DATA)
    reference = make_model()
    ref_opt = wrapper(reference)
    get_optimizer_state_dict(reference, ref_opt)  # the same DCP warm-up of the inner AdamW
    train(reference, ref_opt, DATA)
    assert_same(params_of(model), params_of(reference))


# --- migration ----------------------------------------------------------------------------------


def test_a_plain_torch_checkpoint_migrates_into_the_wrapper():
    model = make_model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in DATA[:2]:
        F.cross_entropy(model(x), y).backward()
        plain.step()
        plain.zero_grad()
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": plain.state_dict()})
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(ckpt["opt"]))  # its own copy: AdamW steps its "step" tensors in place

    resumed = make_model(seed=3)
    resumed.load_state_dict(ckpt["model"])
    opt = wrapper(resumed)
    train(resumed, opt, DATA[:2])  # a stale window the migration must close
    opt.load_state_dict(ckpt["opt"])
    assert not opt.window_open and all(p.grad is None for p in resumed.parameters())
    assert int(gtx.metrics(opt.tx_state)["micro_step"]) == 0
    train(resumed, opt, DATA[2 : 2 + K])
    xs = torch.cat([x for x, _ in DATA[2 : 2 + K]])
    ys = torch.cat([y for _, y in DATA[2 : 2 + K]])
    F.cross_entropy(reference(xs), ys).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()
    for a, b in zip(params_of(resumed), params_of(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_dcp_checkpoint_of_a_plain_optimizer_migrates_into_the_wrapper():
    model = make_model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(DATA[0][0]), DATA[0][1]).backward()
    plain.step()
    osd = copy.deepcopy(get_optimizer_state_dict(model, plain))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gtx.clip(1.0))
    set_optimizer_state_dict(model, opt, osd)
    for p, q in zip(model.parameters(), plain.state.values()):
        assert torch.equal(opt.optimizer.state[p]["momentum_buffer"], q["momentum_buffer"])


def test_a_gradtx_checkpoint_goes_to_a_plain_optimizer_at_a_boundary_only():
    model = make_model()
    opt = wrapper(model)
    train(model, opt, DATA[:K])
    at_boundary = gtx.checkpoint.to_torch_optimizer(opt.state_dict())
    plain = torch.optim.AdamW(make_model().parameters(), lr=1e-2)
    plain.load_state_dict(at_boundary)
    for pid, s in enumerate(plain.state_dict()["state"].values()):
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.equal(s["exp_avg"], opt.optimizer.state_dict()["state"][pid]["exp_avg"])
    train(model, opt, DATA[K : K + 1])
    with pytest.raises(ValueError, match="window open .*micro_step = 1.*partial sums would be lost"):
        gtx.checkpoint.to_torch_optimizer(opt.state_dict())


def test_to_torch_optimizer_names_what_it_takes_when_given_a_functional_checkpoint():
    """gradtx.checkpoint.state_dict's dict has "state" too (and "global", no "param_groups"): it raised KeyError."""
    params = {"w": torch.ones(2)}
    tx = gtx.adam(0.1)
    with pytest.raises(
        ValueError, match=r"to_torch_optimizer: expected an optimizer state dict \('state', 'param_groups'\)"
    ):
        gtx.checkpoint.to_torch_optimizer(gtx.checkpoint.state_dict(tx.init(params), params, tx=tx))


def test_a_param_the_wrapper_had_not_stepped_starts_fresh_in_the_plain_optimizer():
    """Its saved stand-in is no state: a plain AdamW resumed from the checkpoint steps it as AdamW throughout."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    params, ref_params = [*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()]
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(params, lr=0.1), gtx.identity())
    ref = torch.optim.AdamW(ref_params, lr=0.1)
    x = torch.randn(4, 3)
    for o, m in ((opt, a), (ref, ref_a)):  # b gets no grad yet
        m(x).sum().backward()
        o.step()
        o.zero_grad()
    plain = torch.optim.AdamW(params, lr=0.1)
    plain.load_state_dict(gtx.checkpoint.to_torch_optimizer(opt.state_dict()))
    assert plain.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
    for o, (m, n) in ((plain, (a, b)), (ref, (ref_a, ref_b))):
        (m(x).sum() + n(x).sum()).backward()
        o.step()
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


# --- validation before mutation -----------------------------------------------------------------


def _mid_window_pair():
    model = make_model()
    opt = wrapper(model)
    train(model, opt, DATA[:4])
    return model, opt


def test_changed_k_is_refused_and_nothing_changes():
    model = make_model()
    src = wrapper(model, k=4)
    train(model, src, DATA[:5])
    ckpt = src.state_dict()
    target_model, target = _mid_window_pair()
    before = snapshot(target, target_model)
    with pytest.raises(ValueError, match=r"saved with k=4, this transform has k=3"):
        target.load_state_dict(ckpt)
    assert_unchanged(before, target, target_model)


@pytest.mark.parametrize("saved_weighted", [True, False])
def test_a_window_saved_token_weighted_or_not_is_refused_by_the_other_and_nothing_changes(saved_weighted):
    # The two windows sum different grads (of summed or of mean losses) and divide by different counts.
    def run(weighted):
        model = make_model()
        tx = gtx.chain(gtx.accumulate(K, token_weighted=weighted), gtx.clip_by_global_norm(0.5))
        opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tx)
        for x, y in DATA[:4]:
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step(tokens=len(y))
        return model, opt

    (src_model, src), (model, opt) = run(saved_weighted), run(not saved_weighted)
    match = f"saved with token_weighted={saved_weighted}, this transform has token_weighted={not saved_weighted}"
    before = snapshot(opt, model)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(src.state_dict())
    with pytest.raises(ValueError, match=match):  # torch's flattened DCP route
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(model, opt, get_optimizer_state_dict(src_model, src, options=options), options=options)
    assert_unchanged(before, opt, model)
    params = {n: p.detach().clone() for n, p in src_model.named_parameters()}
    grads = {n: torch.ones_like(p) for n, p in params.items()}
    saved_tx, tx = (
        gtx.chain(gtx.accumulate(K, token_weighted=w), gtx.sgd(0.1)) for w in (saved_weighted, not saved_weighted)
    )
    state = saved_tx.update(grads, saved_tx.init(params), params, tokens=5)[1]
    with pytest.raises(ValueError, match=match):
        gtx.checkpoint.load_state_dict(
            gtx.checkpoint.state_dict(state, params, tx=saved_tx), tx.init(params), params, tx=tx
        )
    with pytest.raises(ValueError, match=r"made for \(k, token_weighted\)"):  # a state handed over by hand
        tx.update(grads, state, params, tokens=5)


def test_changed_chain_is_refused_naming_the_key_and_nothing_changes():
    model = make_model()
    src = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        gtx.chain(gtx.accumulate(K), gtx.apply_if_finite(gtx.clip(1.0), 3)),
    )
    train(model, src, DATA[:4])
    target_model, target = _mid_window_pair()
    before = snapshot(target, target_model)
    with pytest.raises(ValueError, match=r"global state: the checkpoint has no '0/1/grad_norm'.*different chain"):
        target.load_state_dict(src.state_dict())
    assert_unchanged(before, target, target_model)


def test_changed_shapes_are_refused_and_nothing_changes():
    other = make_model(hidden=17)
    src = wrapper(other)
    train(other, src, DATA[:4])
    target_model, target = _mid_window_pair()
    before = snapshot(target, target_model)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has shape \(17, 6\), its param \(16, 6\)"):
        target.load_state_dict(src.state_dict())
    assert_unchanged(before, target, target_model)


def test_changed_param_count_and_groups_are_refused():
    model = make_model()
    src = wrapper(model)
    train(model, src, DATA[:4])
    ckpt = src.state_dict()
    fewer = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3, bias=False))
    target = wrapper(fewer)
    with pytest.raises(ValueError, match="param group 0 has 4 params in the checkpoint, 3 here"):
        target.load_state_dict(ckpt)
    two_groups = gtx.TransformedOptimizer(
        torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=1e-2),
        gtx.chain(gtx.accumulate(K), gtx.clip_by_global_norm(0.5)),
    )
    with pytest.raises(ValueError, match="1 param groups, this optimizer 2"):
        two_groups.load_state_dict(ckpt)


def test_changed_dtype_is_refused_and_nothing_changes():
    model = make_model()
    src = wrapper(model)
    train(model, src, DATA[:4])
    ckpt = src.state_dict()
    ckpt["state"][2]["gradtx"]["0/0/acc"] = ckpt["state"][2]["gradtx"]["0/0/acc"].double()
    target_model, target = _mid_window_pair()
    before = snapshot(target, target_model)
    with pytest.raises(
        ValueError,
        match=r"'0/0/acc' of param \"param_groups\[0\]\['params'\]\[2\] \(shape \(3, 16\)\)\": the checkpoint has dtype torch.float64",
    ):
        target.load_state_dict(ckpt)
    assert_unchanged(before, target, target_model)


def test_a_bad_inner_part_changes_nothing_either():
    model = make_model()
    src = wrapper(model)
    train(model, src, DATA[:4])
    ckpt = src.state_dict()
    ckpt["param_groups"][0]["params"] = ckpt["param_groups"][0]["params"][:3] + [17]
    target_model, target = _mid_window_pair()
    before = snapshot(target, target_model)
    with pytest.raises(ValueError, match="state for param 3, which no param group lists"):
        target.load_state_dict(ckpt)
    assert_unchanged(before, target, target_model)


def test_non_dicts_and_missing_keys_are_refused_clearly():
    _, opt = _mid_window_pair()
    with pytest.raises(ValueError, match="missing key 'state'"):
        opt.load_state_dict({"inner": {}, "tx_state": [], "window_open": False})
    with pytest.raises(ValueError, match="missing key 'param_groups'"):
        opt.load_state_dict({"state": {}})
    with pytest.raises(TypeError, match="must be a dict"):
        opt.load_state_dict([])
    with pytest.raises(TypeError, match=r"state_dict\['state'\] must be a dict, got list"):
        opt.load_state_dict({"state": [], "param_groups": opt.state_dict()["param_groups"]})


def _is_empty_sum(tree):
    return all(t.numel() == 0 for t in torch.utils._pytree.tree_leaves(tree))


# --- the functional path ------------------------------------------------------------------------


def _functional_run(data, state=None, params=None, tx=None):
    model = make_model()
    params = params if params is not None else {n: p.detach().clone() for n, p in model.named_parameters()}
    tx = tx or gtx.chain(gtx.accumulate(K), gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2))
    state = state if state is not None else tx.init(params)

    def loss(p, x, y):
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    for x, y in data:
        grads = torch.func.grad(loss)(params, x, y)
        params, state = gtx.update_and_apply(tx, grads, state, params)
    return params, state, tx


@pytest.mark.parametrize("stop", [6, 7])
def test_functional_state_round_trips_through_dcp(tmp_path, stop):
    import torch.distributed.checkpoint as dcp

    full, _, _ = _functional_run(DATA)
    params, state, tx = _functional_run(DATA[:stop])
    assert _is_empty_sum(state[0].acc) == (stop % K == 0)
    sd = gtx.checkpoint.state_dict(state, params, tx=tx)
    assert (
        set(sd["state"]) == set(params) and "0/acc" in sd["state"]["0.weight"] and "2/0/mu" in sd["state"]["0.weight"]
    )
    dcp.save({"params": params, "tx": sd}, checkpoint_id=str(tmp_path))

    fresh = {n: torch.zeros_like(p) for n, p in params.items()}
    fresh_state = tx.init(fresh)
    holder = gtx.checkpoint.TransformState(tx, fresh_state, fresh)
    dcp.load({"params": fresh, "tx": holder}, checkpoint_id=str(tmp_path))
    assert _is_empty_sum(holder.state[0].acc) == (stop % K == 0)
    assert optree.tree_structure(holder.state) == optree.tree_structure(state)  # at a boundary and mid-window
    resumed, _, _ = _functional_run(DATA[stop:], holder.state, fresh, tx)
    for n in full:
        torch.testing.assert_close(resumed[n], full[n], rtol=0, atol=0)


def test_functional_window_with_a_none_grad_resumes_exactly(tmp_path):
    """A param with no grad in the open window holds no sum: saved and loaded, the window keeps that None."""
    import torch.distributed.checkpoint as dcp

    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    grads = {"a": torch.ones(2), "b": None}
    tx = gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0), gtx.sgd(0.1, momentum=0.9))
    _, state = tx.update(grads, tx.init(params), params)
    want, _ = tx.update(grads, state, params)
    sd = gtx.checkpoint.state_dict(state, params, tx=tx)
    assert float(sd["state"]["a"]["0/held"]) == 1.0 and float(sd["state"]["b"]["0/held"]) == 0.0
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = gtx.checkpoint.load_state_dict(torch.load(buffer, weights_only=True), tx.init(params), params, tx=tx)
    dcp.save({"tx": gtx.checkpoint.TransformState(tx, state, params)}, checkpoint_id=str(tmp_path))
    holder = gtx.checkpoint.TransformState(tx, tx.init(params), params)
    dcp.load({"tx": holder}, checkpoint_id=str(tmp_path))
    for resumed in (loaded, holder.state):
        got, _ = tx.update(grads, resumed, params)
        assert got["b"] is None
        torch.testing.assert_close(got["a"], want["a"], rtol=0, atol=0)


def test_functional_load_validates_before_it_builds():
    params, state, tx = _functional_run(DATA[:4])
    sd = gtx.checkpoint.state_dict(state, params, tx=tx)
    renamed = {("x." + n): p for n, p in params.items()}
    with pytest.raises(ValueError, match=r"parameter names: the checkpoint has no 'x.0.bias'"):
        gtx.checkpoint.load_state_dict(sd, tx.init(renamed), renamed, tx=tx)
    other_tx = gtx.chain(gtx.accumulate(K + 1), gtx.clip_by_global_norm(0.5), gtx.adamw(1e-2))
    with pytest.raises(ValueError, match=r"saved with k=3, this transform has k=4"):
        gtx.checkpoint.load_state_dict(sd, other_tx.init(params), params, tx=other_tx)
    sgd_tx = gtx.chain(gtx.accumulate(K), gtx.clip_by_global_norm(0.5), gtx.sgd(1e-2, momentum=0.9))
    with pytest.raises(
        ValueError, match=r"state of param '0.bias': the checkpoint has no '2/0/trace'.*different chain"
    ):
        gtx.checkpoint.load_state_dict(sd, sgd_tx.init(params), params, tx=sgd_tx)
    bad = copy.deepcopy(sd)
    bad["state"]["2.bias"]["2/0/nu"] = torch.zeros(5)
    with pytest.raises(
        ValueError, match=r"'2/0/nu' of param '2.bias': the checkpoint has shape \(5,\), this state \(3,\)"
    ):
        gtx.checkpoint.load_state_dict(bad, state, params, tx=tx)
    loaded = gtx.checkpoint.load_state_dict(sd, tx.init(params), params, tx=tx)
    for a, b in zip(tu.flatten(loaded)[0], tu.flatten(state)[0], strict=True):
        assert torch.equal(a, b)


def test_functional_window_sums_keep_their_dtype_fp64():
    params = {"w": torch.randn(4, 3, dtype=torch.float64)}
    tx = gtx.chain(gtx.accumulate(2), gtx.sgd(0.1))
    state = tx.init(params)
    _, state = tx.update({"w": torch.randn(4, 3, dtype=torch.float64)}, state, params)
    assert state[0].acc["w"].dtype == torch.float64
    boundary = gtx.checkpoint.state_dict(tx.init(params), params, tx=tx)
    assert boundary["state"]["w"]["0/acc"].dtype == torch.float64 and not boundary["state"]["w"]["0/acc"].any()
    saved = copy.deepcopy(gtx.checkpoint.state_dict(state, params, tx=tx))
    loaded = gtx.checkpoint.load_state_dict(saved, tx.init(params), params, tx=tx)
    assert torch.equal(loaded[0].acc["w"], state[0].acc["w"]) and int(loaded[0].micro_step) == 1


class _AcceleratorComm:
    """One rank whose grads live on an accelerator (``meta`` stands in for it): records each collective's devices and
    hands back host zeros of the same shape (a meta tensor holds no values)."""

    def __init__(self) -> None:
        self.devices: list[list[str]] = []

    def all_reduce(self, tensors, op, group):
        self.devices.append([t.device.type for t in tensors])
        return [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]

    def size(self, group):
        return 2


def test_a_mid_window_save_sums_the_per_rank_counts_on_the_params_device():
    """The window's own token collective runs on the grads' device, since a GPU process group (NCCL) reduces device
    tensors only; the save's sums of the same per-rank counts ran on the host, where such a group raises."""
    params = {"w": torch.zeros(4, 3, device="meta")}
    comm = _AcceleratorComm()
    tx = gtx.chain(gtx.accumulate(2, token_weighted=True, comm=comm), gtx.sgd(0.1))
    _, state = tx.update({"w": torch.ones(4, 3, device="meta")}, tx.init(params), params, tokens=3, loss=1.0)
    assert comm.devices == []  # a held micro-step issues nothing
    gtx.checkpoint.state_dict(state, params, tx=tx)
    assert comm.devices and all(d == ["meta"] for d in comm.devices), comm.devices


def test_an_open_window_whose_grads_are_gone_is_refused():
    model = make_model()
    opt = wrapper(model)
    train(model, opt, DATA[:1])
    opt.optimizer.zero_grad()  # the partial sums are gone behind the wrapper's back
    with pytest.raises(ValueError, match=r"window is open \(micro-step 1 of 3\).*Save at a window boundary"):
        opt.state_dict()


@pytest.mark.parametrize("stop", [4, 5])
def test_gradscaler_window_with_an_inf_is_still_skipped_after_a_resume(stop):
    """GradScaler on every micro-step; micro-step 3 (the second window's first) has an inf; resume after it."""

    def run(model, opt, s, data, start):
        for i, (x, y) in enumerate(data, start):
            s.scale(F.cross_entropy(model(x), y)).backward()
            if i == K:
                model[0].weight.grad[0, 0] = float("inf")
            s.step(opt)
            s.update()
            opt.zero_grad()

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10_000)

    model = make_model()
    opt = wrapper(model, opt_cls=torch.optim.SGD)
    s = scaler()
    run(model, opt, s, DATA, 0)
    uninterrupted = params_of(model)

    model = make_model()
    opt, s = wrapper(model, opt_cls=torch.optim.SGD), scaler()
    run(model, opt, s, DATA[:stop], 0)
    assert opt.window_open
    amp = opt.state_dict()["state"][0]["gradtx"]["amp"]
    assert float(amp["scale"]) == 1024.0 and float(amp["inf"]) == 1.0
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": s.state_dict()})
    resumed = make_model(seed=4)
    resumed.load_state_dict(ckpt["model"])
    opt2, s2 = wrapper(resumed, opt_cls=torch.optim.SGD), scaler()
    opt2.load_state_dict(ckpt["opt"])
    s2.load_state_dict(ckpt["scaler"])
    run(resumed, opt2, s2, DATA[stop:], stop)
    assert_same(params_of(resumed), uninterrupted)


def test_masked_and_injected_hyperparams_round_trip_mid_window():
    """A decay mask (state over a subset of params) and injected hyperparameters (0-d tensors by name)."""
    no_bias = {"0.weight": True, "0.bias": False, "2.weight": True, "2.bias": False}
    tx = gtx.chain(
        gtx.accumulate(K),
        gtx.clip_by_global_norm(0.5),
        gtx.masked(gtx.trace(0.9), no_bias),
        gtx.inject_hyperparams(gtx.adamw)(learning_rate=1e-2, weight_decay=0.1, mask=no_bias),
    )
    full, _, _ = _functional_run(DATA, tx=tx)
    params, state, _ = _functional_run(DATA[:7], tx=tx)
    saved = copy.deepcopy(gtx.checkpoint.state_dict(state, params, tx=tx))
    fresh = {n: torch.zeros_like(p) for n, p in params.items()}
    loaded = gtx.checkpoint.load_state_dict(saved, tx.init(fresh), fresh, tx=tx)
    for a, b in zip(tu.flatten(loaded)[0], tu.flatten(state)[0], strict=True):
        assert torch.equal(a, b)
    resumed, _, _ = _functional_run(DATA[7:], loaded, {n: p.clone() for n, p in params.items()}, tx)
    for n in full:
        torch.testing.assert_close(resumed[n], full[n], rtol=0, atol=0)


@pytest.mark.parametrize("stop", [6, 7], ids=["boundary", "mid_window"])
def test_flattened_set_state_dict_of_a_layer_frozen_at_the_save_into_a_trainable_one(stop):
    # torch's flattened load rebuilds every key the loading optimizer shows as {} for a param the checkpoint has no
    # state for (frozen at the save): the param leaves the transform and joins at its first grad, as in the saved run.
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    reference = make_model()
    reference[0].weight.requires_grad_(False)
    ref_opt = wrapper(reference)
    train(reference, ref_opt, DATA[:stop])
    reference[0].weight.requires_grad_(True)
    train(reference, ref_opt, DATA[stop:])
    model = make_model()
    model[0].weight.requires_grad_(False)
    opt = wrapper(model)
    train(model, opt, DATA[:stop])
    ckpt = copy.deepcopy(get_state_dict(model, opt, options=options))
    resumed = make_model(seed=5)
    opt2 = wrapper(resumed)  # the layer trainable here
    set_state_dict(resumed, opt2, model_state_dict=ckpt[0], optim_state_dict=ckpt[1], options=options)
    train(resumed, opt2, DATA[stop:])
    assert_same(params_of(resumed), params_of(reference))


def test_set_state_dict_of_a_layer_trainable_at_the_save_into_a_frozen_first_layer():
    # torch's set_state_dict keeps no state for a param that does not require grad. The save put the transform's
    # global part on its first trainable param: frozen here, that part is gone, and the load says so (not "a different
    # chain"), changing nothing. The route it names (trainable for the load, frozen after) resumes the run exactly.
    stop = 2 * K
    reference = make_model()
    ref_opt = wrapper(reference)
    train(reference, ref_opt, DATA[:stop])
    reference[0].weight.requires_grad_(False)
    train(reference, ref_opt, DATA[stop:])
    model = make_model()
    opt = wrapper(model)
    train(model, opt, DATA[:stop])
    ckpt = copy.deepcopy(get_state_dict(model, opt))
    resumed = make_model(seed=5)
    resumed[0].weight.requires_grad_(False)
    opt2 = wrapper(resumed)
    before = snapshot(opt2, resumed)
    with pytest.raises(ValueError, match="make it trainable for the load"):
        set_state_dict(resumed, opt2, model_state_dict=ckpt[0], optim_state_dict=ckpt[1])
    assert_unchanged(before, opt2, resumed)
    resumed = make_model(seed=5)
    opt2 = wrapper(resumed)
    set_state_dict(resumed, opt2, model_state_dict=ckpt[0], optim_state_dict=ckpt[1])
    resumed[0].weight.requires_grad_(False)
    train(resumed, opt2, DATA[stop:])
    assert_same(params_of(resumed), params_of(reference))


@pytest.mark.parametrize("make_tx", [lambda: gtx.trace(0.9), lambda: gtx.adaptive_clip(0.05)], ids=["trace", "agc"])
def test_flattened_set_state_dict_of_a_chain_with_no_global_state(make_tx):
    # A chain with no global state shows "global": {} on its first param; torch's flattened checkpoint drops an empty
    # dict, so the load finds no "global" key. The run resumes exactly, as through the nested layout.
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    stop = 5

    def build(model):
        return gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), make_tx())

    reference = make_model()
    train(reference, build(reference), DATA)
    model = make_model()
    opt = build(model)
    train(model, opt, DATA[:stop])
    ckpt = copy.deepcopy(get_state_dict(model, opt, options=options))
    resumed = make_model(seed=5)
    opt2 = build(resumed)
    set_state_dict(resumed, opt2, model_state_dict=ckpt[0], optim_state_dict=ckpt[1], options=options)
    train(resumed, opt2, DATA[stop:])
    assert_same(params_of(resumed), params_of(reference))


def test_flattened_set_state_dict_of_a_chain_with_no_global_state_into_one_with_is_refused_as_a_different_chain():
    # The flattened checkpoint of a chain without global state has no "global" key at all (torch drops the empty
    # dict). Loaded into a chain that has some, with every param trainable, the load names the chain, not a frozen
    # param, and changes nothing.
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.trace(0.9))
    train(model, opt, DATA[:2])
    ckpt = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
    resumed = make_model(seed=5)
    other = gtx.TransformedOptimizer(
        torch.optim.AdamW(resumed.parameters(), lr=1e-2), gtx.chain(gtx.trace(0.9), gtx.clip_by_global_norm(1.0))
    )
    before = snapshot(other, resumed)
    with pytest.raises(ValueError, match=r"'0/1/grad_norm'.*different chain") as err:
        set_optimizer_state_dict(resumed, other, ckpt, options=options)
    assert "trainable" not in str(err.value)
    assert_unchanged(before, other, resumed)

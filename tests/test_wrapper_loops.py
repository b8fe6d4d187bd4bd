"""Training loops as users write them around the wrapper, against the same loop in plain torch (issue 29)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import gradtx as gtx
from gradtx.testing import assert_trees_close

K = 3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- item 1: a param listed twice ---------------------------------------------------------------------


def test_a_param_listed_twice_is_refused_naming_both_places():
    """torch warns and steps it twice; gradtx would count its square twice in a norm: refused, named."""
    model = make_model()
    w = model[0].weight
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch.optim.AdamW([w, *model.parameters()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner = torch.optim.AdamW([w, *model.parameters()])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(8, 5\)\).*param_groups\[0\]"):
        gtx.TransformedOptimizer(inner, gtx.clip_by_global_norm(1.0))
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch refuses this one itself
        gtx.TransformedOptimizer(torch.optim.AdamW([{"params": [w]}, {"params": [w]}]), gtx.identity())


def test_add_param_group_with_a_param_already_held_is_refused_and_changes_nothing():
    model = make_model()
    params = list(model.parameters())
    opt = gtx.TransformedOptimizer(torch.optim.SGD(params[:2], lr=0.1), gtx.clip_by_global_norm(1.0))
    before = opt.tx_state
    with pytest.raises(ValueError):  # torch's own add_param_group refuses a param in two groups
        opt.add_param_group({"params": [params[0], params[2]]})
    assert len(opt.param_groups) == 1 and opt.tx_state is before


def test_the_norm_counts_each_param_once_as_torch_does():
    model, ref = make_model(), make_model()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(0.1))
    x, y = batches(1)[0]
    for m in (model, ref):
        F.mse_loss(m(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    opt.step()
    assert_trees_close(opt.metrics["grad_norm"], norm, rtol=1e-6, atol=0)


# --- item 4: a scheduler stepped once per epoch, with a window open -----------------------------------


@pytest.mark.parametrize("sched", ["step", "plateau"])
def test_an_epoch_scheduler_stepped_mid_window_is_read_at_the_closing_step_as_in_torch(sched):
    """Epochs of 4 micro-batches, windows of 3: the scheduler steps inside windows; torch's loop reads the lr then."""
    epochs, per_epoch = 4, 4
    data = batches(epochs * per_epoch)

    def make_sched(opt):
        if sched == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)

    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_sched = make_sched(ref_opt)
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.accumulate(K))
    our_sched = make_sched(opt)
    i = 0
    for epoch in range(epochs):
        for _ in range(per_epoch):
            x, y = data[i]
            i += 1
            (F.mse_loss(ref(x), y) / K).backward()  # torch's recipe: a mean over the window
            if i % K == 0:
                ref_opt.step()
                ref_opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert opt.emitted == (i % K == 0)
        # a rising "validation loss": the plateau scheduler cuts the lr every epoch
        for s in (ref_sched, our_sched):
            s.step(float(epoch)) if sched == "plateau" else s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 1e-2 * 0.5**2
    assert_trees_close(params_of(model), params_of(ref), rtol=1e-5, atol=1e-7)


def test_a_scheduler_stepped_on_every_micro_step_is_still_refused_naming_both_fixes():
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.accumulate(K))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    with pytest.raises(ValueError, match=r"lr changed .*opt\.emitted is True.*opt\.step\(flush=True\)"):
        for x, y in batches(2 * K):
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()


def test_a_refused_step_does_not_count_in_the_scheduler_check():
    """A step refused for its arguments (here tokens=-1) changes nothing: the per-call scheduler is refused at the
    same call as in the run without it. It used to record that call's lrs, and the next good call saw no change."""

    def refused_at(bad_call):
        model = make_model()
        opt = gtx.TransformedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), gtx.accumulate(4, token_weighted=True)
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        for i, (x, y) in enumerate(batches(4)):
            F.mse_loss(model(x), y, reduction="sum").backward()
            if bad_call and i == 1:
                with pytest.raises(ValueError, match="tokens must be >= 0"):
                    opt.step(tokens=-1)
            try:
                opt.step(tokens=len(x))
            except ValueError as err:
                assert "inside an accumulation window" in str(err)
                return i, params_of(model)
            sched.step()
        return None, params_of(model)

    want, got = refused_at(False), refused_at(True)
    assert want[0] == got[0] == 2
    assert_trees_close(got[1], want[1], rtol=0, atol=0)


# --- item 9: nanoGPT's loss / grad_accum_steps ---------------------------------------------------------


def test_the_micro_batch_mean_with_accumulate_equals_torchs_divided_loop():
    """The port: drop nanoGPT's `/ grad_accum_steps`; gradtx's mean gives torch's numbers (and its clip)."""
    data = batches(2 * K)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = make_model()
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.chain(gtx.accumulate(K), gtx.clip_by_global_norm(0.05))
    )
    for step in range(2):
        for x, y in data[step * K : (step + 1) * K]:
            (F.mse_loss(ref(x), y) / K).backward()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.emitted
        assert_trees_close(opt.metrics["grad_norm"], norm, rtol=1e-5, atol=0)
    assert_trees_close(params_of(model), params_of(ref), rtol=1e-5, atol=1e-7)

"""gradtx on a CUDA device against torch on the same device (skipped without one).

CI has no GPU; these run where one is lent (see docs/benchmarks.md for the device they last ran on).
"""

from __future__ import annotations

import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_trees_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).cuda()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()) for _ in range(n)
    ]


def _train_both(ref_model, ref_opt, model, opt, batches, k: int) -> None:
    """torch's clip(0.5) + step on each window of ``k`` batches, the wrapper on each batch: the same params after."""
    for s in range(len(batches) // k):
        for x, y in batches[s * k : (s + 1) * k]:
            (torch.nn.functional.cross_entropy(ref_model(x), y) / k).backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        for x, y in batches[s * k : (s + 1) * k]:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert opt.emitted
    assert_trees_close(list(model.parameters()), list(ref_model.parameters()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
def test_global_norm_and_clip_match_torch_on_cuda(dtype: torch.dtype, norm_type: float):
    g = torch.Generator(device="cuda").manual_seed(0)
    grads = {f"w{i}": torch.randn(257, 129, generator=g, device="cuda").to(dtype) * (i + 1) for i in range(5)}
    tx = gtx.clip_by_global_norm(1.0, norm_type=norm_type)
    updates, state = tx.update(grads, tx.init(grads))
    assert state.grad_norm.dtype == torch.float32 and state.grad_norm.device.type == "cuda"
    exact = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in grads.values()]), norm_type)
    torch.testing.assert_close(state.grad_norm.double(), exact, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=0)
    coef = torch.clamp(1.0 / (exact + 1e-6), max=1.0)
    if dtype == torch.float32:  # torch's own clip on the same device (it sums fp16 in fp16, which overflows here)
        ref = [torch.zeros_like(t, requires_grad=True) for t in grads.values()]
        for p, t in zip(ref, grads.values()):
            p.grad = t.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type)
        torch.testing.assert_close(ref_norm.double().to(exact.device), exact, rtol=1e-5, atol=0)
        expected = [p.grad for p in ref]
    else:
        expected = [(t.double() * coef).to(dtype) for t in grads.values()]
    for u, e in zip(updates.values(), expected):
        torch.testing.assert_close(u.float(), e.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_wrapper_with_accumulation_and_clip_matches_torch_on_cuda(fused: bool):
    k, steps = 2, 4
    batches = _batches(k * steps)
    ref_model, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=fused)
    opt = gtx.TransformedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused),
        gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(0.5)),
    )
    _train_both(ref_model, ref_opt, model, opt, batches, k)


def test_a_clipped_adamw_step_on_cuda_never_syncs_with_the_host():
    torch.manual_seed(0)
    params = {f"w{i}": torch.randn(64, 64, device="cuda") for i in range(3)}
    tx = gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0), gtx.adamw(1e-3))
    state = tx.init(params)
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(4)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in grads:
            updates, state = tx.update(g, state, params)
            params = gtx.apply_updates(params, updates)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_wrapper_built_on_the_cpu_follows_the_model_through_accelerates_prepare():
    # accelerate's prepare moves the model after the optimizer was built on it, then round-trips the optimizer's
    # state_dict through its move_to_device and load_state_dict: the transform's state follows, as the inner one does.
    from accelerate.optimizer import move_to_device

    k, steps = 2, 3
    batches = _batches(k * steps)
    ref_model = _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    model = _model().cpu()
    tx = gtx.chain(gtx.accumulate(k), gtx.clip_by_global_norm(0.5), gtx.trace(0.9))
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tx)
    model.cuda()
    opt.load_state_dict(move_to_device(opt.state_dict(), torch.device("cuda")))
    _train_both(ref_model, ref_opt, model, opt, batches, k)


@pytest.mark.parametrize(
    "make_tx", [gtx.zclip, lambda: gtx.chain(gtx.accumulate(2), gtx.trace(0.9))], ids=["zclip", "acc"]
)
def test_after_accelerates_prepare_the_state_is_where_a_wrapper_built_on_the_device_has_it(make_tx):
    # zclip's state is all global (its running mean and variance live on the params' device); accumulate's counters
    # live on the host. The round trip places each as a wrapper built on the moved model does.
    from accelerate.optimizer import move_to_device

    model = _model().cpu()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), make_tx())
    model.cuda()
    opt.load_state_dict(move_to_device(opt.state_dict(), torch.device("cuda")))
    built_there = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), make_tx())
    devices = [t.device for t in gtx.tree.flatten(opt.tx_state)[0] if isinstance(t, torch.Tensor)]
    assert devices == [t.device for t in gtx.tree.flatten(built_there.tx_state)[0] if isinstance(t, torch.Tensor)]

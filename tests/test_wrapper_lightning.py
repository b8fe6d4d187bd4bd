"""TransformedOptimizer inside a PyTorch Lightning Trainer, against plain torch running the same recipe."""

import logging
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gradtx as gtx
from gradtx.testing import assert_trees_close

MAX_NORM = 0.5
STEPS = 6

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def data(n=STEPS * 2 * 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def loader():
    return DataLoader(TensorDataset(*data()), batch_size=8, shuffle=False)


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer(**kwargs):
    return L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def fit(module, **kwargs):
    t = trainer(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny DataLoader's num_workers hint
        t.fit(module, loader())
    return t


def torch_reference(k=1):
    """The plain loop: k micro-batches of mean loss / k, clip_grad_norm_, AdamW step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = data()
    for i in range(STEPS * k):
        xb, yb = x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
        (F.cross_entropy(model(xb), yb) / k).backward()
        if (i + 1) % k == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
    return params_of(model)


class Automatic(L.LightningModule):
    def __init__(self, tx):
        super().__init__()
        self.model = make_model()
        self.tx = tx

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return gtx.TransformedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=1e-2), self.tx)


class Manual(Automatic):
    def __init__(self, tx):
        super().__init__(tx)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


@pytest.mark.parametrize("k", [1, 2])
def test_automatic_optimization_equals_torch_loop(k):
    module = Automatic(gtx.clip_by_global_norm(MAX_NORM))
    t = fit(module, accumulate_grad_batches=k)  # Lightning's own accumulation: it divides the loss by k
    assert t.global_step == STEPS  # optimizer steps
    assert_trees_close(params_of(module.model), torch_reference(k), rtol=1e-5, atol=1e-6)


def test_manual_optimization_equals_torch_loop():
    module = Manual(gtx.clip_by_global_norm(MAX_NORM))
    t = fit(module)
    assert t.global_step == STEPS
    assert_trees_close(params_of(module.model), torch_reference(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module_type", [Automatic, Manual])
def test_accumulate_in_the_chain_is_refused_naming_lightnings_own(module_type):
    module = module_type(gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(MAX_NORM)))
    with pytest.raises(ValueError, match=r"accumulate_grad_batches"):
        fit(module)


class PlainTorch(Automatic):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


def test_16_mixed_with_gradscaler_equals_lightnings_own_clipping():
    """Lightning's AMP plugin with a GradScaler: the chain clips unscaled grads, as gradient_clip_val does."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def amp():
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return [MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)]

    ours = Automatic(gtx.clip_by_global_norm(MAX_NORM))
    t = fit(ours, plugins=amp())
    ref = PlainTorch(None)
    t_ref = fit(ref, plugins=amp(), gradient_clip_val=MAX_NORM)
    assert t.global_step == t_ref.global_step == STEPS
    assert t.precision_plugin.scaler.get_scale() == t_ref.precision_plugin.scaler.get_scale()
    assert_trees_close(params_of(ours.model), params_of(ref.model), rtol=1e-6, atol=1e-7)

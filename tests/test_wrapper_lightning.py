"""TransformedOptimizer inside a PyTorch Lightning Trainer, against plain torch running the same recipe."""

import logging
import warnings
import weakref

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


class GradualUnfreezing(Automatic):
    """The last layer trains from the start; the first joins at the second epoch, added through self.optimizers()."""

    def __init__(self, make_optimizer):
        super().__init__(None)
        self.make_optimizer = make_optimizer
        self.model[0].requires_grad_(False)

    def configure_optimizers(self):
        return self.make_optimizer(self.model[2].parameters())

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.model[0].requires_grad_(True)
            self.optimizers().add_param_group({"params": list(self.model[0].parameters()), "lr": 1e-3})


def test_a_group_added_through_self_optimizers_trains_as_with_a_torch_optimizer():
    """self.optimizers() is Lightning's proxy of the wrapper (an instance of a subclass of its class, made around it);
    a group added through it is the wrapper's, as one added through the proxy of a torch optimizer is that one's."""
    ours = GradualUnfreezing(
        lambda ps: gtx.TransformedOptimizer(torch.optim.AdamW(ps, lr=1e-2), gtx.clip_by_global_norm(MAX_NORM))
    )
    ref = GradualUnfreezing(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    fit(ours, limit_train_batches=STEPS // 2)  # two epochs
    fit(ref, limit_train_batches=STEPS // 2, gradient_clip_val=MAX_NORM)
    assert len(ours.trainer.optimizers[0].param_tree()) == 2
    assert not torch.equal(ours.model[0].weight, make_model()[0].weight)  # the first layer trained
    assert_trees_close(params_of(ours.model), params_of(ref.model), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_a_checkpoint_and_the_amp_flag_through_self_optimizers_are_the_wrappers(fused):
    """Saved through the proxy before the first step, loaded through another, the run goes on as torch's AdamW with
    clip_grad_norm_ from the start; GradScaler's flag reads as on the proxy of a torch optimizer."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    def wrapper(model):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        return gtx.TransformedOptimizer(inner, gtx.clip_by_global_norm(MAX_NORM))

    saved = LightningOptimizer(wrapper(make_model())).state_dict()
    model, ref = make_model(), make_model()
    opt, ref_opt = wrapper(model), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
    LightningOptimizer(opt).load_state_dict(saved)
    x, y = data()
    for i in range(3):
        F.cross_entropy(model(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8]).backward()
        F.cross_entropy(ref(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_trees_close(params_of(model), params_of(ref), rtol=1e-5, atol=1e-6)
    torch_flag = getattr(LightningOptimizer(ref_opt), "_step_supports_amp_scaling", False)  # what Lightning reads
    assert LightningOptimizer(opt)._step_supports_amp_scaling is opt._step_supports_amp_scaling is torch_flag is fused


class CountsStandIns(Automatic):
    """Records, inside the inner optimizer's first step, how many stand-ins made before it are still alive."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        opt.optimizer.register_step_post_hook(lambda *_: self.alive.append(sum(r() is not None for r in self.refs)))
        return opt

    def on_fit_start(self):  # after Lightning's setup moved the optimizer's state to the device, through opt.state
        opt = self.trainer.optimizers[0]
        self.alive = []
        self.refs = [weakref.ref(opt.state[p][k]) for p in self.model.parameters() for k in ("exp_avg", "exp_avg_sq")]


def test_the_stand_ins_lightnings_setup_makes_are_freed_before_the_inner_optimizer_makes_its_state():
    """Lightning's setup iterates opt.state before the first step, which makes stand-ins of the whole inner state
    (AdamW: two tensors per param). Held while the inner optimizer makes its own at the first step, they would make
    the optimizer's memory there twice a torch optimizer's, which holds one state."""
    module = CountsStandIns(gtx.clip_by_global_norm(MAX_NORM))
    fit(module)
    assert len(module.refs) == 2 * len(list(module.model.parameters()))
    assert module.alive[0] == 0

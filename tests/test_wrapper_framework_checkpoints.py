"""The wrapper through the checkpoints of Lightning, the Hugging Face Trainer and accelerate.

Each framework trains the same recipe twice: once without interruption, and once
stopped halfway, saved by the framework's own checkpointing, rebuilt from
nothing (new model, new inner optimizer, new wrapper, new Trainer or
Accelerator: as a fresh process has), resumed by the framework and continued to
the same number of optimizer steps. The continued run must equal the
uninterrupted one: params, the inner optimizer's state and the transform state.
The frameworks accumulate micro-batches themselves, so the chain holds no
``accumulate``; its stateful member is ``trace``. The model has a param that
never gets a grad, which must stay untouched (torch.optim skips it).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import gradtx as gtx
from gradtx.testing import assert_trees_equal

STEPS = 4  # optimizer steps in the whole run; the interrupted run saves after STEPS // 2
K = 2  # micro-batches per optimizer step, accumulated by the framework
BATCH = 4
LR = 1e-2

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(4)))  # never gets a grad
    return model


def chain() -> gtx.GradientTransformation:
    return gtx.chain(gtx.clip_by_global_norm(0.5), gtx.trace(0.9))


def wrap(params: Any) -> gtx.TransformedOptimizer:
    return gtx.TransformedOptimizer(torch.optim.AdamW(params, lr=LR), chain())


def data(n: int = STEPS * K * BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def inner_state(opt: gtx.TransformedOptimizer) -> list[dict[str, Any]]:
    """The inner optimizer's per-param state, in param order (params of two runs are different objects)."""
    return [dict(opt.optimizer.state.get(p, {})) for g in opt.param_groups for p in g["params"]]


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _leaves(v)]
    return []


def max_difference(a: Any, b: Any) -> float:
    pairs = list(zip(_leaves(a), _leaves(b), strict=True))
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs if x.numel())


def check_resumed(model, opt, ref_model, ref_opt, what: str) -> None:
    """Continued against uninterrupted: params, inner state, transform state, bit for bit.

    Both runs execute the same ops in the same order on the same device, and a
    checkpoint stores fp32 tensors as they are, so nothing is rounded: exact.
    """
    params, ref_params = dict(model.named_parameters()), dict(ref_model.named_parameters())
    assert_trees_equal(params, ref_params)
    assert_trees_equal(inner_state(opt), inner_state(ref_opt))
    assert_trees_equal(opt.tx_state, ref_opt.tx_state)
    steps = [s["step"] for s in inner_state(opt) if "step" in s]
    assert steps and all(int(s) == STEPS for s in steps)  # the inner optimizer really stepped STEPS times
    unused = next(v for k, v in params.items() if k.endswith("unused"))
    assert unused.grad is None and torch.equal(unused.detach(), torch.ones(4))
    diffs = {
        "params": max_difference(params, ref_params),
        "inner": max_difference(inner_state(opt), inner_state(ref_opt)),
        "tx_state": max_difference(opt.tx_state, ref_opt.tx_state),
    }
    print(f"{what}: max |continued - uninterrupted| = {diffs}")  # shown with -s


def assert_moved(model: torch.nn.Module) -> None:
    """The comparison means something only if training moved the params."""
    assert not torch.allclose(model[0].weight.detach(), make_model()[0].weight.detach())


# --- Lightning ----------------------------------------------------------------------------------


def test_lightning_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model()
            self.opt = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            self.opt = wrap(self.model.parameters())
            sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: 1.0 / (1.0 + 0.5 * step))
            return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def fit(max_steps, ckpt_path=None, callbacks=()):
        module = Module()
        trainer = L.Trainer(
            max_steps=max_steps,
            accumulate_grad_batches=K,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=bool(callbacks),
            callbacks=list(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        # An epoch is STEPS // 2 optimizer steps, so the interruption falls on an epoch's last batch: Lightning
        # restarts a plain (not stateful) DataLoader's epoch on a mid-epoch resume, which changes the data seen
        # after it for plain torch.optim as much as for the wrapper.
        loader = DataLoader(TensorDataset(*data(STEPS // 2 * K * BATCH)), batch_size=BATCH, shuffle=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tiny DataLoader's num_workers hint
            trainer.fit(module, loader, ckpt_path=ckpt_path)
        assert trainer.global_step == max_steps
        return module

    ref = fit(STEPS)
    # Interrupted: a ModelCheckpoint saves every STEPS // 2 optimizer steps; the run stops at the first save.
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=STEPS // 2, save_top_k=-1)
    first = fit(STEPS // 2, callbacks=[saver])
    (ckpt,) = tmp_path.glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert "gradtx" in next(iter(saved["state"].values()))  # the transform state is in Lightning's checkpoint
    resumed = fit(STEPS, ckpt_path=str(ckpt))
    assert_moved(resumed.model)
    assert not torch.equal(first.model[0].weight, resumed.model[0].weight)
    check_resumed(resumed.model, resumed.opt, ref.model, ref.opt, "lightning")
    # the scheduler resumed too: its lr is the uninterrupted run's
    assert resumed.opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"] != LR


# --- the Hugging Face Trainer -------------------------------------------------------------------


class Batches(IterableDataset):
    """In order (an iterable dataset is not shuffled), so both runs see the same micro-batches."""

    def __iter__(self):
        x, y = data()
        for i in range(len(y)):
            yield {"x": x[i], "labels": y[i]}


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_hf_trainer_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class StopAt(TrainerCallback):
        """The interruption: training stops right after the checkpoint at `step` is written."""

        def __init__(self, step):
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                control.should_training_stop = True
            return control

    def train(folder, *, save=False, stop=None, resume=None):
        model = Classifier()
        opt = wrap(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step))
        args = TrainingArguments(
            output_dir=str(folder),
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=K,
            max_grad_norm=0.0,  # the chain clips
            use_cpu=True,
            report_to=[],
            save_strategy="steps" if save else "no",
            save_steps=STEPS // 2,
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        callbacks = [StopAt(stop)] if stop else []
        trainer = Trainer(model=model, args=args, train_dataset=Batches(), optimizers=(opt, sched), callbacks=callbacks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=resume)
        return trainer, model, opt

    _, ref_model, ref_opt = train(tmp_path / "ref")
    first, _, _ = train(tmp_path / "run", save=True, stop=STEPS // 2)
    assert first.state.global_step == STEPS // 2
    ckpt = tmp_path / "run" / f"checkpoint-{STEPS // 2}"
    assert (ckpt / "optimizer.pt").exists()
    trainer, model, opt = train(tmp_path / "run", resume=str(ckpt))
    assert trainer.state.global_step == STEPS
    assert_moved(model.net)
    check_resumed(model.net, opt, ref_model.net, ref_opt, "hf trainer")
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != LR


# --- accelerate ---------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield lambda: (AcceleratorState._reset_state(reset_partial_state=True), GradientState._reset_state())
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_accelerate_save_and_load_state_equals_uninterrupted_run(tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    def build():
        fresh_accelerate_state()  # a fresh process has no accelerate singletons either
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
        model = make_model()
        opt = wrap(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step))
        loader = DataLoader(TensorDataset(*data()), batch_size=BATCH, shuffle=False)
        prepared = accelerator.prepare(model, opt, loader, sched)
        return accelerator, model, opt, prepared

    def run(accelerator, prepared, loader, steps, until):
        model, popt, _, sched = prepared
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))  # accelerate divides by K
                popt.step()
                sched.step()
                popt.zero_grad()
            steps += accelerator.sync_gradients
            if steps == until:
                break
        return steps

    accelerator, ref_model, ref_opt, prepared = build()
    assert run(accelerator, prepared, prepared[2], 0, STEPS) == STEPS

    accelerator, _, _, prepared = build()
    assert run(accelerator, prepared, prepared[2], 0, STEPS // 2) == STEPS // 2
    accelerator.save_state(str(tmp_path / "state"))

    accelerator, model, opt, prepared = build()
    accelerator.load_state(str(tmp_path / "state"))
    rest = accelerator.skip_first_batches(prepared[2], STEPS // 2 * K)
    assert run(accelerator, prepared, rest, STEPS // 2, STEPS) == STEPS
    assert_moved(model)
    check_resumed(model, opt, ref_model, ref_opt, "accelerate")
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != LR

"""TransformedOptimizer under Hugging Face accelerate and the transformers Trainer, against plain torch."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import gradtx as gtx
from gradtx.testing import assert_trees_close

MAX_NORM = 0.5
STEPS = 4
BATCH = 8


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def data(n=STEPS * 2 * BATCH):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def torch_reference(k=1):
    """The plain loop: k micro-batches of mean loss / k, clip_grad_norm_, AdamW step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = data()
    for i in range(STEPS * k):
        xb, yb = x[BATCH * i : BATCH * (i + 1)], y[BATCH * i : BATCH * (i + 1)]
        (F.cross_entropy(model(xb), yb) / k).backward()
        if (i + 1) % k == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
    return params_of(model)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# --- accelerate ------------------------------------------------------------------------------


def accelerate_run(tx, k, *, schedule=False):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model = make_model()
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tx)
    loader = DataLoader(TensorDataset(*data()), batch_size=BATCH, shuffle=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    steps = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))  # accelerate divides by k
            opt.step()
            if schedule:
                sched.step()
            steps += accelerator.sync_gradients
            opt.zero_grad()
        if steps == STEPS:
            break
    return accelerator.unwrap_model(model), steps


@pytest.mark.parametrize("k", [1, 2])
def test_accelerate_with_its_own_accumulation_equals_torch_loop(k):
    model, steps = accelerate_run(gtx.clip_by_global_norm(MAX_NORM), k)
    assert steps == STEPS
    assert_trees_close(params_of(model), torch_reference(k), rtol=1e-5, atol=1e-6)


def test_accelerate_with_accumulate_in_the_chain_is_refused():
    """accelerate counts every step() call: its scheduler moves the lr inside the chain's window, which is refused."""
    with pytest.raises(ValueError, match=r"lr changed from .* inside an accumulation window.*"
                       r"gradient_accumulation_steps"):  # fmt: skip
        accelerate_run(gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(MAX_NORM)), 1, schedule=True)


# --- the transformers Trainer ----------------------------------------------------------------


class Batches(IterableDataset):
    """In order (an iterable dataset is not shuffled), so the plain loop sees the same micro-batches."""

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


def hf_train(tmp_path, tx, k, decay=0.0):
    from transformers import Trainer, TrainingArguments

    model = Classifier()
    opt = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tx)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + decay * step))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=k,
        max_grad_norm=0.0,  # the chain clips
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Batches(), optimizers=(opt, sched))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer, model, sched


@pytest.mark.parametrize("k", [1, 2])
def test_hf_trainer_with_its_own_accumulation_equals_torch_loop(tmp_path, k):
    trainer, model, sched = hf_train(tmp_path, gtx.clip_by_global_norm(MAX_NORM), k)
    assert trainer.state.global_step == STEPS
    assert sched.last_epoch == STEPS  # the scheduler counted optimizer steps
    assert_trees_close(params_of(model.net), torch_reference(k), rtol=1e-5, atol=1e-6)


def test_hf_trainer_with_accumulate_in_the_chain_is_refused(tmp_path):
    """The Trainer steps its scheduler on every step() call: the lr moves inside the chain's window, refused."""
    with pytest.raises(ValueError, match=r"lr changed .* inside an accumulation window.*gradient_accumulation_steps"):
        hf_train(tmp_path, gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(MAX_NORM)), 1, decay=0.5)


@pytest.mark.parametrize("fused", [False, True])
def test_accelerate_holds_its_scheduler_on_a_step_gradscaler_skips(fused):
    """accelerate reads a skipped step as one whose optimizer step GradScaler did not call (fp16 on CUDA; a CPU
    GradScaler stands for it here). Through the wrapper its prepared scheduler holds on an inf step as it does for
    the inner optimizer alone, and the run equals the torch loop with accelerate's own clip. (A fused optimizer
    takes GradScaler's inf flag itself, so accelerate sees no skip: the same with or without the wrapper.)"""

    def run(wrapped):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        opt = gtx.TransformedOptimizer(inner, gtx.clip_by_global_norm(1.0)) if wrapped else inner
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        accelerator = Accelerator(cpu=True)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        skipped = []
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
            accelerator.backward(F.mse_loss(model(x), y) * (float("inf") if i == 1 else 1.0))
            if not wrapped:  # what accelerator.clip_grad_norm_ does under fp16 on CUDA
                accelerator.scaler.unscale_(opt.optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            skipped.append(opt.step_was_skipped)
        return dict(model.named_parameters()), skipped, sched.scheduler.last_epoch

    params, skipped, epochs = run(wrapped=True)
    ref_params, ref_skipped, ref_epochs = run(wrapped=False)
    assert skipped == ref_skipped == [False, not fused, False, False]
    assert epochs == ref_epochs == (4 if fused else 3)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-7)

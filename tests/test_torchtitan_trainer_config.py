"""examples/torchtitan_trainer.py inside torchtitan 0.3.0's own config machinery (docs/torchtitan.md).

torchtitan's Trainer needs CUDA (and torchdata; its llama3 config, triton), so it does not run here.
What it does with the optimizer does: torchtitan's ``ConfigManager`` parses the command line into a
root config, ``apply_overrides`` applies ``--override.imports``, ``config.optimizer.build`` builds
the container, and ``train_step`` accumulates, runs torchtitan's ``clip_grad_norm_`` with
``training.max_norm`` and steps. The root config here, :class:`TinyJob`, has the field names of the
Trainer's (``optimizer``, ``lr_scheduler``, ``training``, ``override``), so the flags are the ones
a Trainer run takes; ``test_the_trainer_does_what_these_tests_do`` checks the Trainer's source for
the order this file assumes. The gradtx container is compared with torchtitan's plain one, built
and stepped the same way: the grads, the norms, the params, the AdamW state, the checkpoints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import gradtx as gtx
from gradtx.testing import assert_trees_close, assert_trees_equal

pytest.importorskip("torchtitan")
pytest.importorskip("tyro")

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw
from torchtitan.config import (
    ConfigManager,
    Configurable,
    OverrideConfig,
    TrainingConfig,
    apply_overrides,
)
from torchtitan.distributed.utils import clip_grad_norm_

from examples.torchtitan_trainer import GradtxOptimizersContainer

ROOT = Path(__file__).resolve().parent.parent
TARGET = "examples.torchtitan_trainer.gradtx_optimizer"
K = 2  # torchtitan's gradient accumulation steps in train_step
STEPS = 6


class TinyJob(Configurable):
    """Stands for torchtitan's ``Trainer.Config``: its fields that build and step the optimizer."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        hf_assets_path: str = str(ROOT)  # ConfigManager checks that it exists
        optimizer: OptimizersContainer.Config = field(
            default_factory=lambda: default_adamw(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
        )
        lr_scheduler: LRSchedulersContainer.Config = field(default_factory=LRSchedulersContainer.Config)
        training: TrainingConfig = field(default_factory=TrainingConfig)
        override: OverrideConfig = field(default_factory=OverrideConfig)


def tiny_job() -> TinyJob.Config:
    """The ``--config`` function, as a model's config_registry has them."""
    return TinyJob.Config()


def parse(*flags: str) -> TinyJob.Config:
    """torchtitan's command line: ``--module <this file> --config tiny_job FLAGS``."""
    config = ConfigManager().parse_args(["--module", __name__, "--config", "tiny_job", *flags])
    assert isinstance(config, TinyJob.Config)
    return config


def build(config: TinyJob.Config, model: torch.nn.Module) -> OptimizersContainer:
    """What ``Trainer.__init__`` does: apply the overrides, then build the optimizer container."""
    if config.override.imports:
        apply_overrides(config.override, config)
    return config.optimizer.build(model_parts=[model])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


BATCHES = [
    (torch.randn(8, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g))
    for g in [torch.Generator().manual_seed(1)]
    for _ in range(STEPS * K)
]


def train_step(model, optimizers, config: TinyJob.Config, step: int) -> torch.Tensor:
    """torchtitan's ``Trainer.train_step``: K micro-batches, its clip with ``training.max_norm``, one step."""
    optimizers.zero_grad()
    for x, y in BATCHES[step * K : (step + 1) * K]:
        (F.cross_entropy(model(x), y) / K).backward()
    norm = clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)
    optimizers.step()
    return norm


def inner_state(optimizers: OptimizersContainer) -> dict[str, Any]:
    """The AdamW state of the container's one optimizer, by param name (the wrapper's inner one)."""
    (opt,) = optimizers.optimizers
    opt = opt.optimizer if isinstance(opt, gtx.TransformedOptimizer) else opt
    names = {id(p): n for g in opt.param_groups for p, n in zip(g["params"], g["param_names"])}
    return {names[id(p)]: dict(s) for p, s in opt.state.items()}


def gradtx_flags(max_norm: float = 0.5, *more: str) -> list[str]:
    return ["--override.imports", f'{TARGET}={{"max_norm": {max_norm}}}', "--training.max_norm", "inf", *more]


# --- the config machinery ---------------------------------------------------------------------


def test_the_trainer_does_what_these_tests_do():
    """Trainer.Config has these fields; Trainer.__init__ applies the overrides before it builds the optimizers."""
    spec = find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    source = (Path(next(iter(spec.submodule_search_locations))) / "trainer.py").read_text(encoding="utf-8")
    for line in ("optimizer: OptimizersContainer.Config", "override: OverrideConfig", "training: TrainingConfig"):
        assert line in source, line
    applied = source.index("apply_overrides(config.override, config)")
    assert applied < source.index("self.optimizers = config.optimizer.build(model_parts=self.model_parts)")
    # and its train_step always clips, with training.max_norm, before optimizers.step()
    clip = source.index("grad_norm = dist_utils.clip_grad_norm_(")
    assert "self.config.training.max_norm" in source[clip : clip + 300]
    assert clip < source.index("self.optimizers.step()", clip)


def test_the_command_line_turns_on_the_override_and_builds_the_gradtx_container():
    config = parse(*gradtx_flags(0.25))
    assert config.training.max_norm == math.inf
    # the line torchtitan logs (docs/torchtitan.md: without it, the plain container was built)
    logged = f"[Override] {TARGET}: optimizer OptimizersContainer.Config -> GradtxOptimizersContainer.Config"
    assert apply_overrides(config.override, config) == [f"{logged} with max_norm=0.25"]
    opts = config.optimizer.build(model_parts=[make_model()])
    assert type(opts) is GradtxOptimizersContainer
    assert isinstance(config.optimizer, GradtxOptimizersContainer.Config) and config.optimizer.max_norm == 0.25
    (opt,) = opts.optimizers
    assert isinstance(opt, gtx.TransformedOptimizer) and type(opt.optimizer) is torch.optim.AdamW
    # the registry's settings came through the override: lr, betas, torchtitan's default implementation
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["fused"]) == (1e-2, (0.9, 0.999), 0.01, True)


def test_without_the_override_the_trainer_builds_the_plain_container():
    """A container subclass alone is never used: the Trainer builds what config.optimizer names."""
    opts = build(parse("--training.max_norm", "inf"), make_model())
    assert type(opts) is OptimizersContainer
    assert [type(o) for o in opts.optimizers] == [torch.optim.AdamW]


# --- stepping -----------------------------------------------------------------------------------


def test_torchtitan_max_norm_zero_leaves_gradtx_nothing_to_train_on():
    """The old advice (max_norm 0): torchtitan's clip multiplies every grad by 0, and still reports its norm."""
    config = parse(*gradtx_flags(0.5)[:2], "--training.max_norm", "0")
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opts = build(config, model)
    norm = train_step(model, opts, config, 0)
    assert norm > 0.1  # what torchtitan logs looks normal
    (opt,) = opts.optimizers
    assert float(opt.metrics["grad_norm"]) == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    decayed = [b * (1 - 1e-2 * 0.01) for b in before]  # AdamW's weight decay is all that moved them
    assert_trees_close([p.detach() for p in model.parameters()], decayed, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_the_gradtx_container_steps_as_the_plain_one_clipping(implementation):
    """gradtx's clip at 0.5 behind torchtitan's clip at inf == torchtitan's plain container with its clip at 0.5.

    "fused" is torchtitan's default and runs on CPU; the wrapper folds the clip factor into the fused step.
    """
    impl = ["--optimizer.implementation", implementation]
    plain_config = parse("--training.max_norm", "0.5", *impl)
    gradtx_config = parse(*gradtx_flags(0.5), *impl)
    plain_model, gradtx_model = make_model(), make_model()
    plain, opts = build(plain_config, plain_model), build(gradtx_config, gradtx_model)
    (opt,) = opts.optimizers
    clipped = 0
    for step in range(STEPS):
        plain_norm = train_step(plain_model, plain, plain_config, step)
        titan_norm = train_step(gradtx_model, opts, gradtx_config, step)
        # torchtitan still computes (and logs) its norm, before gradtx's clip: the same one
        torch.testing.assert_close(titan_norm, plain_norm, rtol=1e-6, atol=0)
        torch.testing.assert_close(opt.metrics["grad_norm"], plain_norm, rtol=1e-6, atol=0)
        clipped += int(plain_norm > 0.5)
    assert clipped >= STEPS // 2, "the clip should fire in this recipe"
    assert_trees_close(
        dict(gradtx_model.named_parameters()), dict(plain_model.named_parameters()), rtol=1e-5, atol=1e-6
    )
    assert_trees_close(inner_state(opts), inner_state(plain), rtol=1e-5, atol=1e-7)


# --- checkpoints --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def process_group():
    """torchtitan's CheckpointManager (DCP) needs a process group: one process, gloo."""
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def manager(folder: Path, model, optimizers, **config: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(enable=True, folder="ckpt", interval=1, last_save_model_only=False, **config),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,  # type: ignore[arg-type]
        states={}, sd_adapter=None, base_folder=str(folder),
    )  # fmt: skip


@pytest.mark.parametrize("flags", [[], gradtx_flags(0.5)], ids=["plain", "gradtx"])
def test_the_containers_resume_exactly_through_the_checkpoint_manager(tmp_path, process_group, flags):
    """Save after 3 steps, resume into a newly built job (as a new process would): equal to the uninterrupted run."""
    config = parse(*(flags or ["--training.max_norm", "0.5"]), "--optimizer.implementation", "for-loop")
    ref_model = make_model()
    ref = build(config, ref_model)
    for step in range(STEPS):
        train_step(ref_model, ref, config, step)

    model = make_model()
    opts = build(config, model)
    for step in range(3):
        train_step(model, opts, config, step)
    saved = manager(tmp_path, model, opts)
    saved.save(curr_step=3)
    saved.close()

    config = parse(*(flags or ["--training.max_norm", "0.5"]), "--optimizer.implementation", "for-loop")
    model = make_model()
    opts = build(config, model)
    loader = manager(tmp_path, model, opts)
    assert loader.load(step=3)
    loader.close()
    for step in range(3, STEPS):
        train_step(model, opts, config, step)
    assert_trees_equal(dict(model.named_parameters()), dict(ref_model.named_parameters()))
    assert_trees_equal(inner_state(opts), inner_state(ref))
    if flags:
        assert_trees_equal(opts.optimizers[0].tx_state, ref.optimizers[0].tx_state)


def test_the_gradtx_checkpoint_is_the_plain_one_plus_gradtx_entries():
    config = parse("--training.max_norm", "0.5", "--optimizer.implementation", "for-loop")
    gradtx_config = parse(*gradtx_flags(0.5), "--optimizer.implementation", "for-loop")
    plain_model, gradtx_model = make_model(), make_model()
    plain, opts = build(config, plain_model), build(gradtx_config, gradtx_model)
    for step in range(2):
        train_step(plain_model, plain, config, step)
        train_step(gradtx_model, opts, gradtx_config, step)
    plain_sd, gradtx_sd = plain.state_dict(), opts.state_dict()
    assert set(plain_sd) <= set(gradtx_sd)
    assert all(".gradtx." in key for key in set(gradtx_sd) - set(plain_sd)), sorted(set(gradtx_sd) - set(plain_sd))
    assert_trees_close({k: gradtx_sd[k] for k in plain_sd}, plain_sd, rtol=1e-5, atol=1e-7)


def test_a_plain_checkpoint_loads_into_the_gradtx_job_without_its_optimizer(tmp_path, process_group):
    """Turning gradtx on in a run with checkpoints: the manager refuses the plain optimizer state (no gradtx
    entries); with exclude_from_loading=["optimizer"] the model loads and AdamW starts afresh."""
    config = parse("--training.max_norm", "0.5", "--optimizer.implementation", "for-loop")
    model = make_model()
    plain = build(config, model)
    train_step(model, plain, config, 0)
    saved = manager(tmp_path, model, plain)
    saved.save(curr_step=1)
    saved.close()

    gradtx_config = parse(*gradtx_flags(0.5), "--optimizer.implementation", "for-loop")
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opts = build(gradtx_config, fresh)
    refusing = manager(tmp_path, fresh, opts)
    with pytest.raises(dcp.api.CheckpointException) as refused:
        refusing.load(step=1)
    assert "Missing key in checkpoint state_dict: optimizer.state.0.weight.gradtx." in str(refused.value.failures)
    refusing.close()
    loader = manager(tmp_path, fresh, opts, exclude_from_loading=["optimizer"])
    assert loader.load(step=1)
    loader.close()
    assert_trees_equal(dict(fresh.named_parameters()), dict(model.named_parameters()))
    train_step(fresh, opts, gradtx_config, 1)
    assert int(inner_state(opts)["0.weight"]["step"]) == 1


# --- gtx.accumulate in the chain: what it costs under torchtitan -------------------------------


class AccumulatingContainer(GradtxOptimizersContainer):
    """The example's container with gradtx accumulating 2 of torchtitan's steps per optimizer step."""

    def chain(self) -> gtx.GradientTransformation:
        return gtx.chain(gtx.accumulate(2), super().chain())


def accumulating(*flags: str) -> tuple[torch.nn.Module, OptimizersContainer, TinyJob.Config]:
    config = parse(*gradtx_flags(0.5), "--optimizer.implementation", "for-loop", *flags)
    apply_overrides(config.override, config)
    model = make_model()
    return model, AccumulatingContainer(config.optimizer, model_parts=[model]), config


def test_accumulating_in_the_chain_counts_torchtitans_steps_as_micro_steps():
    """4 torchtitan steps are 2 AdamW steps; torchtitan's norm is each step's part, gradtx's the window's."""
    model, opts, config = accumulating()
    (opt,) = opts.optimizers
    for step in range(4):
        titan_norm = train_step(model, opts, config, step)
        assert bool(opt.emitted) == (step % 2 == 1)
        if opt.emitted:
            assert not torch.allclose(titan_norm, opt.metrics["grad_norm"], rtol=1e-3)
    assert int(inner_state(opts)["0.weight"]["step"]) == 2


def test_accumulating_in_the_chain_refuses_torchtitans_lr_schedule():
    """torchtitan steps its scheduler after every optimizers.step(): the lr changes on consecutive calls, in a window.

    One change inside a window is accepted (an epoch scheduler's, issue 29 item 4); the second in a row is refused.
    """
    model, opts, config = accumulating()
    schedulers = LRSchedulersContainer.Config(warmup_steps=4).build(optimizers=opts, training_steps=10)
    for step in range(2):
        train_step(model, opts, config, step)
        schedulers.step()
    with pytest.raises(ValueError, match="lr changed"):
        train_step(model, opts, config, 2)

    # a constant lr (no warm-up, no decay) goes through
    model, opts, config = accumulating()
    schedulers = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0).build(optimizers=opts, training_steps=10)
    for step in range(4):
        train_step(model, opts, config, step)
        schedulers.step()
    assert int(inner_state(opts)["0.weight"]["step"]) == 2


def test_token_weighted_accumulation_needs_tokens_torchtitan_does_not_pass():
    class TokenWeighted(GradtxOptimizersContainer):
        def chain(self) -> gtx.GradientTransformation:
            return gtx.chain(gtx.accumulate(2, token_weighted=True), super().chain())

    config = parse(*gradtx_flags(0.5), "--optimizer.implementation", "for-loop")
    apply_overrides(config.override, config)
    model = make_model()
    opts = TokenWeighted(config.optimizer, model_parts=[model])
    with pytest.raises(ValueError, match="tokens"):
        train_step(model, opts, config, 0)

"""gradtx in torchtitan's own Trainer: a Config subclass and an @override, turned on with --override.imports.

torchtitan 0.3.0's Trainer builds its optimizers with ``config.optimizer.build(model_parts=...)``,
after it has applied the overrides listed in ``--override.imports``. Without an override it builds
the plain ``OptimizersContainer``, silently: a container subclass on its own is never used. This
module registers one, ``gradtx_optimizer``, which swaps the ``optimizer`` node of the config for
:class:`GradtxOptimizersContainer.Config`; its container wraps each of torchtitan's optimizers in a
:class:`gradtx.TransformedOptimizer` whose chain clips the global norm.

With this file importable as ``examples.torchtitan_trainer`` (here: ``PYTHONPATH=.``)::

    torchrun --nproc_per_node=2 -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --override.imports 'examples.torchtitan_trainer.gradtx_optimizer={"max_norm": 1.0}' \\
        --training.max_norm inf

``--training.max_norm inf``: torchtitan always runs its own clip before ``optimizers.step()``; with
``inf`` its factor is 1, with ``0`` it zeroes every gradient. It still computes its norm (and logs
it as ``grad_norm``); gradtx's is in ``opt.metrics["grad_norm"]`` of each optimizer.

Run on its own (one process, CPU), it does what the Trainer does with the config and then trains a
small model as torchtitan's ``train_step`` does:  python examples/torchtitan_trainer.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer, default_adamw
from torchtitan.config import Configurable, OverrideConfig, apply_overrides, derive, override
from torchtitan.distributed.utils import clip_grad_norm_

import gradtx as gtx


class GradtxOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container, each of its optimizers behind a gradtx chain."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        max_norm: float = 1.0
        """gradtx's clip of the global norm; set torchtitan's ``training.max_norm`` to ``inf``."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self.gradtx_config = config  # the base __init__ builds the optimizers, through the factory below
        super().__init__(config, model_parts=model_parts)

    def chain(self) -> gtx.GradientTransformation:
        """The transform in front of each optimizer: extend it here (a chain of several works alike)."""
        return gtx.clip_by_global_norm(self.gradtx_config.max_norm)

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., torch.optim.Optimizer]:  # type: ignore[override]
        inner = OptimizersContainer._resolve_optimizer_factory(name)

        def build(param_groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
            return gtx.TransformedOptimizer(inner(param_groups, **kwargs), self.chain())

        return build


@override(target=OptimizersContainer.Config, exact=True, description="gradtx: a chain in front of each optimizer")
def gradtx_optimizer(config: OptimizersContainer.Config, **settings: Any) -> GradtxOptimizersContainer.Config:
    """The override: the same param groups and implementation, plus the chain's settings (``max_norm``)."""
    return derive(config, GradtxOptimizersContainer.Config, **settings)


# --- the rest runs the example: what the Trainer does with these, on CPU ------------------------


class Job(Configurable):
    """Stands for torchtitan's ``Trainer.Config`` here (the Trainer needs CUDA): the fields the optimizer needs."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        optimizer: OptimizersContainer.Config = field(default_factory=OptimizersContainer.Config)
        override: OverrideConfig = field(default_factory=OverrideConfig)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 3))
    job = Job.Config(
        # torchtitan's default implementation, "fused", runs on CPU too (torch >= 2.4), clip folded in
        optimizer=default_adamw(lr=1e-2, weight_decay=0.0),
        # as --override.imports '<this module>.gradtx_optimizer={"max_norm": 0.1}' sets it
        override=OverrideConfig(imports=[(f"{gradtx_optimizer.__module__}.gradtx_optimizer", {"max_norm": 0.1})]),
    )
    apply_overrides(job.override, job)  # Trainer.__init__, before it builds any component
    optimizers = job.optimizer.build(model_parts=[model])  # Trainer.__init__
    assert isinstance(optimizers, GradtxOptimizersContainer), type(optimizers)
    (opt,) = optimizers.optimizers

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(6, 3, generator=g)  # the labels the model learns: argmax of a fixed projection
    losses = []
    for step in range(20):  # Trainer.train_step: accumulate 4 micro-batches, clip, step
        optimizers.zero_grad()
        total = 0.0
        for _ in range(4):
            x = torch.randn(16, 6, generator=g)
            y = (x @ teacher).argmax(dim=1)
            loss = torch.nn.functional.cross_entropy(model(x), y) / 4
            loss.backward()
            total += loss.item()
        norm = clip_grad_norm_(list(model.parameters()), float("inf"), foreach=True)  # --training.max_norm inf
        optimizers.step()
        losses.append(total)
        if step % 5 == 0:
            print(f"step {step:2d} loss {total:.4f} torchtitan grad_norm {norm.item():.4f} "
                  f"gradtx grad_norm {opt.metrics['grad_norm'].item():.4f}")  # fmt: skip
    print(f"initial_loss={losses[0]:.6f} final_loss={losses[-1]:.6f}")


if __name__ == "__main__":
    main()

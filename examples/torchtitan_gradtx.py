"""A gradtx chain inside torchtitan: its OptimizersContainer builds TransformedOptimizers, its CheckpointManager saves.

torchtitan builds one optimizer per model part and optimizer name through
``OptimizersContainer._resolve_optimizer_factory``; a subclass returns a
factory that wraps torch's AdamW in a :class:`gradtx.TransformedOptimizer`.
Everything else is torchtitan's own: its ``step``/``zero_grad``, its flattened
FQN-keyed optimizer state dict, its DCP ``CheckpointManager``.

The chain accumulates; the checkpoint is taken at a window boundary (a mid-window one is refused
when torchtitan loads it into its template: docs/torchtitan.md). In torchtitan's
Trainer, accumulate with torchtitan instead and keep gradtx's clip; examples/torchtitan_trainer.py
is how the Trainer builds this container (docs/torchtitan.md says why).

Run (one process, CPU, gloo):  python examples/torchtitan_gradtx.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer, default_adamw

import gradtx as gtx


def gradtx_chain() -> gtx.GradientTransformation:
    """What gradtx adds in front of AdamW: a window of 2 micro-steps, a clip of the global norm, a momentum trace."""
    return gtx.chain(gtx.accumulate(2), gtx.clip_by_global_norm(1.0), gtx.trace(0.5))


class GradtxOptimizersContainer(OptimizersContainer):
    """torchtitan's container, each of its optimizers wrapped in a gradtx chain."""

    chain: Callable[[], gtx.GradientTransformation] = staticmethod(gradtx_chain)

    @classmethod
    def _resolve_optimizer_factory(cls, name: str) -> Callable[..., torch.optim.Optimizer]:
        inner = OptimizersContainer._resolve_optimizer_factory(name)

        def build(param_groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
            return gtx.TransformedOptimizer(inner(param_groups, **kwargs), cls.chain())

        return build


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def build(folder: str) -> tuple[torch.nn.Module, OptimizersContainer, CheckpointManager]:
    model = make_model()
    config = default_adamw(lr=1e-2, weight_decay=0.0)  # torchtitan's default implementation: fused, on CPU too
    optimizers = GradtxOptimizersContainer(config, model_parts=[model])
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="ckpt", interval=1, last_save_model_only=False),
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=None,  # type: ignore[arg-type]
        states={},
        sd_adapter=None,
        base_folder=folder,
    )
    return model, optimizers, manager


def train(model: torch.nn.Module, optimizers: OptimizersContainer, data: list[Any]) -> None:
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        optimizers.step()  # every micro-step: the chain's window decides when AdamW steps
        optimizers.zero_grad()


def main() -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    data = batches(8)
    with tempfile.TemporaryDirectory() as folder:
        model, optimizers, manager = build(folder)
        train(model, optimizers, data[:4])  # saves at a window boundary: torchtitan loads into a template
        manager.save(curr_step=4)
        manager.close()

        resumed_model, resumed_opts, resumed_manager = build(folder)  # as a fresh process would
        resumed_manager.load(step=4)
        train(resumed_model, resumed_opts, data[4:])
        resumed_manager.close()

    reference = make_model()  # the same recipe, uninterrupted
    ref_opts = GradtxOptimizersContainer(default_adamw(lr=1e-2, weight_decay=0.0), model_parts=[reference])
    train(reference, ref_opts, data)
    diff = max((a - b).abs().max().item() for a, b in zip(resumed_model.parameters(), reference.parameters()))
    print(f"max |resumed - uninterrupted| = {diff:.3g}")
    if diff > 1e-6:
        sys.exit(1)


if __name__ == "__main__":
    main()

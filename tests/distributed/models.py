"""Toy models for the multi-process tests, and the single-device references they are checked against.

Every model is built from a seed, so each rank (and the reference inside each
rank) starts from bitwise-identical weights. The references use only
``torch`` and ``torch.nn.utils``, never gradtx, so they are independent.
"""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, OUT = 8, 16, 4
VOCAB, SEQ = 13, 5


class FeedForward(nn.Module):
    """A TP-able block: ``w1`` is column-parallel, ``w2`` row-parallel, ``norm`` replicated over TP."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.w2(torch.tanh(self.w1(x))))


class ToyNet(nn.Module):
    """Two TP-able blocks and an unsharded head; big enough to mix Shard, _StridedShard and Replicate."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([FeedForward(), FeedForward()])
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def toy_net(seed: int = 0) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet()


def tp_plan() -> dict[str, object]:
    """The TP plan for one :class:`FeedForward` (Megatron-style colwise then rowwise)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def batch(seed: int, n: int = 8, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.randn(n, OUT, generator=g)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


# --- a tiny LM with a tied embedding, split into two pipeline stages --------------------------


class Stage0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = FeedForward()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids))


class Stage1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = FeedForward()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(h))


class TiedLM(nn.Module):
    """The single-device reference: ``head.weight`` *is* ``emb.weight``, so autograd sums its two grads."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stage0 = Stage0()
        self.stage1 = Stage1()
        self.stage1.head.weight = self.stage0.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stage1(self.stage0(ids))


def tied_lm_stages(seed: int = 0) -> tuple[Stage0, Stage1]:
    """Two untied stage modules with the reference's weights: the head starts as a copy of the embedding."""
    ref = TiedLM(seed)
    s0, s1 = copy.deepcopy(ref.stage0), Stage1()
    s1.load_state_dict({k: v.detach().clone() for k, v in ref.stage1.state_dict().items()})
    return s0, s1


def lm_batch(seed: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# --- single-device references -----------------------------------------------------------------


def reference_grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Backward ``loss`` and return ``{name: grad}`` of ``model`` (tied params appear once, as autograd sums them)."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_clip(grads: dict[str, torch.Tensor], max_norm: float, norm_type: float):
    """``torch.nn.utils.clip_grad_norm_`` on copies: returns ``(norm, clipped grads)``."""
    params = {n: nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm, norm_type=norm_type)
    return norm, {n: p.grad for n, p in params.items()}


def reference_agc(
    grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor], clipping: float, eps: float = 1e-3
) -> dict[str, torch.Tensor]:
    """AGC written out per unit (dim 0 is the output unit; a 0-d or 1-d tensor is one unit), in plain loops."""
    out = {}
    for name, g in grads.items():
        w = params[name]
        units_g = [g] if g.ndim <= 1 else list(g)
        units_w = [w] if w.ndim <= 1 else list(w)
        clipped = []
        for gu, wu in zip(units_g, units_w):
            gn = math.sqrt(float((gu.detach().double() ** 2).sum()))
            wn = max(math.sqrt(float((wu.detach().double() ** 2).sum())), eps)
            bound = clipping * wn
            clipped.append(gu * (bound / max(gn, 1e-6)) if gn > bound else gu)
        out[name] = clipped[0] if g.ndim <= 1 else torch.stack(clipped)
    return out


# --- results across the process boundary --------------------------------------------------------


def pack(obj: Any) -> bytes:
    """Serialise a rank's result to bytes.

    A tensor put on a multiprocessing queue travels as a shared-memory handle
    that dies with the worker, so a rank that returns and exits first leaves
    the parent unable to read it; bytes have no such lifetime.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)

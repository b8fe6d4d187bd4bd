# torchrun --nproc-per-node 2
"""The grad norm measured in DDP's backward: gtx.norm_in_backward, and the clip that takes it.

Run with ``torchrun --nproc-per-node 2 examples/ddp_backward_norm.py`` (CPU, gloo). A comm hook
measures each DDP bucket's grads as soon as its all-reduce completes; the clip at ``step()`` only
adds one value per bucket. Each step is checked against a second DDP copy clipped by
``torch.nn.utils.clip_grad_norm_``.
"""

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradtx as gtx

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
base = torch.nn.Sequential(
    torch.nn.Linear(16, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 4)
)
model = DDP(copy.deepcopy(base), bucket_cap_mb=0.5)  # 1.1 MB of params: DDP makes several buckets
ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.5)

bn = gtx.norm_in_backward(model, 2.0)  # the comm hook, and the object the clip reads it from
tx = gtx.clip_by_global_norm(0.1, precomputed=bn)
opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), tx)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

g = torch.Generator().manual_seed(rank)
for step in range(3):
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()  # buckets measured as they are reduced
    opt.step()  # the clip adds the buckets' parts: no pass over the grads here
    opt.zero_grad()

    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt.step()
    ref_opt.zero_grad()
    norm = opt.metrics["grad_norm"]
    torch.testing.assert_close(norm, ref_norm, rtol=2e-6, atol=0)
    assert bn.used == step + 1 and bn.fallbacks == 0  # every step took the value from the backward
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    if rank == 0:
        print(f"step: {step} grad_norm={float(norm):.6f} clip_grad_norm_={float(ref_norm):.6f} buckets={bn.buckets}")

dist.barrier()  # every rank is done before the group goes away (gloo aborts otherwise)
dist.destroy_process_group()

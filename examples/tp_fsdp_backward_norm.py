# torchrun --nproc-per-node 4
"""The grad norm in the backward of a TP x FSDP2 model: the last hook starts the one reduction.

Run with ``torchrun --nproc-per-node 4 examples/tp_fsdp_backward_norm.py`` (CPU, gloo). The MLP is
split colwise/rowwise over ``tp`` and sharded by FSDP2 over ``dp`` (mesh dp=2 x tp=2).
``gtx.norm_in_backward`` hooks every sharded param: each grad is measured as soon as FSDP2 has
reduced it. The norm's plan is one all-reduce over the whole mesh, so from the second step on the
last hook of the backward starts that all-reduce itself and ``step()`` only waits on it
(``bn.early`` counts these steps). Each step is checked against the norm of the gathered grads.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradtx as gtx

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)  # replicated over tp: sharded over dp only
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


torch.manual_seed(0)
model = MLP()
parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
bn = gtx.norm_in_backward(model, 2.0)  # a post-accumulate-grad hook on every sharded param
opt = gtx.TransformedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(0.1, precomputed=bn)
)

g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # one batch per dp rank, the same on its tp ranks
for step in range(3):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()  # from step 1 on, the last hook starts the reduction
    full = [p.grad.full_tensor() for p in model.parameters()]  # the gathered grads, for the check only
    opt.step()  # waits on the reduction the backward started (step 0: reduces here, and arms the hooks)
    opt.zero_grad()
    norm = opt.metrics["grad_norm"]
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(full), rtol=2e-6, atol=0)
    assert (bn.used, bn.early, bn.fallbacks) == (step + 1, step, 0)
    if dist.get_rank() == 0:
        print(f"step: {step} grad_norm={float(norm):.6f} reduction started in the backward: {bn.early > 0}")

dist.barrier()  # every rank is done before the group goes away (gloo aborts otherwise)
dist.destroy_process_group()

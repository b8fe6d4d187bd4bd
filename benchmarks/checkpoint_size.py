"""Checkpoint sizes: a plain torch.optim.AdamW against TransformedOptimizer, with torch.save and dcp.save.

Run: ``.venv/bin/python benchmarks/checkpoint_size.py`` (CPU, one process, a 1.05 M-param MLP).
"""

import io
import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import gradtx as gtx

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
n = sum(p.numel() for p in model.parameters())


def size_torch(sd):
    b = io.BytesIO()
    torch.save(sd, b)
    return b.tell()


def size_dcp(sd):
    with tempfile.TemporaryDirectory() as d:
        dcp.save(sd, checkpoint_id=d)
        return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


x = torch.randn(8, 512)
plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(x).square().mean().backward()
plain.step()
plain.zero_grad()
opt = gtx.TransformedOptimizer(
    torch.optim.AdamW(model.parameters(), lr=1e-3), gtx.chain(gtx.accumulate(4), gtx.clip_by_global_norm(1.0))
)
for _ in range(5):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
print(f"params: {n} ({n * 4 / 2**20:.2f} MiB fp32), window open: {opt.window_open}")
sd_open = opt.state_dict()
dsd_open = get_optimizer_state_dict(model, opt)
print(
    f"{'wrapper accumulate(4)+clip, mid-window':40s} torch.save {size_torch(sd_open) / 2**20:7.2f} MiB   dcp.save {size_dcp({'optim': dsd_open}) / 2**20:7.2f} MiB"
)
for _ in range(3):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
assert not opt.window_open
nowin = gtx.TransformedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), gtx.clip_by_global_norm(1.0))
model(x).square().mean().backward()
nowin.step()
nowin.zero_grad()
for name, o in (("plain AdamW", plain), ("wrapper clip only", nowin), ("wrapper accumulate(4)+clip, boundary", opt)):
    sd = o.state_dict()
    dsd = get_optimizer_state_dict(model, o)
    print(
        f"{name:40s} torch.save {size_torch(sd) / 2**20:7.2f} MiB   dcp.save {size_dcp({'optim': dsd}) / 2**20:7.2f} MiB"
    )

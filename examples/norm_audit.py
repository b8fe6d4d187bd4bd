"""The norm audit on a TP x FSDP2 model: which mesh dims each grad's norm is summed over, and its share.

A small transformer's grads are laid out as TP x FSDP2 lays them out on a 2 x 2 ("dp", "tp") mesh,
simulated in this process (gtx.testing.simulated_mesh: torch's LocalTensorMode, no torchrun). The audit
prints, per leaf, its placements, the elements each rank holds, the dims its p-th power is summed over
and the ones skipped as replicated, and its share of the squared norm; the norm must equal the one of
the unsharded model. Then a declared plan that sums the LayerNorm weights over "tp" (where they are
replicated) shows the double count in the shares.

Run: python examples/norm_audit.py   (exits 1 if a check fails)
"""

from __future__ import annotations

import sys

import torch

import gradtx as gtx
from gradtx import testing


def transformer_grads() -> dict[str, torch.Tensor]:
    """The grads of one step of a 2-layer transformer LM on random tokens, on one device."""
    torch.manual_seed(0)
    d, vocab = 32, 50
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(vocab, d),
            "blocks": torch.nn.TransformerEncoder(
                torch.nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True), 2
            ),
            "head": torch.nn.Linear(d, vocab),
        }
    )
    tokens = torch.randint(0, vocab, (4, 12))
    logits = model["head"](model["blocks"](model["emb"](tokens)))
    torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def main() -> int:
    grads = transformer_grads()
    expected = float(gtx.global_norm(grads))
    with testing.simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        sharded = testing.distribute(grads, mesh, "tp_fsdp")
        audit = gtx.norm_audit(sharded)
        print(audit)
        # The same grads with a wrong declaration: LayerNorm weights are replicated over tp, summed here.
        wrong = gtx.mesh_groups(sharded, sharded={"*norm*": "tp"})
        double = gtx.norm_audit(sharded, wrong)
    print(f"\none device: {expected:.6f}   audit (TP x FSDP2, 4 simulated ranks): {audit.norm:.6f}")
    norm_rows = [r for r in double if "norm" in r.path]
    print(f"declared sum over tp for {len(norm_rows)} LayerNorm leaves: norm {double.norm:.6f}, e.g.")
    for r in norm_rows[:2]:
        print(f"  {r.path}: summed over {r.summed}, share {audit.row(r.path).share:.2%} -> {r.share:.2%}")
    ok = isinstance(audit.norm, float) and abs(audit.norm - expected) <= 1e-5 * expected
    ok = ok and all(r.summed == ("dp",) for r in audit if "norm" in r.path)
    ok = ok and all(r.summed == ("dp", "tp") for r in norm_rows) and double.norm > audit.norm
    print("norm_audit: ok" if ok else "norm_audit: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

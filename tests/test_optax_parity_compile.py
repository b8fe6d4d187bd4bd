"""The optax-parity transforms compile as one graph: torch.compile sees no data-dependent break in their updates."""

from __future__ import annotations

import torch

import gradtx as gtx
from tests.optax_parity import grads_like, params_tree


def _every_other(step):
    return step % 2 == 0


def test_a_chain_of_the_new_transforms_has_no_graph_break():
    # sgd rather than adam inside: this checks the new transforms, not Adam's eager fast path.
    tx = gtx.chain(
        gtx.monitor({"norm": gtx.global_norm, "norm_ema": gtx.measure_with_ema(gtx.global_norm, 0.9)}),
        gtx.centralize(),
        gtx.normalize_by_update_norm(),
        gtx.ema(0.9),
        gtx.scale_by_lion(),
        gtx.scale_by_trust_ratio(),
        gtx.conditionally_mask(gtx.sgd(0.1, momentum=0.9), _every_other),
        gtx.reduce_on_plateau(patience=1),
    )
    params = params_tree()
    state = tx.init(params)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda g, s, p, v: tx.update(g, s, p, value=v))(
        grads_like(params, 0), state, params, torch.tensor(1.0)
    )
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]

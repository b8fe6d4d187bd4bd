"""gradtx.wrapper.grads: which params the transform sees, and its state as params join."""

import torch

import gradtx as gtx
from gradtx.testing import assert_trees_equal
from gradtx.wrapper import grads


def test_a_param_joining_mid_group_keeps_everyone_elses_state_by_identity():
    a, b, c = (torch.nn.Parameter(torch.full((2,), float(i))) for i in range(3))
    b.requires_grad_(False)
    groups = [{"params": [a, b, c]}]
    old = grads.trainable(groups)
    assert old == [[a, c]]
    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.trace(0.5))
    state = tx.update([[torch.ones(2), torch.full((2,), 2.0)]], tx.init(old), old)[1]
    b.requires_grad_(True)
    assert grads.joined(old, groups, [b]) is None  # no grad yet: not joined
    b.grad = torch.ones(2)
    new = grads.joined(old, groups, [b])
    assert new == [[a, b, c]]
    grown = grads.regrow(tx, state, old, new)
    old_trace, new_trace = state[1].trace[0], grown[1].trace[0]
    assert new_trace[0] is old_trace[0] and new_trace[2] is old_trace[1]  # a and c keep theirs
    assert_trees_equal(new_trace[1], torch.zeros(2))  # b starts fresh, as tx.init gives it
    assert grown[0] is state[0] or grown[0] == state[0]


def test_a_missing_grad_reads_as_zeros_only_on_an_emitting_step():
    p = torch.nn.Parameter(torch.ones(3))
    assert_trees_equal(grads.missing(p, emitting=True), torch.zeros(3))
    assert grads.missing(p, emitting=False).numel() == 0


def test_write_and_undo():
    p = torch.nn.Parameter(torch.ones(2))
    g = torch.ones(2)
    p.grad = g
    replaced = grads.write([[p]], [[torch.full((2,), 3.0)]])
    assert float(p.grad[0]) == 3.0
    assert replaced == [(p, g)]  # what the wrapper puts back if the inner step raises

"""accumulate / apply_if_finite / TransformedOptimizer with a comm, in one process.

The data-parallel math is checked against a simulated second rank: :class:`PeerComm`
adds the other rank's tensors (given by the test) to this rank's, so the expected
numbers can be written down by hand. :class:`gradtx.testing.RecordingComm` counts
the collectives. The real multi-process runs are in ``tests/distributed/``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import gradtx as gtx
import gradtx.checkpoint.layout as checkpoint_layout
from gradtx.comm import LocalComm, ReduceOp
from gradtx.testing import RecordingComm, assert_pure, assert_trees_close, assert_trees_equal
from gradtx.wrapper import sum_grad_reduction


class PeerComm:
    """A two-rank :class:`~gradtx.comm.Comm` in one process: each call folds in the next queued peer tensors."""

    def __init__(self, *peers: Sequence[torch.Tensor]) -> None:
        self.peers = [list(p) for p in peers]

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: object) -> list[torch.Tensor]:
        del group
        peer = self.peers.pop(0)
        assert len(peer) == len(tensors), "the test queued the wrong number of peer tensors"
        combine = torch.add if ReduceOp(op) is ReduceOp.SUM else torch.maximum
        return [combine(t, p.to(t.dtype)) for t, p in zip(tensors, peer)]

    def size(self, group: object) -> int:
        del group
        return 2


def _tokens(n: int) -> torch.Tensor:
    """The peer's part of the window's one count collective: its tokens, then its loss weight and sum (none)."""
    return torch.tensor([n, 0.0, 0.0], dtype=torch.float64)


# --- accumulate: reduce_grads and the token total -------------------------------------------------


def test_token_weighted_reduce_grads_divides_the_global_sum_by_the_global_token_count():
    g1, g2 = (
        {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)},
        {"w": torch.tensor([5.0, -4.0]), "b": torch.tensor(1.0)},
    )
    peer_sum = {"w": torch.tensor([10.0, 20.0]), "b": torch.tensor(-6.0)}  # the other rank's window, summed
    # optree flattens a dict in sorted key order: "b", then "w".
    comm = RecordingComm(PeerComm([_tokens(7)], [peer_sum["b"], peer_sum["w"]]))
    tx = gtx.accumulate(2, token_weighted=True, comm=comm, group="dp", reduce_grads=True)
    state = tx.init(g1)
    out, state = tx.update(g1, state, tokens=2)
    assert out is None and comm.calls == []  # a holding micro-step never communicates
    out, state = tx.update(g2, state, tokens=3)
    total = 2 + 3 + 7
    expected = {k: (g1[k] + g2[k] + peer_sum[k]) / total for k in g1}
    assert_trees_close(out, expected, rtol=1e-6)
    assert int(state.last_tokens) == total and int(gtx.metrics(state)["tokens"]) == total
    # One count collective (tokens, loss weight, loss sum), then one coalesced grad collective with every leaf,
    # both over "dp".
    assert [(c.op, c.group, c.num_tensors) for c in comm.calls] == [("sum", "dp", 1), ("sum", "dp", 2)]
    assert comm.calls[0].shapes == ((3,),)
    assert sorted(comm.calls[1].shapes) == [(), (2,)]


def test_token_total_alone_is_one_small_collective_and_grads_stay_local():
    comm = RecordingComm(PeerComm([_tokens(6)]))
    tx = gtx.accumulate(1, token_weighted=True, comm=comm, group="dp")
    g = {"w": torch.tensor([4.0, 8.0])}
    out, _ = tx.update(g, tx.init(g), tokens=2)
    assert_trees_equal(out, {"w": g["w"] / 8})  # DDP/FSDP2 summed the grads already; only the count is global
    assert [(c.op, c.num_tensors, c.shapes) for c in comm.calls] == [("sum", 1, ((3,),))]  # with the loss


def test_plain_mean_reduce_grads_divides_by_micro_steps_times_ranks():
    peer = torch.tensor([3.0, 30.0])
    comm = RecordingComm(PeerComm([peer]))
    tx = gtx.accumulate(2, comm=comm, reduce_grads=True)
    state = tx.init({"w": torch.zeros(2)})
    _, state = tx.update({"w": torch.tensor([1.0, 2.0])}, state)
    out, state = tx.update({"w": torch.tensor([2.0, 4.0])}, state)
    assert_trees_close(out, {"w": (torch.tensor([3.0, 6.0]) + peer) / 4}, rtol=1e-6)
    assert [(c.op, c.num_tensors) for c in comm.calls] == [("sum", 1)]  # no token collective when not weighted


class _RankedPeerComm(PeerComm):
    """:class:`PeerComm` as rank 0 of its two ranks (what a checkpoint load asks)."""

    def rank(self, group: object) -> int:
        del group
        return 0

    def group_id(self, group: object) -> object:
        return group


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)])
def test_a_plain_reduce_grads_window_resumed_on_another_number_of_ranks_is_the_mean_over_its_micro_batches(
    saved_on, resumed_on
):
    # Micro-batch i of the global batch is split over the ranks; each rank feeds its rows' mean-loss grad. A
    # window saved after micro-step 1 on `saved_on` ranks and closed on `resumed_on` must emit what one device
    # gets: the mean over the window of each whole micro-batch's mean-loss grad.
    g = torch.Generator().manual_seed(0)
    w0, batches = torch.randn(3, 4, generator=g), [(torch.randn(8, 4, generator=g), torch.randn(8, 3)) for _ in "ab"]

    def grad(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        w = w0.clone().requires_grad_()
        return {"w": torch.autograd.grad(F.mse_loss(x @ w.T, y), w)[0]}

    def rows(i: int, rank: int, ranks: int) -> dict[str, torch.Tensor]:
        x, y = batches[i]
        return grad(x[rank * 8 // ranks : (rank + 1) * 8 // ranks], y[rank * 8 // ranks : (rank + 1) * 8 // ranks])

    def comm(ranks: int, peer: dict[str, torch.Tensor]) -> Any:  # rank 0 of `ranks`; the peer's sum when two
        return LocalComm() if ranks == 1 else _RankedPeerComm([peer["w"]])

    params = {"w": w0}
    saving = gtx.accumulate(2, comm=comm(saved_on, rows(0, 1, 2)), reduce_grads=True)
    _, state = saving.update(rows(0, 0, saved_on), saving.init(params), params)
    saved = gtx.checkpoint.state_dict(state, params, tx=saving)
    resuming = gtx.accumulate(2, comm=comm(resumed_on, rows(1, 1, 2)), reduce_grads=True)
    state = gtx.checkpoint.load_state_dict(saved, resuming.init(params), params, tx=resuming)
    out, _ = resuming.update(rows(1, 0, resumed_on), state, params)
    one_device = [grad(*batch)["w"] for batch in batches]
    assert_trees_close(out, {"w": (one_device[0] + one_device[1]) / 2}, rtol=1e-5, atol=1e-6)


def test_reduce_grads_runs_in_fp32_and_emits_the_grads_dtype():
    comm = RecordingComm()
    tx = gtx.accumulate(2, comm=comm, reduce_grads=True)
    g = {"w": torch.full((4,), 1.5, dtype=torch.bfloat16)}
    state = tx.init(g)
    _, state = tx.update(g, state)
    out, _ = tx.update(g, state)
    assert comm.calls[0].shapes == ((4,),)
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], g["w"])


def test_a_rank_with_no_tokens_is_fine_a_global_zero_skips_before_the_grad_collective():
    comm = RecordingComm(PeerComm([_tokens(4)], [torch.tensor([8.0])]))
    tx = gtx.accumulate(1, token_weighted=True, comm=comm, reduce_grads=True)
    g = {"w": torch.tensor([0.0])}  # no valid tokens here: a zero grad sum
    out, _ = tx.update(g, tx.init(g), tokens=0)
    assert_trees_equal(out, {"w": torch.tensor([2.0])})

    comm = RecordingComm(PeerComm([_tokens(0)]))
    tx = gtx.accumulate(2, token_weighted=True, comm=comm, reduce_grads=True)
    state = tx.init(g)
    _, state = tx.update(g, state, tokens=0)
    out, state = tx.update(g, state, tokens=0)
    assert out is None and int(state.empty_windows) == 1 and int(state.micro_step) == 0
    assert [c.num_tensors for c in comm.calls] == [1]  # the token total only: every rank stops at the same point


def test_flush_with_reduce_grads_closes_a_short_window():
    comm = RecordingComm(PeerComm([_tokens(1)], [torch.tensor([2.0])]))
    tx = gtx.accumulate(4, token_weighted=True, comm=comm, reduce_grads=True)
    state = tx.init({"w": torch.zeros(1)})
    _, state = tx.update({"w": torch.tensor([3.0])}, state, tokens=1)
    out, state = tx.update({"w": torch.tensor([4.0])}, state, tokens=2, flush=True)
    assert_trees_close(out, {"w": torch.tensor([(3.0 + 4.0 + 2.0) / 4])}, rtol=1e-6)
    assert int(state.micro_step) == 0 and len(comm.calls) == 2


def test_window_reduce_writes_into_the_donated_buffers():
    grad = torch.tensor([2.0, 4.0])
    comm = RecordingComm(PeerComm([torch.tensor([6.0, 6.0])]))
    window = gtx.accumulate(1, token_weighted=True, comm=comm, reduce_grads=True).window
    out = window.reduce([grad], write_back=True)
    assert out[0] is grad  # the .grad object (and a DTensor's metadata) is kept
    assert torch.equal(grad, torch.tensor([8.0, 10.0]))


def test_the_wrapper_sums_the_window_in_grad_over_ranks_and_divides_by_the_global_tokens():
    p = torch.nn.Parameter(torch.zeros(2))
    grad = torch.tensor([2.0, 4.0])
    p.grad = grad
    comm = PeerComm([_tokens(3)], [torch.tensor([1.0, 1.0])])
    tx = gtx.accumulate(1, token_weighted=True, comm=comm, reduce_grads=True)
    opt = gtx.TransformedOptimizer(torch.optim.SGD([p], lr=1.0), tx)
    opt.step(tokens=1)
    assert torch.equal(p.grad, torch.tensor([3.0, 5.0]) / 4)  # summed over the ranks, then the mean
    assert torch.equal(p.detach(), -torch.tensor([3.0, 5.0]) / 4)


def test_a_step_that_raises_after_the_window_closes_leaves_grad_unreduced_for_the_retry():
    """The wrapper sums .grad over the ranks before the chain's other members run: one that then raises (a forgotten
    value=) must leave .grad as autograd made it, or the retried step sums it over the ranks a second time."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([2.0, 4.0])
    peer = [torch.tensor([1.0, 1.0])]
    comm = PeerComm(peer, peer)  # the failed step's collective, then the retry's
    tx = gtx.chain(gtx.accumulate(1, comm=comm, reduce_grads=True), gtx.reduce_on_plateau())
    opt = gtx.TransformedOptimizer(torch.optim.SGD([p], lr=1.0), tx)
    with pytest.raises(ValueError, match="reduce_on_plateau: update\\(\\) needs value="):
        opt.step()
    assert torch.equal(p.grad, torch.tensor([2.0, 4.0])) and torch.equal(p.detach(), torch.zeros(2))
    opt.step(value=1.0)
    # The two ranks' sum (2 + 1, 4 + 1), divided by the window's k * ranks = 2: once, not twice.
    assert torch.equal(p.detach(), -torch.tensor([3.0, 5.0]) / 2)


def test_a_param_without_a_grad_here_steps_on_the_other_ranks_sum():
    """The window sums .grad over the ranks: a param this rank gave no grad (unused here, or no backward at all in
    the window) steps on the sum as it does on the rank that did, so the ranks' params stay equal."""
    used, unused = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    used.grad = torch.tensor([2.0, 4.0])
    peer_grads = [torch.tensor([1.0, 1.0]), torch.tensor([3.0, 6.0, 9.0])]  # the other rank used both
    comm = PeerComm([_tokens(2)], peer_grads)
    tx = gtx.accumulate(1, token_weighted=True, comm=comm, reduce_grads=True)
    opt = gtx.TransformedOptimizer(torch.optim.SGD([used, unused], lr=1.0), tx)
    opt.step(tokens=1)
    torch.testing.assert_close(used.detach(), -torch.tensor([3.0, 5.0]) / 3)
    torch.testing.assert_close(unused.detach(), -torch.tensor([3.0, 6.0, 9.0]) / 3)


class DeviceComm:
    """One rank of a job whose grads live on an accelerator (``meta`` stands in for it): records each collective's
    devices; a meta token total comes back as ones on the host (a meta tensor holds no values), the rest as given."""

    def __init__(self) -> None:
        self.devices: list[list[str]] = []

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp, group: object) -> list[torch.Tensor]:
        del op, group
        self.devices.append([t.device.type for t in tensors])
        return [torch.ones(t.shape, dtype=t.dtype) if t.dtype == torch.float64 else t for t in tensors]

    def size(self, group: object) -> int:
        del group
        return 2


def test_a_rank_with_no_grad_at_all_issues_the_token_total_on_the_params_device():
    """Another rank sends its token total from the grads' device; a rank whose grads were all ``None`` sent its
    from the host, which a GPU process group (NCCL) refuses, or a mixed one reduces in another backend: a hang."""
    params = {"a": torch.zeros(3, device="meta"), "b": torch.zeros(2, device="meta")}
    expected = {}
    for name, grads in (("some", {"a": torch.ones(3, device="meta"), "b": None}), ("none", {"a": None, "b": None})):
        comm = DeviceComm()
        tx = gtx.accumulate(1, token_weighted=True, comm=comm, reduce_grads=True)
        out, _ = tx.update(grads, tx.init(params), params, tokens=0)
        assert {n: u.device.type for n, u in out.items()} == {"a": "meta", "b": "meta"}
        expected[name] = comm.devices
    assert expected["none"] == expected["some"] == [["meta"], ["meta", "meta"]]


def test_reduce_grads_is_pure():
    tx = gtx.accumulate(2, token_weighted=True, comm=RecordingComm(), reduce_grads=True)
    grads = {"w": torch.randn(3), "b": torch.randn(2, 2)}
    assert_pure(tx, grads, steps=3, tokens=4)


def test_state_carries_k():
    state = gtx.accumulate(5).init({"w": torch.zeros(1)})
    assert int(state.k) == 5


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"reduce_grads": True}, ValueError, "reduce_grads=True needs a comm"),
        ({"comm": object()}, TypeError, "comm must implement"),
        ({"reduce_grads": 1, "comm": LocalComm()}, TypeError, "reduce_grads must be a bool"),
        ({"token_weighted": "yes"}, TypeError, "token_weighted must be a bool"),
    ],
)
def test_bad_options_raise_naming_the_argument(kwargs, err, match):
    with pytest.raises(err, match=match):
        gtx.accumulate(2, **kwargs)


# --- apply_if_finite: global agreement -----------------------------------------------------------


def test_apply_if_finite_skips_when_another_rank_saw_a_nan():
    params = {"w": torch.ones(2)}
    comm = RecordingComm(PeerComm([torch.tensor(1.0)], [torch.tensor(0.0)]))  # the peer: not finite, then finite
    tx = gtx.apply_if_finite(gtx.sgd(0.5), 3, comm=comm, group="world")
    state = tx.init(params)
    updates, state = tx.update({"w": torch.ones(2)}, state, params)
    assert bool(state.skipped) and int(state.notfinite_count) == 1
    assert_trees_equal(updates, {"w": torch.zeros(2)})
    updates, state = tx.update({"w": torch.ones(2)}, state, params)
    assert not bool(state.skipped) and int(state.total_skipped) == 1
    assert [(c.op, c.group, c.shapes) for c in comm.calls] == [("max", "world", ((),))] * 2


def test_apply_if_finite_comm_must_be_a_comm():
    with pytest.raises(TypeError, match="comm must implement"):
        gtx.apply_if_finite(gtx.identity(), 1, comm="world")


# --- TransformedOptimizer: maybe_no_sync, and reduce_grads on a plain replicated model -------------


class FakeFSDP(torch.nn.Linear):
    """Records FSDP2's set_requires_gradient_sync calls."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.sync_calls: list[bool] = []

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.sync_calls.append(sync)


class FakeDDP(torch.nn.Linear):
    """Records which backward ran under DDP's no_sync."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.in_no_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


def test_maybe_no_sync_syncs_only_the_emitting_micro_step():
    model = FakeDDP()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(3))
    synced = []
    for _ in range(6):
        with opt.maybe_no_sync(model):
            synced.append(not model.in_no_sync)
            model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert synced == [False, False, True] * 2


def test_maybe_no_sync_fsdp2_and_flush():
    model = FakeFSDP()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.accumulate(4))
    assert opt.emits_next() is False and opt.emits_next(flush=True) is True
    with opt.maybe_no_sync(model):
        model(torch.ones(1, 3)).sum().backward()
    assert model.sync_calls == [False, True]  # turned off for the backward, restored after
    opt.step()
    with opt.maybe_no_sync(model, flush=True):  # a short final window syncs on its flushing step
        model(torch.ones(1, 3)).sum().backward()
    assert model.sync_calls == [False, True]
    opt.step(flush=True)
    assert opt.emitted


def test_maybe_no_sync_without_accumulate_always_syncs():
    model = FakeFSDP()
    opt = gtx.TransformedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gtx.clip_by_global_norm(1.0))
    for _ in range(2):
        assert opt.emits_next()
        with opt.maybe_no_sync(model):
            model(torch.ones(1, 3)).sum().backward()
        opt.step()
    assert model.sync_calls == []


@pytest.mark.parametrize("fused", [False, True])
def test_wrapper_reduce_grads_on_a_replicated_model(fused):
    torch.manual_seed(0)
    ref, ours = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ours.load_state_dict(ref.state_dict())
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    peer_x, peer_y = torch.randn(5, 3), torch.tensor([1, 1, 0, 0, 1])
    # The reference sees both "ranks'" samples in one batch.
    F.cross_entropy(ref(torch.cat([x, peer_x])), torch.cat([y, peer_y])).backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()

    peer = torch.nn.Linear(3, 2)
    peer.load_state_dict(ours.state_dict())
    F.cross_entropy(peer(peer_x), peer_y, reduction="sum").backward()
    comm = RecordingComm(PeerComm([_tokens(5)], [p.grad for p in peer.parameters()]))
    tx = gtx.accumulate(1, token_weighted=True, comm=comm, reduce_grads=True)
    opt = gtx.TransformedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.5, fused=fused), tx)
    F.cross_entropy(ours(x), y, reduction="sum").backward()
    opt.step(tokens=4)
    assert opt.emitted
    assert_trees_close(dict(ours.named_parameters()), dict(ref.named_parameters()), rtol=1e-5, atol=1e-7)
    assert [c.num_tensors for c in comm.calls] == [1, 2]


def test_sum_grad_reduction_rejects_a_plain_module():
    with pytest.raises(TypeError, match="DistributedDataParallel or contain fully_shard"):
        sum_grad_reduction(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        sum_grad_reduction("model")


def test_the_token_weighted_window_loss_is_the_global_token_mean():
    """With a comm the window's loss is divided as its grads are: every rank's summed losses over every rank's
    tokens, in the token collective. A rank with no token in a window gets that window's loss too."""
    peer = torch.tensor([5.0, 5.0, 20.0], dtype=torch.float64)  # the other rank: 5 tokens, summed loss 20
    comm = RecordingComm(PeerComm([peer], [peer]))
    tx = gtx.accumulate(2, token_weighted=True, comm=comm, group="dp")
    g = {"w": torch.ones(2)}
    state = tx.init(g)
    _, state = tx.update(g, state, tokens=3, loss=torch.tensor(6.0))
    _, state = tx.update(g, state, tokens=1, loss=torch.tensor(4.0))
    assert float(state.last_loss) == pytest.approx((6 + 4 + 20) / (3 + 1 + 5), rel=1e-6)
    for _ in range(2):  # no token here: the global loss, not this rank's last window's
        _, state = tx.update(g, state, tokens=0, loss=torch.tensor(0.0))
    assert float(state.last_loss) == pytest.approx(20 / 5, rel=1e-6)
    assert [c.num_tensors for c in comm.calls] == [1, 1]  # one collective per window


def test_reduce_grads_refuses_grads_sharded_over_its_own_ranks_and_sums_those_sharded_over_others():
    # FSDP2 reduce-scatters over dp: each dp rank holds another shard of the summed grad, and a sum of the shards
    # over dp mixes rows of different params' pieces. What one device gets is the grad itself.
    pytest.importorskip("torch.distributed._local_tensor")
    from torch.distributed.tensor import Shard

    from gradtx.testing import distribute, simulated_mesh

    full = {"w": torch.arange(8.0).reshape(4, 2)}
    with simulated_mesh((2, 2), ("dp", "tp")) as mesh:
        tx = gtx.accumulate(1, comm=gtx.comm.TorchComm(mesh), group="dp", reduce_grads=True)
        tp_only = distribute(full, mesh["tp"], {"w": (Shard(0),)})  # the same on both dp ranks: summed, then / 2
        out, _ = tx.update(tp_only, tx.init(tp_only), tp_only)
        torch.testing.assert_close(out["w"].full_tensor(), full["w"])
        for sharded in (
            distribute(full, mesh["dp"], {"w": (Shard(0),)}),
            distribute(full, mesh, {"w": (Shard(1), Shard(0))}),
        ):
            state = tx.init(sharded)
            with pytest.raises(ValueError, match=r"reduce_grads=True sums the grads over 'dp', but grad 0 is sharded"):
                tx.update(sharded, state, sharded)
            assert int(state.micro_step) == 0 and not bool(state.emitted)


def _peer_grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"b": torch.randn(2, generator=g), "c": torch.randn(2, generator=g)}


def test_a_reduce_grads_window_resumed_keeps_the_sum_of_a_param_that_has_no_grad_on_the_saving_rank():
    # This rank never reaches "c" (its grad is None); the peer rank does. The window's sum over the ranks holds the
    # peer's "c", which a checkpoint must keep whichever rank's flags it saves: a window reading "c" as never held
    # dropped it (silently here; on the peer rank, its next "c" grad was refused, and this rank hung in the sum).
    mine, peer = [_peer_grads(s) for s in (1, 2)], [_peer_grads(s) for s in (3, 4)]
    params = {"b": torch.zeros(2), "c": torch.zeros(2)}
    saving = gtx.accumulate(2, comm=PeerComm([peer[0]["b"], peer[0]["c"]]), reduce_grads=True)
    _, state = saving.update({"b": mine[0]["b"], "c": None}, saving.init(params), params)
    saved = gtx.checkpoint.state_dict(state, params, tx=saving)
    # The peer resumes with zeros (its total is on this rank) and adds its second micro-batch.
    resuming = gtx.accumulate(2, comm=_RankedPeerComm([peer[1]["b"], peer[1]["c"]]), reduce_grads=True)
    state = gtx.checkpoint.load_state_dict(saved, resuming.init(params), params, tx=resuming)
    out, _ = resuming.update({"b": mine[1]["b"], "c": None}, state, params)
    want = {
        "b": (mine[0]["b"] + mine[1]["b"] + peer[0]["b"] + peer[1]["b"]) / 4,
        "c": (peer[0]["c"] + peer[1]["c"]) / 4,
    }
    assert_trees_close(out, want, rtol=1e-6, atol=1e-7)


def test_a_wrapped_reduce_grads_window_resumed_keeps_the_sum_of_a_param_without_grad_on_the_saving_rank():
    def model() -> torch.nn.ModuleDict:
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"b": torch.nn.Linear(2, 1), "c": torch.nn.Linear(2, 1)})

    x = [torch.randn(3, 2), torch.randn(3, 2)]
    peer = [[torch.randn(p.shape) for p in model().parameters()] for _ in range(2)]  # the peer's b and c grads

    def step(m: torch.nn.ModuleDict, opt: gtx.TransformedOptimizer, i: int) -> None:
        m["b"](x[i]).sum().backward()  # this rank never reaches "c"
        opt.step()

    m = model()
    opt = gtx.TransformedOptimizer(
        torch.optim.SGD(m.parameters(), lr=1.0), gtx.accumulate(2, comm=PeerComm(peer[0]), reduce_grads=True)
    )
    step(m, opt, 0)
    saved = opt.state_dict()
    m2 = model()
    opt2 = gtx.TransformedOptimizer(
        torch.optim.SGD(m2.parameters(), lr=1.0), gtx.accumulate(2, comm=_RankedPeerComm(peer[1]), reduce_grads=True)
    )
    opt2.load_state_dict(saved)
    step(m2, opt2, 1)
    assert opt2.emitted
    ref = model()  # one device: this rank's two micro-batches through b, the peer's grads added, mean of 4
    for xi in x:
        ref["b"](xi).sum().backward()
    with torch.no_grad():
        for p, *peers in zip(ref.parameters(), *peer):
            p -= ((p.grad if p.grad is not None else 0) + sum(peers)) / 4
    assert_trees_close(dict(m2.named_parameters()), dict(ref.named_parameters()), rtol=1e-6, atol=1e-7)


def test_a_reduce_grads_window_closing_on_a_none_grad_leaves_the_held_sum_in_the_input_state_untouched():
    # The last micro-step has no grad for "b": the window emits the sum it holds, which is the input state's own
    # tensor; the reduction and the 1/n scaling wrote into it, so the state passed in changed (and a rerun differed).
    tx = gtx.accumulate(2, comm=LocalComm(), reduce_grads=True)
    params = {"a": torch.zeros(3), "b": torch.zeros(3)}
    _, state = tx.update({"a": torch.ones(3), "b": torch.full((3,), 2.0)}, tx.init(params), params)
    out, _ = assert_pure(tx, {"a": torch.full((3,), 3.0), "b": None}, params, state=state, steps=1)
    assert_trees_equal(out, {"a": torch.full((3,), 2.0), "b": torch.full((3,), 1.0)})  # (1 + 3) / 2, (2 + 0) / 2
    assert_trees_equal(state.acc, {"a": torch.ones(3), "b": torch.full((3,), 2.0)})


def test_the_wrapper_steps_on_autograds_own_grad_summed_in_place_when_no_member_makes_new_grads():
    # Only scalar members after the window (a clip): the ranks' sum goes into .grad itself once the chain has run. A
    # new buffer rebound to .grad kept autograd's grads alive through the inner step: one more grad-sized copy at
    # the step's peak memory (torch.optim's foreach Adam adds its temporaries on top).
    p = torch.nn.Parameter(torch.zeros(2))
    grad = p.grad = torch.tensor([2.0, 4.0])
    window = gtx.accumulate(1, comm=PeerComm([torch.tensor([1.0, 1.0])]), reduce_grads=True)
    opt = gtx.TransformedOptimizer(torch.optim.SGD([p], lr=1.0), gtx.chain(window, gtx.clip_by_global_norm(100.0)))
    stepped: list[bool] = []
    opt.optimizer.register_step_pre_hook(lambda *_: stepped.append(p.grad is grad))
    opt.step()
    assert stepped == [True] and p.grad is grad
    assert torch.equal(p.detach(), -torch.tensor([3.0, 5.0]) / 2)  # (2 + 1, 4 + 1) over k * ranks = 2, not clipped


@pytest.mark.parametrize("lacking", [0, 1])
def test_a_window_that_cp_reduce_sums_resumes_mid_window_where_one_cp_rank_has_no_grad_for_a_param(lacking):
    # chain(accumulate(2), cp_reduce): each CP rank's window sums its chunk's grads; "c" is reached by one rank's
    # chunk only. Rank 0 saves after micro-step 1 (the checkpoint sums the windows over the CP ranks and keeps its
    # flags); the rank without "c" resumes, its peer's half of cp_reduce's sum given. Keeping rank 0's 'held' flag
    # dropped the peer's sum of "c" when rank 0 lacked it (silently), and made rank 1 refuse its next None
    # ('missing') while rank 0 waited in cp_reduce's all-reduce when rank 1 lacked it.
    g = [[_peer_grads(10 * r + m) for m in range(2)] for r in range(2)]  # rank -> micro-step -> grads
    for grads in g[lacking]:
        grads["c"] = None
    params = {"b": torch.zeros(2), "c": torch.zeros(2)}

    def total(*trees: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {n: sum((t[n] for t in trees if t[n] is not None), torch.zeros(2)) for n in params}

    saved_total = total(g[0][0], g[1][0])
    saving = gtx.chain(gtx.accumulate(2), gtx.cp_reduce("cp", comm=PeerComm(list(total(g[1][0]).values()))))
    _, state = saving.update(g[0][0], saving.init(params), params)
    saved = gtx.checkpoint.state_dict(state, params, tx=saving)
    other = 1 - lacking  # the peer: rank 0 resumes with the saved total, rank 1 with zeros
    peer_emits = {n: v / 2 for n, v in total(g[other][1], saved_total if other == 0 else total()).items()}
    comm = (_RankedPeerComm if lacking == 0 else _SecondPeerComm)(list(peer_emits.values()))
    resuming = gtx.chain(gtx.accumulate(2), gtx.cp_reduce("cp", comm=comm))
    state = gtx.checkpoint.load_state_dict(saved, resuming.init(params), params, tx=resuming)
    out, _ = resuming.update(g[lacking][1], state, params)
    want = {n: v / 2 for n, v in total(*g[0], *g[1]).items()}  # one device: the sum of the chunks, mean of 2
    assert_trees_close(out, want, rtol=1e-6, atol=1e-7)


class _SecondPeerComm(_RankedPeerComm):
    """:class:`PeerComm` as rank 1 of its two ranks."""

    def rank(self, group: object) -> int:
        del group
        return 1


def test_a_reduce_grads_window_that_cp_reduce_also_sums_resumes_mid_window_with_every_cp_rank_s_sums():
    # A functional step on a (dp, cp) mesh: accumulate(2, reduce_grads=True) sums over "dp", cp_reduce over "cp",
    # so the update is the mean over dp ranks and micro-steps of the sum over cp ranks. A mid-window checkpoint
    # summed the sums over "dp" only: the ranks of a cp group held different sums, and the checkpoint kept one.
    # This rank is (dp 0, cp 0); g[d][c][m] is rank (d, c)'s grad on micro-step m.
    gen = torch.Generator().manual_seed(0)
    g = [[[torch.randn(3, generator=gen) for _ in range(2)] for _ in range(2)] for _ in range(2)]
    params = {"w": torch.zeros(3)}

    def tx(dp_peer: list[torch.Tensor], cp_peer: list[torch.Tensor], comm: type[PeerComm]) -> Any:
        return gtx.chain(
            gtx.accumulate(2, comm=comm(dp_peer), reduce_grads=True), gtx.cp_reduce("cp", comm=comm(cp_peer))
        )

    # The save: this rank's sum plus its dp peer's, over 2 (a mean over dp), plus its cp peer's likewise.
    saving = tx([g[1][0][0]], [(g[0][1][0] + g[1][1][0]) / 2], PeerComm)
    _, state = saving.update({"w": g[0][0][0]}, saving.init(params), params)
    saved = gtx.checkpoint.state_dict(state, params, tx=saving)
    # Resumed as the first rank of both groups, it holds the total; its peers hold zeros and add micro-step 1.
    resuming = tx([g[1][0][1]], [(g[0][1][1] + g[1][1][1]) / 4], _RankedPeerComm)
    state = gtx.checkpoint.load_state_dict(saved, resuming.init(params), params, tx=resuming)
    out, _ = resuming.update({"w": g[0][0][1]}, state, params)
    want = sum(g[d][c][m] for d in range(2) for c in range(2) for m in range(2)) / 4
    assert_trees_close(out, {"w": want}, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduce_grads", [False, True])
def test_a_window_emitting_a_sum_without_this_micro_step_s_grad_leaves_the_state_it_was_given(reduce_grads):
    # "b" has no grad on the emitting micro-step: the window emits the sum it holds, and it scaled the state's own
    # tensor in place, so the state passed in changed and a retry from it emitted half of "b" again.
    tx = gtx.accumulate(2, comm=LocalComm() if reduce_grads else None, reduce_grads=reduce_grads)
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    g = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])}
    _, state = tx.update(g, tx.init(params), params)
    kept = copy.deepcopy(state)
    for _ in range(2):  # the second: a retry from the same state
        out, _ = tx.update({"a": g["a"], "b": None}, state, params)
        assert_trees_equal(out, {"a": g["a"], "b": g["b"] / 2})  # (a + a) / 2 and (b + 0) / 2
        assert_trees_equal(state, kept)


def test_loading_an_open_window_without_tx_in_several_processes_is_refused(monkeypatch):
    # Saved with tx=, the window holds its group's totals (tokens, sums), which a load hands to the group's first
    # rank; without tx= every rank took them, counting them once per rank (2 gloo ranks, token-weighted
    # reduce_grads, DCP: the resumed update 0.10 off the uninterrupted one, silently).
    tx = gtx.accumulate(2, comm=LocalComm(), token_weighted=True, reduce_grads=True)
    params = {"w": torch.zeros(2)}
    _, state = tx.update({"w": torch.ones(2)}, tx.init(params), params, tokens=3)
    saved = gtx.checkpoint.state_dict(state, params, tx=tx)
    monkeypatch.setattr(checkpoint_layout, "multi_process", lambda: 2)  # torch.distributed would say 2 processes
    with pytest.raises(ValueError, match="open accumulation window, in a run of several processes; pass tx="):
        gtx.checkpoint.load_state_dict(saved, tx.init(params), params)
    assert_trees_equal(gtx.checkpoint.load_state_dict(saved, tx.init(params), params, tx=tx), state)

"""The norm-based optax-parity transforms on DTensor grads over 2 gloo ranks, against one device.

scale_by_trust_ratio, lars and lamb need each param's whole norm, and
normalize_by_update_norm the whole model's: on shards split along dim 0 and
dim 1 (and replicated) they must scale every shard by the single-device
factor, with the norms read from the placements. centralize sums a row cut
over tp (Shard(1)) before taking its mean. add_noise gives each shard its
part of the one-device noise. Every rank also runs the same steps on the full
tensors, and the parent compares the gathered results with that. On a Partial grad
(a pending sum) the noise transforms refuse, on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import gradtx as gtx
from tests.distributed.harness import part_results, share_spawn

WORLD = 2
PLACEMENTS = {"w": Shard(0), "v": Shard(1), "b": Shard(0), "r": Replicate()}
SHAPES = {"w": (6, 4), "v": (4, 6), "b": (8,), "r": (3, 3)}


def _tree(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) for k, shape in SHAPES.items()}


def _full(tree: Any) -> Any:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in tree.items()}


def _run(make: Callable[[], gtx.GradientTransformation], steps: int = 3, keys=tuple(SHAPES)) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))

    def shard(tree):
        return {k: distribute_tensor(v, mesh, [PLACEMENTS[k]]) for k, v in tree.items() if k in keys}

    ref_params = {k: v for k, v in _tree(0).items() if k in keys}
    params = shard(ref_params)
    tx, ref_tx = make(), make()
    state, ref_state = tx.init(params), ref_tx.init(ref_params)
    for step in range(steps):
        grads = _tree(100 + step)
        u, state = tx.update(shard(grads), state, params)
        ref_u, ref_state = ref_tx.update({k: v for k, v in grads.items() if k in keys}, ref_state, ref_params)
        params, ref_params = gtx.apply_updates(params, u), gtx.apply_updates(ref_params, ref_u)
        assert all(isinstance(v, DTensor) and v.placements == (PLACEMENTS[k],) for k, v in u.items())
    return {"params": _full(params), "ref": ref_params}


def _trust_ratio(rank: int) -> dict[str, Any]:
    return _run(lambda: gtx.chain(gtx.scale_by_trust_ratio(trust_coefficient=0.5), gtx.scale(-0.1)))


def _lamb(rank: int) -> dict[str, Any]:
    return _run(lambda: gtx.lamb(1e-2, weight_decay=0.1))


def _lars(rank: int) -> dict[str, Any]:
    return _run(lambda: gtx.lars(0.5, weight_decay=1e-2))


def _normalize(rank: int) -> dict[str, Any]:
    return _run(lambda: gtx.chain(gtx.normalize_by_update_norm(2.0), gtx.sgd(0.1, momentum=0.9)))


def _elementwise(rank: int) -> dict[str, Any]:
    return _run(lambda: gtx.chain(gtx.ema(0.5), gtx.lion(1e-2)))


def _centralize(rank: int) -> dict[str, Any]:
    return _run(lambda: gtx.chain(gtx.centralize(), gtx.sgd(0.1)))  # v's rows are cut: summed over tp


def _noise(rank: int) -> dict[str, Any]:
    # every shard its part of the single-device noise, not a copy of shard 0's (the same seed on every rank)
    return _run(lambda: gtx.chain(gtx.add_noise(0.5, 0.55, seed=3), gtx.sgd(0.1)))


def _noise_partial(rank: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    grads = {"w": DTensor.from_local(torch.full((2, 3), rank + 1.0), mesh, [Partial()])}  # each rank's term
    out = {}
    for name, tx in (
        ("add_noise", gtx.add_noise(1.0, 0.0, seed=0)),
        ("differentially_private_aggregate", gtx.differentially_private_aggregate(1e3, 1.0, seed=0)),
    ):
        try:
            tx.update(grads, tx.init(grads))
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - which error, for the parent
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _partial(rank: int) -> dict[str, Any]:
    """Each rank holds one term of a Partial grad (a pending sum, as TP leaves on a SequenceParallel norm's weight)."""
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    terms = [torch.tensor([1.0, 0.5]), torch.tensor([2.0, -3.0])]
    p0 = torch.tensor([1.0, -2.0])

    def grad() -> DTensor:
        return DTensor.from_local(terms[rank].clone(), mesh, [Partial()], run_check=False)

    params = {"w": distribute_tensor(p0.clone(), mesh, [Replicate()])}
    out: dict[str, Any] = {"sum": sum(terms), "p0": p0, "term": terms[rank]}
    for name, tx in (("scale", gtx.scale(-0.1)), ("sgd", gtx.sgd(0.1))):  # linear and stateless: exact
        out[name] = tx.update({"w": grad()}, tx.init(params), params)[0]["w"].full_tensor()
    for name, tx in (
        ("adam", gtx.adam(0.1)),
        ("sgd_momentum", gtx.sgd(0.1, momentum=0.9)),  # the update is exact, the Replicate trace would not be
        ("add_decayed_weights", gtx.add_decayed_weights(0.5)),
        ("clip", gtx.clip(2.0)),
        ("lion", gtx.lion(0.1)),
        ("ema", gtx.ema(0.5)),
    ):
        try:
            tx.update({"w": grad()}, tx.init(params), params)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    for name, tx in (("wrapper_scale", gtx.scale(1.0)), ("wrapper_clip", gtx.clip(2.0))):
        w = torch.nn.Parameter(distribute_tensor(p0.clone(), mesh, [Replicate()]))
        opt = gtx.TransformedOptimizer(torch.optim.SGD([w], lr=0.1), tx)
        w.grad = grad()
        try:
            opt.step()
            out[name] = w.detach().full_tensor()
        except ValueError as e:
            out[name] = (str(e), w.detach().to_local().clone(), w.grad.placements, w.grad.to_local().clone())
    return out


PARTS: dict[str, Callable[[int], Any]] = {
    "trust_ratio": _trust_ratio,
    "lamb": _lamb,
    "lars": _lars,
    "normalize": _normalize,
    "elementwise": _elementwise,
    "centralize": _centralize,
    "noise": _noise,
    "noise_partial": _noise_partial,
    "partial": _partial,
}

_SHARED = share_spawn(PARTS, WORLD, prefix="optax_parity_sharded")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return _SHARED()


@pytest.mark.parametrize("part", sorted(set(PARTS) - {"noise_partial", "partial"}))
def test_sharded_run_matches_one_device(ranks: list[dict[str, Any]], part: str) -> None:
    for res in part_results(ranks, part):
        assert set(res["params"]) == set(res["ref"])
        for k, v in res["params"].items():
            torch.testing.assert_close(v, res["ref"][k], rtol=1e-5, atol=1e-6, msg=f"{part} {k}")


def test_noise_on_a_partial_grad_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """Each rank adds the whole noise, from one seed, to its term of the pending sum: the sum carried W times the
    single-device noise (the same draw; std W times as large). Refused, naming the path, as the norms refuse."""
    for res in part_results(ranks, "noise_partial"):
        for name, message in res.items():
            assert message.startswith(f"ValueError: {name}: updates leaf at ['w'] is a Partial DTensor"), message


def test_a_partial_grad_passes_a_linear_map_exactly_and_is_refused_elsewhere(ranks: list[dict[str, Any]]) -> None:
    """Each rank's transform sees only its term P_i of G = sum P_i, and the result is read as the sum of the ranks'
    outputs: right for scale (sum(-0.1 P_i) = -0.1 G), wrong for anything else (weight decay gives G + 2 * 0.5 w,
    clip(2.0) clips each term: 3.0 where one device gives 2.0; Adam and Lion sum two normalized steps; a momentum
    or EMA buffer, stored Replicate, would hold each rank's own term). Those refuse on every rank, naming the path,
    through the wrapper too, which leaves the param and its Partial grad as they were."""
    for res in part_results(ranks, "partial"):
        g, p0 = res["sum"], res["p0"]
        torch.testing.assert_close(res["scale"], -0.1 * g)
        torch.testing.assert_close(res["sgd"], -0.1 * g)
        torch.testing.assert_close(res["wrapper_scale"], p0 - 0.1 * g)  # torch.optim.SGD on the one-device grad
        for name in ("adam", "sgd_momentum", "add_decayed_weights", "clip", "lion", "ema"):
            assert "['w'] is a Partial DTensor" in res[name], (name, res[name])
        message, w, placements, term = res["wrapper_clip"]
        assert message.startswith("clip: updates leaf at [0][0] is a Partial DTensor"), message
        torch.testing.assert_close(w, p0)
        assert placements == (Partial(),) and torch.equal(term, res["term"])

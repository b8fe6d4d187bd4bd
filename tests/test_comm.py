"""The comm layer: LocalComm, RecordingComm, TorchComm on real gloo processes, and the only-comm-communicates rule."""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest
import torch

from gradtx.comm import Comm, LocalComm, ReduceOp, TorchComm, reduce_over_groups
from gradtx.testing import RecordingComm
from tests.distributed import models
from tests.distributed.harness import part_results, share_spawn

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "gradtx"

# --- only gradtx/comm/ issues collectives ------------------------------------------------------

# torch.distributed (and functional-collectives) entry points that communicate.
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "scatter", "scatter_object_list", "gather",
    "gather_object", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list", "_coalescing_manager", "all_reduce_inplace",
}  # fmt: skip
# Methods that communicate whatever object they are called on: DTensor's, and ProcessGroup's own.
COMMUNICATING_METHODS = {"full_tensor", "redistribute", "allreduce", "allgather", "reduce_scatter", "alltoall_base"}
DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed._functional_collectives")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def collective_calls(source: str) -> list[str]:
    """``line: call`` for every collective a module's source issues (through any alias of torch.distributed)."""
    tree = ast.parse(source)
    modules = {m: m for m in DIST_MODULES}  # local name -> module it aliases
    functions: dict[str, str] = {}  # local name -> collective imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in DIST_MODULES and alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                local = alias.asname or alias.name
                if full in DIST_MODULES:
                    modules[local] = full
                elif node.module in DIST_MODULES and alias.name in COLLECTIVES:
                    functions[local] = full
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = _dotted(func)
        if isinstance(func, ast.Name) and func.id in functions:
            found.append(f"{node.lineno}: {func.id}")
        elif isinstance(func, ast.Attribute):
            owner = _dotted(func.value)
            if func.attr in COLLECTIVES and owner in modules:
                found.append(f"{node.lineno}: {name}")
            elif func.attr in COMMUNICATING_METHODS:
                found.append(f"{node.lineno}: .{func.attr}()")
    return found


def test_scanner_finds_collectives_through_every_kind_of_alias():
    planted = """
import torch.distributed as dist
import torch.distributed
from torch import distributed as td
from torch.distributed import all_reduce as ar, broadcast
import torch.distributed._functional_collectives as funcol
from gradtx.comm import ReduceOp

def f(x, comm, dt):
    dist.all_reduce(x)
    torch.distributed.barrier()
    td.all_gather_into_tensor(x, x)
    ar(x)
    broadcast(x, 0)
    funcol.all_reduce(x, "sum", group=None)
    dt.full_tensor()
    dt.redistribute(placements=[])
    comm.all_reduce([x], ReduceOp.SUM, "tp")   # the Comm protocol: allowed
    dist.get_rank()                             # not a collective: allowed
"""
    found = collective_calls(planted)
    assert len(found) == 8, found
    assert not any("comm.all_reduce" in f or "get_rank" in f for f in found)


def test_only_gradtx_comm_issues_collectives():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "comm") in path.parents:
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{hit}" for hit in collective_calls(path.read_text())]
    assert not offenders, "collectives outside gradtx/comm/ (go through a Comm instead):\n" + "\n".join(offenders)


def test_the_comm_package_is_where_collectives_live():
    # The scan would pass vacuously if it could not see a collective at all.
    assert collective_calls((PACKAGE / "comm" / "torch_dist.py").read_text())


# --- LocalComm and RecordingComm --------------------------------------------------------------


def test_local_comm_is_the_identity_and_a_comm():
    comm = LocalComm()
    x, y = torch.tensor([1.0, 2.0]), torch.tensor(3)
    assert isinstance(comm, Comm)
    out = comm.all_reduce([x, y], ReduceOp.SUM, "tp")
    assert out[0] is x and out[1] is y
    assert comm.size("anything") == 1
    with pytest.raises(ValueError, match="'mean' is not a valid ReduceOp"):  # as TorchComm refuses it
        comm.all_reduce([x], "mean", "tp")  # type: ignore[arg-type]


def test_recording_comm_logs_and_forwards():
    comm = RecordingComm()
    comm.all_reduce([torch.zeros(2, 3), torch.zeros(())], ReduceOp.MAX, "dp")
    comm.all_reduce([], "sum", "pp")
    assert [(c.op, c.group, c.num_tensors, c.shapes) for c in comm.calls] == [
        ("max", "dp", 2, ((2, 3), ())),
        ("sum", "pp", 0, ()),
    ]


def test_a_transform_with_a_recording_comm_pickles_and_copies():
    """Before: pickle.dumps, copy.copy and copy.deepcopy of a RecordingComm (and pickling a transform built with
    one) hit RecursionError: the copy looked up __setstate__ before it had an inner, and __getattr__ asked inner."""
    import copy
    import pickle

    import gradtx as gtx

    comm = RecordingComm()
    comm.all_reduce([torch.zeros(2)], "sum", "dp")
    for again in (copy.copy(comm), copy.deepcopy(comm), pickle.loads(pickle.dumps(comm))):
        assert again.calls == comm.calls and isinstance(again.inner, LocalComm)
    tx = gtx.accumulate(2, token_weighted=True, comm=RecordingComm(), group="dp")
    again = pickle.loads(pickle.dumps(tx))
    grads = {"w": torch.tensor([1.0, 2.0])}
    state, state2 = tx.init(grads), again.init(grads)
    for tokens in (3, 5):
        out, state = tx.update(grads, state, tokens=tokens)
        out2, state2 = again.update(grads, state2, tokens=tokens)
    assert torch.equal(out2["w"], out["w"])  # the pickled copy computes what the original does


def test_recording_comm_and_reduce_over_groups_name_a_bad_argument():
    """Before: RecordingComm took any inner and failed at its first collective with an AttributeError;
    reduce_over_groups with fewer groups than values raised an IndexError."""
    with pytest.raises(TypeError, match="RecordingComm: comm must implement gradtx.comm.Comm"):
        RecordingComm("dp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduce_over_groups: 2 values but 1 groups"):
        reduce_over_groups(LocalComm(), [torch.ones(1), torch.ones(1)], [("dp",)], ["dp"], ReduceOp.SUM)


# --- TorchComm --------------------------------------------------------------------------------


def test_torch_comm_rejects_bad_arguments_without_a_process_group():
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        TorchComm("dp")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"groups\['tp'\] must be a ProcessGroup"):
        TorchComm(groups={"tp": 3})  # type: ignore[dict-item]
    for groups in (["tp"], "tp"):  # a name, not a mapping: dict() failed with "update sequence element #0"
        with pytest.raises(TypeError, match=r"TorchComm: groups must be a dict \{name: ProcessGroup\}"):
            TorchComm(groups=groups)  # type: ignore[arg-type]
    comm = TorchComm()
    with pytest.raises(ValueError, match="unknown group 'tp'.*pass mesh=DeviceMesh"):
        comm.resolve("tp")
    with pytest.raises(TypeError, match="group key"):
        comm.resolve(3.5)
    assert comm.resolve("world") is None and comm.resolve(None) is None
    assert comm.all_reduce([], ReduceOp.SUM, "world") == []  # nothing to reduce: no collective at all


def _torch_comm_body(rank: int, world: int) -> bytes:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:  # this process runs other checks after this one: put the real collective back whatever happens
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        comm = TorchComm(mesh, groups={"pair": dist.new_group([0, 1])})
        a = torch.full((2, 3), float(rank + 1))
        b = torch.tensor(float(10 * (rank + 1)))
        c = torch.arange(3, dtype=torch.int64) * (rank + 1)
        a_before = a.clone()
        out: dict = {}
        calls.clear()
        out["sum"] = comm.all_reduce([a, b], ReduceOp.SUM, "dp")
        out["sum_calls"] = list(calls)
        calls.clear()
        out["max"] = comm.all_reduce([a, b], ReduceOp.MAX, mesh.get_group("dp"))
        out["max_calls"] = list(calls)
        calls.clear()
        out["mixed"] = comm.all_reduce([a, c, b], ReduceOp.SUM, "world")
        out["mixed_calls"] = list(calls)
        out["pair"] = comm.all_reduce([b], "sum", "pair")
        out["unmodified"] = torch.equal(a, a_before)
        out["size"] = (comm.size("dp"), comm.size("world"), comm.size("pair"))
        out["rank"] = comm.rank("dp")
        try:
            comm.all_reduce([DTensor.from_local(a, mesh, [Replicate()])], ReduceOp.SUM, "dp")
            out["dtensor_error"] = None
        except TypeError as err:
            out["dtensor_error"] = str(err)
        try:
            comm.resolve("tp")
            out["unknown_error"] = None
        except ValueError as err:
            out["unknown_error"] = str(err)
    finally:
        dist.all_reduce = real
    return models.pack(out)


_SHARED = share_spawn({"body": functools.partial(_torch_comm_body, world=2)}, 2, prefix="comm")


@pytest.fixture(scope="module")
def torch_comm_results() -> list[dict]:
    return [models.unpack(r) for r in part_results(_SHARED(), "body")]


def test_torch_comm_reduces_a_list_in_one_collective(torch_comm_results):
    for r in torch_comm_results:
        total, peak = r["sum"]
        assert torch.equal(total, torch.full((2, 3), 3.0)) and total.dtype == torch.float32
        assert torch.equal(peak, torch.tensor(30.0)) and peak.shape == ()
        assert r["sum_calls"] == [7]  # one flat buffer: 6 + 1 elements, one collective
        assert torch.equal(r["max"][0], torch.full((2, 3), 2.0)) and torch.equal(r["max"][1], torch.tensor(20.0))
        assert r["max_calls"] == [7]
        assert r["unmodified"]


def test_torch_comm_mixed_dtypes_reduce_exactly_one_collective_per_dtype(torch_comm_results):
    for r in torch_comm_results:
        a, c, b = r["mixed"]
        assert c.dtype == torch.int64 and torch.equal(c, torch.arange(3) * 3)
        assert torch.equal(a, torch.full((2, 3), 3.0)) and torch.equal(b, torch.tensor(30.0))
        assert sorted(r["mixed_calls"]) == [3, 7]


def test_torch_comm_group_keys_sizes_and_errors(torch_comm_results):
    for rank, r in enumerate(torch_comm_results):
        assert torch.equal(r["pair"][0], torch.tensor(30.0))
        assert r["size"] == (2, 2, 2) and r["rank"] == rank
        assert "plain torch.Tensor" in r["dtensor_error"]
        assert "unknown group 'tp'" in r["unknown_error"] and "'dp'" in r["unknown_error"]


# --- the protocol: everything gradtx calls on a comm is declared ---------------------------------


class _TwoMethods:
    """A user's comm with only what every comm needs: all_reduce and size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def all_reduce(self, tensors, op, group):
        return [t * self.n for t in tensors]

    def size(self, group) -> int:
        return self.n


def test_every_method_gradtx_calls_is_on_the_protocol_and_local_comm_has_them_all():
    declared = {m for m in vars(Comm) if not m.startswith("_")}
    assert declared == {"all_reduce", "size", "rank", "group_id"}
    assert isinstance(LocalComm(), Comm) and isinstance(RecordingComm(), Comm)
    assert LocalComm().rank("dp") == 0 and LocalComm().group_id("dp") != LocalComm().group_id("tp")


def test_a_comm_with_two_methods_is_adapted_and_a_rank_it_cannot_know_raises():
    from gradtx.comm import MinimalComm, as_comm

    one, two = as_comm(_TwoMethods(1), name="t"), as_comm(_TwoMethods(2), name="t")
    assert isinstance(one, MinimalComm) and isinstance(one, Comm)
    assert one.rank("dp") == 0 and one.group_id("dp") == ("key", "dp")
    with pytest.raises(TypeError, match=r"_TwoMethods has no rank\(group\), and group 'dp' has 2 ranks"):
        two.rank("dp")
    assert RecordingComm(_TwoMethods(1)).rank("dp") == 0  # RecordingComm declares it and forwards
    with pytest.raises(TypeError, match="t: comm must implement gradtx.comm.Comm .* without all_reduce, size"):
        as_comm(object(), name="t")
    tc = LocalComm()
    assert as_comm(tc, name="t") is tc

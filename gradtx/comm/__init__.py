"""The communication layer: the only code in gradtx that issues collectives."""

from gradtx.comm.base import Comm, ExchangeComm, GroupKey, LocalComm, MinimalComm, ReduceOp, as_comm, reduce_over_groups

try:  # a torch build without distributed support still has LocalComm
    from gradtx.comm.torch_dist import TorchComm
except ImportError:  # pragma: no cover
    TorchComm = None  # type: ignore[assignment,misc]

__all__ = [
    "Comm",
    "ExchangeComm",
    "GroupKey",
    "LocalComm",
    "MinimalComm",
    "ReduceOp",
    "TorchComm",
    "as_comm",
    "reduce_over_groups",
]

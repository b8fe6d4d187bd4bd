"""The communication layer: the only code in gradtx that issues collectives."""

from gradtx.comm.base import Comm, GroupKey, ReduceOp
from gradtx.comm.local import LocalComm
from gradtx.comm.torch_dist import TorchComm

__all__ = ["Comm", "GroupKey", "LocalComm", "ReduceOp", "TorchComm"]

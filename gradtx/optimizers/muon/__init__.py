"""Muon: momentum orthogonalized by Newton–Schulz, exact on sharded matrices.

:func:`scale_by_muon` keeps a momentum of the gradients and replaces each
weight matrix's momentum by an approximately orthogonal matrix (a few
Newton–Schulz iterations); :func:`muon` chains it with the shape scaling,
weight decay and the learning rate, and sends the other leaves to AdamW, as
``optax.contrib.muon`` does. :func:`orthogonalize` is the Newton–Schulz step
alone, to chain with a momentum of one's own.

**Layout.** A leaf's :class:`MuonDimensionNumbers` say which axes form the
matrix (``reduction_axis``, ``output_axis``); every other axis is a batch
axis (heads, stacked experts), each slice orthogonalized on its own. The
default reads PyTorch's ``(out, in)`` weights: reduction axis 1, output axis 0,
as ``torch.optim.Muon`` and :func:`gradtx.adaptive_clip` do. Optax's default
(reduction 0, output 1) assumes JAX's ``(in, out)``; pass
``MuonDimensionNumbers(0, 1)`` to get it.

**Sharded matrices.** The momentum is elementwise, so it runs on each
DTensor's local shard. The Newton–Schulz iteration needs whole matrices, so a
leaf sharded across the matrix axes is *owned* by one rank of its mesh: every
rank sends its shard to the owner in one bucketed all-to-all, each owner
orthogonalizes the matrices it owns, and a second all-to-all brings every
rank its shard of the result. Owners are assigned greedily by Newton–Schulz
cost, largest first, to the least-loaded rank, so each matrix is
orthogonalized once and the work is spread. A leaf sharded only along batch
axes (experts over an EP dim) holds whole matrices and needs no
communication; a replicated or plain leaf is orthogonalized where it is.
The cost is stated in ``docs/muon.md``; :func:`exchange_plan` computes it.

**One device.** Local matrices of one shape, dtype and memory layout are
stacked (``ns_batch`` at most) and iterated as one batched ``bmm`` chain, and
the momentum runs as foreach ops, so a step launches a few kernels per stack
rather than a few per matrix.

The modules: ``iteration`` (dimension numbers, layouts, the Newton–Schulz
iteration), ``exchange`` (owners, the all-to-all exchange, the per-step
orthogonalizer), ``transforms`` (the momentum, the orthogonalization and the shape
scaling) and ``optimizer`` (:func:`muon`).
"""

from gradtx.optimizers.muon.exchange import ExchangePlan, exchange_plan
from gradtx.optimizers.muon.iteration import MuonDimensionNumbers, newton_schulz
from gradtx.optimizers.muon.optimizer import muon
from gradtx.optimizers.muon.transforms import MuonState, orthogonalize, scale_by_muon, scale_by_shape

__all__ = [
    "ExchangePlan",
    "MuonDimensionNumbers",
    "MuonState",
    "exchange_plan",
    "muon",
    "newton_schulz",
    "orthogonalize",
    "scale_by_muon",
    "scale_by_shape",
]

# The public names keep this package as their module, as when it was one file: pickles, the safe globals of
# torch.load(weights_only=True) and the API pages name them gradtx.optimizers.muon.X.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name

"""One validation layer for every factory: numpy scalars accepted, truthy stand-ins for flags refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtx as gtx

# Every factory argument that is a number, given as a numpy scalar, builds the same transform as the Python number.
NUMPY_CASES = {
    "clip": lambda v: gtx.clip(v(0.5)),
    "clip_by_global_norm": lambda v: gtx.clip_by_global_norm(v(1.0), norm_type=v(2.0)),
    "adaptive_clip": lambda v: gtx.adaptive_clip(v(0.01), eps=v(1e-3)),
    "scale": lambda v: gtx.scale(v(0.5)),
    "sgd": lambda v: gtx.sgd(v(0.1), momentum=v(0.9), weight_decay=v(0.01)),
    "adam": lambda v: gtx.adam(v(0.1), b1=v(0.9), b2=v(0.99), eps=v(1e-8)),
    "adamw": lambda v: gtx.adamw(v(0.1), weight_decay=v(0.1)),
    "trace": lambda v: gtx.trace(v(0.9)),
    "add_decayed_weights": lambda v: gtx.add_decayed_weights(v(0.1)),
}


@pytest.mark.parametrize("name", sorted(NUMPY_CASES))
@pytest.mark.parametrize("np_type", [np.float32, np.float64])
def test_numpy_scalars_build_the_same_transform(name, np_type):
    params = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0)) + 1.0}
    grads = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(1))}
    ours = NUMPY_CASES[name](lambda x: np_type(x))
    ref = NUMPY_CASES[name](float)
    out, _ = ours.update(grads, ours.init(params), params)
    expected, _ = ref.update(grads, ref.init(params), params)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


def test_numpy_integers_and_bools():
    state = gtx.accumulate(np.int64(3), token_weighted=np.bool_(True)).init({"w": torch.zeros(1)})
    assert int(state.k) == 3
    assert gtx.apply_if_finite(gtx.identity(), np.int32(2)) is not None
    gtx.trace(0.9, nesterov=np.bool_(True))


@pytest.mark.parametrize(
    "build, arg",
    [
        (lambda: gtx.scale_by_learning_rate(0.1, flip_sign=None), "flip_sign"),
        (lambda: gtx.adaptive_clip(unitwise="no"), "unitwise"),
        (lambda: gtx.trace(0.9, nesterov=1), "nesterov"),
        (lambda: gtx.sgd(0.1, momentum=0.9, nesterov="yes"), "nesterov"),
        (lambda: gtx.accumulate(2, token_weighted=0), "token_weighted"),
        (lambda: gtx.accumulate(2, reduce_grads=None), "reduce_grads"),
    ],
)
def test_flags_must_be_bools(build, arg):
    with pytest.raises(TypeError, match=f"{arg} must be a bool"):
        build()


@pytest.mark.parametrize(
    "build, err, match",
    [
        (lambda: gtx.sgd(float("nan")), ValueError, "learning_rate must not be NaN"),
        (lambda: gtx.adam(0.1, b1=1.0), ValueError, r"b1 must be in \[0, 1\)"),
        (lambda: gtx.clip_by_global_norm(0.0), ValueError, "max_norm must be > 0"),
        (lambda: gtx.clip_by_global_norm(1.0, norm_type=-1), ValueError, "norm_type must be > 0 or inf"),
        (lambda: gtx.adaptive_clip(float("inf")), ValueError, "clipping must be finite"),
        (lambda: gtx.accumulate(np.float64(2.0)), TypeError, "k must be an int"),
        (lambda: gtx.apply_if_finite(gtx.identity(), -1), ValueError, "max_consecutive_errors must be >= 0"),
        (lambda: gtx.scale(True), TypeError, "step_size must be a number"),
    ],
)
def test_bad_numbers_name_the_argument(build, err, match):
    with pytest.raises(err, match=match):
        build()

"""microbatch against optax's, and a microbatched torch.func.grad against the full batch's gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtx as gtx
from gradtx.testing import assert_trees_close
from tests.optax_parity import jnp, optax, to_torch

A = gtx.AccumulationType
B = optax.microbatching.AccumulationType


def _fun(x, y, scale=1.0):  # "losses": one 0-d value per micro-batch, concatenated
    return {"rows": x * 2 + y, "total": (x * y).sum() * scale, "mean": x.mean(0), "losses": (x - y).sum()}


def _fun_jax(x, y, scale=1.0):
    return {"rows": x * 2 + y, "total": (x * y).sum() * scale, "mean": x.mean(0), "losses": (x - y).sum()}


@pytest.mark.parametrize("num_real", [None, 2])
def test_microbatch_matches_optax(num_real):
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    y = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    acc = {"rows": A.CONCAT, "total": A.SUM, "mean": A.RUNNING_MEAN, "losses": A.CONCAT}
    acc_jax = {"rows": B.CONCAT, "total": B.SUM, "mean": B.RUNNING_MEAN, "losses": B.CONCAT}
    got = gtx.microbatch(_fun, argnums=(0, 1), microbatch_size=3, accumulator=acc, num_real_microbatches=num_real)(x, y)
    want = optax.microbatch(
        _fun_jax, argnums=(0, 1), microbatch_size=3, accumulator=acc_jax, num_real_microbatches=num_real
    )(jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    assert_trees_close(got, to_torch(want), rtol=1e-5, atol=1e-6)


def test_microbatch_with_argnames_in_axes_and_mean_matches_optax():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))

    def f(x, y):
        return (x.T * y).sum(0)

    def f_jax(x, y):
        return (x.T * y).sum(0)

    got = gtx.microbatch(f, argnums=0, argnames="y", in_axes=(1, 0), microbatch_size=2, accumulator=A.MEAN)(x, y=y)
    want = optax.microbatch(f_jax, argnums=0, argnames="y", in_axes=(1, 0), microbatch_size=2, accumulator=B.MEAN)(
        jnp.asarray(x.numpy()), y=jnp.asarray(y.numpy())
    )
    np.testing.assert_allclose(got.numpy(), np.array(want), rtol=1e-5, atol=1e-6)


def test_microbatched_grad_is_the_full_batch_grad():
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 1), "b": torch.zeros(1)}
    x, y = torch.randn(32, 4), torch.randn(32, 1)

    def loss(p, x, y):
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    full = torch.func.grad(loss)(params, x, y)
    micro = gtx.microbatch(torch.func.grad(loss), argnums=(1, 2), microbatch_size=8, accumulator=A.MEAN)(params, x, y)
    assert_trees_close(micro, full, rtol=1e-5, atol=1e-6)


def test_microbatch_refuses_an_indivisible_batch():
    with pytest.raises(ValueError, match="not divisible by microbatch_size=5"):
        gtx.microbatch(lambda x: x.sum(), argnums=0, microbatch_size=5)(torch.ones(12))


@pytest.mark.parametrize("batch_size, num_real", [(0, None), (4, 0)])
def test_a_call_that_runs_no_microbatch_is_refused_naming_why(batch_size, num_real):
    fn = gtx.microbatch(lambda x: x.sum(0), argnums=0, microbatch_size=2, num_real_microbatches=num_real)
    why = "an empty batch" if batch_size == 0 else "num_real_microbatches=0"
    with pytest.raises(ValueError, match=f"microbatch: {why}"):
        fn(torch.zeros(batch_size, 3))

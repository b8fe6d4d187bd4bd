"""The peer libraries, imported only when present: torchopt, and optax on JAX.

They come with the ``bench`` extra (``pip install -c constraints.txt -e '.[bench]'``).
A peer that is missing, or that cannot run on the benchmark's device, is
reported as a skipped row with the reason, never replaced by something else.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or ``None``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torchopt() -> tuple[ModuleType | None, str]:
    """``(torchopt, "")``, or ``(None, why it cannot be used)``."""
    try:
        import torchopt as module  # optional: only the benchmarks need it
    except ImportError as e:  # torchopt itself, or graphviz, which torchopt imports
        return None, f"torchopt not importable ({type(e).__name__}: {e}); install the bench extra"
    return module, ""


def optax(device: torch.device) -> tuple[tuple[ModuleType, ModuleType] | None, str]:
    """``((jax, optax), "")`` when optax can run beside ``device``, else ``(None, why)``."""
    try:
        import jax
        import optax as module
    except (ImportError, RuntimeError) as e:  # RuntimeError: a jaxlib that cannot start on this CPU
        return None, f"jax/optax not importable ({type(e).__name__}: {e}); install the bench extra"
    # XLA compiles of big jitted steps take minutes here; keep them between runs.
    jax.config.update("jax_compilation_cache_dir", str(Path.home() / ".cache" / "gradtx-bench" / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    platform = jax.default_backend()
    if device.type != "cpu" and platform == "cpu":
        return None, f"jax has only its CPU backend here; timing it against {device.type} would compare two machines"
    return (jax, module), ""


def to_jax(jax: ModuleType, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Copy a dict of torch tensors into JAX arrays (bf16 through fp32, which numpy lacks)."""
    import jax.numpy as jnp

    out = {}
    for name, t in tensors.items():
        if t.dtype == torch.bfloat16:
            out[name] = jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16)
        else:
            out[name] = jnp.asarray(t.cpu().numpy())
    return jax.device_put(out)

"""Helpers for checking the float64 references against transformers' modules.

``as_float64`` recompiles an HF function from its own source with its explicit float32 casts made
float64 (nothing else changes), so a float64 module can be compared to 1e-10; ``randomize``
fills a module's parameters and returns them by HF name.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def as_float64(fn: Callable[..., Any], namespace: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` recompiled from its source, its float32 casts (``torch.float32``, ``.float()``) float64.

    namespace: the globals ``fn`` runs in (its module's ``vars``).
    """
    src = textwrap.dedent(inspect.getsource(fn))
    new = src.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    assert new != src, f"{fn.__qualname__} has no float32 cast to lift"
    scope: dict[str, Any] = {}
    exec(compile(new, f"<lifted {fn.__qualname__}>", "exec"), namespace, scope)
    return scope[fn.__name__]  # type: ignore[no-any-return]


def randomize(module: torch.nn.Module, seed: int) -> dict[str, np.ndarray]:
    """Make module float64 with random parameters (norm weights around 1, others ~ 1/sqrt(in)).

    Returns copies keyed by HF name, ".weight" dropped ("q_proj", "q_proj.bias", ...).
    """
    g = torch.Generator().manual_seed(seed)
    module.double()
    out = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.1 * r if "norm" in name else r / math.sqrt(p.shape[-1]))
            out[name.removesuffix(".weight")] = p.detach().numpy().copy()
    return out

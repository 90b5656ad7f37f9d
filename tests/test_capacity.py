"""The KV cache memory an engine gets when it sets none (depthserve/engine/capacity.py)."""

from __future__ import annotations

import pytest
import torch

from depthserve.engine.capacity import CPU_CACHE_BYTES, CPU_CACHE_ENV, GIB, cache_memory_bytes
from depthserve.errors import ConfigurationError

CPU = torch.device("cpu")


def test_the_cpu_default_is_a_gib_or_what_the_environment_names(monkeypatch):
    monkeypatch.delenv(CPU_CACHE_ENV, raising=False)
    assert cache_memory_bytes(None, CPU) == CPU_CACHE_BYTES == GIB
    monkeypatch.setenv(CPU_CACHE_ENV, "0.25")
    assert cache_memory_bytes(None, CPU) == GIB / 4
    assert cache_memory_bytes(2.0, CPU) == 2 * GIB  # an engine's own setting wins


@pytest.mark.parametrize("named", ["lots", "0", "-1", "inf", "nan"])
def test_a_bad_cpu_default_in_the_environment_is_refused_by_name(monkeypatch, named):
    monkeypatch.setenv(CPU_CACHE_ENV, named)
    with pytest.raises(ConfigurationError, match=CPU_CACHE_ENV):
        cache_memory_bytes(None, CPU)

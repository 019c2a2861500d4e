"""The drafter's dtype: named, or chosen by the device and the CPU's bf16 support."""
from __future__ import annotations

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.models import loading
from foresight.models.loading import resolve_drafter_dtype


def test_a_named_drafter_dtype_is_used_as_it_is():
    assert resolve_drafter_dtype("float32", "bfloat16", "cpu") == torch.float32
    assert resolve_drafter_dtype("bfloat16", "float32", "cpu") == torch.bfloat16


@pytest.mark.parametrize("native_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_a_cpu_follows_its_bf16_support_not_the_target(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: native_bf16)
    for target_dtype in ("auto", "float32", "bfloat16"):
        assert resolve_drafter_dtype("auto", target_dtype, "cpu") == expected


def test_auto_on_a_gpu_follows_the_target(monkeypatch):
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: True)
    assert resolve_drafter_dtype("auto", "float32", "cuda:1") == torch.float32
    assert resolve_drafter_dtype("auto", "float16", "cuda:1") == torch.float16


def test_a_bad_drafter_dtype_is_refused_by_name():
    with pytest.raises(ConfigError, match="drafter_dtype"):
        EngineConfig(drafter_dtype="int8")

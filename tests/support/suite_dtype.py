"""The dtype the whole suite serves the real model in: FORESIGHT_TEST_DTYPE, or pytest's `--dtype`.

`auto` (the default) is what `foresight serve` picks on this machine: bf16 on CPUs with avx512_bf16 or
AMX, fp32 elsewhere. Tests that need a dtype for what they assert (token-for-token equality with a
reference computed in fp32) state it themselves; every other test that starts a server or a bench runs
in this one.
"""
from __future__ import annotations

import os

import torch

ENV = "FORESIGHT_TEST_DTYPE"
CHOICES = ("auto", "float32", "bfloat16")


def suite_dtype() -> str:
    value = os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(CHOICES)}")
    return value


def resolved_suite_dtype() -> torch.dtype:
    """The torch dtype `--dtype <suite dtype>` resolves to on this machine's CPU."""
    from foresight.models.loading import resolve_dtype

    return resolve_dtype(suite_dtype(), "cpu")

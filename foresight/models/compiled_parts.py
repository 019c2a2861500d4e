"""What the drafter's compiled parts share (models/compiled_draft.py, compiled_adapter.py, compiled_decoder.py): the
choice `--drafter-compile` makes for each, building its graphs with every failure left eager, and its line of the
bench's report."""
from __future__ import annotations

import logging
from typing import Callable

from .compiled_step import built

log = logging.getLogger("foresight.compiled_parts")

# Inductor picks each matrix product's kernel by timing the candidates (its CPU micro-kernels, aten's) at compile time.
AUTOTUNE = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def compiled_part(choice: str, refusal: str | None, owner: str, what: str, make: Callable[[], object]):
    """The graphs `make()` returns, built, where `choice` ("auto", "on", "off") wants them and `refusal` (why they
    cannot be: None when they can) allows; None where `what` stays eager: off, refused (logged when "on" asked for
    it), or a build that failed (logged: a compiler problem never stops the worker)."""
    if choice == "off" or refusal is not None:
        if choice == "on" and refusal is not None:
            log.warning("%s: %s runs eager: %s", owner, what, refusal)
        return None
    graphs = make()
    if not built(graphs, owner, what):
        return None
    log.info("%s: %s compiled for up to %d threads (%s)", owner, what, graphs.threads,
             "loaded from the cache" if graphs.loaded else f"{graphs.compile_s:.1f} s compiling")
    return graphs


def part_info(graphs, flag: str, prefix: str = "") -> dict:
    """`graphs`' line of the bench's report: `flag` (whether the part runs compiled), the seconds spent compiling it at
    start-up and the packages loaded from the cache (keys `<prefix>compile_s`, `<prefix>loaded`)."""
    if graphs is None:
        return {flag: False, f"{prefix}compile_s": 0.0, f"{prefix}loaded": 0}
    return {flag: True, f"{prefix}compile_s": round(graphs.compile_s, 1), f"{prefix}loaded": graphs.loaded}

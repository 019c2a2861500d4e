"""The `foresight` command's start-up checks."""
from __future__ import annotations

import pytest

from foresight import cli


@pytest.mark.parametrize("drafter", ["ngram", "auto"])
def test_pipelined_without_foresight_is_a_one_line_error(drafter, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FORESIGHT_CHECKPOINTS", str(tmp_path))  # no shipped drafter: auto means ngram

    def load(*args, **kwargs):
        raise AssertionError("models were loaded before the configuration was checked")

    monkeypatch.setattr("foresight.server.app.create_app", load)
    assert cli.main(["serve", "--mode", "pipelined", "--drafter", drafter]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--mode pipelined" in err and "--mode sync" in err


def test_hybrid_without_a_draft_model_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FORESIGHT_CHECKPOINTS", str(tmp_path))  # no shipped drafter

    def load(*args, **kwargs):
        raise AssertionError("models were loaded before the configuration was checked")

    monkeypatch.setattr("foresight.server.app.create_app", load)
    assert cli.main(["serve", "--mode", "hybrid"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--mode hybrid" in err and "--mode ngram" in err


def test_a_split_that_cannot_share_out_the_heads_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    from support.tiny_models import save_tiny_model

    path = save_tiny_model("llama", tmp_path)  # 4 attention heads, 2 KV heads
    capsys.readouterr()  # the save's progress bar

    def load(*args, **kwargs):
        raise AssertionError("models were loaded before the configuration was checked")

    monkeypatch.setattr("foresight.server.app.create_app", load)
    assert cli.main(["serve", "--target", str(path), "--drafter", "ngram", "--tensor-parallel-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tensor_parallel_size 4 must divide the target's 4 attention heads and 2 KV" in err

import pytest

from foresight.server.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """One token per byte; decode is utf-8 with replacement, as real byte-level BPE behaves."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(detok, text_bytes, step=1):
    out = []
    ids = list(text_bytes)
    for i in range(0, len(ids), step):
        out.append(detok.add(ids[i:i + step], final=i + step >= len(ids)))
    return "".join(out)


def test_streams_everything_without_stops():
    assert feed(IncrementalDetokenizer(CharTokenizer()), b"hello world") == "hello world"


def test_multibyte_characters_are_never_split():
    detok = IncrementalDetokenizer(CharTokenizer())
    pieces = [detok.add([b]) for b in "é€".encode()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "é€"


@pytest.mark.parametrize("step", [1, 3])
def test_stop_string_cuts_output_and_is_not_leaked(step):
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["END", "\n\n"])
    text = feed(detok, b"abc EN more ENDtail", step)
    assert text == "abc EN more "
    assert detok.stopped

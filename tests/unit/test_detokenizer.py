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


# ------------------------------------------------------------------ windowed decoding

import random  # noqa: E402

TRICKY = ("Héllo, wörld!  Two  spaces,\ttabs\nand lines.\n\n€uro 100 ¥, naïve café — “quotes” "
          "日本語のテキスト 🙂👍🏽 emoji, Ωmega; def f(x):\n    return x  # indent\n")


class PieceTokenizer:
    """Tokens are arbitrary byte strings, so multi-byte characters split across tokens; counts the
    tokens each decode call sees. `strip_leading_space`: decode drops one leading space, as SentencePiece
    does at the start of a sequence."""

    def __init__(self, strip_leading_space=False):
        self.pieces: list[bytes] = []
        self.strip = strip_leading_space
        self.decoded: list[int] = []

    def tokenize(self, text: str, rng: random.Random, max_bytes=4) -> list[int]:
        data, ids, i = text.encode(), [], 0
        while i < len(data):
            n = rng.randint(1, max_bytes)
            self.pieces.append(data[i:i + n])
            ids.append(len(self.pieces) - 1)
            i += n
        return ids

    def decode(self, ids, skip_special_tokens=True):
        self.decoded.append(len(ids))
        text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        return text[1:] if self.strip and text.startswith(" ") else text


def feed_ids(detok, ids, rng, max_step=4):
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_step)
        out.append(detok.add(ids[i:i + n], final=i + n >= len(ids)))
        i += n
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("strip", [False, True])
def test_windowed_decoding_equals_the_full_decode(seed, strip):
    rng = random.Random(seed)
    tok = PieceTokenizer(strip_leading_space=strip)
    text = (" " if strip else "") + TRICKY
    ids = tok.tokenize(text, rng)
    pieces = feed_ids(IncrementalDetokenizer(tok), ids, rng)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # a character is sent once all its bytes are there


def test_work_per_step_does_not_grow_with_the_output():
    rng = random.Random(0)
    tok = PieceTokenizer()
    ids = tok.tokenize(TRICKY * 40, rng)  # ~10k tokens
    detok = IncrementalDetokenizer(tok, stop=["never-there"])
    tok.decoded.clear()
    feed_ids(detok, ids, rng)
    # The window holds the tokens since the last step that ended on a character boundary: a few steps,
    # or a run of multi-byte characters cut at random (the text's longest is 24 bytes), never the output.
    assert max(tok.decoded) <= 24 + 2 * 4
    assert sum(tok.decoded) <= 10 * len(ids)  # linear; decoding everything each step would be ~len(ids)**2 / 5


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_across_multibyte_tokens(step):
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["€E"])
    assert feed(detok, "naïve €uro €End".encode(), step) == "naïve €uro "
    assert detok.stopped


def test_real_tokenizer_streams_its_own_full_decode():
    from pathlib import Path

    from foresight.models.loading import default_model_dir

    path = default_model_dir()
    if not (Path(path) / "tokenizer.json").is_file():
        pytest.skip(f"the default model is not converted yet ({path}); `foresight prepare-model`")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode(TRICKY, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert streamed == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("step", [1, 4, 40])
def test_the_tokens_kept_end_with_the_one_that_completed_the_stop_string(step):
    """A step of several tokens (a speculative round) that runs past a stop string keeps only the tokens up to the
    one completing it; without stop strings every token is kept."""
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["END"])
    ids, kept = list(b"abc ENDtail and more"), 0
    for i in range(0, len(ids), step):
        detok.add(ids[i:i + step])
        kept += detok.kept
    assert kept == len(b"abc END") and detok.stopped
    plain = IncrementalDetokenizer(CharTokenizer())
    plain.add(ids)
    assert plain.kept == len(ids)

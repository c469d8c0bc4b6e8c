"""Incremental detokenization never splits a UTF-8 character; stop strings never leak."""

import pytest

from server.detokenizer import IncrementalDetokenizer, StopChecker

TEXT = "héllo wörld 🎉 naïve café — ünïcode ✓ 日本語 the quick brown fox"


def test_one_token_at_a_time_equals_full_decode(tiny_tokenizer):
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # rare characters become several byte-level tokens
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == TEXT
    assert any(d == "" for d in deltas)  # some tokens were held back mid-character


def test_flush_releases_an_incomplete_tail(tiny_tokenizer):
    ids = tiny_tokenizer.encode("🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert detok.add(ids[:-1]) == ""
    assert detok.flush() != ""


def feed_all(stops, pieces):
    checker = StopChecker(stops)
    out = [checker.feed(p, final=(i == len(pieces) - 1)) for i, p in enumerate(pieces)]
    return out, checker


def test_stop_string_across_pieces_is_cut():
    out, checker = feed_all(["END"], ["abc E", "N", "D more"])
    assert "".join(out) == "abc " and checker.stopped
    assert out[0] == "abc "  # "E" held back: it could start "END"


@pytest.mark.parametrize("pieces", [["x", "E", "N", "Dy"], ["xEN", "D"], ["xEND"]])
def test_no_partial_stop_string_is_ever_released(pieces):
    out, _ = feed_all(["END"], pieces)
    assert "".join(out) == "x"
    assert all("E" not in o for o in out)


def test_held_back_text_is_released_when_it_diverges_or_ends():
    out, checker = feed_all(["END"], ["abE", "Nx", "E"])
    assert "".join(out) == "abENxE" and not checker.stopped
    assert out[:2] == ["ab", "ENx"]


def test_earliest_of_several_stops_wins():
    out, _ = feed_all(["lo", "hel"], ["say hello"])
    assert "".join(out) == "say "


def test_no_stops_passes_everything():
    out, _ = feed_all([], ["a", "b"])
    assert out == ["a", "b"]

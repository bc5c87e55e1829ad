"""TextAssembler: incremental text equals the full decode, stop strings cut like OpenAI (even
across token boundaries), and text that may start a stop string is held back, never retracted."""

from __future__ import annotations

from service.textstream import TextAssembler, _held_suffix

TEXT = "Speculative decoding drafts tokens, then the target verifies them.\nDone: yes."


def _feed(codec, stops, ids, batch=1):
    asm = TextAssembler(codec, stops)
    pieces = []
    for i in range(0, len(ids), batch):
        p = asm.push(ids[i : i + batch])
        pieces.append(p.text)
        if p.stopped:
            return asm, pieces
    pieces.append(asm.finish().text)
    return asm, pieces


def test_without_stops_text_is_the_decode(codec) -> None:
    ids = codec.encode(TEXT)
    for batch in (1, 3, len(ids)):
        asm, pieces = _feed(codec, [], ids, batch)
        assert "".join(pieces) == codec.decode(ids) == asm.text
        assert asm.tokens_used == len(ids) and not asm.stopped


def test_stop_string_truncates_and_counts_tokens(codec) -> None:
    ids = codec.encode(TEXT)
    full = codec.decode(ids)
    for stop in ("tokens, then", "\nDone", "s.", "verif"):
        for batch in (1, 4):
            asm, pieces = _feed(codec, ["never-there", stop], ids, batch)
            assert asm.stopped and "".join(pieces) == full[: full.index(stop)] == asm.text
            assert stop in codec.decode(ids[: asm.tokens_used])
            assert stop not in codec.decode(ids[: asm.tokens_used - 1])


def test_possible_stop_prefix_is_held_back(codec) -> None:
    asm = TextAssembler(codec, ["drafts tokens, now"])
    ids = codec.encode(TEXT)
    sent = ""
    for tok in ids:
        piece = asm.push([tok])
        sent += piece.text
        assert codec.decode(ids).startswith(sent)  # never sends text that must be taken back
    sent += asm.finish().text
    assert sent == codec.decode(ids) and not asm.stopped


def test_held_suffix() -> None:
    assert _held_suffix("abc", ["cde"]) == 1
    assert _held_suffix("abcd", ["bcdz", "d"]) == 3
    assert _held_suffix("abc", ["xyz"]) == 0
    assert _held_suffix("", ["abc"]) == 0

"""The conversation scenario: Topical-Chat turns replayed with the model's own answers, learnt
state reset per conversation, every method's answers equal, mean ± std across conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evospec.bench.conversation import (
    format_conversation_table,
    load_conversations,
    run_conversations,
    summarise_conversations,
)
from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from tests.vocab.helpers import SMALL, stand_in_indices


def _shared(tmp_path: Path) -> Path:
    chats = {
        f"t_{i}": {
            "content": [
                {
                    "message": f"user {i} turn {j}" if j % 2 == 0 else f"other {i} reply {j}",
                    "agent": f"agent_{1 + j % 2}",
                }
                for j in range(7)
            ]
        }
        for i in range(3)
    }
    chats["t_short"] = {"content": [{"message": "only one", "agent": "agent_1"}]}
    (tmp_path / "topical_chat").mkdir()
    (tmp_path / "topical_chat" / "test_freq.json").write_text(json.dumps(chats))
    return tmp_path


def test_the_first_speakers_turns_are_the_user_turns(tmp_path: Path) -> None:
    convs = load_conversations(_shared(tmp_path), 3, max_turns=3)
    assert convs[0] == ["user 0 turn 0", "user 0 turn 2", "user 0 turn 4"]
    assert len(convs) == 3 and all(len(c) == 3 for c in convs)
    with pytest.raises(ValueError, match="only 3 conversations"):
        load_conversations(tmp_path, 4, max_turns=3)  # the one-turn chat does not count
    with pytest.raises(FileNotFoundError, match="topical_chat"):
        load_conversations(tmp_path / "none", 1, 3)


class _Codec:
    """Chat rendering over a 64-id vocabulary: each character of each message becomes an id."""

    has_chat_template = True

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return [1 + (ord(c) % 60) for m in messages for c in m["role"][0] + m["content"]][-120:]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def test_methods_replay_every_turn_with_equal_answers_and_state_reset_per_conversation(
    tmp_path: Path, target, head
) -> None:
    convs = load_conversations(_shared(tmp_path), 2, max_turns=2)
    tree = TreeConfig(top_k=2, depth=3, total_tokens=5)
    decoders = {
        "ar": make_decoder("ar", target),
        "evospec": make_decoder(
            "evospec", target, draft=head, tree=tree, vocab=SMALL, indices=stand_in_indices(target)
        ),
    }
    resets = []
    original = decoders["evospec"].vocab.reset_dynamic
    decoders["evospec"].vocab.reset_dynamic = lambda: resets.append(1) or original()
    records, mismatches = run_conversations(
        decoders, convs, _Codec(), SamplingParams(max_new_tokens=8), progress=False
    )
    assert mismatches == {"ar": 0, "evospec": 0}
    assert len(records) == 4 and all(r.turns == 2 for r in records)
    assert len(resets) == 2  # once before each conversation
    result = summarise_conversations(records, {"conversations": 2, "max_turns": 2, "max_new_tokens": 8})
    assert result["methods"]["ar"]["speedup_vs_ar"]["mean"] == pytest.approx(1.0)
    evo = result["methods"]["evospec"]
    assert len(evo["per_conversation_mal"]) == 2 and evo["mal"]["mean"] >= 1.0 and evo["mal"]["std"] >= 0
    assert "| evospec |" in format_conversation_table(result)

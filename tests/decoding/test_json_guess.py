"""Jump-forward guesses: the text a JSON grammar forces, spaced as the answer spaces it, and a
speculative loop that verifies it (output always plain decoding's under the same grammar)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from evospec.decoding.json_grammar import AFTER, JsonGrammar, TokenTable
from evospec.decoding.json_guess import JsonGuess
from evospec.decoding.json_schema import compile_schema
from evospec.decoding.penalties import Penalties
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from tests.decoding.spec_helpers import ar_tokens, chi2_pvalue, prompt_of, spec_events, tiny_target
from tests.decoding.test_json_mode import EOS, TOKENS, VOCAB, second_token_law

STRING = {"type": "string"}
SCHEMA = {"type": "object", "properties": {"key": STRING, "a": STRING, "b": {"type": "integer"}}}
SCHEMA["required"] = ["key", "a", "b"]


@pytest.fixture(scope="module")
def grammar() -> JsonGrammar:
    return JsonGrammar(TokenTable(TOKENS, [EOS], VOCAB), compile_schema(SCHEMA))


def _guess(grammar: JsonGrammar, written: bytes, limit: int = 8) -> bytes:
    """The guessed text after ``written`` (fed as the table spells it)."""
    guess = JsonGuess(grammar, limit)
    guess.extend(grammar.table.encode(written))
    assert grammar.machine.walk(grammar.start(), written) == guess.state
    return b"".join(TOKENS[t] for t in guess.propose())


def test_a_schema_s_next_key_is_guessed_with_its_quotes_colon_and_the_value_s_quote(grammar):
    assert _guess(grammar, b"") == b'{"key": "'
    assert _guess(grammar, b'{"key": "c",') == b' "a": "'
    # an integer next: its digits are the model's, and so is the space before them
    assert _guess(grammar, b'{"key": "c", "a": "d", "') == b'b":'


def test_nothing_is_guessed_where_the_model_chooses(grammar):
    assert _guess(grammar, b'{"key": "c') == b""  # inside a string
    assert _guess(grammar, b'{"key": "c", "a": "d", "b": 1') == b""  # more digits or the end
    assert _guess(grammar, b'{"key": "c", "a": "d", "b": 12}') == b""  # closed: only EOS
    json_mode = JsonGrammar(grammar.table)
    assert _guess(json_mode, b"{") == b""  # a free object: a key or "}"
    assert _guess(json_mode, b'{"a": 1, "b') == b""


def test_the_answer_s_own_spacing_is_repeated(grammar):
    written = b'{\n  "key" : "c",\n  "a'
    assert _guess(grammar, written) == b'" : "'
    assert _guess(grammar, written + b'" : "d",') == b'\n  "b" :'
    # a whitespace run already begun is completed, not doubled; another run: none added
    assert _guess(grammar, b'{"key":"c",  "a":"d", ') == b' "b":'
    assert _guess(grammar, written + b'" : "d",  ') == b'"b" :'


def test_at_most_limit_tokens_and_refused_tokens_leave_the_state(grammar):
    assert _guess(grammar, b"", limit=2) == b'{"key'
    guess = JsonGuess(grammar, 8)
    guess.extend(grammar.table.encode(b'{"key": "c"'))
    before = guess.state
    guess.extend([EOS, TOKENS.index(b"}")])  # EOS, and a "}" the schema refuses (keys missing)
    assert guess.state == before
    with pytest.raises(ValueError):
        JsonGuess(grammar, 0)


@pytest.mark.parametrize("lookup", [0, 3])
def test_guesses_are_verified_and_the_output_is_plain_decoding_s(grammar, lookup):
    """A loop with no draft model verifies the grammar's guesses (rows where nothing else
    guesses), some are accepted, and the output is token for token plain decoding's under the
    grammar (the tiny model spaces its JSON at random, so many guesses are rejected)."""
    target = tiny_target(5, eos=(EOS,))
    chain = TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=lookup)
    params = SamplingParams(max_new_tokens=40, penalties=Penalties(grammar=grammar))
    rows, accepted = dict.fromkeys((4, 0), 0), dict.fromkeys((4, 0), 0)
    for jump in (4, 0):
        for seed in range(4):
            prompt = prompt_of(seed, 6)
            events = spec_events(target, None, prompt, params, replace(chain, jump_forward=jump), (EOS,))
            assert [t for ev in events for t in ev.tokens] == ar_tokens(target, prompt, params, (EOS,))
            rows[jump] += sum(ev.tree_size for ev in events)
            accepted[jump] += sum(ev.accepted for ev in events)
    assert rows[4] > rows[0] + 20
    if not lookup:
        assert rows[0] == accepted[0] == 0 < accepted[4]


def test_only_byte_is_the_one_byte_any_of_256_would_find(grammar):
    """``only_byte`` tries a few candidate bytes (a token's first bytes, a name's next ones);
    checked against all 256 at every state of schema and JSON-mode texts."""
    json_mode = JsonGrammar(grammar.table)
    texts = {
        grammar: b'{ "key" : "c\\"d",\n  "a": "", "b": -12 }',
        json_mode: b'{"a": [1, {"b": null}, "x"], "key": true, "c": {}}',
    }
    met = 0
    for g, text in texts.items():
        state, ws_free = g.start(), b" \t\n\r"
        for b in text:
            between = state.mode <= AFTER
            taken = [
                c
                for c in range(256)
                if not (between and c in ws_free) and g.machine.step(state, c) is not None
            ]
            assert g.only_byte(state) == (taken[0] if len(taken) == 1 else None)
            met += len(taken) == 1
            state = g.machine.step(state, b)
    assert met >= 10


def test_sampled_guesses_follow_the_masked_distribution(grammar):
    """Under sampling a guessed token is accepted with the target's probability of it (a
    model-free proposal): the second token's law is the masked one's, guesses or not."""
    sharp = tiny_target(4, sharp=1.0, eos=(EOS,))
    prompt = prompt_of(8, 5)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, penalties=Penalties(grammar=grammar))
    exact = second_token_law(sharp, grammar, prompt, params)
    chain = TreeConfig(top_k=1, depth=1, total_tokens=1, jump_forward=4)
    n, counts, guessed = 1500, torch.zeros(VOCAB), 0
    for s in range(n):
        events = spec_events(sharp, None, prompt, replace(params, seed=s), chain, (EOS,))
        counts[[t for ev in events for t in ev.tokens][1]] += 1
        guessed += sum(ev.tree_size for ev in events)
    assert guessed > n // 4  # the first token often leaves a key to guess
    assert chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("bad", [-1, True, 2.5])
def test_a_bad_jump_forward_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"tree\.jump_forward must be an integer >= 0"):
        TreeConfig(jump_forward=bad)

"""A ``pattern``'s automaton: over strings of the characters it generates (printable ASCII but
the two JSON escapes), it takes exactly the strings Python's ``re.search`` finds the pattern in;
every state it can reach can still end; what it cannot honour is refused by name."""

from __future__ import annotations

import random
import re

import pytest

from evospec.decoding.json_regex import Pattern, compile_pattern

PATTERNS = [
    r"^[a-z]+$",
    r"^\d{3}-\d{4}$",
    r"^(foo|bar)baz?$",
    r"[A-Z]{2}\d+",
    r"^\w+@\w+\.(com|org)$",
    r"^.{2,5}$",
    r"^(?:ab)*c$",
    r"^[^0-9]+$",
    r"x",
    r"^\s?a$",
    r"^[a-c-]+$",
    r"^a{2,}b{0,2}$",
    r"^(a|b|)c*?$",
    r"ab|cd",
    r"^[\d.]+\D$",
    r"^\W\S\w$",
    r"^\u0041\.\/$",
    r"^[]a]$",
    r"^[^\"]+\!$",
]
ALPHABET = "abcdfoxrzACZ09-@._ /]A!"


def _takes(pattern: Pattern, text: str) -> bool:
    at = pattern.start()
    for b in text.encode():
        at = pattern.step(at, b)
        if at is None:
            return False
    return pattern.done(at)


@pytest.mark.parametrize("source", PATTERNS)
def test_the_automaton_takes_exactly_the_strings_the_pattern_is_found_in(source):
    pattern = compile_pattern(source)
    rng = random.Random(source)
    found = 0
    for _ in range(3000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(9)))
        want = re.search(source, text) is not None
        assert _takes(pattern, text) == want, text
        found += want
    for text in ["foo", "barba", "ab@cd.com", "aac", "abababc", "123-4567", "xx"]:
        assert _takes(pattern, text) == (re.search(source, text) is not None), text


@pytest.mark.parametrize("source", [*PATTERNS, r"^é+$", r"^\d{1,256}$", r'^(ab"|ac)$', r"x(y\t|z)"])
def test_every_state_it_can_reach_can_still_end(source):
    pattern = compile_pattern(source)
    seen, todo = {0}, [0]
    while todo:
        at = todo.pop()
        for b in range(256):
            nxt = pattern.step(at, b)
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    ends = {at for at in seen if pattern.done(at)}
    for at in seen:  # a walk of moves from every reachable state reaches an end
        frontier, visited = {at}, {at}
        while frontier and not frontier & ends:
            frontier = {
                n for s in frontier for b in range(256) if (n := pattern.step(s, b)) is not None
            } - visited
            visited |= frontier
        assert frontier & ends, (source, at)


def test_characters_json_escapes_and_non_ascii_ones_are_never_generated_by_classes():
    anything = compile_pattern(r"^.*$")
    assert _takes(anything, "a b!~") and not _takes(anything, 'a"b') and not _takes(anything, "a\\b")
    assert not _takes(anything, "a\tb") and not _takes(anything, "é")
    assert _takes(compile_pattern(r"^é+$"), "éé")  # a non-ASCII literal is its UTF-8 bytes
    assert _takes(compile_pattern(r"^(a|\n)$"), "a") and not _takes(compile_pattern(r"^(a|\n)$"), "\n")


@pytest.mark.parametrize(
    ("source", "words"),
    [
        (r"^a|b$", "in a group"),
        (r"(?=a)", "lookaround"),
        (r"\1", "escape"),
        (r"\b", "escape"),
        (r"[é]", "non-ASCII"),
        (r"a{300}", "counts"),
        (r"a{2,1}", "counts"),
        (r"a{x}", "digits"),
        (r"(a", "not closed"),
        (r"a)", "without"),
        (r"[a", "not closed"),
        (r"*a", "nothing to repeat"),
        (r"[z-a]", "backwards"),
        (r'^"$', "no string"),
        (r"^\t$", "no string"),
        (r"a^b", "only at the start"),
        (r"\u00e9", "above ASCII"),
        ("a" * 1001, "at most"),
        (r"^[ab]*a[ab]{11}$", "states"),  # 2^12 subsets
        (r"^((a{200}){200})$", "too large"),  # counts multiply before any subset is made
        (r"^(a|b|c|d|e|f|g|h){0,256}z{0,256}$", "too complex"),  # stopped after ~0.5 s of work
    ],
)
def test_what_it_cannot_honour_is_refused_by_name(source, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        compile_pattern(source)


def test_patterns_are_equal_by_their_source():
    assert compile_pattern(r"^a+$") == compile_pattern(r"^a+$") and hash(compile_pattern("x")) == hash(
        compile_pattern("x")
    )

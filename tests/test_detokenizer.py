"""Incremental detokenizer: equals a full decode, UTF-8 safe while streaming, stop strings never leak."""

from __future__ import annotations

import random

import pytest

from depthserve.detokenizer import IncrementalDetokenizer

TEXTS = [
    "naïve café 中文 🙂 emoji",
    "Hello, world! The quick brown fox jumps over the lazy dog.\n  Indented line\twith a tab.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "こんにちは世界。今日はいい天気ですね。東京タワー🗼",
    "Ελληνικά: Καλημέρα κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया",
    "Emoji sequences 👍🏽👨‍👩‍👧‍👦🇫🇷 and math ∀x∈ℝ: x² ≥ 0 — “quotes” …",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code with ünïcödé\n",
]


def stream(tokenizer, prompt: list[int], ids: list[int], **kwargs) -> tuple[list[str], str, list[str | None]]:
    """Feeds ids one by one; returns every intermediate text(False), the final text and the stop results."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    seen, stops = [], []
    for token in ids:
        stops.append(detok.add_token(token))
        seen.append(detok.text(False))
        if stops[-1] is not None:
            break
    return seen, detok.text(True), stops


def check_streaming(seen: list[str], final: str) -> None:
    for before, after in zip(seen, seen[1:] + [final]):
        assert after.startswith(before), (before, after)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(smollm_tokenizer, text):
    tok = smollm_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Some prompt:", add_special_tokens=False)
    seen, final, _ = stream(tok, prompt, ids)
    assert final == tok.decode(ids, skip_special_tokens=True) == text
    check_streaming(seen, final)
    assert all(not s.endswith("\ufffd") for s in seen)  # valid text: never a partial character
    # A character split over several tokens shows up only once complete.
    assert seen[-1] == final


def test_multibyte_characters_are_held_until_complete(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode(" 🙂🗼", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "test needs an emoji split over tokens"
    seen, final, _ = stream(tok, [], ids)
    assert final == " 🙂🗼"
    assert all("\ufffd" not in s for s in seen)
    check_streaming(seen, final)


def test_random_token_sequences_match_full_decode(smollm_tokenizer):
    tok = smollm_tokenizer
    pool = sorted({t for text in TEXTS for t in tok.encode(text, add_special_tokens=False)})
    specials = [tok.eos_token_id, tok.bos_token_id] if tok.bos_token_id is not None else [tok.eos_token_id]
    rng = random.Random(0)
    for trial in range(150):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 25))]
        if trial % 5 == 0:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 8))]  # may end mid-character
        skip = trial % 3 != 0
        seen, final, _ = stream(tok, prompt, ids, skip_special_tokens=skip)
        assert final == tok.decode(ids, skip_special_tokens=skip), (prompt, ids)
        check_streaming(seen, final)


def test_leading_space_and_prompt_context(smollm_tokenizer):
    tok = smollm_tokenizer
    full = tok.encode("The answer is 42 and more", add_special_tokens=False)
    prompt, out = full[:3], full[3:]
    _, final, _ = stream(tok, prompt, out)
    assert final == tok.decode(out) and final.startswith(" ")


def test_stop_string_split_across_tokens_never_leaks(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "Alpha beta gamma. The END marker follows here."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "END marker fol"  # spans " END", " marker" and part of " follows"
    seen, final, stops = stream(tok, [], ids, stop=[stop])
    assert stops[-1] == stop and all(s is None for s in stops[:-1])
    first = next(i for i in range(len(ids)) if "END" in tok.decode(ids[: i + 1]))
    assert len(stops) - 1 - first >= 2, "the stop string should span three tokens"
    assert final == "Alpha beta gamma. The "
    assert all("E" not in s[len("Alpha beta gamma. The"):] for s in seen)
    check_streaming(seen, final)


def test_stop_string_with_include_stop_str_in_output(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("one two three four five", add_special_tokens=False)
    seen, final, stops = stream(tok, [], ids, stop=["three f"], include_stop_str_in_output=True)
    assert stops[-1] == "three f"
    assert final == "one two three f"
    check_streaming(seen, final)
    assert all(s in ("", "one", "one two", "one two ", "one two three f") for s in seen), seen


def test_stop_string_at_the_very_start(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("STOP and then more", add_special_tokens=False)
    seen, final, stops = stream(tok, [], ids, stop=["STOP"])
    assert final == ""
    assert stops[-1] == "STOP"
    assert all(s == "" for s in seen)


def test_stop_inside_multibyte_text(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "价格是 🙂🙂 然后结束了吧"
    ids = tok.encode(text, add_special_tokens=False)
    seen, final, stops = stream(tok, [], ids, stop=["🙂 然"])
    assert stops[-1] == "🙂 然"
    assert final == "价格是 🙂"
    assert all("然" not in s and not s.endswith("\ufffd") for s in seen)
    check_streaming(seen, final)


def test_held_back_prefix_is_released_when_it_stops_matching(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("Hello world, Hello there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["Hello thereabouts", "worldwide"])
    texts = []
    for token in ids:
        assert detok.add_token(token) is None
        texts.append(detok.text(False))
    full = "Hello world, Hello there"
    # " world" could start "worldwide"... until ",": then it is released.
    assert any(t == "Hello " for t in texts)
    assert "Hello world," in texts[-1]
    # The trailing "Hello there" is a prefix of a stop string: held back while streaming.
    assert texts[-1] == "Hello world, "
    assert detok.text(True) == full  # finished without the stop string: everything is shown
    check_streaming(texts, full)


def test_earliest_completed_stop_wins_and_later_tokens_are_ignored(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("a b c d e f", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["d e f", "c"])
    results = [detok.add_token(t) for t in ids]
    assert "c" in results and results.count("c") == 1
    assert detok.text(True) == "a b "
    assert detok.add_token(ids[0]) is None and detok.text(True) == "a b "


def test_finish_flushes_an_incomplete_character(smollm_tokenizer):
    tok = smollm_tokenizer
    # No stop strings: finishing shows the partial character as the full decode does.
    ids = tok.encode("ab🙂", add_special_tokens=False)
    emoji_start = next(i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[: i + 1]))
    partial = ids[: emoji_start + 1]
    detok = IncrementalDetokenizer(tok, [])
    for t in partial:
        detok.add_token(t)
    assert not detok.text(False).endswith("\ufffd")
    assert detok.text(True) == tok.decode(partial)

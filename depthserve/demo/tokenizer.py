"""The demo models' word-level tokenizer, built with the `tokenizers` library and saved as a
checkpoint's `tokenizer.json` (so the engine loads it like any Hugging Face tokenizer).

Words are split on whitespace; the vocabulary holds every statement (`c=4`, `h=f`), every
question (`h?`) and every digit, so one statement is one token. An unknown word is an error when
encoding through the engine (no <unk>)."""

from __future__ import annotations

from pathlib import Path

from depthserve.demo.task import DIGITS, VARIABLES

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL = (PAD, BOS, EOS)


def statement(name: str, value: str) -> str:
    return f"{name}={value}"


def question(name: str) -> str:
    return f"{name}?"


def vocabulary() -> tuple[str, ...]:
    """Every word of the task, in a fixed order: specials, digits, questions, statements."""
    return (SPECIAL + tuple(DIGITS) + tuple(question(v) for v in VARIABLES)
            + tuple(statement(v, rhs) for v in VARIABLES for rhs in VARIABLES + DIGITS if rhs != v))


def build_tokenizer():
    """A `tokenizers.Tokenizer` with one token per word of `vocabulary()`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={word: i for i, word in enumerate(vocabulary())}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL))
    return tokenizer


def save_tokenizer(out: Path):
    """Write tokenizer.json and tokenizer_config.json to `out`; returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    return fast

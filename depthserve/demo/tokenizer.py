"""The demo models' character-level tokenizer, built with the `tokenizers` library and saved as a
checkpoint's `tokenizer.json` (so the engine loads it like any Hugging Face tokenizer)."""

from __future__ import annotations

from pathlib import Path

from depthserve.demo.task import DIGITS, VARIABLES

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL = (PAD, BOS, EOS)
CHARACTERS = VARIABLES + DIGITS + "=;? "


def build_tokenizer():
    """A `tokenizers.Tokenizer`: one token per character of the task's alphabet, plus <pad>, <s>
    and </s>; an unknown character is an error when encoding through the engine (no <unk>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL + tuple(CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL))
    return tokenizer


def save_tokenizer(out: Path):
    """Write tokenizer.json and tokenizer_config.json to `out`; returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    return fast

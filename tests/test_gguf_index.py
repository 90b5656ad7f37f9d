"""The GGUF index (depthserve/loading/gguf_loader.py, `read_gguf`): the first read of a file parses
it with gguf's reader and saves the config and the tensors' places; later reads take them from the
index without parsing, with the same config, weights and codes; a rewritten file is parsed again;
a cache that cannot be written costs only the parse. On a tiny llama GGUF written by gguf's writer."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from depthserve.loading import gguf_loader
from depthserve.loading.derived_cache import derived_dir

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 96, 4, 2, 2, 300


def write_tiny_gguf(path: Path, seed: int) -> None:
    """A llama GGUF: F32 norms, Q8_0 projections and embedding, a vocabulary of VOCAB strings."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0 + seed)
    writer.add_token_list([f"token{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for layer in range(LAYERS):
        shapes |= {f"blk.{layer}.attn_norm.weight": (HIDDEN,), f"blk.{layer}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{layer}.attn_q.weight": (HIDDEN, HIDDEN),
                   f"blk.{layer}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{layer}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{layer}.attn_output.weight": (HIDDEN, HIDDEN),
                   f"blk.{layer}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{layer}.ffn_up.weight": (FFN, HIDDEN),
                   f"blk.{layer}.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def parses(monkeypatch, tmp_path):
    """A cache directory of the test's own, and the count of the files gguf's reader parses (its
    class itself: the suite shares one parse per path otherwise, conftest.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parsed = []

    def reader(path, *args):
        parsed.append(path)
        return gguf.gguf_reader.GGUFReader(path, *args)

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    return parsed


def _same(a: tuple, b: tuple) -> bool:
    (config_a, tensors_a), (config_b, tensors_b) = a, b
    return config_a == config_b and [(t.name, t.kind, t.dims, t.data.dtype, t.data.shape) for t in tensors_a] == \
        [(t.name, t.kind, t.dims, t.data.dtype, t.data.shape) for t in tensors_b] and \
        all(np.array_equal(x.data, y.data) for x, y in zip(tensors_a, tensors_b))


def test_a_second_read_takes_the_index_and_gives_the_same_config_and_tensors(tmp_path, parses):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    first = gguf_loader.read_gguf(path)
    assert (derived_dir(path, "gguf-index") / "index.json").is_file() and len(parses) == 1
    second = gguf_loader.read_gguf(path)
    assert len(parses) == 1, "the second read parsed the file again"
    assert _same(first, second)
    config, tensors = second
    assert config["num_hidden_layers"] == LAYERS and config["vocab_size"] == VOCAB and config["tie_word_embeddings"]
    assert {t.kind for t in tensors} == {"F32", "Q8_0"} and isinstance(tensors[0].data, np.memmap)


def test_a_rewritten_file_is_parsed_again(tmp_path, parses):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    before = gguf_loader.read_gguf(path)
    path.unlink()
    write_tiny_gguf(path, seed=1)
    after = gguf_loader.read_gguf(path)
    assert len(parses) == 2 and after[0]["rope_theta"] == 10001.0 != before[0]["rope_theta"]
    assert _same(after, gguf_loader.read_gguf(path)) and len(parses) == 2


def test_a_cache_that_cannot_be_written_costs_only_the_parse(tmp_path, parses, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    first = gguf_loader.read_gguf(path)
    assert _same(first, gguf_loader.read_gguf(path)) and len(parses) == 2

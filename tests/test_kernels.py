"""Every Triton kernel against its torch fallback, on small shapes, under TRITON_INTERPRET=1 on CPU
(or natively where a GPU is present). Shapes cover ragged lengths, padding rows, GQA, head
subsets (page-table rows repeated per query head), empty and full selections."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from depthserve.kernels.dispatch import Kernels  # noqa: E402
from depthserve.kernels.triton.paged import decode_splits  # noqa: E402
from tests.flash_helpers import stand_in_flash  # noqa: E402

torch_ops, triton_ops = Kernels("torch"), Kernels("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 everywhere: IEEE dot products on both paths, so only summation order differs.
ATOL = 2e-5


def make_pool(num_pages: int, block_size: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, block_size, head_dim, generator=gen)
    v = torch.randn(num_pages, block_size, head_dim, generator=gen)
    return k.to(DEVICE), v.to(DEVICE)


def random_tables(batch: int, kv_heads: int, blocks: int, num_pages: int, seed: int) -> torch.Tensor:
    """Distinct pages per (sequence, head, block), in scrambled order (as a real pool looks)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=gen)[: batch * kv_heads * blocks]
    # Laid out [batch, blocks, heads] and viewed transposed, as the engine's page tables are.
    return perm.view(batch, blocks, kv_heads).to(DEVICE).transpose(1, 2)


def test_store_kv_skips_padding_rows():
    k_pages, v_pages = make_pool(6, 4, 8)
    expected_k, expected_v = k_pages.clone(), v_pages.clone()
    k = torch.randn(5, 2, 8, device=DEVICE)
    v = torch.randn(5, 2, 8, device=DEVICE)
    index = torch.tensor([[0, 4], [1, 5], [-1, -1], [9, 13], [23, -1]], device=DEVICE)
    torch_ops.store_kv(k, v, expected_k, expected_v, index)
    triton_ops.store_kv(k, v, k_pages, v_pages, index)
    assert torch.equal(k_pages, expected_k) and torch.equal(v_pages, expected_v)
    assert not torch.equal(k_pages, make_pool(6, 4, 8)[0])  # something was written


@pytest.mark.parametrize("tiles_per_split", [None, 1])
def test_kernels_read_views_of_a_fused_qkv_output_in_place(tiles_per_split):
    """Queries, keys and values as a decode layer hands them over: views into one fused QKV
    output (rows 960 wide for SmolLM2), and the slot's index columns of a wider index row. The
    kernels read them through their strides (no copy kernels in a decode step) and match torch,
    which reads them as they are too."""
    batch, q_heads, kv_heads, head_dim, block_size, lens = 3, 6, 2, 16, 4, [5, 9, 12]
    fused = torch.randn(batch, q_heads + 2 * kv_heads, head_dim, device=DEVICE)
    q, k, v = fused.split([q_heads, kv_heads, kv_heads], dim=1)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    max_blocks = 4
    num_pages = batch * kv_heads * max_blocks + 3
    table = random_tables(batch, kv_heads, max_blocks, num_pages, seed=7)
    wide_index = torch.full((batch, 3 * kv_heads), -1, dtype=torch.int32, device=DEVICE)
    for row, length in enumerate(lens):  # the last position of each sequence, in the middle slot's columns
        block, offset = divmod(length - 1, block_size)
        wide_index[row, kv_heads: 2 * kv_heads] = table[row, :, block] * block_size + offset
    index = wide_index[:, kv_heads: 2 * kv_heads]
    results = []
    for ops in (torch_ops, triton_ops):
        k_pages, v_pages = make_pool(num_pages, block_size, head_dim, seed=1)
        ops.store_kv(k, v, k_pages, v_pages, index)
        context_lens = torch.tensor(lens, device=DEVICE)
        extra = (tiles_per_split,) if ops is triton_ops else ()
        results.append((k_pages, v_pages, ops.paged_decode_attention(q, k_pages, v_pages, table, context_lens, 0.3,
                                                                     *extra)))
    (k_expected, v_expected, expected), (k_got, v_got, got) = results
    assert torch.equal(k_got, k_expected) and torch.equal(v_got, v_expected)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, block_size, lens, tiles_per_split",
    [
        (3, 4, 4, 4, [1, 7, 16], None),  # MHA, ragged, a context of one key
        (2, 6, 2, 8, [33, 70], None),  # GQA 3:1, several tiles
        (2, 6, 2, 8, [33, 70], 1),  # the same with split-K: one tile per split
        (4, 3, 3, 2, [5, 64, 9, 100], 2),  # a head subset laid out as one table row per query head
        (1, 9, 3, 16, [130], 1),  # SmolLM2's heads, several splits, last split partly empty
    ],
)
def test_paged_decode_attention_matches_torch(batch, q_heads, kv_heads, block_size, lens, tiles_per_split):
    head_dim = 16
    max_blocks = -(-max(lens) // block_size) + 1  # one padding block column
    num_pages = batch * kv_heads * max_blocks + 3
    k_pages, v_pages = make_pool(num_pages, block_size, head_dim, seed=batch)
    table = random_tables(batch, kv_heads, max_blocks, num_pages, seed=len(lens))
    q = torch.randn(batch, q_heads, head_dim, device=DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    expected = torch_ops.paged_decode_attention(q, k_pages, v_pages, table, context_lens, 0.3)
    got = triton_ops.paged_decode_attention(q, k_pages, v_pages, table, context_lens, 0.3, tiles_per_split)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("lengths_dtype", [torch.int64, torch.int32])
def test_paged_decode_attention_reads_the_lengths_in_place(lengths_dtype, monkeypatch):
    """The compiled decode step holds its context lengths as int64 (one buffer of the step's inputs):
    the decode kernel reads them as they are, in either dtype (the matching tests above run it on
    int64 lengths); a conversion in the op would be one more copy kernel per layer of every step."""
    from depthserve.kernels.triton import paged as triton_paged

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(args)

    monkeypatch.setattr(triton_paged, "_decode_partial_kernel", Recorder())
    monkeypatch.setattr(triton_paged, "_decode_reduce_kernel", Recorder())
    k_pages, v_pages = make_pool(20, 4, 16)
    lens = torch.tensor([5, 9], dtype=lengths_dtype, device=DEVICE)
    triton_paged.paged_decode_attention(torch.randn(2, 4, 16, device=DEVICE), k_pages, v_pages,
                                        random_tables(2, 2, 3, 20, seed=1), lens, 0.25)
    assert launches[0][4] is lens


@pytest.mark.parametrize(
    "multiprocessors, batch, q_heads, kv_heads, block_size, lens, width_blocks",
    [
        (132, 2, 6, 2, 8, [33, 70], 40),  # 5 splits for the width, the longest context fills 2
        (8, 4, 3, 3, 4, [5, 300, 9, 100], 128),  # 3 splits for the width share the longest context's 5 tiles
    ],
)
def test_paged_decode_attention_splits_the_longest_context_of_a_wide_table(
        monkeypatch, multiprocessors, batch, q_heads, kv_heads, block_size, lens, width_blocks):
    """Tables as wide as max_model_len (the CUDA-graph step's) with short contexts: the kernel sizes its
    splits on the batch's longest context, read on the device, and still matches torch."""
    from depthserve.kernels.triton import paged as triton_paged

    monkeypatch.setattr(triton_paged, "_multiprocessors", lambda device: multiprocessors)
    head_dim = 16
    num_pages = batch * kv_heads * width_blocks + 3
    k_pages, v_pages = make_pool(num_pages, block_size, head_dim, seed=batch)
    table = random_tables(batch, kv_heads, width_blocks, num_pages, seed=len(lens))
    q = torch.randn(batch, q_heads, head_dim, device=DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    expected = torch_ops.paged_decode_attention(q, k_pages, v_pages, table, context_lens, 0.3)
    got = triton_ops.paged_decode_attention(q, k_pages, v_pages, table, context_lens, 0.3)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_decode_splits_grow_with_context_and_shrink_with_batch():
    few = triton.cdiv(4096, 32) // decode_splits(1, 1, 4096)
    many = triton.cdiv(4096, 32) // decode_splits(256, 8, 4096)
    assert few > many >= 1


@pytest.mark.parametrize(
    "chunks, q_heads, kv_heads, block_size",
    [
        ([(5, 5), (40, 40), (1, 1)], 4, 2, 4),  # fresh prompts of ragged length, GQA
        ([(8, 20), (33, 45)], 6, 3, 8),  # later chunks over earlier chunks / prefix-cache hits
        ([(70, 70), (3, 77)], 2, 2, 16),  # more queries than one tile
    ],
)
def test_varlen_prefill_attention_matches_torch(chunks, q_heads, kv_heads, block_size):
    head_dim = 16
    max_blocks = -(-max(c for _, c in chunks) // block_size)
    num_pages = len(chunks) * kv_heads * max_blocks + 2
    k_pages, v_pages = make_pool(num_pages, block_size, head_dim, seed=7)
    tables = random_tables(len(chunks), kv_heads, max_blocks, num_pages, seed=3)
    counts = [n for n, _ in chunks]
    starts = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), device=DEVICE)
    context_lens = torch.tensor([c for _, c in chunks], device=DEVICE)
    q = torch.randn(sum(counts), q_heads, head_dim, device=DEVICE)
    args = (q, k_pages, v_pages, tables, starts, context_lens, 0.25)
    expected = torch_ops.paged_prefill_attention_varlen(*args)
    torch.testing.assert_close(triton_ops.paged_prefill_attention_varlen(*args), expected, atol=ATOL, rtol=0)
    # the longest chunk given from the host (the engine's way: no device read for the grid)
    torch.testing.assert_close(triton_ops.paged_prefill_attention_varlen(*args, max_queries=max(counts)), expected,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("takes_gqa, window", [(True, None), (False, None), (True, 7)])
def test_chunks_that_start_their_sequences_take_flash_over_their_own_keys(takes_gqa, window, monkeypatch):
    """The prefill op's CUDA form (here the Triton backend, flash varlen attention stood in by its
    documented semantics): given the chunks' own keys and values (`fresh_kv`, as a layer hands them
    over: views of one fused QKV output), it calls flash once with the chunks' boundaries for
    queries and keys alike, and equals attention over the pool that holds those keys; without them
    (chunks over cached keys) it reads the pool and never calls flash. A torch whose flash takes no
    grouped heads gets the KV heads repeated; a sliding-window layer's op (window 7, shorter than the
    40-token chunk) passes its window on."""
    calls = stand_in_flash(monkeypatch, takes_gqa)
    counts, q_heads, kv_heads, head_dim, block_size = [5, 40, 2], 6, 2, 16, 4
    max_blocks = -(-max(counts) // block_size)
    num_pages = len(counts) * kv_heads * max_blocks + 2
    k_pages, v_pages = make_pool(num_pages, block_size, head_dim, seed=8)
    tables = random_tables(len(counts), kv_heads, max_blocks, num_pages, seed=4)
    fused = torch.randn(sum(counts), q_heads + 2 * kv_heads, head_dim, device=DEVICE)
    q, k, v = fused.split([q_heads, kv_heads, kv_heads], dim=1)
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in counts])
    owner = torch.cat([torch.full((n,), i, device=DEVICE) for i, n in enumerate(counts)])
    slots = tables[owner, :, positions // block_size] * block_size + (positions % block_size)[:, None]
    torch_ops.store_kv(k, v, k_pages, v_pages, slots)
    starts = torch.tensor([0, 5, 45, 47], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    args = (q, k_pages, v_pages, tables, starts, lens, 0.25)
    if window is None:
        expected = torch_ops.paged_prefill_attention_varlen(*args)
        ours = triton_ops.paged_prefill_attention_varlen
    else:
        expected = torch_ops.paged_window_prefill_attention(*args, window)
        assert not torch.allclose(expected, torch_ops.paged_prefill_attention_varlen(*args))  # the window matters
        args += (window,)
        ours = triton_ops.paged_window_prefill_attention
    got = ours(*args, max_queries=max(counts), fresh_kv=(k, v))
    assert calls == [(len(counts), -1 if window is None else window - 1)]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours(*args, max_queries=max(counts)), expected, atol=ATOL, rtol=0)
    assert len(calls) == 1


@pytest.mark.parametrize("fault", ["raises", "disagrees"])
def test_a_flash_that_fails_its_probe_leaves_prefill_to_the_triton_kernel(fault, monkeypatch, caplog):
    """A torch whose flash kernel raises on this device, or computes something else than SDPA,
    fails the probe (once per device, dtype and head layout): the op reads the pool through the
    Triton kernel instead, and the log says why."""
    import torch.nn.attention.varlen

    from depthserve.kernels import flash

    stand_in_flash(monkeypatch)  # flash supported here, its probes fresh

    def broken(q, k, v, *args, **kwargs):
        if fault == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        return torch.zeros_like(q)

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", broken)
    k_pages, v_pages = make_pool(40, 4, 16, seed=2)
    tables = random_tables(2, 2, 3, 40, seed=5)
    q = torch.randn(14, 6, 16, device=DEVICE)
    args = (q, k_pages, v_pages, tables, torch.tensor([0, 5, 14], dtype=torch.int32, device=DEVICE),
            torch.tensor([5, 9], dtype=torch.int32, device=DEVICE), 0.25)
    ignored = torch.randn(14, 2, 16, device=DEVICE)  # not the pool's keys: read only by a flash that ran
    with caplog.at_level("WARNING", logger="depthserve.kernels.flash"):
        got = triton_ops.paged_prefill_attention_varlen(*args, max_queries=9, fresh_kv=(ignored, ignored))
    assert not flash.runs(q, 2)
    assert "prefill attention runs the Triton kernel" in caplog.text
    torch.testing.assert_close(got, torch_ops.paged_prefill_attention_varlen(*args), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["mixed", "none_selected", "all_selected", "step_off_for_some"])
def test_itt_route_and_update_match_torch(case):
    rows, dim = 150, 24  # more rows than one routing tile
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(rows, dim, generator=gen).to(DEVICE)
    weight = torch.randn(dim, generator=gen).to(DEVICE)
    thresholds = {
        "mixed": torch.rand(rows, generator=gen),
        "none_selected": torch.full((rows,), 1.5),
        "all_selected": torch.full((rows,), float("-inf")),
        "step_off_for_some": torch.where(torch.arange(rows) % 3 == 0, float("inf"), 0.5),
    }[case].to(DEVICE)
    expected = torch_ops.itt_route(y, weight, 0.1, thresholds)
    got = triton_ops.itt_route(y, weight, 0.1, thresholds)
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=0)
    assert torch.equal(got[1].cpu(), expected[1].cpu())
    assert torch.equal(got[2].cpu(), expected[2].cpu())
    num_selected = len(expected[2])
    assert num_selected == {"none_selected": 0, "all_selected": rows}.get(case, num_selected)
    if case == "step_off_for_some":
        assert bool((expected[1][::3] == -2).all())

    step_out = torch.randn(num_selected, dim, generator=gen).to(DEVICE)
    phi = torch.randn(dim, generator=gen).to(DEVICE)
    for skip_rule in ("paper", "identity"):
        y_ref, y_kernel = y.clone(), y.clone()
        torch_ops.itt_update(y_ref, step_out, expected[1], expected[0], phi, 0.7, skip_rule)
        triton_ops.itt_update(y_kernel, step_out, got[1], got[0], phi, 0.7, skip_rule)
        torch.testing.assert_close(y_kernel, y_ref, atol=ATOL, rtol=0)
        off = expected[1] == -2
        assert torch.equal(y_kernel[off], y[off])  # a step that is off touches nothing


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_itt_update_follows_the_contract(impl):
    update = {"torch": torch_ops.itt_update, "triton": triton_ops.itt_update}[impl]
    y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], device=DEVICE)
    slot = torch.tensor([-1, 1, -2, 0], dtype=torch.int32, device=DEVICE)
    scores = torch.tensor([0.2, 0.5, 0.9, 0.25], device=DEVICE)
    phi = torch.tensor([0.5, -1.0], device=DEVICE)
    f = torch.tensor([[1.0, 2.0], [10.0, 20.0]], device=DEVICE)  # in selection order: row 3, then row 1
    selected_rows = [[3 + 2 * 0.5 * 10 * 0.5, 4 + 2 * 0.5 * 20 * -1.0], [7 + 2 * 0.25 * 1 * 0.5, 8 + 2 * 0.25 * 2 * -1.0]]
    for skip_rule, skipped_row in (("paper", [1.5, 0.0]), ("identity", [1.0, 2.0])):
        out = y.clone()
        update(out, f, slot, scores, phi, 2.0, skip_rule)
        expected = torch.tensor([skipped_row, selected_rows[0], [5.0, 6.0], selected_rows[1]])
        torch.testing.assert_close(out.cpu(), expected)
    out = y.clone()
    update(out, f[:0], torch.tensor([-1, -2, -1, -2], dtype=torch.int32, device=DEVICE), scores, phi, 2.0, "paper")
    torch.testing.assert_close(out.cpu(), torch.tensor([[1.5, 0.0], [3.0, 4.0], [7.5, 0.0], [7.0, 8.0]]))


@pytest.mark.parametrize("max_depth, heads", [(4, 1), (7, 2), (64, 1)])
def test_depth_attention_matches_torch(max_depth, heads):
    tokens, head_dim = 9, 16
    gen = torch.Generator().manual_seed(max_depth)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(tokens, max_depth, heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(tokens, max_depth, heads, head_dim, generator=gen).to(DEVICE)
    valid = torch.randint(1, max_depth + 1, (tokens,), generator=gen).to(DEVICE)
    valid[0], valid[-1] = 1, max_depth
    expected = torch_ops.depth_attention(q, k, v, valid, 0.25)
    torch.testing.assert_close(triton_ops.depth_attention(q, k, v, valid, 0.25), expected, atol=ATOL, rtol=0)
    k[0, 1:] = 1e4  # entries beyond a token's valid depth are never read
    torch.testing.assert_close(triton_ops.depth_attention(q, k, v, valid, 0.25)[0], expected[0], atol=ATOL, rtol=0)


def test_dispatch_picks_torch_on_cpu_and_triton_when_forced(monkeypatch):
    from depthserve.kernels import depth as torch_depth
    from depthserve.kernels.triton import depth as triton_depth

    assert Kernels("torch").depth_attention is torch_depth.depth_attention
    calls = []
    monkeypatch.setattr(triton_depth, "depth_attention", lambda *a: calls.append("triton"))
    q = torch.randn(2, 1, 4)
    k = torch.randn(2, 3, 1, 4)
    valid = torch.tensor([1, 3])
    if DEVICE == "cpu":
        Kernels("auto").depth_attention(q, k, k, valid, 1.0)
        assert calls == []
    Kernels("triton").depth_attention(q, k, k, valid, 1.0)
    assert calls[-1] == "triton"

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 7])
def test_pointwise_cuda_forms_compute_in_fp32_and_round_once(dtype, tokens):
    """The CUDA forms of the rotary embedding (on the rows of a fused qkv output, as LlamaAttention
    passes them: a strided view) and of SwiGLU's gate (leading dims, a width over one program's
    block) against the same arithmetic in fp32 rounded once to the dtype: equal up to one rounding
    of the dtype (fp32: summation order only)."""
    from depthserve.kernels.ops import Form
    from depthserve.layers.activation import SILU_AND_MUL
    from depthserve.layers.rotary import APPLY_ROPE

    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 5, 2, 20  # half of 20 is no power of two: the kernel masks its tail
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    qk = fused[:, : (heads + kv_heads) * head_dim].reshape(tokens, heads + kv_heads, head_dim)
    angles = torch.randn(tokens, head_dim // 2, generator=gen).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = qk.float().split(head_dim // 2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    got = APPLY_ROPE.implementation(Form.CUDA)(qk, cos, sin)
    tolerance = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 0, "atol": 1e-6}
    assert got.shape == qk.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)

    width = 1100  # two programs of 1,024 columns, the second masked
    gate_up = torch.randn(3, tokens, 2 * width, generator=gen).to(DEVICE, dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).to(dtype)
    got = SILU_AND_MUL.implementation(Form.CUDA)(gate_up)
    assert got.shape == (3, tokens, width) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


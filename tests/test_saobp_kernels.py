"""SAOBP kernels: the Triton decode attention with a per-key bias and the bias update against their
torch fallbacks (under TRITON_INTERPRET=1 on CPU, natively on a GPU), on small shapes: ragged
lengths, GQA and MHA, a padding block column, stale values in bias rows beyond each context, with
and without the self message. Plus the torch prefill op against row-by-row decode steps: any split
of a prompt into chunks leaves the same outputs and the same bias."""

from __future__ import annotations

import math

import pytest
import torch

from depthserve.kernels import saobp as torch_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 2e-5
COEFS = {"high": math.expm1(-1.0), "low": math.expm1(1.0)}  # lambda = 1


def make_case(batch, q_heads, kv_heads, block_size, lens, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size) + 1  # one padding block column
    num_pages = batch * kv_heads * max_blocks + 3
    k_pages = torch.randn(num_pages, block_size, head_dim, generator=gen)
    v_pages = torch.randn(num_pages, block_size, head_dim, generator=gen)
    perm = torch.randperm(num_pages, generator=gen)[: batch * kv_heads * max_blocks]
    table = perm.view(batch, max_blocks, kv_heads).transpose(1, 2)  # as the engine lays page tables out
    num_rows = batch * q_heads * max_blocks + 5
    # Stale values everywhere (beyond each context too): the ops must read only keys < context - 1.
    bias_pages = torch.randn(num_rows, block_size, generator=gen) * 0.5
    rows = torch.randperm(num_rows, generator=gen)[: batch * q_heads * max_blocks]
    bias_table = rows.view(batch, max_blocks, q_heads).transpose(1, 2)
    q = torch.randn(batch, q_heads, head_dim, generator=gen) * 1.5
    lens_t = torch.tensor(lens)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(k_pages), to(v_pages), to(table), to(bias_pages), to(bias_table), to(lens_t)


CASES = [
    (3, 4, 4, 4, [1, 7, 16]),  # MHA, ragged, a context of one key
    (2, 6, 2, 8, [33, 70]),  # GQA 3:1, several tiles
    (4, 4, 2, 2, [5, 64, 9, 100]),  # GQA 2:1, small blocks
    (1, 9, 3, 16, [130]),  # SmolLM2's heads: a group of 3 (padded to 4 lanes)
]


@pytest.fixture(scope="module")
def triton_ops():
    pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")
    from depthserve.kernels.triton import saobp

    return saobp


@pytest.mark.parametrize("variant", ["high", "low"])
@pytest.mark.parametrize("self_message", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_matches_torch(triton_ops, case, variant, self_message):
    q, k, v, table, bias, bias_table, lens = make_case(*case, seed=len(case[4]))
    coef = COEFS[variant]
    expected, expected_lse = torch_ops.saobp_decode_attention(q, k, v, table, bias, bias_table, lens, 0.3, coef,
                                                              self_message)
    got, lse = triton_ops.saobp_decode_attention(q, k, v, table, bias, bias_table, lens, 0.3, coef, self_message)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=ATOL, rtol=0)
    # The bias does something: without it (zero rows) the output differs.
    plain, _ = torch_ops.saobp_decode_attention(q, k, v, table, torch.zeros_like(bias), bias_table, lens, 0.3, coef,
                                                False)
    assert (plain - expected).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["high", "low"])
@pytest.mark.parametrize("case", CASES)
def test_bias_update_matches_torch(triton_ops, case, variant):
    q, k, v, table, bias, bias_table, lens = make_case(*case, seed=7 + len(case[4]))
    coef = COEFS[variant]
    _, lse = torch_ops.saobp_decode_attention(q, k, v, table, bias, bias_table, lens, 0.3, coef, False)
    expected = bias.clone()
    torch_ops.saobp_bias_update(q, k, table, expected, bias_table, lens, lse, 0.3, coef)
    got = bias.clone()
    triton_ops.saobp_bias_update(q, k, table, got, bias_table, lens, lse, 0.3, coef)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # Exactly the positions < context changed (the newest set, the others incremented by a term in
    # [-1, 0] (high) or [0, 1] (low)); rows beyond each context are untouched.
    batch, heads, blocks = bias_table.shape
    before = torch_ops.gather_bias(bias, bias_table)
    after = torch_ops.gather_bias(got, bias_table)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(after[b, :, n:], before[b, :, n:])
        delta = after[b, :, : n - 1] - before[b, :, : n - 1]
        if variant == "high":
            assert (delta <= 1e-6).all() and (delta >= -1 - 1e-6).all()
        else:
            assert (delta >= -1e-6).all() and (delta <= 1 + 1e-6).all()


def _row_by_row(q_rows, k, v, table, bias, bias_table, n, coef, self_message, ops):
    """Decode steps for positions 0..n-1 of one sequence (its K/V already stored): outputs [n, H, d]."""
    outs = []
    for j in range(n):
        lens = torch.tensor([j + 1], device=q_rows.device)
        out, lse = ops.saobp_decode_attention(q_rows[j : j + 1], k, v, table, bias, bias_table, lens, 0.25, coef,
                                              self_message)
        ops.saobp_bias_update(q_rows[j : j + 1], k, table, bias, bias_table, lens, lse, 0.25, coef)
        outs.append(out)
    return torch.cat(outs)


@pytest.mark.parametrize("self_message", [False, True])
@pytest.mark.parametrize("chunks", [[37], [5, 1, 13, 2, 16], [1] * 3 + [34]])
def test_prefill_chunks_equal_decode_rows(chunks, self_message):
    """Rows of a chunk see the bias contributions of the chunk's earlier rows exactly as decode does."""
    n = sum(chunks)
    q1, k, v, table, bias0, bias_table, _ = make_case(1, 4, 2, 8, [n], seed=3)
    gen = torch.Generator().manual_seed(4)
    q_rows = (torch.randn(n, 4, 16, generator=gen) * 1.5).to(DEVICE)
    coef = COEFS["high"]
    bias_dec = bias0.clone()
    expected = _row_by_row(q_rows, k, v, table, bias_dec, bias_table, n, coef, self_message, torch_ops)
    bias_pre = bias0.clone()
    outs, start = [], 0
    for size in chunks:
        end = start + size
        if size == 1:  # a one-token chunk is decode-shaped in the engine
            lens = torch.tensor([end], device=DEVICE)
            out, lse = torch_ops.saobp_decode_attention(q_rows[start:end], k, v, table, bias_pre, bias_table, lens,
                                                        0.25, coef, self_message)
            torch_ops.saobp_bias_update(q_rows[start:end], k, table, bias_pre, bias_table, lens, lse, 0.25, coef)
        else:
            out = torch_ops.saobp_prefill_attention(
                q_rows[start:end], k, v, table, bias_pre, bias_table, torch.tensor([0, size], device=DEVICE),
                torch.tensor([end], device=DEVICE), 0.25, coef, self_message)
        outs.append(out)
        start = end
    torch.testing.assert_close(torch.cat(outs), expected, atol=ATOL, rtol=0)
    got_bias = torch_ops.gather_bias(bias_pre, bias_table)[0, :, :n]
    torch.testing.assert_close(got_bias, torch_ops.gather_bias(bias_dec, bias_table)[0, :, :n], atol=ATOL, rtol=0)


def test_triton_decode_rows_equal_torch_rows(triton_ops):
    """The Triton pair run row by row leaves the same outputs and bias as the torch pair."""
    n = 21
    _, k, v, table, bias0, bias_table, _ = make_case(1, 6, 2, 4, [n], seed=9)
    gen = torch.Generator().manual_seed(10)
    q_rows = (torch.randn(n, 6, 16, generator=gen) * 1.5).to(DEVICE)
    coef = COEFS["low"]
    b1, b2 = bias0.clone(), bias0.clone()
    expected = _row_by_row(q_rows, k, v, table, b1, bias_table, n, coef, True, torch_ops)
    got = _row_by_row(q_rows, k, v, table, b2, bias_table, n, coef, True, triton_ops)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch_ops.gather_bias(b2, bias_table)[0, :, :n],
                               torch_ops.gather_bias(b1, bias_table)[0, :, :n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("opts", [dict(variant="high"), dict(variant="low", self_message=True)])
@pytest.mark.slow
def test_engine_through_triton_matches_torch_path(triton_ops, tmp_path, smollm_tokenizer, opts):
    """The engine with every op that has a kernel forced through Triton (decode attention with the
    bias and the bias update included) gives the torch path's tokens and logprobs."""
    from depthserve import SamplingParams
    from depthserve.lab.tiny.saobp import make_tiny
    from depthserve.lab.make_tiny import synthetic_streams
    from tests.depth_helpers import assert_same_generations, generate_on_both_backends

    path = make_tiny(tmp_path / "m", 2, None, None, smollm_tokenizer, lam=1.0, **opts)
    stream = synthetic_streams(49152, 1, 64, seed=4)[0].tolist()
    prompts = [stream[:13], stream[20:23], stream[30:50]]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    expected, got, llm = generate_on_both_backends(str(path), prompts, params, max_model_len=64, block_size=8,
                                                   max_num_batched_tokens=12)
    assert_same_generations(expected, got)
    assert llm.engine.block_manager.num_used_pages == 0


def _pool_decode_step(kernels, q, k, v, k_pages, v_pages, write, table, bias_table, lens, coef):
    """One SAOBP layer's decode step as the model runs it: store the new keys, attend with the bias
    rows kept in the K pool, update them."""
    kernels.store_kv(k, v, k_pages, v_pages, write)
    bias = torch_ops.pool_bias_rows(k_pages)
    out, lse = kernels.saobp_decode_attention(q, k_pages, v_pages, table, bias, bias_table, lens, 0.3, coef, True)
    kernels.saobp_bias_update(q, k_pages, table, bias, bias_table, lens, lse, 0.3, coef)
    return out


def _pool_case(num_pages: int, seed: int = 0):
    """Two sequences (4 query heads, 2 KV heads, block size 4, head dim 16) over a pool of `num_pages`
    fp32 pages whose K half also holds their bias rows (4 per page), as the engine lays them out."""
    gen = torch.Generator().manual_seed(seed)
    k_pages, v_pages = (torch.randn(num_pages, 4, 16, generator=gen) * 0.1 for _ in range(2))
    q = torch.randn(2, 4, 16, generator=gen)
    k, v = (torch.randn(2, 2, 16, generator=gen) for _ in range(2))
    table = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], dtype=torch.int32)  # [batch, kv heads, blocks]
    bias_table = (torch.arange(16).view(2, 4, 2) + 9) * 4  # the first bias row of pages 9..24
    write = torch.tensor([[1 * 4 + 2, 3 * 4 + 2], [5 * 4, 7 * 4]])  # positions 2 and 0 of block 0
    lens = torch.tensor([3, 1])
    for page in range(9, 25):  # bias rows start at 0 (finite values, not the random K values' bits)
        k_pages[page] = 0
    return q, k, v, k_pages, v_pages, write, table, bias_table, lens


def test_compiled_bias_update_writes_the_pool_in_place():
    """The bias rows are a dtype view of the K pool. A custom op declared as mutating that view made the
    compiled step end with the whole K pool copied onto itself (a loop over every element of k_pages,
    each step); the op mutates k_pages itself: the compiled step gives the eager step's results, in the
    same storage, and its generated code has no loop over the pool."""
    from torch._inductor.utils import run_and_get_code

    from depthserve.kernels.dispatch import Kernels

    num_pages = 997  # a prime: the pool's element count (63,808) appears in no other loop bound
    case = _pool_case(num_pages)
    expected_pools = [t.clone() for t in case[3:5]]
    expected = _pool_decode_step(Kernels("torch"), *case[:3], *expected_pools, *case[5:], COEFS["low"])
    k_pages = case[3]
    address = k_pages.data_ptr()
    torch._dynamo.reset()
    step = torch.compile(_pool_decode_step, fullgraph=True)
    got, code = run_and_get_code(step, Kernels("torch", traceable=True), *case, COEFS["low"])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(k_pages, expected_pools[0], atol=ATOL, rtol=0)
    assert k_pages.data_ptr() == address
    assert str(k_pages.numel()) not in "\n".join(code), "the compiled step copies the whole K pool"


def test_compiled_bias_update_needs_the_pools_own_bias_rows():
    from depthserve.kernels.dispatch import Kernels

    q, k, v, k_pages, v_pages, write, table, bias_table, lens = _pool_case(30)
    _, lse = torch_ops.saobp_decode_attention(q, k_pages, v_pages, table, torch_ops.pool_bias_rows(k_pages),
                                              bias_table, lens, 0.3, 1.0, False)
    update = Kernels("torch", traceable=True).saobp_bias_update
    with pytest.raises(ValueError, match="bias rows of the K pool"):
        update(q, k_pages, table, torch_ops.pool_bias_rows(k_pages).clone(), bias_table, lens, lse, 0.3, 1.0)
    expected = k_pages.clone()
    torch_ops.saobp_bias_update(q, expected, table, torch_ops.pool_bias_rows(expected), bias_table, lens, lse, 0.3,
                                1.0)
    update(q, k_pages, table, torch_ops.pool_bias_rows(k_pages), bias_table, lens, lse, 0.3, 1.0)
    assert torch.equal(k_pages, expected)

"""The native CPU kernels: group-quantized weights times int8-quantized activations with AVX-512
VNNI dot products, and the same weights dequantized for prefill GEMMs (`csrc/group_gemm.cpp`); the
decode step's paged attention and KV store (`csrc/paged_attention.cpp`); RMSNorm (`csrc/norm.cpp`)
and the rotary embedding (`csrc/rotary.cpp`); a Llama or Dory decoder layer's decode step made of
those (`csrc/decode_layer.cpp`: one layer, or consecutive layers in one call); SwiGLU's SiLU(gate) * up
(`csrc/activation.cpp`); nGPT's normalisations, interpolations and gates (`csrc/ngpt.cpp`, Dory's
layers); greedy sampling's argmax and log-normalizer in one call, and a structured-output token
bitmask applied to logits (`csrc/sampling.cpp`).

Built on first use with torch's extension builder (g++ and ninja, about a minute, logged as a
warning when it starts; the build is cached under `TORCH_EXTENSIONS_DIR` in a folder named by the
checkout, so two checkouts never rebuild each other's; `make test` and `make serve` build it once at
install) and loaded as the torch ops `depthserve_cpu::group_gemm`, `group_dequantize`,
`paged_decode_attention`, `paged_prefill_attention_varlen`, `store_kv`, `rms_norm`, `apply_rope`,
`silu_and_mul`, `llama_decode_layers`, `dory_decode_layers`, `l2_normalize`, `ngpt_interpolate`, `gated_l2_normalize`,
`swiglu_l2_normalize`, `unit_rope`, `greedy_pick` and `apply_token_bitmask`. Only on CPUs with
AVX-512 F/BW/VL and AVX-512 VNNI: elsewhere, or where the build fails, `available()` is False and
the quantized layers use torch's weight-only kernels (the reason is logged once).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
EXTENSION_PREFIX = "depthserve_cpu_kernels"  # + a hash of SOURCE_DIR (extension_name)
SOURCES = [SOURCE_DIR / name
           for name in ("group_gemm.cpp", "paged_attention.cpp", "norm.cpp", "rotary.cpp", "activation.cpp",
                        "decode_layer.cpp", "sampling.cpp", "ngpt.cpp", "bf16_gemm.cpp")]
CFLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
          "-mavx512vnni"]
FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # the activations, norms, tables and pages the kernels take
DISABLE_ENV = "DEPTHSERVE_NO_NATIVE_KERNELS"  # set to 1: never build or use them (torch's kernels instead)


def cpu_has_native_bf16_gemm() -> bool:
    """AVX-512 BF16 or AMX: torch's bf16 GEMMs (oneDNN) run on the CPU's own bf16 instructions;
    without them oneDNN emulates bf16 with fp32 arithmetic, several times slower."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_has_vnni() -> bool:
    """AVX-512 (torch checks F, BW, VL and DQ) and AVX-512 VNNI."""
    return bool(torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported())


@functools.cache
def unavailable_reason() -> str | None:
    """Why the native kernels cannot run here (None: they are loaded)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return f"{DISABLE_ENV}=1"
    if not cpu_has_vnni():
        return "the CPU lacks AVX-512 VNNI"
    try:
        build_and_load()
    except Exception as exc:  # noqa: BLE001 - a missing compiler, ninja or header: fall back, say why
        return f"the build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    _register_fakes()
    return None


def build_and_load() -> None:
    """Load the kernels' library, building it first where this checkout's build is missing or older
    than its sources (saying so: the first model load waits for it)."""
    from torch.utils import cpp_extension

    _put_venv_ninja_on_path()
    name = extension_name(SOURCE_DIR)
    build_directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not build_is_current(build_directory, name, source_files(SOURCE_DIR)):
        log.warning("building native CPU kernels (about a minute) in %s", build_directory)
    cpp_extension.load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=CFLAGS,
                       extra_include_paths=[str(SOURCE_DIR)], build_directory=str(build_directory),
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def extension_name(source_dir: Path) -> str:
    """The build's name, one per checkout: torch's builder keeps one folder per name under
    TORCH_EXTENSIONS_DIR, and under one shared name each checkout's build file names its own sources,
    so loading from one checkout after another rebuilt every kernel (about 100 s)."""
    return f"{EXTENSION_PREFIX}_{hashlib.sha256(str(source_dir.resolve()).encode()).hexdigest()[:12]}"


def source_files(source_dir: Path) -> list[Path]:
    """Everything the build reads: the sources and the headers they include."""
    return sorted(path for path in source_dir.iterdir() if path.suffix in (".cpp", ".h"))


def build_is_current(build_directory: Path, name: str, sources: list[Path]) -> bool:
    """Whether the built library exists and is newer than every source (else loading builds it)."""
    library = build_directory / f"{name}.so"
    if not library.is_file():
        return False
    return library.stat().st_mtime >= max(source.stat().st_mtime for source in sources)


def _put_venv_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package installs it beside this Python,
    which is not on PATH when a virtual environment's python runs without being activated."""
    here = Path(sys.executable).parent
    if shutil.which("ninja") is None and (here / "ninja").exists():
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"


def available() -> bool:
    reason = unavailable_reason()
    if reason is not None:
        _log_once(reason)
    return reason is None


@functools.cache
def _log_once(reason: str) -> None:
    log.info("native CPU kernels not used (%s): quantized layers run torch's weight-only kernels", reason)


def _register_fakes() -> None:
    """Shapes for torch.compile, which calls each op as one opaque node."""

    @torch.library.register_fake("depthserve_cpu::group_gemm")
    def _(x, codes, scale, low, bits, out_features, refine):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("depthserve_cpu::paged_decode_attention")
    def _(q, k_pages, v_pages, page_table, context_lens, scale, window=None):
        return torch.empty_like(q)

    @torch.library.register_fake("depthserve_cpu::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("depthserve_cpu::silu_and_mul")
    def _(x):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("depthserve_cpu::apply_rope")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("depthserve_cpu::store_kv")
    def _(k, v, k_pages, v_pages, slot_index):
        return None

    @torch.library.register_fake("depthserve_cpu::greedy_pick")
    def _(logits, floor):
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows), logits.new_empty(rows)

    @torch.library.register_fake("depthserve_cpu::bf16_gemm")
    def _(x, weight):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("depthserve_cpu::group_dequantize")
    def _(codes, scale, low, bits, out_features, dtype):
        return codes.new_empty(out_features, codes.shape[1] * GROUP, dtype=dtype)


GROUP = 32  # inputs per group
BLOCK = 16  # output rows side by side in the packed layout


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] weight in the kernel's layout (csrc/group_gemm.cpp): w = scale * code + low."""

    bits: int
    out_features: int
    codes: torch.Tensor  # uint8 [blocks, groups, 16 * 32 * bits / 8]
    scale: torch.Tensor  # fp16 [blocks, groups, 16]
    low: torch.Tensor  # fp16 [blocks, groups, 16]


def pack(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int) -> PackedWeight:
    """Unsigned codes [out, in] (0..15 or 0..255) with scale and low [out, in / 32] into the kernel's
    layout; scale and low are rounded to fp16 (exact for GGUF's own fp16 values)."""
    out_features, width = codes.shape
    blocks, groups = -(-out_features // BLOCK), width // GROUP
    if width % GROUP:
        raise ValueError(f"the input width {width} is not a multiple of {GROUP}")
    padding = blocks * BLOCK - out_features
    if padding:
        codes = torch.cat([codes, codes.new_zeros(padding, width)])
        scale, low = (torch.cat([t, t.new_zeros(padding, groups)]) for t in (scale, low))
    # [block, row i, group, step t, input j] -> [block, group, step t, row i, input j]
    steps = codes.view(blocks, BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 4:
        steps = steps[:, :, :4] | (steps[:, :, 4:] << 4)
    packed = steps.contiguous().view(blocks, groups, BLOCK * GROUP * bits // 8)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.view(blocks, BLOCK, groups).transpose(1, 2).to(torch.float16).contiguous()

    return PackedWeight(bits, out_features, packed, per_block(scale), per_block(low))


def group_gemm(x: torch.Tensor, weight: PackedWeight, refine: bool = False) -> torch.Tensor:
    """x [n, in] (fp32 or bf16) times the weight [out, in] transposed: [n, out] in x's dtype. The
    activations are rounded to int8 per group of 32 (within max|x_g| / 254); with `refine`, to
    16-bit precision (within max|x_g| / 64516) at twice the integer work (csrc/group_gemm.cpp)."""
    return torch.ops.depthserve_cpu.group_gemm(x, weight.codes, weight.scale, weight.low, weight.bits,
                                               weight.out_features, refine)


def group_dequantize(weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] = scale * code + low, in dtype (fp32 or bf16)."""
    return torch.ops.depthserve_cpu.group_dequantize(weight.codes, weight.scale, weight.low, weight.bits,
                                                     weight.out_features, dtype)


def unpack_rows(weight: PackedWeight, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unsigned codes [n, in], scale [n, in / 32], low [n, in / 32]) of the weight's rows `index`."""
    blocks, groups = weight.codes.shape[:2]
    block, row = index // BLOCK, index % BLOCK
    if weight.bits == 8:
        steps = weight.codes.view(blocks, groups, 8, BLOCK, 4)[block, :, :, row, :]  # [n, groups, 8, 4]
    else:
        nibbles = weight.codes.view(blocks, groups, 4, BLOCK, 4)[block, :, :, row, :]
        steps = torch.cat([nibbles & 15, nibbles >> 4], dim=2)
    codes = steps.reshape(len(index), groups * GROUP)
    return codes, weight.scale[block, :, row].float(), weight.low[block, :, row].float()


def dequantize_rows(weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of the weight in fp32 (an embedding lookup in a tied head's table). scale * code
    is exact in fp32 (at most 8 + 11 significant bits), so adding low rounds once, as the kernel does."""
    codes, scale, low = unpack_rows(weight, index)
    grouped = codes.view(len(index), -1, GROUP).float() * scale[..., None] + low[..., None]
    return grouped.view(len(index), -1)


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, in] (fp32 or bf16) times the contiguous bf16 weight [out, in] transposed (in a multiple
    of 32): [n, out] in x's dtype, summed in fp32 and rounded once (csrc/bf16_gemm.cpp)."""
    return torch.ops.depthserve_cpu.bf16_gemm(x, weight)


# ---- paged attention: kernels/paged.py's decode ops, where the shapes fit the native kernel ----------
MAX_HEAD_DIM, MAX_GROUP = 256, 8
# The native prefill kernel reads each key block once for all of a chunk's queries, which makes it
# 2-4x faster than SDPA for chunks of a few tokens over thousands of cached keys (a long prompt's
# capped chunks); past ~100 queries SDPA's blocked GEMMs win (bench/prefill_chunks.py, docs/server.md).
NATIVE_PREFILL_MAX_QUERIES = 64


def attention_fits(head_dim: int, num_q_heads: int, num_kv_heads: int, *tensors: torch.Tensor) -> bool:
    return (head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= MAX_GROUP
            and all(t.dtype in FLOAT_DTYPES and t.device.type == "cpu" for t in tensors))


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """kernels/paged.py's `paged_decode_attention` as one native call (there where the shapes fit);
    `window`: a sliding-window layer's (the kernel reads only the window's keys)."""
    if not attention_fits(q.shape[-1], q.shape[1], page_table.shape[1], q, k_pages, v_pages) or q.stride(-1) != 1:
        from depthserve.kernels import paged

        return paged.paged_decode_attention(q, k_pages, v_pages, page_table, context_lens, scale, window)
    return torch.ops.depthserve_cpu.paged_decode_attention(q, k_pages, v_pages, page_table, context_lens, scale, window)


def paged_window_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                  page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  window: int) -> torch.Tensor:
    """kernels/paged.py's `paged_window_decode_attention`: the decode attention of a sliding-window layer."""
    return paged_decode_attention(q, k_pages, v_pages, page_table, context_lens, scale, window)


def paged_prefill_attention_varlen(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                   page_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                                   scale: float, window: int | None = None, *,
                                   max_queries: int | None = None,
                                   fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """kernels/paged.py's `paged_prefill_attention_varlen` as one native call, for chunks of at most
    NATIVE_PREFILL_MAX_QUERIES queries each (there where the shapes fit; a sliding window takes the
    torch implementation). `max_queries`: the longest chunk's queries, where the caller knows it;
    `fresh_kv` is not read (the pool holds the same keys)."""
    from depthserve.kernels import paged

    if max_queries is None:
        max_queries = paged.longest_chunk(query_starts)
    if (window is not None or q.stride(-1) != 1
            or not attention_fits(q.shape[-1], q.shape[1], page_tables.shape[1], q, k_pages, v_pages)
            or max_queries > NATIVE_PREFILL_MAX_QUERIES):
        return paged.paged_prefill_attention_varlen(q, k_pages, v_pages, page_tables, query_starts, context_lens,
                                                    scale, window)
    return torch.ops.depthserve_cpu.paged_prefill_attention_varlen(q, k_pages, v_pages, page_tables, query_starts,
                                                                   context_lens, scale)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
             slot_index: torch.Tensor) -> None:
    """kernels/paged.py's `store_kv` as one native call (there where the shapes fit)."""
    if (not attention_fits(k.shape[-1], 1, 1, k, v, k_pages, v_pages) or k.dtype != v.dtype
            or k.stride(-1) != 1 or v.stride(-1) != 1):
        from depthserve.kernels import paged

        paged.store_kv(k, v, k_pages, v_pages, slot_index)
        return
    torch.ops.depthserve_cpu.store_kv(k, v, k_pages, v_pages, slot_index)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension as one native call (x fp32 or bf16, on the CPU)."""
    return torch.ops.depthserve_cpu.rms_norm(rows_of(x), weight, eps).view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of x [..., 2 * width] = [gate | up], in fp32 and rounded once to x's dtype
    (csrc/activation.cpp)."""
    return torch.ops.depthserve_cpu.silu_and_mul(rows_of(x)).view(*x.shape[:-1], x.shape[-1] // 2)


def greedy_pick(logits: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first argmax [B] int64, maximum [B], log-normalizer [B]) of fp32 logits [B, V] with contiguous
    rows, in one native call (csrc/sampling.cpp); `floor` bounds each exp's argument from below. A
    row's maximum is NaN where it holds a NaN."""
    return torch.ops.depthserve_cpu.greedy_pick(logits, floor)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, limit: int) -> None:
    """In place on fp32 logits [B, V] with contiguous rows: row rows[i] gets -inf at every token
    below `limit` that bitmask row i ([R, W] int32, depthserve/structured/bitmask.py's layout)
    disallows, and at every column from `limit` on (csrc/sampling.cpp)."""
    torch.ops.depthserve_cpu.apply_token_bitmask(logits, bitmask, rows, limit)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers/rotary.py's `apply_rope` (x [tokens, heads, head_dim]; cos, sin [tokens, head_dim / 2])
    as one native call, in fp32 and rounded once to x's dtype."""
    return torch.ops.depthserve_cpu.apply_rope(x, cos, sin)


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dimension] with unit-stride rows (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) along the last dimension (csrc/ngpt.cpp)."""
    return torch.ops.depthserve_cpu.l2_normalize(x, eps)


def ngpt_interpolate(h: torch.Tensor, y: torch.Tensor, rate: torch.Tensor, eps: float, normalize: bool) -> torch.Tensor:
    """h + rate * (N(y) - h), and N of that where `normalize` (csrc/ngpt.cpp)."""
    return torch.ops.depthserve_cpu.ngpt_interpolate(h, y, rate, eps, normalize)


def gated_l2_normalize(x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """N(x * sigmoid(gate * scale)) (csrc/ngpt.cpp)."""
    return torch.ops.depthserve_cpu.gated_l2_normalize(x, gate, scale, eps)


def swiglu_l2_normalize(gate: torch.Tensor, up: torch.Tensor, gate_scale: torch.Tensor, up_scale: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """N(silu(gate * gate_scale) * (up * up_scale)) (csrc/ngpt.cpp)."""
    return torch.ops.depthserve_cpu.swiglu_l2_normalize(gate, up, gate_scale, up_scale, eps)


def unit_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None,
              eps: float) -> torch.Tensor:
    """Per head of x [tokens, heads, head_dim]: N(x), rotated by cos, sin [tokens, head_dim / 2], times
    scale [heads * head_dim] where given (csrc/ngpt.cpp)."""
    return torch.ops.depthserve_cpu.unit_rope(x, cos, sin, scale, eps)


def llama_decode_layers(x: torch.Tensor, norms: list[torch.Tensor], eps: float, weights: list[torch.Tensor],
                        bits: list[int], out_features: list[int], cos: torch.Tensor, sin: torch.Tensor,
                        num_heads: int, kv_heads: int, k_pages: torch.Tensor, v_pages: torch.Tensor,
                        slot_index: torch.Tensor, page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                        first_columns: list[int]) -> torch.Tensor:
    """Consecutive Llama decoder layers' decode step (depthserve/archs/llama/native_decode.py): x [rows,
    hidden] bf16; layer i has the norms 2 i, 2 i + 1, the four projections' (codes, scale, low) from
    weights[12 i], and the cache columns first_columns[i] .. + kv_heads of slot_index [rows, width]
    (where the step's keys and values are stored) and page_table [rows, blocks, width]."""
    return torch.ops.depthserve_cpu.llama_decode_layers(x, norms, eps, weights, bits, out_features, cos, sin,
                                                        num_heads, kv_heads, k_pages, v_pages, slot_index,
                                                        page_table, context_lens, scale, first_columns)


def dory_decode_layers(x: torch.Tensor, scales: list[torch.Tensor], eps: float, weights: list[torch.Tensor],
                       bits: list[int], out_features: list[int], cos: list[torch.Tensor], sin: list[torch.Tensor],
                       windows: list[int], num_heads: int, kv_heads: int, k_pages: torch.Tensor, v_pages: torch.Tensor,
                       slot_index: torch.Tensor, page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                       first_columns: list[int]) -> torch.Tensor:
    """Consecutive Dory decoder layers' decode step (depthserve/archs/dory/native_decode.py): x [rows,
    hidden] bf16; layer i has the six learned scales from scales[6 i], the four projections' (codes,
    scale, low) from weights[12 i], the rotary tables cos[i], sin[i] [rows, head_dim / 2], the window
    windows[i] (0: none) and the cache columns first_columns[i] .. + kv_heads of slot_index and
    page_table, as llama_decode_layers."""
    return torch.ops.depthserve_cpu.dory_decode_layers(x, scales, eps, weights, bits, out_features, cos, sin, windows,
                                                       num_heads, kv_heads, k_pages, v_pages, slot_index, page_table,
                                                       context_lens, scale, first_columns)

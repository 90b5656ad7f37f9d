"""SwiGLU's gating: SiLU(gate) * up of the packed [gate | up] projection."""

import torch
import torch.nn.functional as F

from depthserve.kernels import cpu_native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [..., 2 * width] = [gate | up]. bf16 rows on the CPU take one native
    call that computes in fp32 and rounds once (the eager form dispatches three ops and rounds twice;
    the native decoder layer, kernels/csrc/decode_layer.cpp, calls the same op, so the eager and native
    layers stay bit-identical); every other dtype and device keeps torch's ops."""
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.bfloat16 and not torch.compiler.is_compiling() \
            and cpu_native.available():
        return cpu_native.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

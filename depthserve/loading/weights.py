"""One weight loader for every architecture: checkpoint tensors into model parameters by name.

What a model declares (class attributes and hooks of `archs.base.DepthModel`), in the manner of
nano-vllm's packed-module mapping and gpt-fast's load hooks:

- `checkpoint_prefix`: stripped from checkpoint names to give parameter names ("model." for the
  Hugging Face layout: `model.layers.3.mlp.down_proj.weight` -> `layers.3.mlp.down_proj.weight`).
- `packed_modules`: checkpoint modules whose tensors are concatenated (dim 0, in shard order)
  into one parameter of another module (`q_proj` -> shard 0 of `qkv_proj`).
- `take_weights(weights, source)`: pops the tensors an architecture places itself (routers,
  folded experts, calibration tables) and returns the parameter names it filled.
- `after_load(loaded)`: parameters derived from loaded ones (tied heads, SGT's loop heads);
  returns their names.

Every parameter must be filled, and every checkpoint tensor used, or the load fails naming them.
"""

from __future__ import annotations

import torch

from depthserve.loading.checkpoint import CheckpointFormatError

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, never loaded


def parameter_name(checkpoint_name: str, prefix: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """(parameter name, shard index or None) of a checkpoint tensor."""
    name = checkpoint_name[len(prefix):] if prefix and checkpoint_name.startswith(prefix) else checkpoint_name
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in packed:
        target, shard = packed[module]
        return f"{parent}.{target}.{leaf}" if parent else f"{target}.{leaf}", shard
    return name, None


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> set[str]:
    """Copy `weights` (consumed) into `model` as its class declares (see the module docstring);
    returns the names of the parameters `after_load` derived."""
    params = dict(model.named_parameters())
    loaded = set(model.take_weights(weights, source))
    shards: dict[str, dict[int, torch.Tensor]] = {}
    unexpected = []
    for name, tensor in weights.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        target, shard = parameter_name(name, model.checkpoint_prefix, model.packed_modules)
        if target not in params:
            unexpected.append(name)
        elif shard is None:
            _copy(params[target], tensor, name, source)
            loaded.add(target)
        else:
            shards.setdefault(target, {})[shard] = tensor
    weights.clear()
    if unexpected:
        raise CheckpointFormatError(f"{source}: unexpected weights: {unexpected[:5]}")
    for target, parts in shards.items():
        expected = 1 + max(shard for module, (packed, shard) in model.packed_modules.items()
                           if packed == target.rsplit(".", 2)[-2])
        if sorted(parts) != list(range(expected)):
            raise CheckpointFormatError(f"{source}: {target} needs {expected} tensors, got shards {sorted(parts)}")
        _copy(params[target], torch.cat([parts[i] for i in range(expected)]), target, source)
        loaded.add(target)
    derived = model.after_load(loaded)
    loaded |= derived
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointFormatError(f"{source}: weights missing from the checkpoint: {missing[:5]}")
    return derived


def keep_stored_width(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """Widen `param` to the dtype of a checkpoint tensor stored wider than it (a float32 tensor in a
    model built in bf16): the model keeps the checkpoint's precision there. Its values are kept, for
    a parameter filled in parts."""
    if tensor.is_floating_point() and torch.finfo(tensor.dtype).bits > torch.finfo(param.dtype).bits:
        param.data = param.data.to(tensor.dtype)


def _copy(param: torch.Tensor, value: torch.Tensor, name: str, source: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointFormatError(f"{source}: {name} must be {list(param.shape)}, got {list(value.shape)}")
    param.copy_(value)

"""The token embedding table of a model whose weights come from a checkpoint."""

from __future__ import annotations

import torch
from torch import nn


def checkpoint_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding without torch's random init: the checkpoint fills its weight. Models are built on
    the meta device (engine/model_loader.py), where that init (normal_) runs through torch's Python
    references, which import torch._dynamo (about a second of every engine start-up) for a value
    never used (an eager engine imports it nowhere else; tests/test_startup_imports.py)."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))

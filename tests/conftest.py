"""Shared fixtures. Heavy objects (tokenizer, the default model) are built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data_file(name: str) -> Path:
    """A file of ../shared/data, or a skip that says why (a user's clone has no shared/)."""
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared/data is only present in the project's CI checkout)")
    return path


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from depthserve.loading.registry import resolve_model
    from depthserve.loading.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m-instruct"))

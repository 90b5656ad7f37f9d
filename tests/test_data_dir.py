"""The data folder of tests and benchmarks (bench/common.py, `data_dir`): $DEPTHSERVE_DATA_DIR, else
../shared/data beside the checkout; a test whose file is absent skips and says how to provide it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import DATA_DIR_ENV, data_dir
from tests.conftest import shared_data_file

CHECKOUT = Path(__file__).resolve().parents[1]


def test_the_data_folder_defaults_to_shared_data_beside_the_checkout(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert data_dir() == CHECKOUT.parent / "shared" / "data"


def test_the_environment_names_another_data_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert data_dir() == tmp_path
    (tmp_path / "c4_sample.jsonl").write_text('{"text": "x"}\n')
    assert shared_data_file("c4_sample.jsonl") == tmp_path / "c4_sample.jsonl"


def test_an_absent_data_file_skips_and_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match=f"{tmp_path / 'arc.jsonl'} is absent .*{DATA_DIR_ENV}"):
        shared_data_file("arc.jsonl")

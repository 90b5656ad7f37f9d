"""Where the native CPU kernels are built (kernels/cpu_native.py): one build folder per checkout, and a
warning before a build starts. No compiler runs here: torch's builder is replaced by a recorder."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from depthserve.kernels import cpu_native


def _checkout(root: Path) -> Path:
    source_dir = root / "kernels" / "csrc"
    source_dir.mkdir(parents=True)
    for name in ("a.cpp", "simd.h"):
        (source_dir / name).write_text("// source\n")
    return source_dir


def test_each_checkout_has_its_own_build_name(tmp_path):
    first, second = _checkout(tmp_path / "one"), _checkout(tmp_path / "two")
    (tmp_path / "link").symlink_to(tmp_path / "one")
    assert cpu_native.extension_name(first) != cpu_native.extension_name(second)
    assert cpu_native.extension_name(first) == cpu_native.extension_name(tmp_path / "link" / "kernels" / "csrc")
    assert cpu_native.extension_name(first).startswith(cpu_native.EXTENSION_PREFIX)


def test_a_build_is_current_until_a_source_or_header_changes(tmp_path):
    source_dir = _checkout(tmp_path)
    sources = cpu_native.source_files(source_dir)
    assert [path.name for path in sources] == ["a.cpp", "simd.h"]
    build = tmp_path / "build"
    build.mkdir()
    assert not cpu_native.build_is_current(build, "ext", sources)  # nothing built yet
    library = build / "ext.so"
    library.write_bytes(b"")
    os.utime(library, (2_000_000_000, 2_000_000_000))
    assert cpu_native.build_is_current(build, "ext", sources)
    os.utime(source_dir / "simd.h", (2_000_000_001, 2_000_000_001))
    assert not cpu_native.build_is_current(build, "ext", sources)


@pytest.fixture
def recorded_loads(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    return calls


def test_the_build_is_named_and_placed_by_this_checkout(recorded_loads, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        cpu_native.build_and_load()
    name = cpu_native.extension_name(cpu_native.SOURCE_DIR)
    assert [call["name"] for call in recorded_loads] == [name]
    assert recorded_loads[0]["build_directory"] == str(tmp_path / "extensions" / name)
    assert "building native CPU kernels (about a minute)" in caplog.text


def test_no_build_message_when_the_build_is_current(recorded_loads, tmp_path, caplog):
    name = cpu_native.extension_name(cpu_native.SOURCE_DIR)
    library = tmp_path / "extensions" / name / f"{name}.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    newest = max(path.stat().st_mtime for path in cpu_native.source_files(cpu_native.SOURCE_DIR))
    os.utime(library, (newest + 1, newest + 1))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        cpu_native.build_and_load()
    assert len(recorded_loads) == 1 and "building native CPU kernels" not in caplog.text

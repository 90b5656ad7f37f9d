"""The package builds without warnings and ships what runs from it: `make serve` installs it with
pip, and a build backend's warnings (a data folder missing from `packages`, a deprecated license
form) are noise at every install."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_builds_without_warnings_and_ships_sources_data_and_license(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    assert "Warning" not in build.stdout + build.stderr, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("depthserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("depthserve/kernels/csrc/group_gemm.cpp", "depthserve/kernels/csrc/simd.h",
                   "depthserve/server/static/playground.js", "depthserve/kernels/triton/paged.py"):
        assert needed in names, needed
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    # every Python source of the installed folders ships (a package left out of pyproject's list is not)
    folders = {"depthserve": ROOT / "depthserve", "depthserve/kernels": ROOT / "kernels",
               "depthserve/server": ROOT / "server", "depthserve/clients": ROOT / "clients"}
    for prefix, folder in folders.items():
        for source in folder.rglob("*.py"):
            relative = source.relative_to(folder).as_posix()
            if prefix == "depthserve" and relative.split("/")[0] in {"kernels", "server", "clients"}:
                continue
            assert f"{prefix}/{relative}" in names, f"{prefix}/{relative} is not in the wheel"

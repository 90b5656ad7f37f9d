"""The Python-package side of the GPU-host kit (bench/gpu/prepare.sh fills .gpu/, bench/gpu/run.sh uses it).

    python bench/gpu/kit.py missing                    # name==version of each distribution the project
                                                       # needs that the host lacks (this environment's versions)
    python bench/gpu/kit.py check-wheels .gpu/wheels   # every requirement of the project and of each carried
                                                       # wheel met by a carried wheel or by the host
    python bench/gpu/kit.py repack --dest DIR NAME...  # wheels of this environment's own installed
                                                       # distributions, for this Python (offline kits)
    python bench/gpu/kit.py host-python DIR            # a stand-in for the host's interpreter: this Python
                                                       # with only the host's distributions (dry runs)
    python bench/gpu/kit.py imports SCRIPT... [--optional MODULE]...
                                                       # run each script with --help, then import every
                                                       # module it imports, lazy ones too, except those
                                                       # of optional packages

The host's distributions are listed in bench/gpu/host-packages.txt. Requirement markers are evaluated
for the host (CPython 3.12 on x86-64 Linux), so a dependency that only older Pythons need is not carried.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import csv
import hashlib
import importlib
import importlib.metadata as metadata
import io
import re
import runpy
import sys
import sysconfig
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST_PACKAGES = Path(__file__).resolve().parent / "host-packages.txt"
HOST_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                "platform_machine": "x86_64", "os_name": "posix"}
# Written by an installer, not part of a distribution's own metadata.
INSTALLER_FILES = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def host_packages(path: Path = HOST_PACKAGES) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line}


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    import tomllib

    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def applies_on_host(requirement, extras: set[str]) -> bool:
    """Whether a requirement holds on the host, for a dependant installed with `extras`."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**HOST_MARKERS, "extra": extra}) for extra in {""} | extras)


def missing_on_host(roots: list[str], host: set[str]) -> dict[str, metadata.Distribution]:
    """The distributions that `roots` need, directly or through others, that the host lacks: this
    environment's installed ones (their versions are the ones the project runs with here)."""
    from packaging.requirements import Requirement

    needed: dict[str, metadata.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    queue = [(Requirement(text), "pyproject.toml") for text in roots]
    while queue:
        requirement, dependant = queue.pop()
        name = normalize(requirement.name)
        if name in host:
            continue
        extras = set(requirement.extras)
        if name in needed and extras <= extras_seen[name]:
            continue
        try:
            dist = needed.get(name) or metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            message = f"{requirement} (needed by {dependant}) is not installed here: make install first"
            raise SystemExit(message) from None
        needed[name] = dist
        extras_seen[name] = extras_seen.get(name, set()) | extras
        for text in dist.requires or []:
            child = Requirement(text)
            if applies_on_host(child, extras_seen[name]):
                queue.append((child, f"{dist.metadata['Name']} {dist.version}"))
    return needed


def wheel_metadata(wheel: Path) -> dict[str, object]:
    """Name, version and requirements (Requires-Dist) of a wheel, read from its METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        path = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        message = Parser().parsestr(archive.read(path).decode())
    return {"name": normalize(message["Name"]), "version": message["Version"],
            "requires": message.get_all("Requires-Dist") or []}


def wheel_problems(wheel_dir: Path, host: set[str], roots: list[str]) -> list[str]:
    """What would fail on the host: a project requirement or a carried wheel's requirement that
    neither the host nor a carried wheel meets, or one distribution carried twice."""
    from packaging.requirements import Requirement

    wheels = [wheel_metadata(path) for path in sorted(wheel_dir.glob("*.whl"))]
    carried: dict[str, str] = {}
    problems = []
    for wheel in wheels:
        if wheel["name"] in carried:
            problems.append(f"{wheel['name']} is carried twice ({carried[wheel['name']]} and {wheel['version']})")
        carried[wheel["name"]] = wheel["version"]
    needs = [(text, "pyproject.toml") for text in roots]
    needs += [(text, f"{w['name']} {w['version']}") for w in wheels for text in w["requires"]]
    for text, dependant in needs:
        requirement = Requirement(text)
        name = normalize(requirement.name)
        if not applies_on_host(requirement, set()) or name in host:
            continue
        if name not in carried:
            problems.append(f"{dependant} needs {requirement}, which the host lacks and the kit does not carry")
        elif not requirement.specifier.contains(carried[name], prereleases=True):
            problems.append(f"{dependant} needs {requirement}; the kit carries {name} {carried[name]}")
    return problems


def record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def repack(name: str, dest: Path) -> Path:
    """A wheel of an installed distribution, rebuilt from its files (scripts and byte code left
    out), tagged for this interpreter as its installer recorded it."""
    dist = metadata.distribution(name)
    base = Path(dist.locate_file(""))
    files = [f for f in dist.files or [] if ".." not in f.parts and "__pycache__" not in f.parts]
    info_dir = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    tag = next(line.split(":", 1)[1].strip() for line in (base / info_dir / "WHEEL").read_text().splitlines()
               if line.startswith("Tag:"))
    wheel = dest / f"{info_dir.removesuffix('.dist-info')}-{tag}.whl"
    records = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in files:
            if file.parts[0] == info_dir and file.name in INSTALLER_FILES:
                continue
            data = (base / file).read_bytes()
            archive.writestr(file.as_posix(), data)
            records.append(record_line(file.as_posix(), data))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*records, [f"{info_dir}/RECORD", "", ""]])
        archive.writestr(f"{info_dir}/RECORD", text.getvalue())
    return wheel


def installed_closure(names: set[str], leave_out: set[str]) -> set[str]:
    """`names` and what their installed versions here need, except `leave_out` (for this Python)."""
    from packaging.requirements import Requirement

    installed = {normalize(d.metadata["Name"] or ""): d for d in metadata.distributions()}
    found: set[str] = set()
    queue = [name for name in names if name in installed]
    while queue:
        name = queue.pop()
        if name in found or name in leave_out or name not in installed:
            continue
        found.add(name)
        for text in installed[name].requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                queue.append(normalize(requirement.name))
    return found


def link_host_distributions(site: Path, host: set[str]) -> int:
    """Links in `site` to this environment's installed distributions that the host holds (their
    top-level modules and metadata), with what their versions here need beyond the host's list (a
    newer release here may need more than the host's), except what the kit carries; returns how many."""
    carried = set(missing_on_host(project_requirements(), host))
    wanted = installed_closure(host, leave_out=carried)
    site.mkdir(parents=True, exist_ok=True)
    linked = 0
    for dist in metadata.distributions():
        if normalize(dist.metadata["Name"] or "") not in wanted or not dist.files:
            continue
        for top in {f.parts[0] for f in dist.files if ".." not in f.parts and f.parts[0] != "__pycache__"}:
            target, link = Path(dist.locate_file(top)), site / top
            if target.exists() and not link.exists():
                link.symlink_to(target)
        linked += 1
    return linked


def make_host_python(dest: Path, host: set[str]) -> Path:
    """A virtual environment of this Python's base interpreter that sees only the host's
    distributions: what the host's `python3` imports, less what the host has and this machine lacks."""
    env = dest / "env"
    venv.EnvBuilder(with_pip=False, clear=True, symlinks=True).create(env)
    site = dest / "host-site"
    count = link_host_distributions(site, host)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    (purelib / "host-site.pth").write_text(f"{site}\n")
    print(f"{count} distributions of the host's list linked into {site}", file=sys.stderr)
    return env / "bin" / "python"


def imported_modules(script: Path) -> list[str]:
    """Every module `script` imports, at top level or inside functions, except under a
    `try: ... except ImportError` (optional imports)."""
    tree = ast.parse(script.read_text(), str(script))
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            optional.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"{node.module}.{alias.name}" if alias.name != "*" else node.module for alias in node.names]
    return list(dict.fromkeys(names))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in {"ImportError", "ModuleNotFoundError"} for k in kinds)


def import_name(name: str) -> None:
    """Import `a.b.c` as a module, or `a.b` and its attribute `c` (a `from a.b import c` of a name)."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        parent, _, attribute = name.rpartition(".")
        if not parent or error.name != name:
            raise
        if not hasattr(importlib.import_module(parent), attribute):
            raise ImportError(f"cannot import name {attribute!r} from {parent!r}") from error


def parses_help(script: Path) -> str | None:
    """Runs `script --help` in this process (its top level and its argument parser); the failure, if any."""
    argv = sys.argv
    sys.argv = [str(script), "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as end:
        return None if end.code in (0, None) else f"{script} --help exited with {end.code}"
    except Exception as error:  # noqa: BLE001 - reported
        return f"{script} --help: {type(error).__name__}: {error}"
    finally:
        sys.argv = argv
    return f"{script} --help did not exit"


def check_imports(scripts: list[Path], optional: set[str]) -> list[str]:
    failures = []
    for script in scripts:
        sys.path.insert(0, str(script.resolve().parent))  # as running the script does
        failures += [failure for failure in [parses_help(script)] if failure]
        for name in imported_modules(script):
            if name.split(".")[0] in optional:
                continue
            try:
                import_name(name)
            except Exception as error:  # noqa: BLE001 - every failure is reported, not only ImportError
                failures.append(f"{script}: {name}: {type(error).__name__}: {error}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("missing")
    sub.add_parser("check-wheels").add_argument("wheel_dir", type=Path)
    repack_parser = sub.add_parser("repack")
    repack_parser.add_argument("--dest", type=Path, required=True)
    repack_parser.add_argument("names", nargs="+")
    sub.add_parser("host-python").add_argument("dest", type=Path)
    imports_parser = sub.add_parser("imports")
    imports_parser.add_argument("scripts", nargs="+", type=Path)
    imports_parser.add_argument("--optional", action="append", default=[], metavar="MODULE",
                                help="a top-level module the scripts import only for an optional feature")
    ns = parser.parse_args(argv)

    if ns.command == "missing":
        for dist in missing_on_host(project_requirements(), host_packages()).values():
            print(f"{dist.metadata['Name']}=={dist.version}")
    elif ns.command == "check-wheels":
        problems = wheel_problems(ns.wheel_dir, host_packages(), project_requirements())
        for problem in problems:
            print(f"kit: {problem}", file=sys.stderr)
        return 1 if problems else 0
    elif ns.command == "repack":
        ns.dest.mkdir(parents=True, exist_ok=True)
        for name in ns.names:
            print(repack(name, ns.dest))
    elif ns.command == "host-python":
        print(make_host_python(ns.dest, host_packages()))
    elif ns.command == "imports":
        failures = check_imports(ns.scripts, set(ns.optional))
        for failure in failures:
            print(f"import failed: {failure}", file=sys.stderr)
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

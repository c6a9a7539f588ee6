"""Gather every wheel bert-ds needs into one folder, for GPU nodes without internet.

    python -m bert_ds.tools.bundle OUT_DIR [--python-version 3.11] [--platform manylinux_2_28_x86_64 ...]
                             [--torch SPEC | --no-torch] [--extra-index-url URL ...]

Run it on a machine that reaches the package index, with the project's environment
(``.venv``: it has torch, which DeepSpeed's build needs), copy OUT_DIR to the node and
follow ``OUT_DIR/INSTALL.md``:

    python3 -m venv --system-site-packages .venv        # inherits the node's CUDA torch
    .venv/bin/pip install --no-index --find-links OUT_DIR -r OUT_DIR/requirements.txt

OUT_DIR then holds the wheels, ``requirements.txt`` (an exact pin of each),
``INSTALL.md`` and ``SHA256SUMS`` (``sha256sum -c SHA256SUMS`` inside OUT_DIR).

Design choices, and why:

- torch is not bundled by default: a GPU container ships a torch built for its CUDA
  and driver, and a second one from PyPI would be gigabytes of CUDA libraries that
  shadow it. So torch is taken out of the requirements the resolution starts from,
  and where another package requires it too (accelerate does), the resolved set keeps
  only what the roots reach without passing through torch: torch and the packages only
  torch needs (its CUDA libraries) are neither downloaded nor bundled. ``--torch SPEC`` bundles one: a requirement
  (``'torch==2.11.0+cu130'`` with ``--extra-index-url https://download.pytorch.org/whl/cu130``),
  a wheel file, or a folder of wheels (the newest torch there that fits the target).
- Resolve first, then download: ``pip install --dry-run --report`` resolves the whole
  set for the target Python and platform from package metadata (no wheel is fetched
  where the index serves it, as PyPI does), then ``pip download --no-deps`` fetches
  exactly the resolved files, hash-checked. Wheels only (``--only-binary=:all:``), so
  what the bundle holds installs on the target whatever machine built it.
- Packages published only as source (DeepSpeed) are built here with
  ``pip wheel --no-deps --no-build-isolation`` in the running environment (DeepSpeed's
  ``setup.py`` imports torch). A source build is used only when no wheel of the
  package exists for this machine either (so an unsupported target platform is
  reported instead of compiling numpy), and only when it is pure Python: a local
  build's ``linux_x86_64`` tag would not install on a ``manylinux`` node. DeepSpeed
  builds pure (its CUDA ops compile on first use on the node, with the bundled ninja).
- Locally built wheels (bert-ds itself, DeepSpeed) do not enter the resolution, since
  both require torch; their own requirements do, with markers evaluated for the
  target. pip evaluates the markers of indirect dependencies for the running
  interpreter, so a bundle for another Python minor version gets a warning.
- pip takes ``--platform`` literally, but a ``manylinux_2_28`` node runs every older
  manylinux wheel too (ninja ships ``manylinux_2_17`` only): the platform list is
  widened to the older glibc (or musl) versions before pip sees it.
- The project wheel is built from a copy of the checkout's source files (what git
  tracks or would track), so a stale ``build/`` folder cannot leak into it and
  ``.venv/`` or ``runs/`` are never copied.
- OUT_DIR may be rerun: wheels already there are reused when their hash matches,
  those no longer needed are removed, and the listing files are rewritten last.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.parse
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging import tags
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError, guarded

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MARKER = ".bert-ds-bundle"  # an OUT_DIR holding it is an earlier bundle and may be rewritten
LISTING_FILES = ("requirements.txt", "INSTALL.md", "SHA256SUMS")
MIN_PIP = Version("22.2")  # --report
ARCHES = ("x86_64", "aarch64", "ppc64le", "s390x", "i686", "armv7l", "riscv64")
_PLATFORM_RE = re.compile(
    r"(?P<kind>manylinux|musllinux)_(?P<major>\d+)_(?P<minor>\d+)_(?P<arch>[a-z0-9_]+)"
    r"|manylinux(?P<legacy>1|2010|2014)_(?P<legacy_arch>[a-z0-9_]+)"
    r"|linux_(?P<linux_arch>[a-z0-9_]+)"
    r"|macosx_\d+_\d+_(?P<mac_arch>x86_64|arm64|universal2|intel|universal)"
    r"|win32|win_amd64|win_arm64"
)
_LEGACY_MANYLINUX = {"2014": (2, 17), "2010": (2, 12), "1": (2, 5)}  # PEP 600 aliases, newest first
_NO_MATCH_RE = re.compile(r"No matching distribution found for (\S+)")


class BundleError(UserError):
    """The bundle cannot be made for this target: the message says why."""


def log(message: str) -> None:
    print(f"[bundle] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the target


@dataclass(frozen=True)
class Target:
    """The Python and platforms the bundle is for; ``platforms`` is already widened."""

    python: tuple[int, int]
    platforms: tuple[str, ...]

    @property
    def abi(self) -> str:
        return f"cp{self.python[0]}{self.python[1]}"

    @property
    def python_version(self) -> str:
        return f"{self.python[0]}.{self.python[1]}"

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--python-version", self.python_version,
                "--implementation", "cp", "--abi", self.abi]
        for platform in self.platforms:
            args += ["--platform", platform]
        return args

    def supported_tags(self) -> set[tags.Tag]:
        return set(tags.cpython_tags(self.python, [self.abi, "abi3", "none"], self.platforms)) | set(
            tags.compatible_tags(self.python, self.abi, self.platforms))

    def accepts(self, wheel: Path) -> bool:
        return bool(parse_wheel_filename(wheel.name)[3] & self.supported_tags())

    def marker_environment(self) -> dict[str, str]:
        """PEP 508 marker values on the target, for the requirements the resolution starts from."""
        env = dict(default_environment())
        env.update(python_version=self.python_version, python_full_version=f"{self.python_version}.0",
                   implementation_name="cpython", platform_python_implementation="CPython")
        first = self.platforms[0]
        if first.startswith(("manylinux", "musllinux", "linux")):
            env.update(sys_platform="linux", platform_system="Linux", os_name="posix")
        elif first.startswith("macosx"):
            env.update(sys_platform="darwin", platform_system="Darwin", os_name="posix")
        else:
            env.update(sys_platform="win32", platform_system="Windows", os_name="nt")
        arch = next((a for a in ARCHES + ("arm64",) if first.endswith(a)), None)
        if arch:
            env["platform_machine"] = {"win_amd64": "AMD64", "win_arm64": "ARM64"}.get(first, arch)
        return env


def parse_python_version(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"3\.(\d{1,2})", text.strip())
    if not match:
        raise BundleError(f"--python-version {text!r}: expected MAJOR.MINOR of a CPython 3, e.g. 3.11")
    return 3, int(match.group(1))


def expand_platform(platform: str) -> list[str]:
    """``platform`` and the older platform tags a machine of that kind also runs, newest first.

    pip matches ``--platform`` literally, while a glibc 2.28 system runs every wheel
    built for an older glibc (PEP 600), including the legacy ``manylinux2014`` names.
    """
    match = _PLATFORM_RE.fullmatch(platform)
    if not match:
        raise BundleError(f"--platform {platform!r} is not a wheel platform tag "
                          "(e.g. manylinux_2_28_x86_64, manylinux2014_aarch64, macosx_11_0_arm64, win_amd64)")
    arch = match.group("arch") or match.group("legacy_arch") or match.group("linux_arch")
    if arch is not None and arch not in ARCHES:
        raise BundleError(f"--platform {platform!r}: unknown architecture {arch!r} (one of {', '.join(ARCHES)})")
    if match.group("legacy"):
        glibc = _LEGACY_MANYLINUX[match.group("legacy")]
        return expand_platform(f"manylinux_{glibc[0]}_{glibc[1]}_{arch}")
    if match.group("kind") == "manylinux":
        major, newest = int(match.group("major")), int(match.group("minor"))
        out = [f"manylinux_{major}_{minor}_{arch}" for minor in range(newest, 4, -1)] if major == 2 else [platform]
        out += [f"manylinux{name}_{arch}" for name, (_, minor) in _LEGACY_MANYLINUX.items() if minor <= newest]
        return out
    if match.group("kind") == "musllinux":
        major, newest = int(match.group("major")), int(match.group("minor"))
        return [f"musllinux_{major}_{minor}_{arch}" for minor in range(newest, -1, -1)]
    return [platform]  # linux_*, macosx (pip widens macOS versions itself), windows


def make_target(python_version: str, platforms: list[str]) -> Target:
    widened: list[str] = []
    for platform in platforms:
        widened += [p for p in expand_platform(platform) if p not in widened]
    return Target(parse_python_version(python_version), tuple(widened))


# ---------------------------------------------------------------- wheels built here


@dataclass(frozen=True)
class LocalWheel:
    """A wheel built on this machine, with what its metadata says."""

    path: Path
    name: str  # canonical
    version: str
    requires: tuple[str, ...]  # Requires-Dist lines, markers included
    requires_python: str | None

    @classmethod
    def read(cls, path: Path) -> LocalWheel:
        with zipfile.ZipFile(path) as zf:
            meta_name = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            meta = email.parser.Parser().parsestr(zf.read(meta_name).decode("utf-8"), headersonly=True)
        return cls(path, canonicalize_name(meta["Name"]), meta["Version"], tuple(meta.get_all("Requires-Dist") or ()),
                   meta.get("Requires-Python"))

    def runs_on(self, target: Target) -> bool:
        return not self.requires_python or SpecifierSet(self.requires_python).contains(
            f"{target.python_version}.0", prereleases=True)

    def requirements_on(self, env: dict[str, str]) -> list[Requirement]:
        """The requirements that apply on the target (no extras), markers removed."""
        out = []
        for line in self.requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            req.marker = None
            out.append(req)
        return out


# ---------------------------------------------------------------- running pip


class Pip:
    """``python -m pip`` for the running interpreter; a failure becomes one :class:`BundleError` line."""

    def __init__(self, extra_index_urls: list[str], log_path: Path):
        self.index_args = [arg for url in extra_index_urls for arg in ("--extra-index-url", url)]
        self.log_path = log_path

    def run(self, what: str, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pip", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n(exit {proc.returncode})\n\n")
        if check and proc.returncode != 0:
            raise BundleError(f"{what} failed: {summarize_pip_error(proc.stdout + proc.stderr)} "
                              f"(full pip output in {self.log_path})")
        return proc


def summarize_pip_error(output: str) -> str:
    """pip's ``ERROR:`` lines (or its last line) as one line of at most ~400 characters."""
    errors = [line.removeprefix("ERROR:").strip() for line in output.splitlines() if line.startswith("ERROR:")]
    if not errors:
        errors = [line.strip() for line in output.splitlines() if line.strip()][-1:] or ["no output"]
    text = "; ".join(dict.fromkeys(e.rstrip(".") for e in errors if e))
    return text if len(text) <= 400 else text[:397] + "..."


def check_pip() -> None:
    version = Version(metadata.version("pip"))
    if version < MIN_PIP:
        raise BundleError(f"pip {version} is too old for bundling (needs >= {MIN_PIP}): "
                          f"{sys.executable} -m pip install -U pip")


# ---------------------------------------------------------------- the steps


def build_project_wheel(pip: Pip, dest: Path) -> LocalWheel:
    """bert-ds's own wheel, built from a copy of the checkout's source files."""
    if not (PROJECT_ROOT / "pyproject.toml").is_file():
        raise BundleError(f"{PROJECT_ROOT} is not a bert-ds source checkout (no pyproject.toml): "
                          "run the bundler from the repository")
    with tempfile.TemporaryDirectory(prefix="bert-ds-src-") as tmp:
        src = Path(tmp) / "src"
        for rel in source_files(PROJECT_ROOT):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT_ROOT / rel, src / rel, follow_symlinks=False)  # bert_ds/kernels etc. stay links
        pip.run("building the bert-ds wheel",
                ["wheel", "--no-deps", "--quiet", *pip.index_args, "-w", str(dest), str(src)])
    wheel = next(dest.glob("bert_ds-*.whl"), None)
    if wheel is None:
        raise BundleError(f"pip built no bert-ds wheel from {PROJECT_ROOT}")
    return LocalWheel.read(wheel)


_NOT_SOURCE = ("build", "dist", "runs")  # outputs, not inputs, when git cannot say


def source_files(root: Path) -> list[Path]:
    """The checkout's files, relative to ``root``: what git tracks or would track (ignored files
    such as ``.venv/``, ``runs/`` and a stale ``build/`` are left out); without git, every
    file outside hidden folders, build outputs, caches and virtual environments."""
    if (root / ".git").exists():
        try:
            listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                    cwd=root, capture_output=True, check=True).stdout
            return [Path(n) for n in sorted(set(listed.decode().split("\0")))
                    if n and ((root / n).is_file() or (root / n).is_symlink())]
        except (OSError, subprocess.CalledProcessError):
            pass  # no git here: walk the tree instead
    files = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        files += [(here / d).relative_to(root) for d in dirs if (here / d).is_symlink()]  # not walked into
        dirs[:] = [d for d in dirs
                   if not (d.startswith(".") or d == "__pycache__" or d.endswith(".egg-info")
                           or (here == root and d in _NOT_SOURCE) or (here / d / "pyvenv.cfg").exists())]
        files += [(here / n).relative_to(root) for n in names if not n.endswith(".pyc")]
    return sorted(files)


def has_wheel_for_this_machine(pip: Pip, requirement: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="bert-ds-probe-") as tmp:
        proc = pip.run("probing", ["install", "--dry-run", "--no-deps", "--ignore-installed", "--only-binary=:all:",
                                   "--quiet", "--target", tmp, *pip.index_args, requirement], check=False)
    return proc.returncode == 0


def build_source_only(pip: Pip, requirement: Requirement, target: Target, dest: Path) -> LocalWheel:
    """A wheel of a package published only as source, built in the running environment."""
    name = canonicalize_name(requirement.name)
    if has_wheel_for_this_machine(pip, str(requirement)):
        raise BundleError(f"{requirement} has no wheel for CPython {target.python_version} on "
                          f"{target.platforms[0]} (there is one for this machine): choose another "
                          "--platform/--python-version, or bundle on a machine like the node")
    log(f"{requirement} is published as source only: building a wheel here")
    with tempfile.TemporaryDirectory(prefix="bert-ds-build-") as tmp:
        pip.run(f"building {requirement} from source",
                ["wheel", "--no-deps", "--no-build-isolation", "--quiet", *pip.index_args, "-w", tmp, str(requirement)])
        built = next((p for p in Path(tmp).glob("*.whl") if canonicalize_name(parse_wheel_filename(p.name)[0]) == name),
                     None)
        if built is None:
            raise BundleError(f"building {requirement} from source gave no wheel")
        if not target.accepts(built):
            raise BundleError(f"{requirement} is published as source only and builds here as {built.name}, which "
                              f"does not install on CPython {target.python_version}/{target.platforms[0]}: "
                              "bundle on a machine like the node")
        shutil.copy2(built, dest / built.name)
    return LocalWheel.read(dest / built.name)


def torch_requirement(spec: str, target: Target) -> str:
    """``--torch`` as a pip requirement: a requirement string, a wheel file, or a folder of wheels."""
    path = Path(spec).expanduser()
    if path.is_dir():
        candidates = []
        for wheel in path.glob("torch-*.whl"):
            try:
                version = parse_wheel_filename(wheel.name)[1]
            except InvalidWheelFilename:
                continue
            if target.accepts(wheel):
                candidates.append((version, wheel))
        if not candidates:
            raise BundleError(f"--torch {spec}: no torch wheel there for CPython {target.python_version} "
                              f"on {target.platforms[0]}")
        path = max(candidates)[1]
    if path.suffix == ".whl":
        if not path.is_file():
            raise BundleError(f"--torch {spec}: no such file")
        if canonicalize_name(parse_wheel_filename(path.name)[0]) != "torch":
            raise BundleError(f"--torch {spec}: not a torch wheel")
        if not target.accepts(path):
            raise BundleError(f"--torch {spec}: this wheel does not install on CPython "
                              f"{target.python_version}/{target.platforms[0]}")
        return f"torch @ {path.resolve().as_uri()}"
    try:
        req = Requirement(spec)
    except InvalidRequirement as err:
        raise BundleError(f"--torch {spec!r} is neither a requirement, a wheel file nor a folder: {err}") from None
    if canonicalize_name(req.name) != "torch":
        raise BundleError(f"--torch {spec!r} names {req.name}, not torch")
    return str(req)


def resolution_roots(local: dict[str, LocalWheel], torch_req: str | None, target: Target) -> list[str]:
    """What the resolution starts from: the local wheels' requirements, without torch unless bundled.

    A requirement on another local wheel is checked here instead (the local wheel is the answer).
    """
    env = target.marker_environment()
    roots: list[str] = []
    for wheel in local.values():
        for req in wheel.requirements_on(env):
            name = canonicalize_name(req.name)
            if name in local:
                if not req.specifier.contains(local[name].version, prereleases=True):
                    raise BundleError(f"{wheel.name} needs {req} but {local[name].path.name} was built")
                continue
            if name == "torch" and torch_req is None:
                continue
            roots.append(str(req))
    if torch_req is not None:
        roots.append(torch_req)
    return list(dict.fromkeys(roots))


class _NoWheel(Exception):
    def __init__(self, requirement: str):
        super().__init__(requirement)
        self.requirement = requirement


def resolve(pip: Pip, roots: list[str], target: Target, find_links: Path, work: Path) -> list[dict]:
    """pip's report of what to install on the target (its ``install`` list).

    Raises :class:`_NoWheel` when some package has no wheel for the target, and
    :class:`BundleError` on any other failure."""
    report = work / "resolution.json"
    proc = pip.run("resolving the dependencies", [
        "install", "--dry-run", "--ignore-installed", "--quiet", "--target", str(work / "target"),
        "--report", str(report), *target.pip_args(), "--find-links", str(find_links), *pip.index_args, *roots,
    ], check=False)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        missing = _NO_MATCH_RE.search(output)
        if missing:
            raise _NoWheel(missing.group(1))
        raise BundleError(f"resolving the dependencies failed: {summarize_pip_error(output)} "
                          f"(full pip output in {pip.log_path})")
    return json.loads(report.read_text())["install"]


def _source_only_candidate(text: str, local: dict[str, LocalWheel], target: Target) -> Requirement:
    """The requirement pip found no wheel for, if building it here may help."""
    try:
        req = Requirement(text)
    except InvalidRequirement:
        raise BundleError(f"no wheel for {text} on CPython {target.python_version}/{target.platforms[0]}") from None
    name = canonicalize_name(req.name)
    if name == "torch":  # never compile torch: a wrong --torch or platform is the cause
        raise BundleError(f"no torch wheel matches {req} for CPython {target.python_version} on "
                          f"{target.platforms[0]}: check --torch, --extra-index-url and --platform")
    if name in local:  # each round builds a new package, so this loop ends
        raise BundleError(f"no wheel for {req} on the target, even after building {local[name].path.name}")
    return req


def without_torch(items: list[dict], roots: list[str], env: dict[str, str]) -> tuple[list[dict], list[str]]:
    """The resolved items the roots need when torch is the node's own: what the roots reach
    through the items' requirements (markers evaluated for the target, with the extras asked
    for) without passing through torch. Returns the kept items and the names left out: torch
    and what only torch needs (its CUDA libraries, triton, sympy ...)."""
    by_name = {canonicalize_name(item["metadata"]["name"]): item for item in items}
    extras: dict[str, set[str]] = {}  # kept package -> the extras asked of it
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "torch" or name not in by_name:  # a local wheel's or the node's
            continue
        new = set(req.extras) | ({""} if name not in extras else set())
        new -= extras.get(name, set())
        if not new:
            continue
        extras.setdefault(name, set()).update(new)
        for line in by_name[name]["metadata"].get("requires_dist", []):
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in new):
                todo.append(dep)
    kept = [item for name, item in by_name.items() if name in extras]
    return kept, sorted(set(by_name) - set(extras))


def download(pip: Pip, items: list[dict], target: Target, out_dir: Path) -> list[Path]:
    """Fetch exactly the resolved files into ``out_dir`` (hash-checked; files already there are kept)."""
    reqs = []
    for item in items:
        info = item["download_info"]
        url = info["url"]
        sha = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if sha and "#" not in url:
            url += f"#sha256={sha}"
        reqs.append(f"{item['metadata']['name']} @ {url}")
    if reqs:
        pip.run("downloading the wheels", ["download", "--no-deps", "--quiet", *target.pip_args(), "-d", str(out_dir),
                                             *pip.index_args, *reqs])
    files = []
    for item in items:
        name = Path(urllib.parse.unquote(urllib.parse.urlparse(item["download_info"]["url"]).path)).name
        if not (out_dir / name).is_file():
            raise BundleError(f"pip download did not leave {name} in {out_dir}")
        files.append(out_dir / name)
    return files


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install_md(pins: list[str], target: Target, project: LocalWheel) -> str:
    torch_pin = next((p for p in pins if p.startswith("torch==")), None)
    if torch_pin:
        torch_note = f"This bundle holds its own torch ({torch_pin})."
        venv = "python3 -m venv .venv"
    else:
        need = next((str(r) for r in project.requirements_on(target.marker_environment())
                     if canonicalize_name(r.name) == "torch"), "torch")
        torch_note = (f"torch is NOT in this bundle: the node's python3 must already import a torch that "
                      f"satisfies `{need}` (a GPU container's own CUDA build), which the environment "
                      "below inherits. Without one, pip stops with 'No matching distribution found for torch'.")
        venv = "python3 -m venv --system-site-packages .venv   # inherits the node's torch"
    about = textwrap.fill(f"Wheels for CPython {target.python_version} on {target.platforms[0]} (and the older "
                          f"platform tags it runs), gathered by `python -m bert_ds.tools.bundle`. {torch_note}", 88)
    return f"""# Offline install of bert-ds {project.version}

{about}

On the node, with this folder copied to `$BUNDLE`:

```bash
BUNDLE=/path/to/this/folder
(cd "$BUNDLE" && sha256sum -c --quiet SHA256SUMS)   # optional: check the copy
{venv}
.venv/bin/python -m pip install --no-index --find-links "$BUNDLE" -r "$BUNDLE/requirements.txt"
.venv/bin/python -m bert_ds.train.extensions   # DeepSpeed's JIT ops, built now rather than at the first start
.venv/bin/python -m bert_ds.train --help
```

`requirements.txt` pins every wheel here, and `--no-index` keeps pip from looking
anywhere else. `bundle.log` holds the pip commands that gathered them.
"""


def make_bundle(out_dir: Path, target: Target, torch_spec: str | None, extra_index_urls: list[str]) -> list[Path]:
    """Gather the wheels and write the listing files; returns the wheels."""
    check_pip()
    if sys.version_info[:2] != target.python:
        log(f"warning: bundling for Python {target.python_version} with Python "
            f"{sys.version_info[0]}.{sys.version_info[1]}: pip evaluates the environment markers of "
            "indirect dependencies for this interpreter; check the bundle on a node")
    torch_req = torch_requirement(torch_spec, target) if torch_spec is not None else None
    _prepare_out_dir(out_dir)
    pip = Pip(extra_index_urls, out_dir / "bundle.log")
    pip.log_path.write_text("")
    with tempfile.TemporaryDirectory(prefix="bert-ds-bundle-") as tmp:
        work, built = Path(tmp), Path(tmp) / "built"
        built.mkdir()
        log("building the bert-ds wheel")
        project = build_project_wheel(pip, built)
        if not project.runs_on(target):
            raise BundleError(f"bert-ds needs Python {project.requires_python}, not {target.python_version}")
        local = {project.name: project}
        while True:
            roots = resolution_roots(local, torch_req, target)
            log(f"resolving {len(roots)} requirements for CPython {target.python_version} on {target.platforms[0]}")
            try:
                items = resolve(pip, roots, target, built, work)
                break
            except _NoWheel as err:
                req = _source_only_candidate(err.requirement, local, target)
                wheel = build_source_only(pip, req, target, built)
                local[wheel.name] = wheel
        if torch_req is None:
            items, left_out = without_torch(items, roots, target.marker_environment())
            if left_out:
                log(f"left out torch and what only torch needs ({len(left_out)} packages: "
                    f"{', '.join(left_out[:6])}{', ...' if len(left_out) > 6 else ''}): the node's own torch serves")
        items = [item for item in items if canonicalize_name(item["metadata"]["name"]) not in local]
        log(f"downloading {len(items)} wheels into {out_dir}")
        wheels = download(pip, items, target, out_dir)
        for wheel in local.values():
            shutil.copy2(wheel.path, out_dir / wheel.path.name)
            wheels.append(out_dir / wheel.path.name)
    for stale in set(out_dir.glob("*.whl")) - set(wheels):
        stale.unlink()
    pins = [f"{meta.name}=={meta.version}" for meta in sorted(map(LocalWheel.read, wheels), key=lambda m: m.name)]
    torch_bundled = any(p.startswith("torch==") for p in pins)
    header = (f"# bert-ds offline bundle: CPython {target.python_version}, {target.platforms[0]}; "
              f"torch {'bundled' if torch_bundled else 'NOT bundled (the node provides it)'}.\n"
              "# pip install --no-index --find-links THIS_FOLDER -r requirements.txt (see INSTALL.md)\n")
    atomic_write(out_dir / "requirements.txt", header + "".join(p + "\n" for p in pins))
    atomic_write(out_dir / "INSTALL.md", install_md(pins, target, project))
    listed = sorted(wheels + [out_dir / "requirements.txt", out_dir / "INSTALL.md"], key=lambda p: p.name)
    atomic_write(out_dir / "SHA256SUMS", "".join(f"{sha256_of(p)}  {p.name}\n" for p in listed))
    return sorted(wheels)


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise BundleError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).is_file():
        raise BundleError(f"{out_dir} is not empty and holds no earlier bundle: choose a new folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER).write_text("written by python -m bert_ds.tools.bundle; wheels here are replaced on a rerun\n")
    for name in LISTING_FILES:  # a bundle that stops half-way must not look complete
        (out_dir / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bert_ds.tools.bundle",
        description="Gather every wheel bert-ds needs (its own, its dependencies, DeepSpeed built here) into "
                    "OUT_DIR for an offline install on an air-gapped node; see OUT_DIR/INSTALL.md after.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path,
                        help="folder to fill (new, empty, or an earlier bundle, whose wheels are reused)")
    parser.add_argument("--python-version", default="3.11", metavar="X.Y",
                        help="CPython version of the node (default: %(default)s)")
    parser.add_argument("--platform", action="append", metavar="TAG",
                        help="wheel platform tag of the node, repeatable; older manylinux/musllinux tags are "
                             "added (default: manylinux_2_28_x86_64)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--torch", metavar="SPEC",
                       help="bundle torch too: a requirement ('torch==2.5.1+cu121', with --extra-index-url for "
                            "its index), a wheel file, or a folder of wheels")
    group.add_argument("--no-torch", dest="torch", action="store_const", const=None,
                       help="leave torch out; the node's own torch is used (the default)")
    parser.add_argument("--extra-index-url", action="append", default=[], metavar="URL",
                        help="another package index, e.g. https://download.pytorch.org/whl/cu121 (repeatable)")
    args = parser.parse_args(argv)
    # the listing files come last (_prepare_out_dir): a stopped bundle does not look complete
    return guarded(lambda: _bundle(args), interrupted=f"{args.out_dir} is incomplete (no SHA256SUMS); "
                                                  "the same command goes on, reusing its wheels")


def _bundle(args: argparse.Namespace) -> None:
    target = make_target(args.python_version, args.platform or ["manylinux_2_28_x86_64"])
    wheels = make_bundle(args.out_dir, target, args.torch, args.extra_index_url)
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:,.0f} MiB, in {args.out_dir}; install with "
          f"{args.out_dir / 'INSTALL.md'}")


if __name__ == "__main__":
    sys.exit(main())

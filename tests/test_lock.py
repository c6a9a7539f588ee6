"""requirements.lock: what ./run.sh installs is a complete, hash-checked set made from pyproject.toml
as it is, and what it leaves out is torch's alone (bert_ds.tools.lock)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bert_ds.base.errors import UserError
from bert_ds.tools import lock
from tests.conftest import REPO

LOCK = REPO / lock.LOCK
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The environment CI and the development machines have; the lock's markers are evaluated for it.
LINUX_311 = {"python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
             "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
             "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _pins(environment: dict[str, str]) -> dict[str, str]:
    """The lock's pins that install in ``environment``: name -> version."""
    pins = {}
    for pin in lock.parse(LOCK.read_text()):
        if pin.marker is None or Marker(pin.marker).evaluate(environment):
            assert pin.name not in pins, f"{pin.name} pinned twice for one environment"
            pins[canonicalize_name(pin.name)] = pin.version
    return pins


def test_the_lock_is_made_from_pyproject_as_it_is(tmp_path):
    lock.check(REPO, LOCK)  # raises where the inputs differ
    # a range changed in pyproject.toml without a new lock is refused, naming the command that fixes it
    changed = (REPO / "pyproject.toml").read_text().replace('"transformers>=5.17,<6"', '"transformers>=5.18,<6"')
    assert changed != (REPO / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(changed)
    with pytest.raises(UserError, match=r"was made from other requirements .* update it with ./run.sh lock"):
        lock.check(tmp_path, LOCK)
    # a change that no requirement sees (a tool's settings) keeps the lock
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text() + "\n[tool.x]\ny = 1\n")
    lock.check(tmp_path, LOCK)


def test_the_lock_pins_every_requirement_inside_its_range_but_torch():
    pins = _pins(LINUX_311)
    wanted = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    wanted += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]]
    wanted += [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    for req in wanted:
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in pins  # the environment's own, or $TORCH_SPEC
            continue
        if req.marker is not None and not req.marker.evaluate(LINUX_311):
            continue
        assert name in pins, f"{req} is not in the lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req}: the lock holds {pins[name]}"


def test_the_lock_leaves_out_only_torch_and_its_builds_libraries():
    text = LOCK.read_text()
    pins = lock.parse(text)
    names = {p.name for p in pins}
    assert not {n for n in names if n == "torch" or n == "triton" or re.fullmatch(r"nvidia-\w+-cu\d+|cuda-\w+", n)}
    assert "nvidia-cuda-nvdisasm" in names  # NVIDIA's, but the test extra's own
    assert {"sympy", "networkx", "mpmath", "jinja2", "filelock"} <= names  # what torch needs everywhere
    assert all(any(line.lstrip().startswith("--hash=sha256:") for line in p.lines) for p in pins)
    # no path in the annotations (a temporary file's would make every remake differ)
    assert not [line for p in pins for line in p.lines if line.lstrip().startswith("#") and "/" in line]
    # resolved with the torch run.sh installs
    default = re.search(r"^TORCH_SPEC=\$\{TORCH_SPEC:-(\S+)\}$", (REPO / "run.sh").read_text(), re.MULTILINE).group(1)
    assert lock.recorded(LOCK, lock.TORCH_PREFIX) == default


UV_OUTPUT = """\
accelerate==1.16.0 \\
    --hash=sha256:aa
    # via bert-ds (pyproject.toml)
mpmath==1.3.0 \\
    --hash=sha256:bb
    # via sympy
networkx==3.6.1 ; python_full_version < '3.12' \\
    --hash=sha256:cc
    # via torch
networkx==3.7 ; python_full_version >= '3.12' \\
    --hash=sha256:dd
    # via torch
nvidia-cublas==13.1.1.3 ; sys_platform == 'linux' \\
    --hash=sha256:ee
    # via
    #   nvidia-cudnn-cu13
    #   torch
nvidia-cudnn-cu13==9.20.0.48 ; sys_platform == 'linux' \\
    --hash=sha256:ff
    # via torch
nvidia-cuda-nvdisasm==13.5.37 ; sys_platform == 'linux' \\
    --hash=sha256:gg
    # via bert-ds (pyproject.toml)
setuptools==84.2.1 \\
    --hash=sha256:hh
    # via
    #   -r /tmp/x/build.txt
    #   torch
sympy==1.14.0 \\
    --hash=sha256:ii
    # via torch
torch==2.13.0 \\
    --hash=sha256:jj
    # via
    #   -c /tmp/x/torch.txt
    #   bert-ds (pyproject.toml)
    #   accelerate
"""


def test_torch_goes_with_what_only_its_build_needs():
    pins = lock.parse(UV_OUTPUT)
    assert [p.name for p in pins].count("networkx") == 2
    assert pins[4].via == {"nvidia-cudnn-cu13", "torch"} and pins[7].via == {"", "torch"}
    assert lock.left_out(pins) == {"torch", "nvidia-cublas", "nvidia-cudnn-cu13"}
    text = lock.render(pins, lock.left_out(pins), "torch==2.13.0", "0123")
    assert "nvidia-cublas==" not in text and "torch==2.13.0 \\" not in text and "\nsympy==1.14.0 \\" in text
    assert lock.parse(text)[0].name == "accelerate"  # the header is comments only


def test_unknown_output_and_a_torch_range_are_refused():
    with pytest.raises(UserError, match="does not know"):
        lock.parse("accelerate>=1.16\n")
    assert lock.torch_version("torch==2.13.0") == "2.13.0"
    with pytest.raises(UserError, match="exact pin"):
        lock.torch_version("torch>=2.11")


def test_check_from_the_command_line_is_one_line(tmp_path):
    """What ./run.sh setup runs first, with the system's Python, before any environment exists."""
    stale = tmp_path / "requirements.lock"
    stale.write_text(LOCK.read_text().replace(lock.INPUTS_PREFIX, lock.INPUTS_PREFIX + "0", 1))
    for path, status in ((LOCK, 0), (stale, 2), (tmp_path / "none.lock", 2)):
        proc = subprocess.run([sys.executable, "-m", "bert_ds.tools.lock", "--check", "--output", str(path)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == status, proc.stderr
        if status == 0:
            assert proc.stderr == ""
        else:
            assert proc.stderr.startswith(f"error: {path}") and proc.stderr.count("\n") == 1, proc.stderr

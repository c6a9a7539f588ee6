"""The offline bundle: target tags, what the resolution starts from, one-line errors,
and (when the package index answers) a real bundle installed into a bare venv with
``--no-index``, then imported and run there."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging import tags
from packaging.utils import parse_wheel_filename

from bert_ds.tools import bundle
from bert_ds.tools.bundle import BundleError, LocalWheel, expand_platform, make_target, resolution_roots
from tests.conftest import REPO

LINUX_311 = make_target("3.11", ["manylinux_2_28_x86_64"])


def test_manylinux_platform_widens_to_older_glibc_and_legacy_names():
    out = expand_platform("manylinux_2_28_x86_64")
    assert out[0] == "manylinux_2_28_x86_64" and out[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64"} <= set(out)
    assert "manylinux_2_29_x86_64" not in out
    assert expand_platform("manylinux2014_aarch64")[0] == "manylinux_2_17_aarch64"
    assert "manylinux2014_x86_64" not in expand_platform("manylinux_2_12_x86_64")
    assert expand_platform("musllinux_1_2_x86_64") == ["musllinux_1_2_x86_64", "musllinux_1_1_x86_64",
                                                      "musllinux_1_0_x86_64"]
    assert expand_platform("win_amd64") == ["win_amd64"]


def test_target_accepts_older_manylinux_wheels_only():
    assert LINUX_311.accepts(Path("ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"))
    assert LINUX_311.accepts(Path("tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.whl"))
    assert LINUX_311.accepts(Path("deepspeed-0.19.8-py3-none-any.whl"))
    assert not LINUX_311.accepts(Path("deepspeed-0.19.8-cp311-cp311-linux_x86_64.whl"))  # a local build
    assert not LINUX_311.accepts(Path("numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl"))
    assert not LINUX_311.accepts(Path("pyarrow-26.0.1-cp311-cp311-manylinux_2_34_x86_64.whl"))


def _wheel(name: str, version: str, *requires: str) -> LocalWheel:
    return LocalWheel(Path(f"{name}-{version}-py3-none-any.whl"), name, version, requires, ">=3.10")


def test_roots_leave_torch_out_unless_asked_and_evaluate_markers_for_the_target():
    local = {"bert-ds": _wheel("bert-ds", "0.1.0", "torch>=2.4", "deepspeed<0.20,>=0.16", "numpy<3,>=1.24",
                               'tomli; python_version < "3.11"', 'pytest>=8; extra == "test"'),
             "deepspeed": _wheel("deepspeed", "0.19.8", "torch>=2.0.0", "hjson", 'pywin32; sys_platform == "win32"')}
    assert resolution_roots(local, None, LINUX_311) == ["numpy<3,>=1.24", "hjson"]
    assert "tomli" in resolution_roots(local, None, make_target("3.10", ["manylinux_2_28_x86_64"]))
    assert "pywin32" in resolution_roots(local, None, make_target("3.11", ["win_amd64"]))
    with_torch = resolution_roots(local, "torch==2.5.1", LINUX_311)
    assert {"torch>=2.4", "torch>=2.0.0", "torch==2.5.1"} <= set(with_torch)
    local["deepspeed"] = _wheel("deepspeed", "0.20.1")
    with pytest.raises(BundleError, match="needs deepspeed"):
        resolution_roots(local, None, LINUX_311)


def _item(name: str, *requires: str) -> dict:
    return {"metadata": {"name": name, "requires_dist": list(requires)}}


def test_without_torch_keeps_what_the_roots_reach_and_leaves_out_what_only_torch_needs():
    items = [_item("accelerate", "torch>=2.0", "numpy", "pyyaml", 'pytest; extra == "test"'),
             _item("torch", "nvidia-cublas-cu12; platform_system == 'Linux'", "sympy", "numpy", "filelock"),
             _item("nvidia-cublas-cu12"), _item("sympy", "mpmath"), _item("mpmath"), _item("numpy"),
             _item("pyyaml"), _item("filelock"), _item("pytest"),
             _item("datasets", "filelock", 'fsspec[http]; python_version >= "3.8"'),
             _item("fsspec", 'aiohttp; extra == "http"'), _item("aiohttp")]
    kept, left_out = bundle.without_torch(items, ["accelerate>=1.1", "datasets"], LINUX_311.marker_environment())
    assert sorted(i["metadata"]["name"] for i in kept) == ["accelerate", "aiohttp", "datasets", "filelock", "fsspec",
                                                           "numpy", "pyyaml"]
    # torch's own needs go with it; filelock stays (datasets needs it too); pytest is an extra nobody asked for
    assert left_out == ["mpmath", "nvidia-cublas-cu12", "pytest", "sympy", "torch"]


def test_torch_option_takes_a_requirement_a_wheel_or_a_folder(tmp_path):
    for name in ("torch-2.4.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "torch-2.5.1-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "torch-2.9.0-cp312-cp312-manylinux_2_28_x86_64.whl",  # newer, but not for 3.11
                 "torch-2.9.0-cp311-none-macosx_11_0_arm64.whl"):
        (tmp_path / name).write_bytes(b"")
    picked = bundle.torch_requirement(str(tmp_path), LINUX_311)
    assert picked == f"torch @ {(tmp_path / 'torch-2.5.1-cp311-cp311-manylinux_2_28_x86_64.whl').as_uri()}"
    assert bundle.torch_requirement("torch==2.5.1+cu121", LINUX_311) == "torch==2.5.1+cu121"
    for bad, why in [("numpy==2", "not torch"), ("torch>>1", "neither"),
                     (str(tmp_path / "torch-2.9.0-cp312-cp312-manylinux_2_28_x86_64.whl"), "does not install"),
                     (str(tmp_path / "missing-1.0-py3-none-any.whl"), "no such file")]:
        with pytest.raises(BundleError, match=why):
            bundle.torch_requirement(bad, LINUX_311)


def test_pip_errors_become_one_line():
    out = ("Looking in links: /x\nERROR: Could not find a version that satisfies the requirement foo<2\n"
           "ERROR: No matching distribution found for foo<2\n")
    assert bundle.summarize_pip_error(out) == ("Could not find a version that satisfies the requirement foo<2; "
                                               "No matching distribution found for foo<2")
    assert bundle.summarize_pip_error("a\nlast words\n\n") == "last words"


@pytest.mark.parametrize("args, message", [
    (["--platform", "manylinux_2_28_sparc"], "unknown architecture"),
    (["--platform", "ubuntu"], "not a wheel platform tag"),
    (["--python-version", "3"], "expected MAJOR.MINOR"),
    (["--torch", "numpy"], "not torch"),
])
def test_bad_target_is_one_line_exit_2(tmp_path, capsys, args, message):
    assert bundle.main([str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_not_a_bundle_is_left_alone(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert bundle.main([str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err and os.listdir(tmp_path) == ["notes.txt"]


def test_project_wheel_sources_leave_out_environments_and_build_outputs(tmp_path):
    files = {str(p) for p in bundle.source_files(REPO)}  # the checkout: git decides
    assert {"pyproject.toml", "README.md", "bert_ds/tools/bundle.py"} <= files
    assert not any(f.startswith((".venv/", "runs/", "build/", ".git/")) or "__pycache__" in f for f in files)
    for rel in ("pyproject.toml", "pkg/__init__.py", "pkg/__pycache__/x.pyc", "build/lib/pkg/old.py", "runs/a/ckpt",
                "env/pyvenv.cfg", "env/lib/site.py", ".git/HEAD", "pkg.egg-info/PKG-INFO", "ds_configs/zero1.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert [str(p) for p in bundle.source_files(tmp_path)] == ["ds_configs/zero1.json", "pkg/__init__.py",
                                                               "pyproject.toml"]


# ---------------------------------------------------------------- end to end, online


def _pip_env(**extra: str) -> dict[str, str]:
    """The environment without pip's settings or a PYTHONPATH that would reach the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _index_reachable() -> bool:
    """deepspeed is only on the real index (as source), so finding it means the index answers."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "deepspeed", "--timeout", "10",
                               "--retries", "0"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def _local_torch_wheel() -> Path | None:
    """A torch wheel for this interpreter on disk: $BERT_DS_TORCH_WHEEL, or in pip's find-links."""
    if os.environ.get("BERT_DS_TORCH_WHEEL"):
        return Path(os.environ["BERT_DS_TORCH_WHEEL"])
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    folders += [f for value in re.findall(r"find-links='([^']*)'", config) for f in value.split()]
    here = set(tags.sys_tags())
    found = [w for folder in folders if Path(folder).is_dir() for w in Path(folder).glob("torch-*.whl")
             if parse_wheel_filename(w.name)[3] & here]
    return max(found, key=lambda w: parse_wheel_filename(w.name)[1], default=None)


@pytest.mark.long
def test_bundle_installs_offline_into_a_bare_venv(tmp_path):
    torch_wheel = _local_torch_wheel()
    if torch_wheel is None:
        pytest.skip("no torch wheel for this interpreter on disk (set BERT_DS_TORCH_WHEEL): "
                    "the test never downloads torch")
    if not _index_reachable():
        pytest.skip("the package index is not reachable")
    platform = next(t.platform for t in tags.sys_tags() if t.platform.startswith("manylinux_"))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    out = tmp_path / "bundle"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "bert_ds.tools.bundle", str(out), "--python-version", version,
                           "--platform", platform, "--torch", str(torch_wheel)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bundled = time.monotonic()

    pins = [line for line in (out / "requirements.txt").read_text().splitlines() if not line.startswith("#")]
    names = {pin.split("==")[0] for pin in pins}
    assert {"bert-ds", "deepspeed", "torch", "transformers", "ninja"} <= names
    assert f"torch=={parse_wheel_filename(torch_wheel.name)[1]}" in pins
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == len(pins)
    sums = dict(reversed(line.split("  ")) for line in (out / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {w.name for w in wheels} | {"requirements.txt", "INSTALL.md"}
    assert sums["requirements.txt"] == hashlib.sha256((out / "requirements.txt").read_bytes()).hexdigest()
    assert "--no-index" in (out / "INSTALL.md").read_text()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_pip_env())
    python = str(venv / "bin" / "python")
    # --no-compile: byte-compiling torch's files would double the install time of the test
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-compile", "--no-index",
                              "--find-links", str(out), "-r", str(out / "requirements.txt")],
                             capture_output=True, text=True, env=_pip_env(), cwd=tmp_path, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    installed = time.monotonic()

    run_env = _pip_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    # bert_ds is the only import name the project installs: kernels/data_tools/ds_configs come under
    # it (a `kernels` may be installed all the same: Hugging Face's, which transformers requires)
    imports = subprocess.run([python, "-c", "import bert_ds, bert_ds.data_tools.build, bert_ds.kernels.ops, "
                                            "bert_ds.config, deepspeed, transformers, importlib.metadata as m; "
                                            "tops = {f.parts[0] for f in m.files('bert-ds') if f.parts[0] != '..'}; "
                                            "assert {t.split('-')[0] for t in tops} == {'bert_ds'}, tops; "
                                            "print(bert_ds.__file__)"],
                             capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=300)
    assert imports.returncode == 0, imports.stderr[-3000:]
    assert Path(imports.stdout.strip()).is_relative_to(venv)  # the installed package, not the checkout
    helped = subprocess.run([python, "-m", "bert_ds.train", "--help"], capture_output=True, text=True,
                            env=run_env, cwd=tmp_path, timeout=300)
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stderr[-3000:]

    size = sum(w.stat().st_size for w in wheels)
    print(f"\nbundle: {len(wheels)} wheels, {size / 2**20:.0f} MiB; bundled in {bundled - started:.0f} s, "
          f"installed in {installed - bundled:.0f} s, checked in {time.monotonic() - installed:.0f} s")

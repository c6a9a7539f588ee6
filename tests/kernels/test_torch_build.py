"""The build checks of ``bert_ds.kernels.compile_check`` beyond nvcc: the binding compiled by the
host compiler as torch's extension builder compiles it, and the plumbing of
``--with-torch`` (its environment, its errors, its CPU-tensor check), with no download.

The binding itself is compiled by ``test_cuda_sources.py`` (one run of the whole check);
here small sources show that the check applies torch's rule and fails on a warning.
``--with-torch`` proper (a 5 GB environment, minutes of compiling) is a command, not a test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bert_ds.base.errors import UserError
from bert_ds.kernels import _build, compile_check

REPO = Path(__file__).resolve().parents[2]

needs_host_compile = pytest.mark.skipif(
    compile_check.find_nvcc() is None or bool(compile_check.host_compile_blocker()),
    reason="no CUDA toolkit or no ninja: the binding's host compile cannot run")


def _compile(tmp_path: Path, text: str) -> compile_check.Result:
    source = tmp_path / "probe.cpp"
    source.write_text(text)
    out = tmp_path / "build"
    out.mkdir()
    return compile_check.compile_bindings(out, source)


@needs_host_compile
def test_the_host_compile_has_torchs_defines_the_toolkits_headers_and_the_builds_flags(tmp_path):
    # Each line fails to compile unless the JIT build's define, header or flag is there.
    result = _compile(tmp_path, f"""
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include "launchers.h"
#define STR_(x) #x
#define STR(x) STR_(x)
static_assert(sizeof(STR(TORCH_EXTENSION_NAME)) == sizeof("{_build.EXTENSION_NAME}"));
static_assert(sizeof(STR(BDS_SOURCE_HASH)) == sizeof("{_build.source_hash()}"));
static_assert(__cplusplus >= 202002L);
int dtype() {{ return BDS_FLOAT32; }}
""")
    assert result.ok, result.output
    assert result.arch == "host c++20"


@needs_host_compile
def test_a_warning_fails_the_host_compile(tmp_path):
    result = _compile(tmp_path, '#include "launchers.h"\nint dtype() { int unused = 0; return BDS_FLOAT32; }\n')
    assert not result.ok
    assert "unused" in result.summary and "error" in result.summary


def _with_torch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bert_ds.kernels.compile_check", "--with-torch", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def test_with_torch_without_a_toolkit_is_a_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = str(Path(sys.executable).parent)  # python, but no nvcc
    env["XDG_CACHE_HOME"] = str(tmp_path)
    proc = _with_torch(env)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --with-torch needs a CUDA toolkit")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing prepared


@pytest.mark.skipif(compile_check.find_nvcc() is None, reason="nvcc not found")
def test_with_torch_when_torch_cannot_be_downloaded_is_a_one_line_error(tmp_path):
    empty_index = tmp_path / "index"
    empty_index.mkdir()
    proc = _with_torch({**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                       "--index-url", empty_index.as_uri())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = proc.stderr.strip()
    assert len(error.splitlines()) == 1
    assert error.startswith(f"error: cannot install torch=={compile_check.installed_torch_release()} from")
    assert "pip.log" in error
    [prepared] = (tmp_path / "cache" / "bert-ds" / "torch-cuda").iterdir()
    assert not (prepared / "ready.json").exists()  # the next run resumes the install


def _fake_env(directory: Path, script: str) -> None:
    python = directory / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n" + script)
    python.chmod(0o755)


def test_a_prepared_environment_is_reused_without_running_anything(tmp_path):
    _fake_env(tmp_path, "exit 1\n")  # any pip or probe run would fail
    (tmp_path / "ready.json").write_text(json.dumps({"torch": "2.13.0+cu130", "cuda": "13.0"}))
    env, reused = compile_check.prepare_torch_env(tmp_path, "2.13.0", "13.0", "file:///nowhere")
    assert reused and env.torch == "2.13.0+cu130" and env.cuda == "13.0"


def _pip_succeeds_and_torch_reports(version: str, cuda: str | None) -> str:
    report = json.dumps([version, cuda])
    return f'case "$1" in -m) exit 0 ;; -c) echo \'{report}\' ;; esac\n'


def test_an_environment_is_ready_once_its_torch_is_a_cuda_build(tmp_path):
    _fake_env(tmp_path, _pip_succeeds_and_torch_reports("2.13.0+cu130", "13.0"))
    env, reused = compile_check.prepare_torch_env(tmp_path, "2.13.0", "13.0", "file:///nowhere")
    assert not reused and env.torch == "2.13.0+cu130"
    assert json.loads((tmp_path / "ready.json").read_text()) == {"torch": "2.13.0+cu130", "cuda": "13.0"}


@pytest.mark.parametrize(("torch_version", "cuda", "says"), [
    ("2.13.0+cpu", None, "none (CPU only)"),
    ("2.13.0+cu128", "12.8", "CUDA 12.8"),
])
def test_a_torch_the_toolkit_cannot_build_for_is_refused(tmp_path, torch_version, cuda, says):
    _fake_env(tmp_path, _pip_succeeds_and_torch_reports(torch_version, cuda))
    with pytest.raises(UserError, match="the toolkit is CUDA 13.0") as error:
        compile_check.prepare_torch_env(tmp_path, "2.13.0", "13.0", "file:///nowhere")
    assert says in str(error.value)
    assert not (tmp_path / "ready.json").exists()


@pytest.mark.skipif(compile_check.find_nvcc() is None, reason="nvcc not found")
def test_the_toolkit_is_found_through_a_wrapper_script_on_path(tmp_path, monkeypatch):
    real = compile_check.find_nvcc()
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    root = compile_check.toolkit_root()
    assert root != tmp_path  # not the wrapper's grandparent directory
    assert (root / "include" / "cuda_runtime_api.h").is_file()
    release, tag = compile_check.toolkit_version(root)
    assert tag == "cu" + release.replace(".", "")


def _fake_extension(**ops) -> ModuleType:
    module = ModuleType("fake_extension")
    module.source_hash = "0123456789abcdef"
    for name, op in ops.items():
        setattr(module, name, op)
    return module


def _refuses(name: str):
    def op(*args):
        raise RuntimeError(f"{name} must be a CUDA tensor, got one on cpu")
    return op


def test_the_cpu_tensor_check_passes_one_line_refusals_of_every_op():
    module = _fake_extension(**{name: _refuses("x") for name in compile_check._cpu_calls()})
    assert compile_check.cpu_refusal_problems(module) == ([], "x must be a CUDA tensor, got one on cpu")


def test_the_cpu_tensor_check_catches_acceptance_long_errors_and_unknown_ops():
    ops = {name: _refuses("x") for name in compile_check._cpu_calls()}
    ops["bias_gelu_fwd"] = lambda *args: None

    def long_error(*args):
        raise RuntimeError("x must be a CUDA tensor, got one on cpu\nException raised from check_cuda at ...")

    ops["layer_norm_fwd"] = long_error
    ops["new_op"] = _refuses("x")
    problems, _ = compile_check.cpu_refusal_problems(_fake_extension(**ops))
    assert problems[0] == "new_op: no CPU call written for it"
    assert "bias_gelu_fwd: accepted CPU tensors" in problems
    assert any(problem.startswith("layer_norm_fwd: refused with") for problem in problems)
    assert len(problems) == 3


def test_a_failure_is_summed_up_by_the_first_diagnostic_not_a_path_that_names_one():
    output = ("ninja: Entering directory `/tmp/test_a_warning_fails/build'\n"
              "/tmp/test_a_warning_fails/probe.cpp:2:18: error: unused variable 'unused' [-Werror=unused-variable]\n"
              "cc1plus: all warnings being treated as errors\n")
    assert compile_check._first_problem(output, "failed").startswith("/tmp/test_a_warning_fails/probe.cpp:2:18: error")
    nvcc = 'layer_norm.cu(40): warning #177-D: variable "x" was declared but never referenced\n'
    assert compile_check._first_problem(nvcc, "failed") == nvcc.strip()
    assert compile_check._first_problem("", "nvcc failed") == "nvcc failed"

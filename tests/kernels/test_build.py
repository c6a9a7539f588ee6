"""The extension loader's logic, with the GPU and the compiler faked (CPU-only)."""

import json
import logging
import subprocess
import sys

import pytest
import torch

from bert_ds.kernels import _build, choice


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A loader that believes it runs on a CUDA torch with a device, its caches cleared and
    its cache directory under tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    for cached in (_build.load_extension, choice.op_verdicts, _build.source_hash):
        cached.cache_clear()
    sys.modules.pop(_build.EXTENSION_NAME, None)
    yield tmp_path
    sys.modules.pop(_build.EXTENSION_NAME, None)  # a fake module must not outlive its test
    for cached in (_build.load_extension, choice.op_verdicts, _build.source_hash):
        cached.cache_clear()


def _install_fake_module(monkeypatch, tmp_path, source_hash: str) -> None:
    (tmp_path / f"{_build.EXTENSION_NAME}.py").write_text(f"source_hash = {source_hash!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_prebuilt_module_from_these_sources_is_used(fresh_loader, monkeypatch):
    _install_fake_module(monkeypatch, fresh_loader, _build.source_hash())
    module, reason = _build.load_extension()
    assert module is not None and reason == "" and module.source_hash == _build.source_hash()


def test_a_prebuilt_module_from_other_sources_is_ignored(fresh_loader, monkeypatch, caplog):
    _install_fake_module(monkeypatch, fresh_loader, "0123456789abcdef")
    monkeypatch.setattr(_build, "_jit_build", lambda: (None, "the build failed: stub"))
    with caplog.at_level(logging.WARNING, logger="bert_ds.kernels._build"):
        assert _build.load_extension() == (None, "the build failed: stub")
    assert "built from other sources" in caplog.text


def test_no_nvcc_is_a_reason(fresh_loader, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    module, reason = _build.load_extension()
    assert module is None and "nvcc not found" in reason


def test_the_source_hash_covers_torch_and_the_sources(monkeypatch):
    _build.source_hash.cache_clear()
    first = _build.source_hash()
    _build.source_hash.cache_clear()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    try:
        assert _build.source_hash() != first
    finally:
        _build.source_hash.cache_clear()


def test_the_first_error_line_is_reported():
    text = ("Error building extension 'bert_ds_kernels': [1/4] nvcc ...\n"
            "FAILED: attention.cuda.o\n"
            "/x/attention.cu(12): error: identifier \"foo\" is undefined\n"
            "1 error detected\n")
    assert _build._first_error_line(text) == '/x/attention.cu(12): error: identifier "foo" is undefined'


def test_verdicts_are_recorded_once_per_build_and_device(fresh_loader, monkeypatch):
    from bert_ds.kernels import selfcheck

    _install_fake_module(monkeypatch, fresh_loader, _build.source_hash())
    runs = []
    monkeypatch.setattr(selfcheck, "run_all", lambda: runs.append(1) or {"layer_norm": "", "bias_gelu": "bad"})
    assert choice.op_verdicts() == {"layer_norm": "", "bias_gelu": "bad"}
    recorded = json.loads(_build.verdict_path().read_text())
    assert recorded["key"] == {"source_hash": _build.source_hash(), "device": "Fake H100",
                               "torch": torch.__version__, "cuda": "13.0"}
    assert recorded["selfcheck"] == {"layer_norm": "", "bias_gelu": "bad"}
    assert _build.verdict_path().name == "verdicts-fake-h100.json"

    choice.op_verdicts.cache_clear()  # a new process: reads the record, does not check again
    assert choice.op_verdicts() == {"layer_norm": "", "bias_gelu": "bad"}
    assert len(runs) == 1


def test_no_verdicts_without_an_extension(monkeypatch):
    monkeypatch.setattr(choice, "load_extension", lambda: (None, "no CUDA device"))
    choice.op_verdicts.cache_clear()
    try:
        assert choice.op_verdicts() == {}
    finally:
        choice.op_verdicts.cache_clear()


def test_the_selfcheck_rule_passes_the_reference_and_catches_a_wrong_kernel():
    from bert_ds.kernels import selfcheck
    from bert_ds.kernels.bias_gelu import bias_gelu_ref

    generator = torch.Generator().manual_seed(0)
    leaves = {"x": torch.randn(8, 33, generator=generator).bfloat16(),
              "bias": torch.randn(33, generator=generator).bfloat16()}
    grad = torch.randn(8, 33, generator=generator).bfloat16()

    def reference(x, bias):
        return bias_gelu_ref(x, bias, "none")

    def wrong(x, bias):
        return bias_gelu_ref(x, bias, "none") * 1.05

    assert selfcheck.compare("case", reference, reference, leaves, grad, torch.bfloat16) == []
    problems = selfcheck.compare("case", wrong, reference, leaves, grad, torch.bfloat16)
    assert problems and problems[0].startswith("case out: error")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the checks would run")
def test_a_check_that_raises_is_a_failed_verdict():
    from bert_ds.kernels import dispatch, selfcheck

    verdicts = selfcheck.run_all()
    assert set(verdicts) == set(dispatch.OPS)  # every op's fused kernel is checked
    assert all(v.startswith("raised ") for v in verdicts.values())


def test_an_unwritable_cache_still_gives_verdicts(fresh_loader, monkeypatch, caplog):
    from bert_ds.kernels import selfcheck

    _install_fake_module(monkeypatch, fresh_loader, _build.source_hash())
    blocker = fresh_loader / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # every path under it fails to be created
    monkeypatch.setattr(selfcheck, "run_all", lambda: {"layer_norm": ""})
    with caplog.at_level(logging.WARNING, logger="bert_ds.kernels._build"):
        assert choice.op_verdicts() == {"layer_norm": ""}
    assert "cannot record verdicts" in caplog.text


def test_the_build_command_prints_the_self_check_and_the_speed_verdicts(fresh_loader, monkeypatch, capsys):
    from bert_ds.kernels import build, selfcheck
    from bert_ds.kernels.speed import Choice

    _install_fake_module(monkeypatch, fresh_loader, _build.source_hash())
    monkeypatch.setattr(selfcheck, "run_all", lambda: {"layer_norm": "", "bias_gelu": "", "varlen_attention": ""})
    raced = {
        "layer_norm": Choice("fused", {"native": 0.052, "fused": 0.031}, {"native": 0.05, "fused": 0.022},
                             {"apex": "apex is not installed"}),
        "bias_gelu": Choice("native", {"native": 0.04, "fused": 0.05}, {"native": 0.04, "fused": 0.03}, {}),
    }
    monkeypatch.setattr(choice, "op_choices", lambda shapes=None: raced)  # as if this process had raced
    assert build.main([]) == 0
    out = capsys.readouterr().out
    assert "self-check on Fake H100:\n  bias_gelu          ok\n" in out
    assert ("  layer_norm         runs fused (1.68x faster than native; wall (device) per call: native 0.052 ms "
            "(0.050), fused 0.031 ms (0.022)); apex not a candidate: apex is not installed\n") in out
    assert ("  bias_gelu          runs native (1.25x faster than fused; wall (device) per call: native 0.040 ms "
            "(0.040), fused 0.050 ms (0.030))\n") in out


# --------------------------------------------------------------------------- the host compiler

def _wrapper(tmp_path, name: str, flags: str) -> str:
    """A compiler that runs g++ with extra flags, as an image's own toolchain might."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\nexec g++ {flags} "$@"\n')
    path.chmod(0o755)
    return str(path)


needs_gxx = pytest.mark.skipif(not (_build.shutil.which("g++") and _build.shutil.which("readelf")),
                               reason="needs g++ and readelf (binutils)")


@needs_gxx
def test_a_compiler_that_links_libstdcxx_statically_is_replaced(tmp_path, monkeypatch):
    # The H100 image's CXX linked a second libstdc++ into the extension, and its error
    # messages crashed the process (benchmarks/results/H100-2026-11-24/SUMMARY.md).
    static = _wrapper(tmp_path, "static-g++", "-static-libstdc++")
    assert _build._links_libstdcxx_dynamically(static) is False
    monkeypatch.setenv("CXX", static)
    compiler, note = _build.host_compiler()
    assert compiler is not None and compiler != static and _build._links_libstdcxx_dynamically(compiler)
    assert "links libstdc++ statically" in note and compiler in note


@needs_gxx
def test_a_compiler_that_links_libstdcxx_dynamically_is_kept(tmp_path, monkeypatch):
    dynamic = _wrapper(tmp_path, "plain-g++", "")
    monkeypatch.setenv("CXX", dynamic)
    assert _build.host_compiler() == (dynamic, "")


@needs_gxx
def test_no_dynamic_compiler_means_no_build_and_a_reason(tmp_path, monkeypatch):
    static = _wrapper(tmp_path, "static-g++", "-static-libstdc++")
    monkeypatch.setenv("CXX", static)
    monkeypatch.setattr(_build, "_links_libstdcxx_dynamically", lambda compiler: compiler == "never")
    compiler, reason = _build.host_compiler()
    assert compiler is None and "set CXX to a compiler that links it dynamically" in reason


def test_a_compiler_that_cannot_be_run_leaves_torchs_choice(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert _build.host_compiler() == ("/nonexistent/c++", "")


# --------------------------------------------------------------------------- the build's lock


@pytest.fixture
def fake_build(fresh_loader, monkeypatch):
    """build_into with torch's load faked (it records its calls) and a compiler that always fits."""
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(_build, "host_compiler", lambda: ("c++", ""))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or sys.modules[__name__])
    directory = _build.build_dir()
    directory.mkdir(parents=True)
    return directory, calls


def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_runs(fake_build, capfd):
    directory, calls = fake_build
    (directory / "lock").touch()  # no process holds it: a build killed with kill -9
    module, reason = _build.build_into(directory)
    assert module is not None and reason == "" and len(calls) == 1
    assert not (directory / "lock").exists()
    err = capfd.readouterr().err
    assert f"removed a stale build lock {directory / 'lock'}" in err
    assert "building the fused CUDA kernels into" in err and "kernels: built in" in err


def test_a_lock_held_past_the_bound_ends_the_build_with_a_reason(fake_build, monkeypatch):
    directory, calls = fake_build
    lock = directory / "lock"
    holder = subprocess.Popen([sys.executable, "-c", f"import time; f = open({str(lock)!r}, 'w'); "
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("BERT_DS_BUILD_LOCK_TIMEOUT", "1")
        module, reason = _build.build_into(directory)
    finally:
        holder.kill()
        holder.wait()
    assert module is None and not calls
    assert reason.startswith(f"the fused kernels' build lock {lock} is still held by pid {holder.pid} ")

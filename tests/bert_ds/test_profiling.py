"""bert_ds.train.profiling: --profile-steps' range, and the profiler over a run's steps."""

import json

import pytest
import torch

from bert_ds.base.errors import ConfigError
from tests.conftest import REPO
from bert_ds.train.profiling import (
    OUTSIDE, StepProfiler, StepRange, bucket_lines, bucket_of, buckets, busy_us, overlap_us, stage, stage_split,
)

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)


@pytest.mark.parametrize("text,expected", [("11-13", (11, 13)), ("7", (7, 7)), (" 2 - 4 ", (2, 4))])
def test_a_step_range_parses(text, expected):
    steps = StepRange.parse(text)
    assert (steps.first, steps.last) == expected and str(steps) == f"{expected[0]}-{expected[1]}"


@pytest.mark.parametrize("text", ["", "a-b", "0-3", "5-2", "1-2-3", "-3"])
def test_a_bad_step_range_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--profile-steps"):
        StepRange.parse(text)


def test_busy_time_is_the_union_of_intervals():
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_us([]) == 0


def test_each_stage_is_charged_the_gpu_idle_time_inside_it():
    # forward runs twice; the GPU's kernels overlap each other and the stages' edges
    stages = [("forward", 0, 100), ("backward", 100, 300), ("forward", 300, 400)]
    kernels = [(50, 150), (120, 180), (350, 500)]  # union: [50, 180) and [350, 500): 280 us busy
    rows = {r["stage"]: r for r in stage_split(stages, kernels, steps=2, wall_us=600)}
    us_per_step = {name: tuple(round(r[key] * 2e3, 6) for key in
                               ("host_ms_per_step", "gpu_busy_ms_per_step", "gpu_idle_ms_per_step"))
                   for name, r in rows.items()}
    assert us_per_step == {"forward": (200, 100, 100), "backward": (200, 80, 120), OUTSIDE: (200, 100, 100)}
    assert list(rows)[0] == "backward"  # the most GPU idle time first
    # without GPU kernels (a CPU run) there is host time only
    cpu = stage_split(stages, [], steps=1, wall_us=400)
    assert [r["gpu_idle_ms_per_step"] for r in cpu] == [None, None, None]
    assert stage_split([], kernels, steps=1, wall_us=600) == []


@pytest.mark.parametrize("start,stop,expected", [(0, 10, 0), (0, 60, 10), (55, 58, 3), (60, 130, 50),
                                                  (0, 1000, 110), (200, 300, 0)])
def test_overlap_with_a_union_of_intervals(start, stop, expected):
    assert overlap_us(start, stop, [(50, 100), (120, 150), (170, 200)]) == expected


def _work(n: int = 64) -> None:
    with stage("forward"):
        x = torch.randn(n, n)
        (x @ x).relu_().sum()


def _run(profiler: StepProfiler, steps: range) -> list:
    written = []
    for step in steps:
        profiler.before(step)
        _work()
        written.append(profiler.after(step))
    return written


def test_the_range_is_profiled_once_and_written_on_its_last_step(tmp_path):
    profiler = StepProfiler(StepRange(2, 3), tmp_path, torch.device("cpu"), rank=0)
    written = _run(profiler, range(1, 6))
    assert written == [None, None, tmp_path / "profile" / "rank0.md", None, None]
    assert profiler.close() is None
    record = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert record["steps"] == "2-3" and record["summary"]["steps"] == 2
    # a stage's range is no caller: the ops inside it are the top-level host ops
    assert any(op["name"] == "aten::matmul" for op in record["summary"]["top_host_ops"])
    assert not any(op["name"].startswith("step.") for op in record["summary"]["top_host_ops"])
    forward = next(r for r in record["summary"]["stages"] if r["stage"] == "forward")
    assert forward["host_ms_per_step"] > 0 and forward["gpu_idle_ms_per_step"] is None
    markdown = written[2].read_text()
    assert "## Training steps 2-3 profiled: rank 0, cpu" in markdown and "| forward | " in markdown
    assert (tmp_path / "profile" / "rank0.trace.json.gz").stat().st_size > 0


def test_a_run_that_ends_inside_the_range_writes_the_steps_it_ran(tmp_path):
    profiler = StepProfiler(StepRange(2, 9), tmp_path, torch.device("cpu"), rank=1)
    assert _run(profiler, range(1, 4)) == [None, None, None]
    assert profiler.close() == tmp_path / "profile" / "rank1.md"
    assert json.loads((tmp_path / "profile" / "rank1.json").read_text())["steps"] == "2-3"


def test_a_resumed_run_past_the_range_or_a_failed_one_writes_nothing(tmp_path):
    late = StepProfiler(StepRange(2, 3), tmp_path, torch.device("cpu"), rank=0)
    assert _run(late, range(4, 6)) == [None, None] and late.close() is None
    failed = StepProfiler(StepRange(1, 3), tmp_path, torch.device("cpu"), rank=0)
    failed.before(1)
    failed.discard()
    assert failed.close() is None
    assert not (tmp_path / "profile").exists()


# Kernel names from the H200 profile of a BERT-Base step (benchmarks/results/H200-2026-11-26), by hand.
KERNELS = {
    "nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_bias_TNT": "GEMM",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn": "GEMM",
    "void bds::(anonymous namespace)::attention_bwd_kernel<__nv_bfloat16, 64>(__nv_bfloat16 const*)": "attention",
    "void bds::(anonymous namespace)::attention_dsum_kernel<__nv_bfloat16, 64>(__nv_bfloat16 const*)": "attention",
    "void bds::(anonymous namespace)::convert_kernel<__nv_bfloat16>(float const*, __nv_bfloat16*, long)": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>()": "attention",
    "void bds::(anonymous namespace)::ln_bwd_registers<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 768>()": "normalization",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>()": "normalization",
    "void bds::(anonymous namespace)::bias_gelu_bwd_kernel<__nv_bfloat16, __nv_bfloat16, 8, false>()": "elementwise",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>()": "elementwise",
    "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float>()": "elementwise",
    "void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::masked_scale_kernel"
    "<bool, c10::BFloat16, float>(at::Tensor&, at::Tensor const&)::{lambda(c10::BFloat16, bool)#1}>()": "elementwise",
    "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t"
    "<c10::BFloat16, at::native::sum_functor<c10::BFloat16, float>::operator()::{lambda(float, float)#1}>>>()":
        "reductions",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>()": "reductions",
    "Memcpy DtoD (Device -> Device)": "copies",
    "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda()>()": "copies",
    "void bds::(anonymous namespace)::lamb_update_kernel<4>(float*, float const*)": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<1>>()": "optimizer",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)": "communication",
    "some_kernel_nobody_knows": "other",
}


@pytest.mark.parametrize("name, bucket", KERNELS.items())
def test_each_kernel_falls_in_its_bucket(name, bucket):
    assert bucket_of(name) == bucket


def test_buckets_add_kernel_time_per_step_and_the_idle_time():
    rows = {r["bucket"]: r for r in buckets({"nvjet_gemm": 3000.0, "ampere_gemm": 1000.0, "Memcpy DtoD": 500.0},
                                            idle_us=500.0, steps=2, wall_us=5000.0)}
    assert rows["GEMM"]["ms_per_step"] == pytest.approx(2.0) and rows["GEMM"]["share_of_wall"] == pytest.approx(0.8)
    assert rows["copies"]["ms_per_step"] == pytest.approx(0.25) and rows["idle"]["ms_per_step"] == pytest.approx(0.25)
    assert rows["attention"]["ms_per_step"] == 0.0 and list(rows)[-2:] == ["other", "idle"]
    table = bucket_lines({"seq 128": {"buckets": list(rows.values())}})
    assert table[0] == "| bucket | seq 128 ms/step | seq 128 share |"
    assert "| GEMM | 2.00 | 80.0% |" in table and not any(line.startswith("| attention") for line in table)


# --------------------------------------------------------------------------- host syncs by line

def _synchronizing_call():
    import warnings

    from bert_ds.train.sync_debug import MESSAGE
    warnings.warn(MESSAGE, UserWarning, stacklevel=1)  # as torch raises it, from the line that waited


def test_each_sync_is_counted_by_its_line_and_other_warnings_pass_through():
    import inspect
    import warnings

    from bert_ds.train.sync_debug import SyncRecorder

    modes, passed = [], []
    before = warnings.showwarning
    warnings.showwarning = lambda message, *rest, **kw: passed.append(str(message))
    try:
        recorder = SyncRecorder(set_mode=modes.append)
        recorder.start()
        for _ in range(3):  # the same line every time: each call counts, not once per line
            _synchronizing_call()
        warnings.warn("something else", UserWarning, stacklevel=1)
        recorder.stop()
        _synchronizing_call()  # after stop(): not counted
        assert warnings.showwarning is not recorder._show
    finally:
        warnings.showwarning = before
    line = inspect.getsourcelines(_synchronizing_call)[1] + 4
    assert recorder.report(steps=3) == [
        {"where": f"tests/bert_ds/test_profiling.py:{line} _synchronizing_call", "via": "", "per_step": 1.0}]
    assert modes == ["warn", "default"] and "something else" in passed


def test_a_sync_inside_a_library_names_the_line_of_ours_that_reached_it():
    import traceback

    from bert_ds.train.sync_debug import caller

    site = "/venv/lib/python3.12/site-packages/"
    repo = str(REPO) + "/"
    stack = [traceback.FrameSummary(repo + "bert_ds/train/step.py", 180, "__call__"),
             traceback.FrameSummary(site + "deepspeed/runtime/bf16_optimizer.py", 402, "step"),
             traceback.FrameSummary(site + "torch/_tensor.py", 1100, "__bool__")]
    assert caller(stack) == ("deepspeed/runtime/bf16_optimizer.py:402 step", "bert_ds/train/step.py:180 __call__")
    assert caller(stack[:1]) == ("bert_ds/train/step.py:180 __call__", "")
    assert caller(stack[2:]) == ("(inside torch)", "")


def test_the_profile_lists_the_host_syncs_by_line():
    from bert_ds.train.profiling import summary_lines

    s = {"wall_ms_per_step": 10.0, "device_busy_ms_per_step": 8.0, "idle_ms_per_step": 2.0,
         "kernel_launches_per_step": 100, "blocking_calls_per_step": {}, "annotated_ranges": [], "top_kernels": [],
         "top_host_ops": [], "host_syncs": [{"where": "deepspeed/x.py:3 f", "via": "bert_ds/train/step.py:9 g",
                                              "per_step": 2.0}]}
    assert "| `deepspeed/x.py:3 f` | `bert_ds/train/step.py:9 g` | 2 |" in summary_lines(s)

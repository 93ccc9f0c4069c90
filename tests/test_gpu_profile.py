"""benchmarks/profile_ops.py and gpu_profile.py: a trace's ops attributed to the compiled step's HLO
and featherweight's scopes, on synthetic planes and HLO (the GPU's layout, which no CPU trace
has), and the whole profile end to end with --tiny on CPU."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import profile_ops  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))

HLO = """HloModule jit_step, is_scheduled=true

%fused_dot (p0: bf16[8,16], p1: bf16[16,32]) -> bf16[8,32] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/mlp/dot_general"}
}

%fused_dequant (p0: u8[64]) -> bf16[128] {
  %p0 = u8[64]{0} parameter(0)
  %c = bf16[128]{0} convert(%p0), metadata={op_name="jit(step)/while/body/mlp/jit(dequantize_nf4)/nf4_dequantize/convert"}
  ROOT %m = bf16[128]{0} multiply(%c, %c), metadata={op_name="jit(step)/while/body/mlp/jit(dequantize_nf4)/nf4_dequantize/mul"}
}

%fused_slice (p0: bf16[4,128], p1: s32[]) -> bf16[128] {
  %p0 = bf16[4,128]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,128]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,128}
  ROOT %b = bf16[128]{0} bitcast(%ds)
}

ENTRY %main (a: bf16[8,16], w: bf16[16,32], q: u8[64], s: bf16[4,128], i: s32[]) -> bf16[8,32] {
  %a = bf16[8,16]{1,0} parameter(0)
  %w = bf16[16,32]{1,0} parameter(1)
  %q = u8[64]{0} parameter(2)
  %s = bf16[4,128]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %gemm_fusion.3 = bf16[8,32]{1,0} fusion(%a, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/while/body/mlp/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %custom-call.7 = (bf16[8,32]{1,0}, u8[0]{0}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/while/body/transpose(jvp(mlp))/lora/dot_general"}
  %loop_fusion.2 = bf16[128]{0} fusion(%q), kind=kLoop, calls=%fused_dequant, metadata={op_name="jit(step)/while/body/mlp/jit(dequantize_nf4)/nf4_dequantize/mul"}
  %fmha = (bf16[2,8,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/while/body/attention/dot_product_attention"}
  %slice_fusion = bf16[128]{0} fusion(%s, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/while/body/mlp/dynamic_slice"}
  %norm = bf16[8,16]{1,0} multiply(%a, %a), metadata={op_name="jit(step)/while/body/transpose(jvp(rms_norm))/mul"}
  %copy-start.1 = (bf16[4,128]{1,0:S(5)}, bf16[4,128]{1,0}, u32[]) copy-start(%s)
  ROOT %add.9 = bf16[8,32]{1,0} add(%gemm_fusion.3, %gemm_fusion.3), metadata={op_name="jit(step)/loss_chunk/add"}
}
"""


def _event(name, start, duration, **stats):
    return SimpleNamespace(name=name, start_ns=start, duration_ns=duration, stats=stats.items())


def _plane(name, lines):
    return SimpleNamespace(
        name=name, lines=[SimpleNamespace(name=n, events=events) for n, events in lines.items()]
    )


def test_innermost_scope_reads_op_name_components_through_transformations():
    assert profile_ops.innermost_scope("jit(step)/while/body/mlp/lora/dot_general") == "lora"
    assert profile_ops.innermost_scope("jit(step)/transpose(jvp(rms_norm))/mul") == "rms_norm"
    assert profile_ops.innermost_scope("loss_chunk/mul") == "loss_chunk"
    assert profile_ops.innermost_scope("jit(step)/jit(rms_norm_fn)/mul") == ""  # not a component
    assert profile_ops.innermost_scope("jit(step)/apply_rotary/mul") == ""


def test_each_instruction_is_read_with_its_kind_target_scope_and_category():
    hlo = profile_ops.parse_hlo(HLO)
    assert profile_ops.module_name(HLO) == "jit_step"
    gemm, lora, dequant = hlo["gemm_fusion.3"], hlo["custom-call.7"], hlo["loop_fusion.2"]
    assert (gemm.opcode, gemm.fusion_kind, gemm.target, gemm.matmul) == (
        "fusion", "kCustom", "__triton_gemm", True
    )  # fmt: skip
    assert (lora.target, lora.matmul, lora.scope) == ("__cublas$lt$matmul", True, "lora")
    assert (dequant.scope, dequant.matmul, dequant.root) == ("nf4_dequantize", False, "multiply")
    categories = {
        name: profile_ops.category(hlo[name]) for name in hlo if hlo[name].computation == "main"
    }
    assert categories == {
        "a": "other", "w": "other", "q": "other", "s": "other", "i": "other",
        "gemm_fusion.3": "GEMMs",
        "custom-call.7": "lora",  # the adapters' matmuls are featherweight's own small kernels
        "loop_fusion.2": "nf4_dequantize",
        "fmha": "attention kernels",
        "slice_fusion": profile_ops.CATEGORIES[8],  # a fusion that only moves data
        "norm": "rms_norm/rotary",
        "copy-start.1": "host transfers",  # S(5): host memory
        "add.9": "loss_chunk",
    }  # fmt: skip
    assert profile_ops.category(None, "MemcpyH2D") == "host transfers"
    assert profile_ops.category(None, "some_kernel") == "not in the step's HLO"


def test_gpu_xla_ops_line_is_read_per_op_and_summed_per_step():
    hlo = profile_ops.parse_hlo(HLO)
    ops = [  # two steps; times in ns
        _event("gemm_fusion.3", 0, 600), _event("loop_fusion.2", 600, 100),
        _event("custom-call.7", 700, 50), _event("fmha", 800, 200),
        _event("gemm_fusion.3", 2000, 600), _event("loop_fusion.2", 2600, 100),
        _event("custom-call.7", 2700, 50), _event("fmha", 2800, 200),
        _event("fusion.1", 3000, 40, hlo_module="jit_other"),  # another program: left out
    ]  # fmt: skip
    planes = [
        _plane("/host:CPU", {"python": [_event("gemm_fusion.3", 0, 10**6)]}),
        _plane("/device:GPU:0", {"XLA Modules": [_event("jit_step", 0, 3000)], "XLA Ops": ops}),
    ]
    events, where = profile_ops.step_events(planes, hlo, "jit_step")
    assert where == "/device:GPU:0 XLA Ops"
    summary = profile_ops.summarize(events, hlo, steps=2, step_s=1e-6, top=3)
    assert summary["busy_s_per_step"] == pytest.approx(950e-9)
    assert [row["op"] for row in summary["top_ops"]] == ["gemm_fusion.3", "fmha", "loop_fusion.2"]
    top = summary["top_ops"][0]
    assert (top["seconds_per_step"], top["share_of_step"], top["runs_per_step"]) == (
        pytest.approx(600e-9), pytest.approx(0.6), 1
    )  # fmt: skip
    assert summary["by_category"]["GEMMs"] == pytest.approx(600e-9)
    assert summary["by_category"]["lora"] == pytest.approx(50e-9)
    assert summary["by_scope"]["mlp"] == pytest.approx(600e-9)


def test_gpu_stream_kernels_map_by_their_hlo_op_stat_and_memcpys_are_host_transfers():
    hlo = profile_ops.parse_hlo(HLO)
    stream = [
        _event("sm90_xmma_gemm_bf16", 0, 300, hlo_op="custom-call.7", hlo_module="jit_step"),
        _event("cublasLt_splitk_reduce", 300, 20, hlo_op="custom-call.7", hlo_module="jit_step"),
        _event("MemcpyH2D", 100, 400),  # on another stream, overlapping
        _event("triton_kernel", 600, 5, hlo_op="fusion.999", hlo_module="jit_step"),
    ]
    planes = [
        _plane("/device:GPU:0", {"Stream #13(Compute)": stream[:2], "Stream #14": stream[2:]})
    ]
    events, where = profile_ops.step_events(planes, hlo, "jit_step")
    assert "Stream #13(Compute)" in where and "Stream #14" in where
    summary = profile_ops.summarize(events, hlo, steps=1, step_s=1e-6)
    assert summary["by_category"]["lora"] == pytest.approx(320e-9)  # both kernels of one op
    assert summary["by_category"]["host transfers"] == pytest.approx(400e-9)
    assert summary["by_category"]["not in the step's HLO"] == pytest.approx(5e-9)
    assert summary["busy_s_per_step"] == pytest.approx(505e-9)  # overlap counted once


def test_cpu_thunks_nested_in_a_loop_count_their_self_time_once():
    hlo = profile_ops.parse_hlo(HLO.replace("%norm = ", "%while.1 = ").replace("rms_norm", "x"))
    line = [
        _event("while.1", 0, 1000),  # holds the two below
        _event("gemm_fusion.3", 100, 300),
        _event("end: gemm_fusion.3", 400, 0),
        _event("loop_fusion.2", 500, 200),
        _event("ThunkExecutor::Execute", 0, 1000),
    ]
    events, where = profile_ops.step_events([_plane("/host:CPU", {"tf_XLA/1": line})], hlo, "")
    assert "XLA:CPU" in where
    self_ns = {event.op: event.self_ns for event in events}
    assert self_ns == {"while.1": 500, "gemm_fusion.3": 300, "loop_fusion.2": 200}
    assert profile_ops.busy_ns(events) == 1000


SCRIPT = REPO / "benchmarks" / "gpu_profile.py"


def test_tiny_profile_runs_end_to_end_on_cpu_and_reanalyzes_from_its_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--steps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    profile = json.loads((out / "profile.json").read_text())
    assert profile["platform"] == "cpu" and len(profile["step_s"]) == 2
    assert "XLA:CPU" in profile["events_from"]
    categories = profile["by_category"]
    for name in ("GEMMs", "nf4_dequantize", "lora", "attention kernels", "rms_norm/rotary"):
        assert categories[name] > 0, name  # the tiny QLoRA step's own work is found and named
    assert categories["not in the step's HLO"] == 0
    assert len(profile["top_ops"]) == 25
    assert profile["top_ops"][0]["seconds_per_step"] >= profile["top_ops"][-1]["seconds_per_step"]
    markdown = (out / "profile.md").read_text()
    assert "measured on cpu (cpu), jax " in markdown and "no measure of a GPU" in markdown
    (out / "profile.json").unlink()
    again = [sys.executable, str(SCRIPT), "--out", str(out), "--analyze"]
    result = subprocess.run(again, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "profile.json").read_text())["by_category"] == categories


@pytest.mark.slow  # the tiny profile and two tiny flag processes: about 30 s
def test_the_gpu_call_wrapper_leaves_two_tables_and_two_archives(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    env["FLAGS_ARGS"] = "--tiny --steps 1 --rounds 1"
    env["GPU_CHECK_WHEELS"] = str(tmp_path / "no-wheels")
    command = [str(REPO / "benchmarks" / "gpu_profile.sh"), "--tiny", "--steps", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "flags.md", "profile.md", "results.tar.gz", "trace.tar.gz"
    ]  # fmt: skip
    with tarfile.open(out / "results.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"profile/profile.json", "flags/flags.json", "flags/flags.jsonl"} <= names
    with tarfile.open(out / "trace.tar.gz") as archive:
        names = archive.getnames()
    assert "profile/step_hlo.txt" in names and any(n.endswith(".xplane.pb") for n in names)


def test_raw_gpu_kernels_map_through_their_annotation_where_no_hlo_op_stat_exists():
    # the profiler adds `hlo_op` / `hlo_module` when it post-processes; a raw trace's kernels
    # may carry only XLA's annotations
    hlo = profile_ops.parse_hlo(HLO)
    stream = [
        _event(
            "sm90_gemm", 0, 300, kernel_annotation="XlaModule:#hlo_module=jit_step#::custom-call.7"
        ),
        _event("loop_fusion", 300, 50, annotation="loop_fusion.2:#scope=x#"),
        _event("other_kernel", 400, 9, annotation="XlaModule:#hlo_module=jit_other#::fmha"),
        _event("unknown_kernel", 500, 7),
    ]
    planes = [_plane("/device:GPU:0", {"Stream #7": stream})]
    events, _ = profile_ops.step_events(planes, hlo, "jit_step")
    assert [(e.op, e.duration_ns) for e in events] == [
        ("custom-call.7", 300), ("loop_fusion.2", 50), ("?unknown_kernel", 7)
    ]  # fmt: skip
    layout = profile_ops.trace_layout(planes)
    assert layout == [{"plane": "/device:GPU:0", "line": "Stream #7", "events": 4,
                       "names": ["sm90_gemm", "loop_fusion", "other_kernel"],
                       "stats": ["annotation", "kernel_annotation"]}]  # fmt: skip


def test_a_module_spelled_otherwise_by_the_profiler_keeps_every_event_and_says_so():
    hlo = profile_ops.parse_hlo(HLO)
    ops = [_event(op, 0, 600, hlo_module="jit_step.123") for op in ("gemm_fusion.3", "fmha")]
    planes = [_plane("/device:GPU:0", {"XLA Ops": ops})]
    events, where = profile_ops.step_events(planes, hlo, "jit_step")
    assert [event.op for event in events] == ["gemm_fusion.3", "fmha"]
    assert where == "/device:GPU:0 XLA Ops (no event of module 'jit_step': every module's)"

# The whole-model benchmarks' own machinery, on the CPU: a copy that shares
# weights, cache snapshots, and short runs end to end (the expert-parallel one
# as two ranks on the loopback). The figures they report are only as good as
# these.

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="the whole-model benchmark runs mlx-lm models")
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import switch_layers  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import benchmarks  # noqa: E402
from benchmarks import load_patterns, model as bench  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks.workloads import LAYER_SHAPES, MODELS, layer_shape, with_layers  # noqa: E402
from mlx_moe_plan.nn import SwitchGLU, patch_model  # noqa: E402

import two_ranks  # noqa: E402  (beside this file, on sys.path as pytest imports it)
from conftest import grouped_qmm_by_mlx_ops  # noqa: E402


def small_model(name="small-qwen3-moe", layers=2):
    config = with_layers(MODELS[name], layers)
    model, _ = bench.random_model(config, dtype=mx.float32, bits=None, group_size=64)
    return model


def test_shared_copy_shares_weights_and_patches_alone():
    model = small_model()
    patched = bench.shared_copy(model)
    assert patch_model(patched) == 2
    # The original keeps mlx-lm's layers; both hold the very same arrays.
    assert sum(isinstance(m, switch_layers.SwitchGLU) for _, m in model.named_modules()) == 2
    assert not any(isinstance(m, SwitchGLU) for _, m in model.named_modules())
    ours, theirs = dict(tree_flatten(patched.parameters())), dict(tree_flatten(model.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(ours[k] is theirs[k] for k in ours)


def test_float32_copy_casts_its_own_floating_arrays():
    """The float32 run of the same weights: its scales and norms float32, its
    quantized matrices the model's very arrays; the model keeps its dtypes."""
    config = with_layers(MODELS["small-qwen3-moe"], 1)
    model, _ = bench.random_model(config, dtype=mx.bfloat16, bits=4, group_size=64)
    reference = bench.float32_copy(model)
    ours = dict(tree_flatten(reference.parameters()))
    theirs = dict(tree_flatten(model.parameters()))
    assert ours.keys() == theirs.keys()
    floating = [k for k, a in theirs.items() if mx.issubdtype(a.dtype, mx.floating)]
    quantized = [k for k, a in theirs.items() if a.dtype == mx.uint32]
    assert floating and quantized
    assert all(theirs[k].dtype == mx.bfloat16 and ours[k].dtype == mx.float32 for k in floating)
    assert all(ours[k] is theirs[k] for k in quantized)


def test_model_benchmark_float32_logits(tmp_path):
    """`--float32-logits`: each side's prefill logits against the float32 run,
    bfloat16 sides a little off it."""
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "20", "--batches", "1", "--context", "8",
                       "--steps", "1", "--warmup", "1", "--rounds", "1", "--decode-rounds", "1",
                       "--ops", "off", "--dtype", "bfloat16", "--float32-logits",
                       "--json", str(out)]) == 0
    (entry,) = json.loads(out.read_text())["models"]
    for side in ("mlx-lm", "patched"):
        assert 0 < entry["prefill"][f"{side}_float32_rel_diff"] < 1


def test_restored_cache_decodes_the_same_step():
    model = small_model()
    cache = make_prompt_cache(model)
    model(mx.array(np.random.default_rng(1).integers(0, 4096, (2, 9))), cache=cache)
    mx.eval([c.state for c in cache])
    saved = bench.snapshot(cache)
    token = mx.array([[3], [5]])
    first = model(token, cache=cache)
    mx.eval(first)
    model(token, cache=cache)  # a step more, overwriting the cache's arrays in place
    bench.restore(cache, saved)
    np.testing.assert_array_equal(np.array(model(token, cache=cache)), np.array(first))


class RecordingModel:
    """A model of one-token logits that logs each call's side and cache, and can
    fail as MLX's CUDA backend fails to launch a graph."""

    def __init__(self, side, log, fail_from=None):
        self.side, self.log, self.fail_from = side, log, fail_from

    def __call__(self, y, cache=None):
        calls = sum(side == self.side for side, _ in self.log)
        self.log.append((self.side, cache))
        if self.fail_from is not None and calls >= self.fail_from:
            raise RuntimeError("cuGraphAddKernelNode: invalid argument")
        return mx.full((y.shape[0], 1, 5), float(calls))


def test_decode_steps_interleave_the_sides():
    # Step by step, the first side alternating from step to step and from the
    # round's start, each side on its own cache; warm-up steps untimed.
    log = []
    sides = bench.Sides(RecordingModel("mlx-lm", log), RecordingModel("patched", log))
    caches = {"mlx-lm": "cache-a", "patched": "cache-b"}
    out = bench.decode_interleaved(sides, caches, mx.zeros((2, 1), mx.int32), steps=2,
                                   warmup=1, start=1, what="decode")
    assert [side for side, _ in log] == ["patched", "mlx-lm", "mlx-lm", "patched",
                                         "patched", "mlx-lm"]
    assert all(cache == caches[side] for side, cache in log)
    for side in caches:
        builds, walls, first_logits = out[side]
        assert len(builds) == len(walls) == 2
        assert all(wall >= build > 0 for build, wall in zip(builds, walls))
        assert float(first_logits.max()) == 0  # the first call's
    # mlx-lm failing at its second step: dropped, with why; the patched side goes on.
    log.clear()
    sides = bench.Sides(RecordingModel("mlx-lm", log, fail_from=1), RecordingModel("patched", log))
    out = bench.decode_interleaved(sides, caches, mx.zeros((2, 1), mx.int32), steps=3,
                                   warmup=1, start=0, what="decode")
    assert list(out) == ["patched"] and len(out["patched"][0]) == 3
    assert "invalid argument" in sides.failure
    assert [side for side, _ in log].count("mlx-lm") == 2
    # A control side: three rotating, each first in turn.
    log.clear()
    sides = bench.Sides(RecordingModel("mlx-lm", log), RecordingModel("patched", log),
                        RecordingModel("control", log))
    caches = {"mlx-lm": "cache-a", "patched": "cache-b", "control": "cache-c"}
    out = bench.decode_interleaved(sides, caches, mx.zeros((2, 1), mx.int32), steps=2,
                                   warmup=0, start=0, what="decode")
    assert [side for side, _ in log] == ["mlx-lm", "patched", "control",
                                         "patched", "control", "mlx-lm"]
    assert sorted(out) == ["control", "mlx-lm", "patched"]


def test_layer_shapes_are_the_models():
    assert LAYER_SHAPES["qwen3-30b-a3b"] == layer_shape(MODELS["qwen3-30b-a3b"])
    assert (LAYER_SHAPES["mixtral"].experts, LAYER_SHAPES["mixtral"].top_k) == (8, 2)
    assert with_layers(MODELS["deepseek-v3"], 4)["first_k_dense_replace"] == 1
    assert len(with_layers(MODELS["gpt-oss-20b"], 3)["layer_types"]) == 3


def test_model_benchmark_end_to_end(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "20", "--batches", "1,20",
                       "--context", "8", "--steps", "2", "--warmup", "1", "--rounds", "1",
                       "--decode-rounds", "2", "--ops", "off",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (entry,) = result["models"]
    assert entry["name"] == "small-qwen3-moe" and entry["describe"]["patched_layers"] == 1
    # float32 on the CPU: mlx-lm's own call below 64 entries, the same GEMMs
    # on sorted rows above (batch 20, K 4): the same logits, bit for bit.
    assert entry["prefill"]["logits_rel_diff"] == 0
    assert [d["batch"] for d in entry["decode"]] == [1, 20]
    for row in entry["decode"]:
        assert row["logits_rel_diff"] == 0
        assert row["patched_wall_ms"] >= row["patched_build_ms"] > 0
        assert row["mlx-lm_wall_ms"] >= row["mlx-lm_build_ms"] > 0
    assert "speedup" in capsys.readouterr().out


@pytest.mark.parametrize("flags, dense, submit", [([], True, True), (["--no-dense"], False, True),
                                                  (["--no-submit"], True, False)])
def test_model_benchmark_patch_options(tmp_path, flags, dense, submit):
    # patch_model(dense=True, submit=True) by default, --no-dense and
    # --no-submit: False, said in the description; off CUDA their rules say
    # no, so prefill's logits stay bit for bit.
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "20", "--batches", "1", "--context", "8",
                       "--steps", "2", "--warmup", "1", "--rounds", "1", "--decode-rounds",
                       "1", "--ops", "off", "--no-pipelined", *flags,
                       "--json", str(out)]) == 0
    (entry,) = json.loads(out.read_text())["models"]
    assert entry["describe"]["dense"] is dense
    assert entry["describe"]["submit"] is submit
    assert entry["prefill"]["logits_rel_diff"] == 0


def test_model_benchmark_on_a_cpu_starts_with_the_ops(tmp_path, monkeypatch, capsys):
    # A CPU run's default (--ops auto): benchmarks.moe's ops, checked against
    # the reference and timed, in its table and the JSON; then the model's
    # table; then the sentence on what a CPU shows. Here the ops at one small
    # shape (the default's arguments are moe's own), the model at its smallest.
    from benchmarks import moe

    assert mx.default_device().type == mx.cpu
    moe.parse_args(bench.CPU_OPS_ARGS)
    monkeypatch.setattr(bench, "CPU_OPS_ARGS", ["--shapes", "mixtral", "--tokens", "8", "--hidden",
                                                "16", "--repeats", "1", "--calls", "1",
                                                "--no-progress"])
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "0", "--batches", "1", "--context", "8",
                       "--steps", "1", "--warmup", "0", "--decode-rounds", "1",
                       "--no-pipelined", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ops = result["ops"]
    assert ops["benchmark"] == "benchmarks.moe" and ops["shapes"] == ["mixtral"] and ops["checks"]
    assert {row["op"] for row in ops["summary"]} >= {"plan", "gather", "combine", "unsort"}
    assert [row["batch"] for row in result["models"][0]["decode"]] == [1]
    printed = capsys.readouterr().out
    ops_table = printed.index("mlx_moe_plan benchmark on Device(cpu")
    model_table = printed.index("small-qwen3-moe: 1 MoE layers patched")
    assert ops_table < model_table < printed.index(bench.CPU_NOTE)


def test_model_benchmark_control(tmp_path, capsys):
    # --control: an unpatched copy of mlx-lm's model decodes with both sides,
    # its own figures and its ratio to mlx-lm's in the row and the table.
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "0", "--batches", "1", "--context", "8",
                       "--steps", "2", "--warmup", "1", "--decode-rounds", "2", "--control",
                       "--ops", "off", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["models"][0]["decode"]
    assert row["control_wall_ms"] >= row["control_build_ms"] > 0
    assert row["control_speedup"] == pytest.approx(row["mlx-lm_wall_ms"] / row["control_wall_ms"])
    assert row["control_pipelined_speedup"] > 0
    assert "control: mlx-lm's speed over an unpatched copy" in capsys.readouterr().out


def test_model_benchmark_processes_merge_after_a_warm_process(tmp_path, monkeypatch, capsys):
    # --processes 2 --warm-process: three children, the first unreported; the
    # merged figures are the medians of the two reported ones, each ratio's
    # lowest beside it.
    monkeypatch.chdir(Path(bench.__file__).parents[1])
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "0", "--batches", "1", "--context", "8",
                       "--steps", "2", "--warmup", "1", "--decode-rounds", "1",
                       "--processes", "2", "--warm-process", "--ops", "off",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and len(result["per_process"]) == 2
    for process in result["per_process"]:
        assert "--warm-process" not in process["command"]
        assert "--steps 2" in process["command"]  # not the warm-up's settings
    (row,) = result["models"][0]["decode"]
    speedups = [p["models"][0]["decode"][0]["speedup"] for p in result["per_process"]]
    assert row["speedup"] == pytest.approx(sum(speedups) / 2)
    assert row["speedup_min"] == min(speedups)
    assert "lowest ratio of 2 processes" in capsys.readouterr().out


@two_ranks.needs_two_ranks
def test_expert_parallel_benchmark_end_to_end(tmp_path):
    # benchmarks.expert_parallel as two ranks on the loopback, every side, one
    # short run: each side's figures are there, a rank holds half the experts'
    # bytes under expert and tensor parallelism, every side's logits are the
    # single device's within float32 rounding, and the all-reduce alone is timed.
    out = tmp_path / "ep.json"
    result = two_ranks.launch(
        [sys.executable, "-m", "benchmarks.expert_parallel", "--layers", "1", "--prompts",
         "20", "--block-tokens", "1,8", "--batches", "1,3", "--context", "8", "--steps", "2",
         "--warmup", "1", "--rounds", "1", "--calls", "2", "--json", out],
        timeout_s=240, cwd=Path(bench.__file__).parents[1], merge_stderr=True)
    assert out.exists(), result.stdout[-4000:]
    (entry,) = json.loads(out.read_text())["models"]
    sides = entry["sides"]
    assert list(sides) == ["one", "tensor", "tensor+patch", "expert", "expert+tensor"], \
        result.stdout[-4000:]
    full = sides["one"]["expert_bytes"]
    for side, row in sides.items():
        assert "error" not in row and not row["errors"], (side, row)
        assert set(row["block_ms"]) == {"1", "8"} and set(row["prefill_ms"]) == {"20"}
        assert set(row["decode_ms"]) == set(row["decode_build_ms"]) == {"1", "3"}
        assert all(0 < row["decode_build_ms"][b] <= row["decode_ms"][b] for b in ("1", "3"))
        timings = [*row["block_ms"].values(), *row["prefill_ms"].values(),
                   *row["decode_ms"].values()]
        assert all(t > 0 for t in timings), (side, row)
        assert row["logits_rel_diff"] < 1e-5, (side, row["logits_rel_diff"])
        assert row["expert_bytes"] * (1 if side == "one" else 2) == full, (side, row)
    assert "experts' bytes a rank holds" in result.stdout
    assert "expert+tensor vs tensor+patch" in result.stdout
    assert set(entry["all_sum_ms"]) == {"1", "8"} and all(
        ms > 0 for ms in entry["all_sum_ms"].values())
    assert "one all_sum of a block's [T, " in result.stdout


def test_grouped_qmm_tilings_parse():
    from benchmarks.grouped_qmm import parse_tilings, tiling_name

    tilings = parse_tilings("default; tiles=1;steps=4,tiles=2")
    assert tilings == [{}, {"tiles": 1}, {"steps": 4, "tiles": 2}]
    assert [tiling_name(t) for t in tilings] == ["default", "tiles=1", "steps=4,tiles=2"]


def test_grouped_qmm_medians_of_processes(monkeypatch, tmp_path, capsys):
    """--processes N runs the rest of the command in N processes one after
    another, process p's shapes turned by p places, each writing its lines
    (--json); the parent prints and writes each line's medians, its TFLOP/s
    its work over them, and its spread, the slowest process over the
    fastest."""
    from benchmarks import grouped_qmm as bench_qmm

    times = {"a": ([100.0, 130.0, 110.0], [200.0, 180.0, 260.0]),
             "b": ([50.0, 40.0, 45.0], [90.0, 90.0, 80.0])}
    commands = []

    def run(command, check):
        assert check
        process = len(commands)
        commands.append(command)
        order = command[command.index("--shapes") + 1].split(",")
        rows = [{"shape": name, "tokens": 8, "projection": "gate", "tiling": "default",
                 "active_experts": 5, "ours_us": times[name][0][process],
                 "gather_qmm_us": times[name][1][process], "floor_us": 10.0,
                 "tflops": 1000.0 / times[name][0][process],
                 "gather_qmm_tflops": 1000.0 / times[name][1][process], "busiest": 1.0,
                 "launch": "tiles"} for name in order]
        with open(command[command.index("--json") + 1], "w") as f:
            json.dump({"rows": rows}, f)

    monkeypatch.setattr(bench_qmm.subprocess, "run", run)
    out = tmp_path / "medians.json"
    assert bench_qmm.main(["--shapes", "a,b", "--tokens", "8", "--processes", "3",
                           "--sides", "kernel", "--json", str(out)]) == 0
    assert [command[command.index("--shapes") + 1] for command in commands] == \
        ["a,b", "b,a", "a,b"]
    for command in commands:
        assert command[1:3] == ["-m", "benchmarks.grouped_qmm"]
        assert "--processes" not in command and command.count("--shapes") == 1
        assert command[command.index("--sides") + 1] == "kernel"
    written = json.loads(out.read_text())
    assert len(written["per_process"]) == 3
    medians = {row["shape"]: row for row in written["rows"]}
    assert list(medians) == ["a", "b"]  # the first process's order
    assert (medians["a"]["ours_us"], medians["a"]["gather_qmm_us"]) == (110.0, 200.0)
    assert medians["a"]["tflops"] == pytest.approx(1000.0 / 110.0)
    assert medians["a"]["gather_qmm_tflops"] == pytest.approx(1000.0 / 200.0)
    assert medians["a"]["spread"] == pytest.approx(1.3)
    assert medians["b"]["ours_us"] == 45.0 and medians["b"]["processes"] == 3
    printed = capsys.readouterr().out
    assert bench_qmm.format_row(medians["a"]) in printed
    assert "widest spread of a line's processes: 1.30x (a T = 8 gate default)" in printed
    with pytest.raises(SystemExit):
        bench_qmm.main(["--processes", "2", "--ncu"])
    # the options a child leaves out, in either form
    assert timing.without_options(["--json", "x", "--tokens", "8", "--processes=3", "--shapes",
                                   "a"], ("--json", "--processes", "--shapes")) \
        == ["--tokens", "8"]


def test_grouped_qmm_weight_sets_outgrow_the_cache():
    from benchmarks.grouped_qmm import CACHE_BYTES, weight_sets_for

    for touched in (1e5, 6.3e6, 4e7, 6e7, 2e9):
        sets = weight_sets_for(touched, 48)
        assert 2 <= sets <= 48
        assert sets * touched >= 2 * CACHE_BYTES or sets == 48


def test_projections_chains_and_checks_each_side(capsys):
    # On the CPU: MLX's three shapes of the same GEMM and the package's call,
    # checked against each other, timed as chains beside the chain's add
    # alone, one line a B, then the table weighing the rule's shape.
    from benchmarks import projections

    assert projections.main(["--gemms", "mixtral/router", "--batches", "8,9", "--max-calls",
                             "2", "--target-s", "0"]) == 0
    out, slower = capsys.readouterr().out.split(
        "the rule's call slower than the fastest side by over 5%:")
    lines = [line for line in out.splitlines() if line.startswith("mixtral/router ")]
    assert len(lines) == 4 and "B=  9" in lines[1]
    for line in lines[:2]:
        times = dict(re.findall(r"(\w+) ([0-9.]+)", line.split("B=")[1].split(" ", 1)[1]))
        assert set(times) == {"none", "batched", "matrix", "rows", "patched"}, line
        assert all(float(us) > 0 for us in times.values()), line
    for line in lines[2:]:  # the rule's table: on the CPU, mlx-lm's shape
        assert line.split()[6] == "batched", line
    assert slower.split()[0].isdigit() and slower.split()[2] == "2"


def test_projections_summarize_reads_each_marked_side(tmp_path):
    """--ncu's markers are identifiers naming the side; --summarize gives each
    side's kernels a call (of NCU_CALLS), those before the first marker left out."""
    from benchmarks import projections

    marker = (projections.MARKER + projections.marker_name("qwen3-30b-a3b/o_32") + "_6_"
              + projections.marker_name("grouped:block_input_splits=1"))
    assert marker.isidentifier()
    header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    rows = [("0", "void copy_s<float>(const float *)", "ns", "999"),
            ("1", f"mlx::core::cu::custom_kernel_{marker}(const float *, float *)", "ns", "1"),
            ("2", "mlx::core::cu::custom_kernel_moe_grouped_qmm_tiles_1(const short *)", "us",
             "27.5"),
            ("3", "mlx::core::cu::custom_kernel_moe_grouped_qmm_tiles_1(const short *)", "ns",
             "28,100"),
            ("4", "void mlx::core::cu::copy_v<float>(const float *)", "ns", "300"),
            ("5", "mlx::core::cu::custom_kernel_moe_grouped_qmm_tiles_1(const short *)", "ns",
             "27,800")]
    csv_path = tmp_path / "gemm.csv"
    csv_path.write_text("==PROF== Connected to process 1\n" + header + "\n" + "\n".join(
        f'"{i}","{name}","gpu__time_duration.sum","{unit}","{value}"'
        for i, name, unit, value in rows) + "\n")
    assert projections.NCU_CALLS == 3
    (line,) = projections.summarize(str(csv_path), top=2).splitlines()
    label = marker.removeprefix(projections.MARKER)
    assert line.split() == [label, "27.9", "us", "1", "kernels",
                            "[mlx::core::cu::custom_kernel_moe_grouped_qmm_tiles_1", "27.8,",
                            "mlx::core::cu::copy_v", "0.1]"]


def test_projections_prefill_times_the_grouped_kernel(monkeypatch, capsys):
    # --prefill on the CPU, the kernel stood in for: "matrix" [1, T, D] and
    # the grouped kernel in each tiling, checked against it, then the table of
    # the fastest grouped side with both sides' TFLOP/s.
    from benchmarks import projections

    grouped_qmm_on_cpu(monkeypatch)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setitem(projections.GEMMS, "small/q", (48, 128, 4))
    assert projections.main(["--prefill", "--gemms", "small/q", "--batches", "40",
                             "--tilings", "default;block_row_tiles=2", "--max-calls", "2",
                             "--target-s", "0"]) == 0
    out = capsys.readouterr().out
    timed = [line for line in out.splitlines() if "B= 40" in line]
    assert len(timed) == 1
    times = dict(re.findall(r"(\S+) ([0-9.]+)", timed[0].split("B= 40")[1]))
    assert set(times) == {"none", "matrix", "grouped:default", "grouped:block_row_tiles=2"}
    table = out.splitlines()[-1].split()
    assert table[:4] == ["small/q", "bfloat16", "4", "40"] and table[-1].startswith("grouped:")
    fastest = min(times["grouped:default"], times["grouped:block_row_tiles=2"], key=float)
    # The timed line prints two decimals, the table one: half a tenth apart
    # at most, and a hair more in binary (1873.65 against 1873.6).
    assert float(table[5]) == pytest.approx(float(fastest), abs=0.051)
    assert table[7] == f"{2 * 40 * 48 * 128 / float(fastest) / 1e6:.1f}"  # TFLOP/s


def grouped_qmm_on_cpu(monkeypatch):
    """benchmarks.grouped_qmm on the CPU, the kernel stood in for by MLX's ops
    of the same meaning, with a tiny shape "small": (the module, the shape)."""
    from benchmarks import grouped_qmm as bench_qmm
    from mlx_moe_plan import _backend, _gpu

    class StandIn:
        fuses = True  # the layer's rule, as a test sets it

        def grouped_qmm(self, *arrays, stream, **options):
            return grouped_qmm_by_mlx_ops(*arrays, **options)

        def grouped_qmm_fuses(self, **layer):
            return self.fuses

    cpu_stream = mx.default_stream(mx.cpu)
    monkeypatch.setattr(mx, "default_stream", lambda device: cpu_stream)
    monkeypatch.setattr(_backend, "gpu_backend", lambda: "cuda")
    stand_in = StandIn()
    monkeypatch.setattr(_gpu, "for_backend", lambda backend: stand_in)
    shape = dataclasses.replace(LAYER_SHAPES["qwen3-30b-a3b"], hidden=128, intermediate=64,
                                experts=16)
    monkeypatch.setitem(bench_qmm.LAYER_SHAPES, "small", shape)
    # One timed graph a side and turn: these tests check the plumbing, not the times.
    monkeypatch.setattr(bench_qmm, "time_calls",
                        functools.partial(timing.time_calls, repeats=1))
    return bench_qmm, shape


def test_grouped_qmm_benchmark_lines(monkeypatch):
    """The benchmark's plumbing on the CPU, the kernel stood in for by MLX's
    ops of the same meaning (the GPU suite times the kernel itself): each
    projection in each tiling, and gate+up fused (each tiling) and unfused,
    all checked against MLX's, a line each, with their floors."""
    bench_qmm, shape = grouped_qmm_on_cpu(monkeypatch)
    lines = bench_qmm.measure("small", 3, 4, 4800.0, [{}, {"tiles": 1}])
    assert [(line["projection"], line["tiling"]) for line in lines] == [
        ("gate", "default"), ("gate", "tiles=1"), ("down", "default"), ("down", "tiles=1"),
        ("gate+up", "unfused"), ("gate+up", "fused"), ("gate+up", "fused,tiles=1")]
    active = lines[0]["active_experts"]
    assert 0 < active <= 3 * shape.top_k
    # the launch each tiling runs: the decode body at these few rows by default
    assert [line["launch"].split(",")[0] for line in lines] == [
        "decode body"] * 4 + ["", "decode body", "decode body"]
    forced = bench_qmm.launch_text(16, 128, 64, 12, {"tiles_from_rows": 0})
    # an expert's block of the few rows it holds (launch._fitted_row_tiles)
    assert forced.startswith("tiles 8x128, 128 values x ")
    ring = bench_qmm.launch_text(16, 2048, 768, 12, {"word_stages": 3})
    assert ring == "decode body, 4 steps, words in a ring of 3, 1 sets"
    # a field the launch does not take launches the default's kernel, and says so
    assert bench_qmm.launch_text(16, 2048, 768, 12, {"block_tiles": 4}) \
        == "decode body, 4 steps, 4 sets, the default's launch"
    assert bench_qmm.launch_text(16, 128, 64, 12, {"tiles_from_rows": 0, "block_tiles": 2}) \
        == forced
    for line in lines:
        assert line["ours_us"] > 0 and line["gather_qmm_us"] > 0
        projections = 2 if line["projection"] == "gate+up" else 1
        in_dims = 64 if line["projection"] == "down" else 128
        assert line["floor_us"] == pytest.approx(
            projections * active * line["out"] * bench_qmm.column_bytes(in_dims) / 4.8e6)
    # the layer's default: the side its backend's rule runs, fused or apart
    from mlx_moe_plan import _gpu

    layers = {line["tiling"]: line for line in bench_qmm.layer_rows(lines)}
    assert layers["default"] == {**layers["fused"], "tiling": "default"}
    _gpu.for_backend("cuda").fuses = False
    layers = {line["tiling"]: line
              for line in bench_qmm.layer_rows(bench_qmm.measure("small", 3, 4, 4800.0, [{}]))}
    assert layers["default"] == {**layers["unfused"], "tiling": "default"}


def test_grouped_qmm_ncu_profiles_each_side_after_its_marker(monkeypatch, capsys):
    """--ncu times nothing: after each projection's check, each side's one
    call runs inside `timing.profiled` (stood in for here), after a marker
    naming the shape, T, projection, side's place and side; no lines."""
    bench_qmm, _ = grouped_qmm_on_cpu(monkeypatch)
    regions = []

    def profiled(marker, run):
        before = len(calls)
        run()
        regions.append((marker, len(calls) - before))

    calls = []
    original_eval = mx.eval
    monkeypatch.setattr(timing, "profiled", profiled)
    monkeypatch.setattr(mx, "eval", lambda *arrays: (calls.append(1), original_eval(*arrays)))
    assert bench_qmm.measure("small", 3, 4, 4800.0, [{}, {"tiles": 1}], ncu=True) == []
    markers = [marker for marker, _ in regions]
    assert markers == [bench_qmm.MARKER + f"small_T_3_{projection}_{index}_{side}"
                       for projection, sides in (
                           ("gate", ("gather_qmm", "default", "tiles_1")),
                           ("down", ("gather_qmm", "default", "tiles_1")),
                           ("gate_up", ("gather_qmm", "unfused", "fused", "fused_tiles_1")))
                       for index, side in enumerate(sides)]
    assert all(count == 1 for _, count in regions)  # one call, evaluated alone
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == markers


def test_grouped_qmm_weight_formats(monkeypatch, capsys, tmp_path):
    """--bits, --group-size and --dtype reach every side: the experts, the
    ceilings (the 16-bit matmul named by its dtype), the floors and the lines;
    main refuses a format the kernel has not, by name, and names a shape whose
    rows are not whole groups of it, which it leaves out."""
    bench_qmm, shape = grouped_qmm_on_cpu(monkeypatch)
    form = bench_qmm.WeightFormat(bits=8, group_size=32, dtype="float16")
    lines = bench_qmm.measure("small", 5, 2, 4800.0, [{}], mlx_tiles=[4], ceilings=True,
                              form=form)
    assert [(line["projection"], line["tiling"]) for line in lines] == [
        (projection, side) for projection in ("gate", "down")
        for side in ("mlx,tile_m=4", "default", "matmul_fp16", "qmm_dense")
    ] + [("gate+up", side) for side in ("mlx,tile_m=4", "unfused", "fused")]
    active = lines[0]["active_experts"]
    for line in lines:
        assert (line["bits"], line["group_size"], line["dtype"]) == (8, 32, "float16")
        projections = 2 if line["projection"] == "gate+up" else 1
        in_dims = shape.intermediate if line["projection"] == "down" else shape.hidden
        assert line["floor_us"] == pytest.approx(
            projections * active * line["out"] * (in_dims + in_dims // 32 * 4) / 4.8e6)
    # the layer's GEMMs, each side's gate and up then down, its work three projections'
    layers = {line["tiling"]: line for line in bench_qmm.layer_rows(lines)}
    assert set(layers) == {"mlx,tile_m=4", "unfused", "fused", "default", "matmul_fp16",
                           "qmm_dense"}
    assert layers["default"] == {**layers["fused"], "tiling": "default"}  # the rule's side
    by_side = {(line["projection"], line["tiling"]): line for line in lines}
    for side, halves, down in (("fused", [("gate+up", "fused")], "default"),
                               ("unfused", [("gate+up", "unfused")], "default"),
                               ("mlx,tile_m=4", [("gate+up", "mlx,tile_m=4")], "mlx,tile_m=4"),
                               ("qmm_dense", [("gate", "qmm_dense")] * 2, "qmm_dense")):
        parts = [by_side[key] for key in halves] + [by_side[("down", down)]]
        layer = layers[side]
        assert layer["projection"] == "layer"
        for key in ("ours_us", "gather_qmm_us", "floor_us"):
            assert layer[key] == pytest.approx(sum(part[key] for part in parts))
        assert layer["tflops"] == pytest.approx(
            2 * 5 * shape.top_k * 3 * shape.hidden * shape.intermediate / layer["ours_us"] / 1e6)
    assert bench_qmm.column_bytes(2048, 8, 32) == 2048 + 64 * 4
    assert bench_qmm.launch_text(16, 128, 64, 12, {"tiles_from_rows": 0}, form=form) \
        .startswith("tiles 8x128, 128 values x ")
    experts = bench_qmm.quantized_experts(2, 8, 64, form)
    assert experts[0].shape == (2, 8, 64 * 8 // 32) and experts[1].dtype == mx.float16
    assert experts[1].shape == (2, 8, 2)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    for option, value in (("--bits", "3"), ("--group-size", "16"), ("--dtype", "float32")):
        with pytest.raises(SystemExit):
            bench_qmm.main([option, value])
        assert option in capsys.readouterr().err
    # a shape whose rows are not whole groups is named and left out, not a traceback
    assert bench_qmm.main(["--shapes", "gpt-oss-20b", "--tokens", "8", "--group-size", "128"]) == 0
    assert "gpt-oss-20b: rows of 2880 values are not whole groups of 128: not measured" \
        in capsys.readouterr().out
    # the table prints each side's layer line after the projections' lines,
    # and --json writes the same lines
    written = tmp_path / "lines.json"
    assert bench_qmm.main(["--shapes", "small", "--tokens", "5", "--calls", "2",
                           "--bits", "8", "--group-size", "32", "--dtype", "float16",
                           "--json", str(written)]) == 0
    printed = [line.split() for line in capsys.readouterr().out.splitlines()
               if line.startswith("small")]
    assert [line[2] for line in printed][-5:] == ["layer"] * 5
    assert [line[3] for line in printed if line[2] == "layer"] == \
        ["unfused", "fused", "default", "matmul_fp16", "qmm_dense"]
    rows = json.loads(written.read_text())["rows"]
    assert [bench_qmm.format_row(row).split() for row in rows] == printed


def test_step_kernels_timeline_of_prefills(monkeypatch, capsys):
    """--prefill without --variants times one side's prefills (on a CPU no
    timeline follows); --timeline's reading of torch's profiler, as a
    prefill's runs give it:
    the GPU's busy time a run is the union of its kernels' intervals
    (overlapping ones counted once), the idle time before a kernel counts
    from its run's start for the first, and host records are API calls."""
    import types
    from contextlib import nullcontext

    from benchmarks import step_kernels

    def event(name, start, end, device="DeviceType.CUDA"):
        return types.SimpleNamespace(name=name, device_type=device,
                                     time_range=types.SimpleNamespace(start=start, end=end))

    events = [event(step_kernels.RUN_RANGE, 0, 10_000, "DeviceType.CPU"),
              event("gemm", 1_000, 4_000), event("add", 3_000, 5_000),  # overlapping
              event("Memcpy HtoD", 5_000, 9_000),  # not a kernel
              event("cudaLaunchKernel", 100, 300, "DeviceType.CPU"),
              event(step_kernels.RUN_RANGE, 10_000, 20_000, "DeviceType.CPU"),
              event("gemm", 14_000, 17_000)]
    profiler = types.SimpleNamespace(
        ProfilerActivity=types.SimpleNamespace(CPU="cpu", CUDA="cuda"),
        profile=lambda activities: nullcontext(types.SimpleNamespace(events=lambda: events)),
        record_function=lambda name: nullcontext())
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(init=lambda: None),
                                  profiler=profiler)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)
    runs = iter([(0.0, 0.010), (0.0, 0.012)])
    lines = step_kernels.timeline(lambda: next(runs), 2, top=3, unit="prefill").splitlines()
    # Busy: 4 ms then 3 ms, 3.5 a run of an 11 ms median wall.
    assert lines[0] == ("  traced: wall 11.000 ms, build 0.000 ms, the GPU busy 3.500 ms a "
                        "prefill (32% of the evaluation), 2 kernels a prefill")
    assert lines[1].split() == ["3000.0", "us", "1x", "gemm"]  # 6 ms in 2 runs
    # Idle: 1 ms before the first gemm (from the run's start), 9 ms before the second.
    idle = lines.index("  GPU idle before a kernel, 5.000 ms a prefill:")
    assert lines[idle + 1].split() == ["5000.0", "us", "1x", "gemm"]
    assert "  CUDA API calls, 0.100 ms a prefill:" in lines
    monkeypatch.undo()
    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "1", "--dtype",
                              "float32", "--prefill", "40", "--timeline", "1",
                              "--build-profile", "1", "--top", "400"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    wall, build = map(float, re.fullmatch(
        r"small-qwen3-moe 1 layers, patched, prefill 40: wall ([0-9.]+) ms, "
        r"build ([0-9.]+) ms", first).groups())
    assert 0 < build < wall
    # The profile: one prefill, its two model calls (a chunk, the last token).
    calls = {line.split()[-1]: line.split()[0] for line in out.splitlines()[1:]
             if line.strip()[:1].isdigit() and "(" in line}
    assert [count for name, count in calls.items() if name.endswith("(prefill)")] == ["1"]
    assert any(name.endswith("(__call__)") and "qwen3_moe" in name and count == "2"
               for name, count in calls.items())


def test_step_kernels_times_steps_and_sums_marked_kernels(tmp_path, capsys, monkeypatch):
    from benchmarks import step_kernels
    from mlx_moe_plan import _compiled

    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "1", "--batches",
                              "1,3", "--context", "8", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "small-qwen3-moe 1 layers, patched, batch 1", "small-qwen3-moe 1 layers, patched, batch 3"]
    # The build profile: 2 steps' building by function, the patched layer's among them.
    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "1", "--batches", "2",
                              "--context", "8", "--dtype", "float32", "--build-profile", "2",
                              "--top", "400"]) == 0
    profile = capsys.readouterr().out
    calls = {line.split()[-1]: line.split()[0] for line in profile.splitlines()
             if line.strip()[:1].isdigit() and "(" in line}
    assert [count for name, count in calls.items() if name.endswith("(build_step)")] == ["2"]
    assert any("fused_blocks.py:" in name for name in calls)
    # --variants: every side a batch, the rules as they were afterwards, and
    # a key that is neither a rule's constant nor a tiling field refused.
    from mlx_moe_plan import rules

    threshold = rules.DENSE_DECODING_FROM_IN_DIMS
    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "1", "--batches", "2",
                              "--context", "8", "--dtype", "float32", "--rounds", "2",
                              "--variants", "all:DENSE_DECODING_FROM_IN_DIMS=0;"
                              "body:tiles_from_rows=65"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines[1:]] == ["mlx-lm", "patched", "all", "body"]
    assert all(len(line.split("turns")[1].split()) == 2 for line in lines[1:])
    assert rules.DENSE_DECODING_FROM_IN_DIMS == threshold
    # --prefill: each turn one prefill, every side, then the rules as they were;
    # a turn drops the traces and prefills untimed before the timed one, so
    # none is traced while timed.
    events = []

    def recorded(name, function):
        def call(*args):
            events.append(name)
            return function(*args)
        return call

    # step_kernels' untimed prefill, and benchmarks.model's timed one.
    monkeypatch.setattr(step_kernels, "prefill", recorded("prefill", step_kernels.prefill))
    monkeypatch.setattr(bench, "prefill", recorded("prefill", bench.prefill))
    monkeypatch.setattr(_compiled, "forget", recorded("forget", _compiled.forget))
    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "1", "--dtype",
                              "float32", "--rounds", "2", "--prefill", "40",
                              "--variants", "all:DENSE_DECODING_FROM_IN_DIMS=0;"
                              "body:tiles_from_rows=65"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[1:]] == [
        ["prefill", "40", name] for name in ("mlx-lm", "patched", "all", "body")]
    assert events == ["forget", "prefill", "prefill"] * 4 * 2 + ["forget"]
    assert all(len(line.split("turns")[1].split()) == 2 for line in lines[1:])
    assert rules.DENSE_DECODING_FROM_IN_DIMS == threshold
    with pytest.raises(SystemExit, match="neither"):
        step_kernels.parse_variants("bad:NOT_A_RULE=1")
    with pytest.raises(SystemExit, match="neither"):
        step_kernels.parse_variants("bad:attention=cudnn")
    assert step_kernels.parse_variants("a:attention=sketch,tiles_from_rows=65;"
                                       "b:attention=sketch-mma") == {
        "a": ({}, {"tiles_from_rows": 65}, {"attention": "sketch"}),
        "b": ({}, {}, {"attention": "sketch-mma"})}
    from benchmarks.decode_attention import PACKAGE_FORMS, SKETCH_FORMS
    assert (set(step_kernels.VARIANT_OPTIONS["attention"].values())
            == {*SKETCH_FORMS, *PACKAGE_FORMS})
    # Nsight Compute's CSV: log lines, the table; kernels before the first
    # marker are another step's and not counted; units as the tool gives them.
    header = ('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"')
    rows = [("0", "void mlx::copy_s<float>(const float *)", "ns", "999"),
            ("1", "mlx::custom_kernel_step_marker_b8(const float *, float *)", "ns", "1,000"),
            ("2", "void mlx::qmv_kernel<64>(const T1 *)", "ns", "2,500"),
            ("3", "void mlx::qmv_kernel<64>(const T1 *)", "us", "1.5"),
            ("4", "mlx::custom_kernel_moe_plan_512(const int *)", "ns", "700"),
            ("5", "mlx::custom_kernel_step_marker_b32(const float *, float *)", "ns", "900"),
            ("6", "void mlx::rope<float>(const T *)", "ns", "40")]
    csv_path = tmp_path / "steps.csv"
    csv_path.write_text("==PROF== Connected to process 1\n" + header + "\n" + "\n".join(
        f'"{i}","{name}","gpu__time_duration.sum","{unit}","{value}"'
        for i, name, unit, value in rows) + "\n")
    assert step_kernels.summarize(str(csv_path), top=5).splitlines() == [
        "batch 8: 3 kernels, 4.7 us",
        "        4.0 us     2x  mlx::qmv_kernel",
        "        0.7 us     1x  mlx::custom_kernel_moe_plan_512",
        "batch 32: 1 kernels, 0.0 us",
        "        0.0 us     1x  mlx::rope"]


def test_step_kernels_counts_a_steps_operations(monkeypatch, capsys):
    """`graph_nodes` counts a graph's operations by primitive, not its arrays;
    `--graph` prints one step's count on both sides, built whole: no block
    submits while it is built, even where the rule says every block does."""
    from benchmarks import step_kernels
    from mlx_moe_plan import rules

    x = mx.array([1.0, 2.0])
    mx.eval(x)
    assert step_kernels.graph_nodes(mx.exp(x) + x * x) == {"Exp": 1, "Multiply": 1, "Add": 1}
    answers, every_answer = [], []  # the rule's, as each block asks it (on any device)

    def submits(rows, position, **_):
        answers.append(rows >= rules.SUBMIT_BLOCKS_FROM_TOKENS)
        every_answer.append(answers[-1])
        return answers[-1]

    monkeypatch.setattr(rules, "SUBMIT_BLOCKS_FROM_TOKENS", 1)
    monkeypatch.setattr(rules, "submits_block", submits)
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: None)  # no CUDA stream to hand on
    graph_answers = []
    build_step = step_kernels.build_step

    def graph_build(*args):  # step_graphs' builds only: the timed steps call model's
        answers.clear()
        outputs = build_step(*args)
        graph_answers.extend(answers)
        return outputs

    monkeypatch.setattr(step_kernels, "build_step", graph_build)
    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "2", "--batches", "2",
                              "--context", "8", "--dtype", "float32", "--graph"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "one step's graph, batch 2:"
    counts = {}
    for line in lines[2:4]:
        name, _, rest = line.strip().partition(": ")
        total, _, _, _, per_layer = rest.split(";")[0].split()[:5]
        counts[name] = int(total)
        assert float(per_layer) == pytest.approx(int(total) / 2)
    assert set(counts) == {"mlx-lm", "patched"} and min(counts.values()) > 0
    # the patched side's two blocks asked and were told no; the timed steps, yes
    assert graph_answers == [False, False] and True in every_answer
    assert rules.SUBMIT_BLOCKS_FROM_TOKENS == 1


def test_step_kernels_interleaves_variants_step_by_step(monkeypatch, capsys):
    """`--interleave`: each side's steps under its own rules, the sides'
    steps taking turns one by one (not a side's whole turn at once), every
    side's median over all rounds and each round's; afterwards the rules and
    the layers' shared traces as they were."""
    from benchmarks import step_kernels
    from mlx_moe_plan import _compiled, rules

    default = rules.DECODE_ATTENTION_FROM_ROWS
    shared = _compiled._SHARED_FORWARDS
    asked = []  # the rule's constant as each attention call of a step finds it
    decodes_attention = rules.decodes_attention

    def recorded(rows, *, cuda, masked=False):
        if not masked:  # a step without a mask asks the unmasked rows
            asked.append(rules.DECODE_ATTENTION_FROM_ROWS)
        return decodes_attention(rows, cuda=cuda, masked=masked)

    monkeypatch.setattr(rules, "decodes_attention", recorded)
    traces = {}  # the layers' shared traces each side's steps kept, by the dict's id
    shared_traces_in = _compiled.shared_traces_in

    def kept_in(side_traces):
        traces[id(side_traces)] = side_traces
        return shared_traces_in(side_traces)

    monkeypatch.setattr(_compiled, "shared_traces_in", kept_in)
    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "1", "--batches", "2",
                              "--context", "8", "--dtype", "float32", "--rounds", "2",
                              "--interleave", "--variants", "on:DECODE_ATTENTION_FROM_ROWS=2;"
                              "body:tiles_from_rows=65"]) == 0
    # every side its own traces, the three patched sides' layers traced there
    # (mlx-lm's unpatched layers trace nothing), none in the process's
    assert len(traces) == 4 and sum(1 for kept in traces.values() if kept) == 3
    assert all(kept is not shared for kept in traces.values())
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines[1:]] == ["mlx-lm", "patched", "on", "body"]
    assert all(len(line.split("rounds")[1].split()) == 2 for line in lines[1:])
    assert rules.DECODE_ATTENTION_FROM_ROWS == default
    assert _compiled._SHARED_FORWARDS is shared
    # Every step of a patched side asks once (its one layer's attention), and
    # `on`'s route once more; the context's fill asks under the defaults too.
    # So `on` asked under its own constant at each of its steps and never
    # another side under it, and its steps took turns with the others'.
    steps = 2 * (step_kernels.TIMED_STEPS + step_kernels.UNTIMED_STEPS)
    assert asked.count(2) == steps + 1
    assert asked.count(default) >= 2 * steps
    tail = asked[-3 * steps:]
    assert sum(1 for a, b in zip(tail, tail[1:]) if a != b) >= steps
    # from mlx-lm's batch caches, each side a copy of the same kind of cache
    assert step_kernels.main(["--models", "small-qwen3-moe", "--layers", "1", "--batches", "3",
                              "--context", "40", "--dtype", "float32", "--rounds", "1",
                              "--batch-cache", "--interleave", "--variants",
                              "on:DECODE_ATTENTION_FROM_ROWS=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines[1:]] == ["mlx-lm", "patched", "on"]
    with pytest.raises(SystemExit):
        step_kernels.main(["--models", "small-qwen3-moe", "--interleave"])
    with pytest.raises(SystemExit, match="every comparison has"):
        step_kernels.parse_variants("patched:DECODE_ATTENTION_FROM_ROWS=2")


def test_step_kernels_gradients_always(monkeypatch):
    """`gradients=always`: within a side's settings the GPU glue makes its
    custom function at every call, traced or not (its launch stood in on the
    CPU), and outside as it is, only where traced."""
    from benchmarks import step_kernels
    from mlx_moe_plan import _gpu, _tracing

    monkeypatch.setattr(_gpu, "_argsort_slice", lambda backend, values, start, count, stream,
                        normalize: (mx.argsort(values)[..., start:start + count],) * 2)
    top_k = _gpu._argsort_slice_function("cuda", 0, 2, False, mx.default_stream(mx.cpu))
    values = mx.array([3.0, 1.0, 2.0])
    constants, tiling, options = step_kernels.parse_variants("always:gradients=always")["always"]
    assert (constants, tiling, options) == ({}, {}, {"gradients": "always"})
    with step_kernels._settings(constants, tiling, options, {}):
        inside = step_kernels.graph_nodes(top_k(values)[0])
    outside = step_kernels.graph_nodes(top_k(values)[0])
    assert inside["CustomTransforms"] == 1 and outside["CustomTransforms"] == 0
    assert _gpu.carries_gradients is _tracing.carries_gradients


def test_model_benchmark_variant(tmp_path, capsys):
    # --variant-tile-m: the model patched another way decodes with the sides,
    # interleaved; its figures, its ratio and its logits in the row and table.
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "0", "--batches", "1,20", "--context", "8",
                       "--steps", "2", "--warmup", "1", "--decode-rounds", "2",
                       "--variant-tile-m", "16", "--control", "--ops", "off",
                       "--json", str(out)]) == 0
    entry = json.loads(out.read_text())["models"][0]
    assert entry["describe"]["variant_tile_m"] == 16
    assert [row["batch"] for row in entry["decode"]] == [1, 20]
    for row in entry["decode"]:
        assert row["variant_wall_ms"] >= row["variant_build_ms"] > 0
        assert row["variant_speedup"] == pytest.approx(row["mlx-lm_wall_ms"]
                                                       / row["variant_wall_ms"])
        assert row["control_speedup"] > 0
        # float32 on the CPU: 16-row tiles compute each row as sorted rows do
        assert row["variant_logits_rel_diff"] < 1e-6
    printed = capsys.readouterr().out
    assert "variant: mlx-lm's speed over the model patched with tile_m=16" in printed
    assert "control: mlx-lm's speed over an unpatched copy" in printed


@pytest.mark.parametrize("option", ["dense", "submit"])
def test_model_benchmark_variant_without_option(tmp_path, capsys, option):
    # --variant-no-dense (--variant-no-submit): the model patched with
    # dense=False (submit=False) decodes beside the default patch (on the CPU
    # the rules keep MLX's calls and submit nothing: the same bits).
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "0", "--batches", "2", "--context", "8",
                       "--steps", "2", "--warmup", "1", "--decode-rounds", "1",
                       f"--variant-no-{option}", "--ops", "off", "--json", str(out)]) == 0
    entry = json.loads(out.read_text())["models"][0]
    assert entry["describe"][f"variant_{option}"] is False
    row = entry["decode"][0]
    assert row["variant_wall_ms"] >= row["variant_build_ms"] > 0
    assert row["variant_logits_rel_diff"] == 0
    assert f", {option}=False, decoded with the others" in capsys.readouterr().out


class ParserCaught(Exception):
    """Raised with the parser in place of parsing: what a benchmark's main would parse."""


BENCHMARK_COMMANDS = sorted(module.name for module in pkgutil.iter_modules(benchmarks.__path__)
                            if hasattr(importlib.import_module(f"benchmarks.{module.name}"),
                                       "main"))


@pytest.mark.parametrize("name", BENCHMARK_COMMANDS)
def test_every_benchmark_option_gives_its_default(name, monkeypatch):
    # Each command's parser, caught as its main parses: every option that
    # takes a value says in its help what it is when not given.
    def catch(parser, *args, **kwargs):
        raise ParserCaught(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(ParserCaught) as caught:
        importlib.import_module(f"benchmarks.{name}").main([])
    parser = caught.value.args[0]
    options = [action for action in parser._actions
               if action.option_strings and action.nargs != 0 and not action.required]
    assert options, f"benchmarks.{name}: no option found"
    for action in options:
        assert "(default: " in (action.help or ""), (name, action.option_strings)


def test_load_patterns_says_where_it_runs(capsys):
    # CUDA text of its own: elsewhere it says so and fails, without a traceback.
    if load_patterns._backend.gpu_backend() == "cuda":
        pytest.skip("on CUDA it runs: tests/gpu_suite.sh load-patterns")
    assert load_patterns.main(["--warps", "32", "--repeats", "1"]) == 1
    assert "CUDA only" in capsys.readouterr().err


def test_grouped_qmm_prefill_sides(monkeypatch):
    """The prefill sides on the CPU, the kernel stood in for as above: MLX's
    tiled gather_qmm and the dense ceilings beside the kernel, TFLOP/s of the
    routed work in each line, and --skew's busier busiest expert."""
    bench_qmm, shape = grouped_qmm_on_cpu(monkeypatch)
    tokens = 64
    lines = bench_qmm.measure("small", tokens, 2, 4800.0, [{}], mlx_tiles=[16, 4],
                              ceilings=True)
    assert [(line["projection"], line["tiling"]) for line in lines] == [
        (projection, side) for projection in ("gate", "down")
        for side in ("mlx,tile_m=16", "mlx,tile_m=4", "default", "matmul_bf16", "qmm_dense")
    ] + [("gate+up", side) for side in ("mlx,tile_m=16", "mlx,tile_m=4", "unfused", "fused")]
    assert {line["reference"] for line in lines} == {"gather_qmm"}
    for line in lines:
        projections = 2 if line["projection"] == "gate+up" else 1
        flops = 2 * tokens * shape.top_k * projections * line["out"] * line["in"]
        assert line["tflops"] > 0 and line["gather_qmm_tflops"] > 0
        assert line["tflops"] == pytest.approx(flops / (line["ours_us"] * 1e-6) / 1e12)
        assert line["gather_qmm_tflops"] == pytest.approx(
            flops / (line["gather_qmm_us"] * 1e-6) / 1e12)
    # --skew: the busiest expert draws more; K distinct experts a token still.
    uniform = lines[0]["busiest"]
    skewed = bench_qmm.measure("small", tokens, 2, 4800.0, [], mlx_tiles=[16], kernel=False,
                               skew=2.0)
    assert [line["tiling"] for line in skewed] == ["mlx,tile_m=16"] * 3
    assert skewed[0]["busiest"] > uniform
    routed = bench_qmm.routed_experts(64, 4, 4096, 1.0, np.random.default_rng(0))
    assert all(len(set(token)) == 4 for token in routed)
    assert bench_qmm.busiest_share(routed, 64) > 3 * bench_qmm.busiest_share(
        bench_qmm.routed_experts(64, 4, 4096, 0.0, np.random.default_rng(0)), 64)
    # Past MLX_SORTED_ROWS rows, MLX's tiles of 64 are the reference (its sorted
    # single rows fail to launch on CUDA there), given or not.
    expected = [(projection, "default", "mlx,tile_m=64") for projection in ("gate", "down")
                ] + [("gate+up", side, "mlx,tile_m=64") for side in ("unfused", "fused")]
    unsorted = bench_qmm.measure("small", tokens, 2, 4800.0, [{}], sorted_rows=False)
    assert [(line["projection"], line["tiling"], line["reference"])
            for line in unsorted] == expected  # --no-sorted: the same
    monkeypatch.setattr(bench_qmm, "MLX_SORTED_ROWS", tokens * shape.top_k)
    past = bench_qmm.measure("small", tokens, 2, 4800.0, [{}])
    assert [(line["projection"], line["tiling"], line["reference"]) for line in past] == expected


def test_decode_attention_sides_attend_to_the_same_keys(capsys):
    """Both sides' keys are the first context + 1 of their buffers, the same
    values: on the CPU (one path) they agree, and each line has both times."""
    from benchmarks import decode_attention
    assert decode_attention.attention_shape("qwen3-30b-a3b") == (32, 4, 128, False)
    assert decode_attention.attention_shape("gpt-oss-20b") == (64, 8, 64, True)
    got = decode_attention.measure("small-qwen3-moe", 300, 2, 2)
    assert got["cudnn"] > 0 and got["vector"] > 0 and got["vector diff"] < 1e-2
    for form in decode_attention.SKETCH_FORMS:
        if form in got:  # CUDA: the sketch against cuDNN's output
            assert got[form + " diff"] < 2e-2
    assert decode_attention.main(["--models", "small-qwen3-moe", "--contexts", "8",
                                  "--batches", "1", "--layers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["model", "context", "batch"]
    assert lines[1].split()[:3] == ["small-qwen3-moe", "8", "1"] and len(lines) == 2


def test_decode_attention_package_sides_split_for_their_groups(monkeypatch, on_the_cpu, capsys):
    """The package's sides: the backend's launch through its glue (here on the
    CPU, its launches computed by MLX's attention), `package` splitting the
    keys as the package does and `package@N` for N groups, each as close to
    the `cudnn` side's output as MLX's own vector path; the groups restored
    after. small-qwen3-moe's heads: 2 sequences of 2 key-value heads."""
    from conftest import decode_attention_by_ops_launched, gpu_glue_on_the_cpu, recording_calls

    from benchmarks import decode_attention
    from mlx_moe_plan import fused_attention
    from mlx_moe_plan.kernels import launch

    splits = []

    # each call's splits, as the glue takes them for its keys and the side's groups
    launched = recording_calls(
        decode_attention_by_ops_launched,
        lambda queries, keys, *_: launch.decode_attention_splits(*keys.shape[:3]), splits)
    gpu_glue_on_the_cpu(monkeypatch, "decode_attention", launched, module=fused_attention,
                        rule="DECODE_ATTENTION_FROM_ROWS", from_rows=4)
    made = launch.DECODE_ATTENTION_GROUPS
    # 301 keys are 5 steps: 8 groups over 4 sequences' key-value heads split
    # them in 2, 12 groups in 3, the package's own in 5
    got = decode_attention.measure("small-qwen3-moe", 300, 2, 2, (8, 12))
    assert set(splits) == {5, 2, 3}
    assert launch.DECODE_ATTENTION_GROUPS == made
    for side in ("package", "package@8", "package@12"):
        assert got[side] > 0 and got[side + " diff"] <= max(got["vector diff"], 1e-2)
    assert decode_attention.main(["--models", "small-qwen3-moe", "--contexts", "8",
                                  "--batches", "1", "--layers", "2",
                                  "--package-groups", "64"]) == 0
    header, line = capsys.readouterr().out.splitlines()
    # the last six fields: package's and package@64's times, ratios and diffs
    assert header.endswith("package@64 diff") and "-" not in line.split()[-6:]
    built = decode_attention.measure("small-qwen3-moe", 8, 2, 2, (), build=True)
    assert all(built[side] > 0 for side in ("cudnn", "vector", "package"))


def test_decode_attention_sketch_takes_decoding_steps_only():
    """The sketch stands in for mlx-lm's attention only where its text
    computes it: one bfloat16 query a sequence, no mask, heads of 64 or 128
    values, at most 8 query heads a key-value head on the CUDA cores and 16
    on the tensor cores, the scale 1 / sqrt(D)."""
    from benchmarks.decode_attention import sketch_takes

    def takes(heads=32, kv_heads=4, queries=1, head_dim=128, dtype=mx.bfloat16,
              scale=None, mask=None, form="cores"):
        q = mx.zeros((2, heads, queries, head_dim), dtype)
        k = mx.zeros((2, kv_heads, 300, head_dim), dtype)
        return sketch_takes(q, k, head_dim ** -0.5 if scale is None else scale, mask, form)

    assert takes() and takes(heads=64, kv_heads=8, head_dim=64) and takes(heads=4, kv_heads=4)
    assert not takes(queries=2) and not takes(mask="causal") and not takes(dtype=mx.float16)
    assert not takes(head_dim=96) and not takes(kv_heads=2) and not takes(scale=0.1)
    assert takes(kv_heads=2, form="mma") and not takes(kv_heads=1, form="mma")


@pytest.mark.parametrize("form", ["cores", "mma", "package-launched", "package-step",
                                  "package"])
def test_decode_attention_sketch_in_a_model(monkeypatch, form):
    """A decoding step of a model attending through the sketch, or the
    package's launches in its place, gives mlx-lm's logits within bfloat16's
    rounding (CUDA); elsewhere the sketch says it needs CUDA, and a stand-in
    for its kernels (MLX's attention) shows the models' calls go to it inside
    the block and to mlx-lm's after."""
    from mlx_lm.models import base, qwen3_moe

    from benchmarks import decode_attention
    from mlx_moe_plan import _backend, rules

    config = with_layers(MODELS["small-qwen3-moe"], 2)
    model, _ = bench.random_model(config, dtype=mx.bfloat16, bits=4, group_size=64)
    stood_in = _backend.gpu_backend() != "cuda"
    if stood_in:
        with pytest.raises(RuntimeError, match="CUDA"), decode_attention.sketch_in_models(form):
            pass
        calls = []

        def stand_in(queries, keys, values, sinks, *scale_form):
            calls.append((keys.shape, scale_form[-1]))
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=queries.shape[-1] ** -0.5, sinks=sinks)
        monkeypatch.setattr(_backend, "gpu_backend", lambda: "cuda")
        monkeypatch.setattr(decode_attention, "sketch_attention", stand_in)
        monkeypatch.setattr(decode_attention, "package_attention", stand_in)
    cache, y = bench.fill_context(model, 3, 300, config["vocab_size"])
    _, expected = bench.build_step(model, cache, y)
    mx.eval(expected)
    for layer_cache in cache:  # the same step again, through the sketch
        layer_cache.offset -= 1
    original = base.scaled_dot_product_attention
    with decode_attention.sketch_in_models(form):
        assert qwen3_moe.scaled_dot_product_attention is not original
        # a patched model's own launch is off inside: the form is what it takes
        assert not rules.decodes_attention(64, cuda=True)
        assert not rules.decodes_attention(64, cuda=True, masked=True)
        _, got = bench.build_step(model, cache, y)
    assert qwen3_moe.scaled_dot_product_attention is original is base.scaled_dot_product_attention
    assert rules.decodes_attention(64, cuda=True)
    expected, got = expected.astype(mx.float32), got.astype(mx.float32)
    assert (mx.linalg.norm(got - expected) / mx.linalg.norm(expected)).item() < 2e-2
    if stood_in:  # both layers, the cache's 301 keys
        assert calls == [((3, 2, 301, 64), form)] * 2


def test_fill_context_batch_caches_as_batch_generation():
    """`fill_context(..., batch_cache=True)` holds the sequences as mlx-lm's
    batch generation does: each prompt filled alone and merged, left-padded
    to the longest, so that a decoding step is masked; its keys are each
    prompt's own."""
    config = with_layers(MODELS["small-qwen3-moe"], 1)
    model, _ = bench.random_model(config, dtype=mx.float32, bits=None, group_size=64)
    mx.random.seed(3)
    cache, y = bench.fill_context(model, 5, 60, config["vocab_size"], batch_cache=True)
    padding = [(b % bench.BATCH_CACHE_SPREAD) * bench.BATCH_CACHE_PADDING for b in range(5)]
    assert type(cache[0]).__name__ == "BatchKVCache"
    assert cache[0].left_padding.tolist() == padding
    mask = cache[0].make_mask(1, return_array=True)
    assert mask.dtype == mx.bool_ and mask.shape == (5, 1, 1, 61)
    assert mask.sum(axis=-1).reshape(-1).tolist() == [61 - p for p in padding]
    assert model(y, cache=cache).shape[:2] == (5, 1)

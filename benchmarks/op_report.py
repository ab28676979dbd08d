"""The op benchmark's report: the table, the targets at the headline shape, the
header that says what was measured, and the JSON document of the whole run."""

from __future__ import annotations

import datetime
import os
import platform

import mlx.core as mx

from .op_peers import mlx_lm
from .workloads import LAYER_SHAPES

# The ops' speed targets, at one shape: the headline row of the report.
HEADLINE = {"model": "qwen3-next", "tokens": 2048, "hidden": 2560, "dtype": "float16"}
CPU_SPEEDUP_TARGETS = {"plan": 10.0, "gather": 4.0, "combine": 4.0}
GPU_PLAN_US_TARGET = 15.0
GPU_GATHER_COPY_TARGET = 0.80

LEGEND = {
    "MB, GB/s": "bytes read once + written once, the same count for ours and mlx-lm: "
                "plan 16*T*K (int32 ids in; order, inverse, sorted ids out), gather, unsort, "
                "copy 2*T*K*H*size, combine (T*K + T)*H*size",
    "mlx-lm": "plan = argsort, argsort, take of ids (_gather_sort's index ops); "
              "gather = its row take x[order // K]; combine = _scatter_unsort + "
              "(y * scores[..., None]).sum(-2); unsort = _scatter_unsort",
    "copy": "MLX's contiguous copy (mx.array(rows)) of the gather's bytes; "
            "%copy = ours GB/s / copy GB/s",
}
OPS = ("plan", "gather", "combine", "unsort", "copy")  # the table's order at each shape


def find(results, op, impl, **where):
    """The result of `op` by `impl` whose fields equal `where`'s, or None."""
    for r in results:
        if r["op"] == op and r["impl"] == impl and all(r[k] == v for k, v in where.items()):
            return r
    return None


def summarize(results: list[dict]) -> list[dict]:
    """One row per (shape, op): ours, mlx-lm, the speedup, the fraction of copy bandwidth."""
    rows = []
    configs = sorted({(r["model"], r["hidden"], r["tokens"], r["dtype"]) for r in results},
                     key=lambda c: (list(LAYER_SHAPES).index(c[0]), c[1], c[2]))
    for model, hidden, tokens, dtype in configs:
        where = {"model": model, "hidden": hidden, "tokens": tokens, "dtype": dtype}
        copy = find(results, "copy", "copy", **where)
        for op in OPS:
            ours = find(results, op, "copy" if op == "copy" else "ours", **where)
            if ours is None:
                continue
            theirs = find(results, op, "mlx-lm", **where)
            row = {**where, "experts": ours["experts"], "top_k": ours["top_k"], "op": op,
                   "ours_us": ours["median_us"], "ours_gbps": ours["gbps"], "bytes": ours["bytes"],
                   "mlx_lm_us": theirs["median_us"] if theirs else None,
                   "mlx_lm_gbps": theirs["gbps"] if theirs else None,
                   "speedup": theirs["median_us"] / ours["median_us"] if theirs else None,
                   "of_copy": None}
            if op in ("gather", "unsort") and copy is not None:
                row["of_copy"] = ours["gbps"] / copy["gbps"]
            rows.append(row)
    return rows


def format_mb(nbytes: int) -> str:
    mb = nbytes / 1e6
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.2f}" if mb >= 1 else f"{mb:.3g}"


def format_table(rows: list[dict]) -> str:
    """`summarize`'s rows as a text table, a blank line between shapes."""
    head = (f"{'model':<14}{'E':>4}{'K':>4}{'H':>6}{'T':>7}  {'op':<8}"
            f"{'us/call':>11}{'MB':>9}{'GB/s':>8}{'mlx-lm us':>12}{'GB/s':>8}{'speedup':>9}"
            f"{'%copy':>7}")
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        config = (r["model"], r["hidden"], r["tokens"])
        if last is not None and config != last:
            lines.append("")
        last = config
        peer_us = f"{r['mlx_lm_us']:12.1f}" if r["mlx_lm_us"] is not None else f"{'-':>12}"
        peer_gbps = f"{r['mlx_lm_gbps']:8.1f}" if r["mlx_lm_gbps"] is not None else f"{'-':>8}"
        speedup = f"{r['speedup']:8.2f}x" if r["speedup"] is not None else f"{'-':>9}"
        of_copy = f"{100 * r['of_copy']:6.0f}%" if r["of_copy"] is not None else f"{'':>7}"
        lines.append(
            f"{r['model']:<14}{r['experts']:>4}{r['top_k']:>4}{r['hidden']:>6}{r['tokens']:>7}  "
            f"{r['op']:<8}{r['ours_us']:11.1f}{format_mb(r['bytes']):>9}{r['ours_gbps']:8.1f}"
            f"{peer_us}{peer_gbps}{speedup}{of_copy}"
        )
    return "\n".join(lines)


def targets(rows: list[dict], on_gpu: bool) -> tuple[list[dict], str]:
    """The targets at the HEADLINE shape, if this run measured it: (found, text)."""
    where = dict(HEADLINE)
    shape = LAYER_SHAPES[where["model"]]
    title = (f"targets at the headline shape ({where['model']} E={shape.experts} K={shape.top_k}, "
             f"H={where['hidden']}, T={where['tokens']}, {where['dtype']}), "
             f"{'GPU' if on_gpu else 'CPU'}; information, not an assertion:")

    def row(op):
        return next((r for r in rows if r["op"] == op and r["model"] == where["model"]
                     and r["hidden"] == where["hidden"] and r["tokens"] == where["tokens"]
                     and r["dtype"] == where["dtype"]), None)

    if row("plan") is None:
        return [], title.split(";")[0] + ": not in this run"
    found = []
    if on_gpu:
        plan, gather = row("plan"), row("gather")
        found.append({"name": "plan us/call", "value": plan["ours_us"],
                      "target": f"<= {GPU_PLAN_US_TARGET:g} us",
                      "pass": plan["ours_us"] <= GPU_PLAN_US_TARGET,
                      "text": f"{plan['ours_us']:.1f} us"})
        if gather and gather["of_copy"] is not None:
            found.append({"name": "gather GB/s / copy GB/s", "value": gather["of_copy"],
                          "target": f">= {100 * GPU_GATHER_COPY_TARGET:.0f}%",
                          "pass": gather["of_copy"] >= GPU_GATHER_COPY_TARGET,
                          "text": f"{100 * gather['of_copy']:.0f}%"})
        for op in ("plan", "gather", "combine"):  # informative on a GPU
            r = row(op)
            if r and r["speedup"] is not None:
                found.append({"name": f"{op} vs mlx-lm", "value": r["speedup"], "target": None,
                              "pass": None, "text": f"{r['speedup']:.2f}x"})
    else:
        names = {"plan": "plan vs mlx-lm index work", "gather": "gather vs mlx-lm take",
                 "combine": "combine vs unsort + weighted sum"}
        for op, goal in CPU_SPEEDUP_TARGETS.items():
            r = row(op)
            ok = None if r is None or r["speedup"] is None else r["speedup"] >= goal
            text = "n/a (mlx-lm not installed)" if ok is None else f"{r['speedup']:.2f}x"
            found.append({"name": names[op], "value": None if ok is None else r["speedup"],
                          "target": f">= {goal:g}x", "pass": ok, "text": text})
        gather = row("gather")
        if gather and gather["of_copy"] is not None:
            found.append({"name": "gather GB/s / copy GB/s", "value": gather["of_copy"],
                          "target": None, "pass": None, "text": f"{100 * gather['of_copy']:.0f}%"})
    lines = [title]
    for t in found:
        verdict = "" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        goal = f"(target {t['target']})" if t["target"] else ""
        lines.append(f"  {t['name']:<34}{t['text']:>12}  {goal:<20}{verdict}")
    return found, "\n".join(lines)


def page_fault_note(results: list[dict], on_gpu: bool) -> str | None:
    """On a CPU, say when fresh output pages bound the data ops (MLX keeps no CPU buffer cache)."""
    copies = [r for r in results if r["op"] == "copy"]
    if on_gpu or not copies:
        return None
    big = max(copies, key=lambda r: r["bytes"])
    try:
        page = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        page = 4096
    out_pages = big["bytes"] / 2 / page
    if big["page_faults"] < 0.5 * out_pages:
        return None
    return (f"the copy at T={big['tokens']} takes {big['page_faults']:.0f} page faults a call "
            f"({big['page_faults'] / out_pages:.0%} of its output's pages): MLX's CPU allocator "
            f"hands large outputs fresh memory, so first-touch faults bound ours, mlx-lm and the "
            f"copy alike")


def device_description() -> dict:
    """The default device: its name, type and what `mx.device_info` says of it."""
    device = mx.default_device()
    info = {}
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception:
        pass
    return {"device": str(device), "type": "gpu" if device.type == mx.gpu else "cpu",
            "name": info.get("device_name", platform.processor() or platform.machine()),
            "info": info, "cpu_count": os.cpu_count()}


def header(device: dict, dtype: str, hidden_rule: str, checks_passed: int, elapsed_s: float,
           notes: list[str]) -> str:
    """The lines above the table: what ran where, how it is measured, the notes."""
    lines = [
        f"mlx_moe_plan benchmark on {device['device']} ({device['name']}), mlx {mx.__version__}, "
        f"mlx-lm {mlx_lm.__version__ if mlx_lm else 'not installed'}",
        f"{dtype} activations, {hidden_rule}, random top-K routing; "
        f"{checks_passed} checks bit for bit against mlx_moe_plan.reference passed; "
        f"{elapsed_s:.0f} s",
        "us/call, GB/s: ours (the copy's on copy rows); mlx-lm us, GB/s: the peer; "
        "speedup = mlx-lm us / ours us",
        "  each time: the median over repeats of one mx.eval of a graph of many calls on "
        "distinct inputs",
        *(f"{key}: {text}" for key, text in LEGEND.items()),
    ]
    lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)


def json_document(*, command: str, device: dict, run: dict, settings: dict, checks: list[dict],
                  results: list[dict], rows: list[dict], found: list[dict], notes: list[str],
                  elapsed_s: float) -> dict:
    """Every result of the run, with its environment, as `--json` writes it.

    Args:
        command (str): The command line that ran.
        device (dict): `device_description()`.
        run (dict): What was measured: dtype, hidden, shapes, tokens.
        settings (dict): How it was timed.
        checks (list): The checks passed.
        results (list): Every measurement.
        rows (list): `summarize(results)`.
        found (list): `targets(rows, ...)`'s targets.
        notes (list): The header's notes.
        elapsed_s (float): Seconds the checks and timing took.

    Returns:
        dict: The document, ready for `json.dump`.
    """
    return {
        "benchmark": "benchmarks.moe", "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__ if mlx_lm else None,
        "python": platform.python_version(), "platform": platform.platform(),
        **run,
        "settings": settings,
        "legend": LEGEND,
        "checks": checks, "results": results, "summary": rows,
        "targets": {"headline": HEADLINE, "device": device["type"], "found": found},
        "notes": notes, "elapsed_s": elapsed_s,
    }

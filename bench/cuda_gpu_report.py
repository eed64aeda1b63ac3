"""One report of a GPU run (bench/cuda_gpu_run.sh): every step's JSON in DIR merged into
ONE OUTDIR/gpu_run.json and ONE markdown file OUTDIR/gpu_run.md, which is also printed.

Run: python bench/cuda_gpu_report.py DIR [--out OUTDIR]      (OUTDIR: DIR unless given)

DIR holds each step's JSON, named after the step (examples.json, optimizer_f32.json, ...), and
optionally steps.tsv (one line a step: name, exit code, seconds; the run script writes it).
What each JSON is, is read from its contents:
  * bench/cuda_gpu_check.py's ("examples": rows): one "way" each (examples: as allocated, the
    vector path; misalign: the element path; symmetric: the device-API kernel; chunks: many
    chunks per fused collective): matches per way, and every row that is not a match listed;
  * bench/cuda_optimizer_check.py's ("checks"): each check's value against its tolerance;
  * bench/cuda_optimizer.py's ("rows" with "table"): its tables (cuda_optimizer.markdown);
  * bench/cuda_gpu_check.py --kernels' ("kernels": runs): every kernel against its bound, per
    schedule the call's time, its kernels' time and their bound, then per unit measured / bound
    (cuda_gpu_check.kernels_report);
  * the timing tables of bench/tp_mlp.py and bench/adam_step.py --backend cuda ("sizes", each
    with "baselines" and "coconet", in seconds): per size, every variant's ms and its time over
    the best baseline (and over the memory roofline where the JSON has one).
The order of the markdown: the steps (exit code, seconds), the examples' matches, the optimizer,
then every other table in the order of steps.tsv (else the run script's order, then by name). gpu_run.json holds the
steps, the summary of matches per way and every step's JSON whole under "results" (so nothing
needs to come back beside it). A JSON that does not parse, or that no section knows, is named
in the report, never a reason to stop."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_optimizer  # noqa: E402  (its tables: one home)
import cuda_gpu_check  # noqa: E402  (the kernels' table: one home)

WAYS = {"examples": "as allocated (vector path)", "misalign": "every tensor one element off (element path)",
        "symmetric": "COCONET_CUDA_FUSED=symmetric (device-API kernel)",
        "chunks": "size 37 in 5-element chunks (COCONET_CUDA_CHUNK=5)"}

# without steps.tsv: the run script's order of its steps
FALLBACK_ORDER = ["examples", "kernels", "optimizer_check", "optimizer_f32", "optimizer_bf16", "tp_mlp_f32", "tp_mlp_bf16", "gpt_block_f32",
                  "gpt_block_bf16", "symmetric",
                  "misalign", "chunks", "adam_step", "adam_step_pipeline", "adam_step_symmetric"]


def read_steps(d: Path) -> list[dict]:
    """steps.tsv: name, exit code, seconds (in the order they ran)."""
    f = d / "steps.tsv"
    if not f.exists():
        return []
    out = []
    for line in f.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            out.append({"step": parts[0], "exit": int(parts[1]) if parts[1].lstrip("-").isdigit() else parts[1],
                        "seconds": int(parts[2]) if parts[2].isdigit() else parts[2]})
    return out


def examples_section(results: dict[str, Any]) -> tuple[list[str], dict]:
    checks = {k: v for k, v in results.items() if isinstance(v, dict) and isinstance(v.get("examples"), list)}
    if not checks:
        return [], {}
    summary = {}
    lines = ["\n## Every example, program and schedule against the interpreter (bench/cuda_gpu_check.py)\n",
             "| way | matches | runs | not matching |", "| --- | --- | --- | --- |"]
    for name, doc in checks.items():
        rows = doc["examples"]
        match = sum(r.get("status") == "match" for r in rows)
        summary[name] = {"match": match, "runs": len(rows)}
        lines.append(f"| {name}: {WAYS.get(name, '')} | {match} | {len(rows)} | {len(rows) - match} |")
    bad: dict[tuple, list[str]] = {}  # a run failing alike in several ways: one line naming them
    for name, doc in checks.items():
        for r in doc["examples"]:
            if r.get("status") != "match":
                detail = str(r.get("detail", "")).strip().splitlines() or [""]
                key = (r.get("file"), r.get("program"), r.get("schedule"), r.get("sizes", ""), r.get("status"),
                       _cell(detail[-1][-240:]))
                bad.setdefault(key, []).append(name)
    if bad:
        lines += ["\nEvery run that did not match (the detail's last line):\n",
                  "| ways | file | program | schedule | sizes | result | detail |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for (f, prog, sched, sizes, status, detail), ways in bad.items():
            lines.append(f"| {', '.join(ways)} | {f} | {prog} | {sched} | {sizes} | {status} | {detail} |")
    else:
        lines.append("\nEvery run matched.")
    return lines, summary


def _cell(text: str) -> str:
    """TEXT in one markdown table cell."""
    return text.replace("\n", " ").replace("|", "\\|")


def _size(n: str) -> str:
    k = int(n)
    return f"2^{k.bit_length() - 1}" if k > 0 and k & (k - 1) == 0 else str(k)


def timing_section(name: str, doc: dict) -> list[str]:
    """A JSON with per-size baselines and coconet variants (seconds)."""
    head = ", ".join(f"{k} {doc[k]}" for k in ("device", "torch", "dtype", "backend", "ranks") if k in doc)
    lines = [f"\n## {name} ({head})\n", "| size | variant | ms | x best baseline | x memory roofline |",
             "| --- | --- | --- | --- | --- |"]
    for n, r in sorted(doc["sizes"].items(), key=lambda kv: int(kv[0])):
        base, ours = r.get("baselines") or {}, r.get("coconet") or {}
        best = min(base.values()) if base else None
        roof = r.get("roofline")
        for label, t in [*base.items(), *((f"coconet {k}", v) for k, v in ours.items())]:
            vs_base = f"{t / best:.2f}" if best else ""
            vs_roof = f"{t / roof:.2f}" if roof else ""
            lines.append(f"| {_size(n)} | {_cell(label)} | {t * 1e3:.4g} | {vs_base} | {vs_roof} |")
        if r.get("shape"):
            lines.append(f"| {_size(n)} | shape {r['shape']} | | | |")
        for what, d in (r.get("max_abs_diff_vs_torch") or {}).items():
            lines.append(f"| {_size(n)} | {_cell(what)} | {d:.2g} | | |")
    return lines


def read_results(d: Path, steps: list[dict]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every JSON of DIR (by step name, in the order the steps ran), and those that do not parse."""
    order = {name: i for i, name in enumerate([s["step"] for s in steps] or FALLBACK_ORDER)}
    results: dict[str, Any] = {}
    unread: dict[str, str] = {}
    for f in sorted(d.glob("*.json"), key=lambda f: (order.get(f.stem, len(order)), f.stem)):
        if f.name == "gpu_run.json":
            continue
        try:
            results[f.stem] = json.loads(f.read_text())
        except (OSError, ValueError) as err:
            unread[f.stem] = f"{type(err).__name__}: {err}"
    return results, unread


def _is_optimizer(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("rows"), list) and all("table" in r for r in doc["rows"])


def _is_checks(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("checks"), list)


def checks_section(name: str, doc: dict) -> list[str]:
    """bench/cuda_optimizer_check.py's checks: each one's value against its tolerance."""
    rows = doc["checks"]
    ok = sum(1 for r in rows if r.get("ok"))
    lines = [f"\n## {name} (bench/cuda_optimizer_check.py): {ok} of {len(rows)} checks passed",
             "\n| check | value | tolerance | result |", "| --- | --- | --- | --- |"]
    for r in rows:
        v = r.get("value")
        value = f"{v:.3g}" if isinstance(v, float) else _cell(str(v))
        lines.append(f"| {_cell(str(r.get('check')))} | {value} | {r.get('tolerance') or ''} | "
                     f"{'ok' if r.get('ok') else 'FAILED'} |")
    return lines


def _is_kernels(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("kernels"), dict) and isinstance(doc["kernels"].get("runs"), list)


def kernels_section(results: dict[str, Any], unread: dict[str, str]) -> list[str]:
    """bench/cuda_gpu_check.py --kernels' JSONs: every kernel against its bound."""
    lines: list[str] = []
    for name, doc in results.items():
        if _is_kernels(doc):
            try:
                lines += ["", cuda_gpu_check.kernels_report(doc["kernels"])]
            except Exception as err:  # noqa: BLE001 - a table that does not read is named, not fatal
                unread[name] = f"{type(err).__name__}: {err}"
    return lines


def _is_timing(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("sizes"), dict) and all(
        isinstance(r, dict) and "coconet" in r for r in doc["sizes"].values())


def _is_block(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("ratios"), dict) and "vs_torch_sdpa" in next(
        iter(doc["ratios"].values()), {})


def block_section(name: str, doc: dict) -> list[str]:
    """bench/gpt_block_gpu.py's table: each variant's time and its ratio to torch eager with SDPA."""
    sh = doc.get("shape", {})
    lines = [f"\n## {name} (bench/gpt_block_gpu.py: gpt_block forward + backward at one rank, {doc.get('dtype')}, "
             f"{doc.get('device', '')}, " + " ".join(f"{k}={v}" for k, v in sh.items()) + ")",
             "\n| variant | ms | torch SDPA / this | GEMMs alone / this |", "| --- | --- | --- | --- |"]
    for k, t in doc["times"].items():
        r = doc["ratios"][k]
        lines.append(f"| {k} | {t * 1e3:.3f} | {r['vs_torch_sdpa']:.2f} | {r['gemm_fraction']:.2f} |")
    return lines


def _table(name: str, doc: Any, unread: dict[str, str]) -> list[str]:
    """A step's table (the GPT block's, or a timing table), or nothing and why in UNREAD."""
    try:
        if _is_block(doc):
            return block_section(name, doc)
        if _is_timing(doc):
            return timing_section(name, doc)
        unread.setdefault(name, "not a table this report knows")
    except Exception as err:  # noqa: BLE001 - a table that does not read is named, not fatal
        unread[name] = f"{type(err).__name__}: {err}"
    return []


def render(steps: list[dict], results: dict[str, Any], unread: dict[str, str]) -> tuple[str, dict]:
    """The markdown (steps, examples, optimizer, the other tables, what was not read) and the
    summary of matches per way."""
    lines = ["# GPU run report (bench/cuda_gpu_run.sh)"]
    if steps:
        lines += ["\n| step | exit | seconds |", "| --- | --- | --- |"]
        lines += [f"| {s['step']} | {s['exit']} | {s['seconds']} |" for s in steps]
    ex_lines, summary = examples_section(results)
    lines += ex_lines
    for name, doc in results.items():
        if name not in summary and _is_checks(doc):
            lines += checks_section(name, doc)
    lines += kernels_section(results, unread)
    for name, doc in results.items():
        if name not in summary and _is_optimizer(doc):
            lines += [f"\n## {name} (bench/cuda_optimizer.py; communicator: {doc.get('communicator', '')})",
                      cuda_optimizer.markdown(doc)]
    for name, doc in results.items():
        if name in summary or _is_optimizer(doc) or _is_checks(doc) or _is_kernels(doc):
            continue
        lines += _table(name, doc, unread)
    missing = [s["step"] for s in steps if s["step"] not in results and s["step"] != "report"]
    if missing:
        lines.append(f"\nSteps without a JSON: {', '.join(missing)} (see run.log).")
    for name, why in unread.items():
        lines.append(f"\n{name}.json: not in the report ({why}).")
    return "\n".join(lines) + "\n", summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the steps' JSON (and steps.tsv)")
    ap.add_argument("--out", default=None, help="where gpu_run.json and gpu_run.md go (default: DIR)")
    a = ap.parse_args()
    d = Path(a.dir)
    out = Path(a.out) if a.out else d
    out.mkdir(parents=True, exist_ok=True)
    steps = read_steps(d)
    results, unread = read_results(d, steps)
    md, summary = render(steps, results, unread)
    merged = {"steps": steps, "examples_matches": summary, "results": results, "not_read": unread}
    (out / "gpu_run.json").write_text(json.dumps(merged, indent=1))
    (out / "gpu_run.md").write_text(md)
    print(md)
    print(f"wrote {out / 'gpu_run.json'} and {out / 'gpu_run.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

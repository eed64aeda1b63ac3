"""`coconetc explain`: for each schedule of a program, the cost model's numbers (plan/cost.py) next
to the time the tuning cache measured at the same sizes and ranks, if any. The schedules the
tuner wrote and measured for these sizes are listed too.

A target ("cpu", "cuda", "cuda-emulated") picks the records: those measured there (tuned.py).
The cost model is the CPU backend's, so on a CUDA target its modelled time is left out (the
header says so): its counts (bytes moved and sent, passes, launches, units) are the plan's as
the CPU backend runs it, and the per-unit algorithm, the CPU runtime's, is not shown."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from coconetc.ir import ops
from coconetc.plan.label import DEFAULT, parse
from coconetc.plan.targets import Target
from coconetc.sourcefile import SourceFile, add_schedules
from coconetc.oracle.inputs import size_symbols
from coconetc.runtime import tuned as cache
from coconetc.plan.units import Library, Plan, title
from coconetc.plan.cost import Cost, Machine, cost


class ExplainError(Exception):
    pass


def symbols(mod: SourceFile, program: str) -> list[str]:
    return size_symbols(mod.programs[program])


def _sizes(mod: SourceFile, program: str, ranks: int, given: dict[str, int],
           target: str) -> dict[str, int]:
    need = symbols(mod, program)
    if all(k in given for k in need):
        return {k: given[k] for k in need}
    recs = [r for r in cache.records(mod.source, program, target) if r.get("ranks") == ranks]
    if recs and not given:
        return dict(recs[-1]["sizes"])
    missing = " ".join(f"--size {k}=INT" for k in need if k not in given)
    sizes = {k: given.get(k, "INT") for k in need}
    raise ExplainError(f"explain {program}: give the sizes ({missing}); the tuning cache has "
                       f"no record of '{program}' on {ranks} ranks{Target(target).facts.measured_on} to take "
                       f"them from (`{cache.tune_command(mod.file, program, ranks, sizes, target)}` makes one)")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def explain(mod: SourceFile, program: str, schedule: str | None, ranks: int,
            given: dict[str, int], nodes: int = 1, target: str = "cpu") -> str:
    """The table for one program (all its schedules, or SCHEDULE; 'auto': the tuned choice);
    over NODES nodes, with the bytes per rank that cross the network (docs/cluster.md); the
    measured times those of TARGET's records (on a CUDA target, no modelled time)."""
    if nodes < 1 or ranks % nodes:
        raise ExplainError(f"--nodes {nodes} does not divide the {ranks} ranks into equal nodes")
    sizes = _sizes(mod, program, ranks, given, target)
    rec = cache.lookup(mod.source, program, sizes, ranks, target=target)
    if rec is not None:
        extra = cache.generated_texts(rec)
        mod = add_schedules(mod, extra) if extra else mod
    labels = _labels(mod, program, schedule, rec)
    if schedule == "auto" and rec is None:
        raise ExplainError(f"no tuned choice for '{program}' at these sizes on {ranks} ranks"
                           f"{Target(target).facts.measured_on}; run "
                           f"`{cache.tune_command(mod.file, program, ranks, sizes, target)}`")
    modelled = Target(target).facts.modelled  # the cost model is the CPU backend's
    measured = rec["measured"] if rec is not None else {}
    head = (f"{'schedule':<26} {'moved':>11} {'sent/rank':>11} " + (f"{'net/rank':>11} " if nodes > 1 else "")
            + f"{'passes':>6} {'launches':>8} {'units':>5} " + (f"{'modelled':>11} " if modelled else "")
            + f"{'measured':>11}")
    lines = [_title(program, sizes, ranks, nodes, target), head]
    for label in labels:
        lab = parse(label)
        c = cost(mod.plans[(program, lab.name)], sizes, ranks, nodes, window=lab.algorithm != "p2p")
        got = f"{measured[label] * 1e3:.3f} ms" if label in measured and nodes == 1 else "-"
        note = " (tuner's choice)" if rec is not None and label == rec["choice"] else ""
        note += " (generated)" if rec is not None and label in rec["generated"] else ""
        net = f"{_human(c.net):>11} " if nodes > 1 else ""
        model = f"{c.seconds() * 1e3:>8.3f} ms " if modelled else ""
        lines.append(f"{label:<26} {_human(c.moved):>11} {_human(c.sent):>11} {net}{c.passes:>6} "
                     f"{c.launches:>8} {c.units:>5} {model}{got:>11}{note}")
        if len(labels) == 1:
            lines += _units(c, algorithms=modelled)
    if rec is None and not modelled:
        lines.append(f"(no record{Target(target).facts.measured_on} at these sizes on {ranks} ranks: run "
                     f"`{cache.tune_command(mod.file, program, ranks, sizes, target)}`)")
    return "\n".join(lines) + "\n"


def _labels(mod: SourceFile, program: str, schedule: str | None, rec: dict | None) -> list[str]:
    """The rows: every schedule (each measured with another fused-collective algorithm after
    it), or SCHEDULE ('auto': the record's choice)."""
    labels = ["default", *(s for s, x in mod.schedules.get(program, {}).items() if not x.auto)]
    if rec is not None:
        labels = [x for s in labels for x in [s, *sorted(m for m in rec["measured"]
                                                          if parse(m).name == s and m != s)]]
    if schedule == "auto":
        return [rec["choice"]] if rec is not None else []
    if schedule is None:
        return labels
    try:  # a label: "zero", "zero@p2p", "default"
        name = parse(schedule).name
    except ValueError as err:
        raise ExplainError(str(err)) from None
    if name != DEFAULT and name not in mod.schedules.get(program, {}):
        raise ExplainError(f"no schedule '{name}' for program '{program}' (schedules: "
                           f"{', '.join(labels)})")
    return [schedule]


def _title(program: str, sizes: dict[str, int], ranks: int, nodes: int, target: str) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
    where = f"{ranks} ranks" + (f" over {nodes} nodes" if nodes > 1 else "")
    if Target(target).facts.modelled:
        return f"{program} at {shown} on {where} (per rank; cost model: docs/performance.md)"
    return (f"{program} at {shown} on {where}, measured{Target(target).facts.measured_on} (per rank; the "
            f"counts are the CPU cost model's, docs/performance.md; its modelled times are the CPU "
            f"backend's and do not apply to {target}, so none is shown)")


def _units(c, algorithms: bool = True) -> list[str]:
    """One row per plan unit (a single schedule explained); ALGORITHMS: each collective's, as
    the CPU runtime chooses it."""
    out = []
    for u, part in c.parts:
        where = f"L{u.line}" if getattr(u, "line", 0) else "-"
        what = type(u).__name__.lower()
        name = getattr(u, "dst", "") or getattr(u, "name", "") or getattr(u, "producer", "")
        label = f"  {where} {what} {name}".rstrip()
        algo = f"  ({part.algorithm})" if part.algorithm and algorithms else ""
        out.append(f"{label:<26} {_human(part.moved):>11} {_human(part.sent):>11} {part.passes:>6} "
                   f"{part.launches:>8}{algo}")
    return out


# --- explain --measure: each unit measured (a trace of the ranks' calls) against the model ---

def cpu_bound(part: Cost, m: Machine | None = None) -> float:
    """A unit's bound on the CPU, in seconds: its slowest resource at the cost model's rates
    (bytes through memory, bytes sent, flops), without the model's per-launch and per-collective
    terms or the overlaps' hiding."""
    m = m or Machine()
    return max(part.moved / m.mem_bw, part.sent / m.link_bw, part.flops / m.flop_rate)


def _one_run(plan: Plan) -> dict[int, tuple[list[int], str]]:
    """The units the CPU runs as one and their row's name, by the unit whose trace mark times
    them all (the others' marks are empty): an attention core's members, by its last
    (Plan.attention); a GEMM and the loop after it that it computes as its epilogue
    (Library.epilogue), by the GEMM; a layernorm_dx and the layernorm_dgamma and sum_lead whose
    results it computes (Library.grads, plan/lngrads.py), by the layernorm_dx."""
    groups = {a.members[-1]: (list(a.members), f"attention {a.kind} call (units {a.members[0]}-{a.members[-1]})")
              for a in plan.attention if "cpu" in a.fused}
    made = {u.dst: i for i, u in enumerate(plan.units) if isinstance(u, Library)}
    for i, u in enumerate(plan.units):
        if not isinstance(u, Library):
            continue
        members, name = [i], title(u)
        if u.epilogue is not None and "cpu" in u.fused and i + 1 < len(plan.units):
            members, name = [i, i + 1], f"{title(u)} + epilogue {title(plan.units[i + 1])}"
        if u.grads is not None and "cpu" in u.grads.on:
            also = [made[n] for n in (u.grads.dgamma, u.grads.dbeta) if n]
            members += also
            name += "".join(f" + {title(plan.units[k])}" for k in also)
        if len(members) > 1:
            groups[i] = (members, name)
    return groups


def measured_units(mod: SourceFile, program: str, label: str, ranks: int, sizes: dict[str, int],
                   traces: list[dict]) -> dict:
    """Each unit of PROGRAM's plan under LABEL, measured in TRACES (each rank's trace file of
    the calls, coconetc/runtime/trace.py; the first call of each rank left out as a warm-up):
    the median over the calls of each unit's time on the slowest rank, the cost model's
    prediction at SIZES and the unit's bound (cpu_bound); the same for the whole call, and
    predicted / measured. A row per unit ("units": its index in the plan), except where the CPU
    runs several as one (_one_run): one row for them, their sums."""
    plan = mod.plans[(program, parse(label).name)]
    c = cost(plan, sizes, ranks, window=parse(label).algorithm != "p2p")
    per_rank: list[list[list[float]]] = []  # rank -> call -> [call's own time, each unit's time]
    for doc in traces:
        events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        calls = [e for e in events if e["cat"] == "call"]
        rows = []
        for call in calls:
            end = call["ts"] + call["dur"]
            units = [e for e in events if e["cat"] == "unit" and call["ts"] <= e["ts"] <= end]
            times = [0.0] * len(plan.units)
            for e in units:
                times[e["args"]["unit_index"]] += e["dur"] * 1e-6
            rows.append([sum(times), *times])
        per_rank.append(rows[1:] if len(rows) > 1 else rows)
    n = min((len(r) for r in per_rank), default=0)
    if n == 0:
        raise ExplainError(f"no traced call of {program} [{label}] was found")
    slowest = [[max(r[k][j] for r in per_rank) for j in range(len(plan.units) + 1)] for k in range(n)]
    median = [statistics.median(col) for col in zip(*slowest)]
    units = []
    groups = _one_run(plan)
    inside = {k for members, _ in groups.values() for k in members}
    for i, u in enumerate(plan.units):
        if i in inside and i not in groups:
            continue
        members, name = groups.get(i, ([i], title(u)))
        parts = [c.parts[k][1] for k in members]
        units.append({"unit": name, "units": members, "measured_s": sum(median[1 + k] for k in members),
                      "predicted_s": sum(q.seconds() for q in parts), "bound_s": sum(cpu_bound(q) for q in parts)})
    whole = median[0]
    return {"program": program, "schedule": label, "ranks": ranks, "sizes": sizes, "calls": n, "units": units,
            "measured_s": whole, "predicted_s": c.seconds(), "bound_s": sum(r["bound_s"] for r in units),
            "predicted_over_measured": c.seconds() / whole if whole > 0 else None}


def units_table(m: dict) -> str:
    """`explain --measure`'s table of measured_units."""
    shown = ", ".join(f"{k}={v}" for k, v in m["sizes"].items())
    lines = [f"{m['program']} [{m['schedule']}] at {shown} on {m['ranks']} ranks: each unit's time on the slowest "
             f"rank, median of {m['calls']} calls (a trace), against the cost model",
             f"{'unit':<58} {'measured':>11} {'predicted':>11} {'bound':>11} {'pred/meas':>9}"]
    for r in [*m["units"], {"unit": "the units together", "measured_s": m["measured_s"],
                            "predicted_s": m["predicted_s"], "bound_s": m["bound_s"]}]:
        ratio = f"{r['predicted_s'] / r['measured_s']:.2f}" if r["measured_s"] > 0 else "-"
        name = r["unit"] if len(r["unit"]) <= 58 else r["unit"][:55] + "..."
        lines.append(f"{name:<58} {_time(r['measured_s']):>11} {_time(r['predicted_s']):>11} "
                     f"{_time(r['bound_s']):>11} {ratio:>9}")
    ratio = m["predicted_over_measured"]
    lines.append(f"the cost model's error for the call: predicted / measured = "
                 f"{f'{ratio:.2f}' if ratio is not None else '-'}")
    return "\n".join(lines) + "\n"


# --- the kernel listing (--backend cuda -s S): each unit's kernels against its bound ----------

# Defaults of the bound, an H100 / H200 SXM's data sheet (NVIDIA): HBM bandwidth in GB/s (H100
# 3350, H200 4800; `--bandwidth`, or the copy bandwidth the GPU script measured, `--machine`) and
# the dense peak in TFLOP/s by the dtype of a library operation's result (the same SMs in both:
# f32 and f64 without tensor cores, as cuBLAS runs f32 by default, bf16/f16 on tensor cores).
GPU_BANDWIDTH_GBPS = {"h100": 3350.0, "h200": 4800.0}
PEAK_TFLOPS = {"f64": 67.0, "f32": 67.0, "bf16": 989.0, "f16": 989.0}
DEFAULT_BANDWIDTH_GBPS = GPU_BANDWIDTH_GBPS["h100"]

# what a profiler's kernel names look like, by the library a unit calls (matched case-blind)
LIBRARY_PATTERNS = {
    "nccl": r"nccl",
    "cublas": r"gemm|gemv|cutlass|xmma|cublas|splitkreduce",
    "memcpy": r"^memcpy|^memset",
    "runtime": r"coconet::cuda::(?!.*coconet_gen::)",  # the runtime's own kernels (reductions, layernorm, ...)
}


@dataclass
class KernelRow:
    """One plan unit in launch order: the kernels the generated code launches for it (extended
    lambdas, named as CUPTI demangles them: FUNC(...)::{lambda(SIG)#K}, K counting FUNC's lambdas
    of that signature in the code's order) and the libraries it calls, its bytes and flops (the
    cost model's, plan/cost.py) and its bound at a bandwidth and peak."""

    unit: int
    what: str
    line: int
    kernels: list[str]
    libraries: list[str]
    read: float
    written: float
    flops: float
    dtype: str
    epilogue: str
    bound_s: float = 0.0
    limit: str = ""

    def as_json(self) -> dict:
        return {k: getattr(self, k) for k in ("unit", "what", "line", "kernels", "libraries", "read", "written",
                                               "flops", "dtype", "epilogue", "bound_s", "limit")}


def machine_rates(bandwidth: float | None = None, peak: float | None = None,
                  machine: str | None = None) -> tuple[float, dict[str, float], str]:
    """(bytes/s, flop/s per dtype, where they come from): --bandwidth GB/s and --peak TFLOP/s
    first, then a measured JSON (MACHINE: {"bandwidth_gbps": .., "peak_tflops": {dtype: ..}}, the
    GPU script writes one), then the defaults (an H100's)."""
    bw, peaks, said = DEFAULT_BANDWIDTH_GBPS, dict(PEAK_TFLOPS), "H100 SXM data sheet"
    if machine:
        try:
            doc = json.loads(Path(machine).read_text())
            bw = float(doc.get("bandwidth_gbps", bw))
            peaks.update({k: float(v) for k, v in (doc.get("peak_tflops") or {}).items()})
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise ExplainError(f"--machine {machine}: not a machine JSON ({err})") from None
        said = f"{machine}{' (' + doc['device'] + ')' if doc.get('device') else ''}"
    if bandwidth is not None:
        bw, said = bandwidth, "given"
    if peak is not None:
        peaks = {k: peak for k in peaks}
        said = "given"
    if bw <= 0 or any(v <= 0 for v in peaks.values()):
        raise ExplainError("--bandwidth and --peak must be positive")
    return bw * 1e9, {k: v * 1e12 for k, v in peaks.items()}, said


def bound(read: float, written: float, flops: float, bw: float, peak: float) -> tuple[float, str]:
    """The least time a unit can take: its bytes at the copy bandwidth or its flops at the peak,
    whichever is longer (a roofline)."""
    mem, compute = (read + written) / bw, flops / peak
    return max(mem, compute), ("compute" if compute > mem else "memory")


_LAMBDA = re.compile(r"\[[=&][^\]\n]*\]\s*(?:__device__\s*|__host__\s*|mutable\s*)*\(([^)]*)\)")


def _signature(params: str) -> str:
    """A lambda's parameter list from the source (`const T& th, int64_t q`) as a demangled name
    writes it (`T const&, long`; a generic lambda's k-th `auto` as `auto:k`)."""
    out: list[str] = []
    autos = 0
    for p in _split_top(params):
        p = p.strip()
        if not p:
            continue
        if re.search(r"[\w>*&]\s+[A-Za-z_]\w*$", p):  # the parameter's name
            p = re.sub(r"\s*\b[A-Za-z_]\w*$", "", p)
        ref = p.endswith("&")
        p = p.rstrip("&").strip()
        if p.startswith("const "):
            p = p[len("const "):] + " const"
        if p.split()[0] == "auto":
            autos += 1
            p = p.replace("auto", f"auto:{autos}", 1)
        out.append(p.replace("int64_t", "long") + ("&" if ref else ""))
    return ", ".join(out)


def _norm(sig: str) -> str:
    """A signature compared alike however it is spelled (spaces, const, &, int64_t)."""
    return re.sub(r"\bconst\b|&|\s", "", sig).replace("int64_t", "long")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


_CHAIN = re.compile(r"coconet_gen::(\w+)\([^)]*\)((?:::\{lambda\([^)]*\)#\d+\}(?:::operator\(\)\([^)]*\)(?: const)?)?)+)")


def lambda_key(name: str) -> tuple[str, tuple[tuple[str, int], ...]] | None:
    """(function, ((signature, K), ...) from the outermost lambda in) of a generated kernel's
    demangled name (`...coconet_gen::FUNC(...)::{lambda(SIG)#K}...`, a lambda inside another
    `...{lambda(S1)#K1}::operator()(S1) const::{lambda(S2)#K2}`), None for any other kernel."""
    m = _CHAIN.search(name)
    if not m:
        return None
    return m.group(1), tuple((_norm(sig), int(k)) for sig, k in re.findall(r"\{lambda\(([^)]*)\)#(\d+)\}", m.group(2)))


def _lambdas(text: str, fn: str) -> list[tuple[int, str]]:
    """Every __device__ lambda of a generated function's TEXT, the template argument of the
    kernel that runs it: (its offset, its name as CUPTI demangles it). Lambdas are numbered per signature in their scope (the function, or the lambda whose
    body holds them: the Itanium ABI's numbering, which nvcc keeps for the device symbol)."""
    found = []  # (start, body start, body end, params)
    for m in _LAMBDA.finditer(text):
        open_at = text.find("{", m.end())
        depth, end = 0, len(text)
        for j in range(open_at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                end = j
                break
        found.append((m.start(), open_at, end, _signature(m.group(1)), "__device__" in m.group(0)))
    out = []
    counts: dict[tuple[int, str], int] = {}  # (the scope's index, -1 the function) -> lambdas so far
    prefix: dict[int, str] = {}
    for i, (start, _, _, sig, device) in enumerate(found):
        scope = max((j for j in range(i) if found[j][1] < start < found[j][2]), default=-1)
        k = counts[(scope, _norm(sig))] = counts.get((scope, _norm(sig)), 0) + 1
        head = f"coconet_gen::{fn}(coconet::cuda::CallArgs const&)" if scope < 0 else \
            f"{prefix[scope]}::operator()({found[scope][3]}) const"
        prefix[i] = f"{head}::{{lambda({sig})#{k}}}"
        if device:  # a kernel's (a host lambda is counted and named, and launches none itself)
            out.append((start, prefix[i]))
    return out


def _unit_sections(plan, fn: str, file: str, outputs: list[str]) -> tuple[list[str], list[int]]:
    """The generated CUDA function of PLAN (the renderer's own output, its lines) and the line
    at which each top-level unit starts."""
    from coconetc.codegen.cuda.render import CudaRenderer

    class Sections(CudaRenderer):
        depth = 0
        marks: list[int] = []

        def unit(self, u):
            top = self.depth == 0
            if top:
                self.marks.append(len(self.w.lines))
            self.depth += 1
            try:
                super().unit(u)
            finally:
                self.depth -= 1

    r = Sections(plan, fn, file, outputs)
    r.marks = []
    lines = r.render().body
    return lines, r.marks


def kernels(mod: SourceFile, program: str, label: str, sizes: dict[str, int], ranks: int,
            bw: float, peaks: dict[str, float]) -> tuple[str, list[KernelRow]]:
    """(the generated function's name, one row per unit of LABEL's plan in launch order): what
    it launches and calls, its bytes and flops (plan/cost.py), its bound at BW bytes/s and PEAKS
    flop/s by dtype."""
    from coconetc.codegen.naming import function_name
    from coconetc.plan.units import Collective, Copy, Fused, GatherMatmul, Library, Overlap, Reduce, Require
    name = parse(label).name
    plan = mod.plans[(program, name)]
    fn = function_name(program, name)
    c = cost(plan, sizes, ranks, window=parse(label).algorithm != "p2p")
    outputs = [pub for pub, _ in mod.variants()[(program, name)].outputs]
    lines, marks = _unit_sections(plan, fn, Path(mod.file).name, outputs)
    at = [sum(len(x) + 1 for x in lines[:m]) for m in [*marks, len(lines)]]  # each unit's offset in the text
    lambdas = _lambdas("\n".join(lines), fn)
    rows = []
    for i, (u, part) in enumerate(c.parts):
        text = lines[marks[i]:marks[i + 1] if i + 1 < len(marks) else len(lines)]
        names = [n for start, n in lambdas if at[i] <= start < at[i + 1]]
        libs: list[str] = []
        if isinstance(u, (Overlap, GatherMatmul)) or (isinstance(u, Library) and ops.has(u.op, ops.GEMM)):
            libs.append("cublas")
        elif isinstance(u, Library) or isinstance(u, Reduce):
            libs.append("runtime")
        if isinstance(u, (Collective, Fused, Overlap, GatherMatmul)) or (isinstance(u, Reduce) and u.cross_rank):
            libs.append("nccl")
        if isinstance(u, Fused):
            libs.append("runtime")  # its symmetric kernel
        if isinstance(u, (Copy, Reduce)) or "nccl" in libs:
            libs.append("memcpy")  # a copy; NCCL on one rank copies; a reduction's accumulator set
        what = _what(text, u)
        dtype = _dtype(plan, u)
        read, written = part.moved - part.written, part.written
        b, limit = bound(read, written, part.flops, bw, peaks.get(dtype, peaks["f32"]))
        if isinstance(u, Require):
            b, limit = 0.0, "none"
        epi = getattr(u, "epilogue", None)
        rows.append(KernelRow(i, what, getattr(u, "line", 0), names, libs, read, written, part.flops, dtype,
                              str(epi) if epi else "", b, limit))
    return fn, rows


def _what(text: list[str], u) -> str:
    for line in text:
        m = re.match(r"\s*// \[[^\]]*\] (.*?)(?: \([^()\s]+\.ccn(?::\d+)?\))?$", line)
        if m:
            return m.group(1)
    return type(u).__name__.lower() + (f" {u.dst}" if getattr(u, "dst", "") else "")


def _dtype(plan, u) -> str:
    for attr in ("dst", "producer", "consumer", "src"):
        n = getattr(u, attr, "")
        if n:
            try:
                return plan.buffer(n).type.dtype
            except KeyError:
                pass
    t = getattr(u, "type", None)
    return t.dtype if t is not None else "f32"


def kernel_listing(mod: SourceFile, program: str, label: str, ranks: int, given: dict[str, int],
                   target: str, bandwidth: float | None = None, peak: float | None = None,
                   machine: str | None = None, records: bool = True) -> dict:
    """The listing of one schedule as JSON (what `--format json` prints, and the GPU script
    reads); RECORDS False: the sizes are not taken from the tuning cache (no GPU here to name
    its records), so all must be given."""
    if label == "auto" or label is None:
        raise ExplainError("the kernel listing is of one schedule: give -s SCHEDULE")
    _labels(mod, program, label, None)  # a schedule of this program, else the error naming them
    missing = [k for k in symbols(mod, program) if k not in given]
    if missing and not records:
        raise ExplainError(f"explain {program}: give the sizes ({' '.join(f'--size {k}=INT' for k in missing)}); "
                           f"without a GPU here no tuning record is read to take them from")
    sizes = _sizes(mod, program, ranks, given, target)
    bw, peaks, said = machine_rates(bandwidth, peak, machine)
    rec = cache.lookup(mod.source, program, sizes, ranks, target=target) if records else None
    fn, rows = kernels(mod, program, label, sizes, ranks, bw, peaks)
    return {"program": program, "schedule": label, "function": fn, "sizes": sizes, "ranks": ranks,
            "bandwidth_gbps": bw / 1e9, "peak_tflops": {k: v / 1e12 for k, v in peaks.items()},
            "rates_from": said, "kernels": [r.as_json() for r in rows],
            "bound_s": sum(r.bound_s for r in rows),
            # the call's time the tuning cache measured at these sizes and ranks on TARGET, if any
            "measured_s": (rec or {}).get("measured", {}).get(label)}


def kernel_table(doc: dict) -> str:
    """The listing as text: one row per unit, its kernels (or library calls) under it."""
    peaks = ", ".join(f"{k} {v:g}" for k, v in doc["peak_tflops"].items())
    shown = ", ".join(f"{k}={v}" for k, v in doc["sizes"].items())
    lines = [f"{doc['program']} [{doc['schedule']}] at {shown} on {doc['ranks']} ranks: function "
             f"coconet_gen::{doc['function']}; bound = max(bytes / {doc['bandwidth_gbps']:g} GB/s, flops / peak "
             f"TFLOP/s ({peaks})) ({doc['rates_from']})",
             f"{'#':>2} {'line':>5} {'unit':<40} {'read':>11} {'written':>11} {'flops':>10} {'bound':>10} limit"]
    for r in doc["kernels"]:
        what = r["what"] + (f" + epilogue {r['epilogue']}" if r["epilogue"] else "")
        lines.append(f"{r['unit']:>2} {'L' + str(r['line']) if r['line'] else '-':>5} {what[:40]:<40} "
                     f"{_human(r['read']):>11} {_human(r['written']):>11} {_flops(r['flops']):>10} "
                     f"{_time(r['bound_s']):>10} {r['limit']}")
        for k in r["kernels"]:
            lines.append(f"{'':>9}kernel {k}")
        if r["libraries"]:
            lines.append(f"{'':>9}calls {', '.join(r['libraries'])}")
    lines.append(f"{'':>9}total bound {_time(doc['bound_s'])}" + (
        f"; the call measured {_time(doc['measured_s'])} (tuning cache)" if doc.get("measured_s") else ""))
    return "\n".join(lines) + "\n"


# --- a profiler's kernels matched to the listing (the GPU script, bench/cuda_gpu_check.py --kernels) --

def trace_kernels(trace: dict | list) -> list[dict]:
    """The device activity of a Chrome trace (torch.profiler's export_chrome_trace: events of
    category kernel, gpu_memcpy, gpu_memset) as {name, ts, dur} (microseconds), in start order."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("ph", "X") == "X" and str(e.get("cat", "")).lower() in (
                "kernel", "gpu_memcpy", "gpu_memset") and "name" in e:
            out.append({"name": str(e["name"]), "ts": float(e.get("ts", 0.0)), "dur": float(e.get("dur", 0.0)),
                        "stream": (e.get("args") or {}).get("stream", e.get("tid"))})
    return sorted(out, key=lambda e: e["ts"])


def library_of(name: str) -> str | None:
    """Which library call a kernel that is not a generated one belongs to (LIBRARY_PATTERNS)."""
    for lib, pattern in LIBRARY_PATTERNS.items():
        if re.search(pattern, name, re.IGNORECASE):
            return lib
    return None


def match_kernels(listing: dict, events: list[dict], calls: int = 1) -> dict:
    """EVENTS (trace_kernels: the device activity of CALLS calls of the listing's schedule, in
    start order) matched to the listing's units: a generated kernel by its name (its function
    and lambda), a library's kernel (cuBLAS, NCCL, a copy, the runtime's) to the first unit at
    or after the last one matched that calls that library. Per unit: the kernels matched, their
    device time per call, and measured / bound. A unit nothing matched is reported (measured
    None), and so is every kernel no unit takes (unlisted): neither is an error."""
    rows = listing["kernels"]
    want: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        for k in r["kernels"]:
            key = lambda_key(k)
            if key is not None:
                want.setdefault(key, i)
    got: list[list[dict]] = [[] for _ in rows]
    unlisted: list[dict] = []
    cur = 0
    for e in events:
        key = lambda_key(e["name"])
        target = None
        if key is not None:
            target = want.get(key)
        else:
            lib = library_of(e["name"])
            if lib is not None:
                # the units are in launch order: the first at or after the last one matched, and after
                # the listing's end (the next call) from the start
                order = [*range(cur, len(rows)), *range(0, cur)]
                target = next((j for j in order if lib in rows[j]["libraries"]), None)
        if target is None:
            unlisted.append(e)
            continue
        got[target].append(e)
        cur = target
    out = []
    for r, evs in zip(rows, got):
        measured = sum(e["dur"] for e in evs) * 1e-6 / calls if evs else None
        names = sorted({e["name"] for e in evs})
        out.append({"unit": r["unit"], "what": r["what"], "line": r["line"], "bound_s": r["bound_s"],
                    "limit": r["limit"], "measured_s": measured, "launches": len(evs) / calls,
                    "ratio": measured / r["bound_s"] if measured is not None and r["bound_s"] > 0 else None,
                    "matched": names, "expected": [*r["kernels"], *r["libraries"]]})
    total_measured = sum(e["dur"] for e in events) * 1e-6 / calls
    total_bound = sum(r["bound_s"] for r in rows)
    return {"program": listing["program"], "schedule": listing["schedule"], "function": listing["function"],
            "sizes": listing["sizes"], "bandwidth_gbps": listing["bandwidth_gbps"], "units": out,
            "unlisted": [{"name": e["name"], "dur_s": e["dur"] * 1e-6} for e in unlisted],
            "measured_s": total_measured, "bound_s": total_bound,
            "ratio": total_measured / total_bound if total_bound > 0 else None,
            "unmatched_units": [u["unit"] for u in out if u["measured_s"] is None and u["limit"] != "none"]}


def measured_table(m: dict) -> list[str]:
    """One schedule's units measured against their bounds (markdown rows)."""
    shown = ", ".join(f"{k}={v}" for k, v in m["sizes"].items())
    lines = [f"\n### {m['program']} [{m['schedule']}] at {shown}: {_us(m['measured_s'])} of kernels against a "
             f"bound of {_us(m['bound_s'])} ({_ratio(m['ratio'])})\n",
             "| # | line | unit | bound | limit | measured | measured / bound | launches | kernels |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for u in m["units"]:
        kern = "; ".join(_short(n) for n in u["matched"]) if u["matched"] else \
            "NO MATCH (expected: " + "; ".join(_short(n) for n in u["expected"]) + ")"
        lines.append(f"| {u['unit']} | {u['line'] or ''} | {u['what']} | {_us(u['bound_s'])} | {u['limit']} | "
                     f"{_us(u['measured_s'])} | {_ratio(u['ratio'])} | {u['launches']:g} | {kern.replace('|', '/')} |")
    for e in m["unlisted"]:
        lines.append(f"| - | | unlisted kernel | | | {_us(e['dur_s'])} | | | {_short(e['name']).replace('|', '/')} |")
    return lines


def _time(s: float) -> str:
    for unit, scale in (("ns", 1e-9), ("us", 1e-6), ("ms", 1e-3)):
        if s < 1000 * scale or unit == "ms":
            return f"{s / scale:.2f} {unit}"
    return f"{s * 1e3:.2f} ms"


def _flops(f: float) -> str:
    for unit, scale in (("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if f < 1000 * scale:
            return f"{f / scale:.3g}{' ' + unit if unit else ''}"
    return f"{f / 1e12:.3g} T"


def _us(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e6:.1f} us"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _short(name: str) -> str:
    """A kernel's name, shortened for a table: a generated kernel as FUNC lambda(SIG)#K."""
    key = lambda_key(name)
    if key is not None:
        return key[0] + "".join(f" lambda({sig})#{k}" for sig, k in key[1])
    return name if len(name) <= 80 else name[:77] + "..."


def pipeline_text(mod: SourceFile, program: str, schedule: str, ranks: int, given: dict[str, int],
                  first: str = "x", chart: str | None = None) -> str:
    """The pipeline of SCHEDULE (a `pipeline(...)` directive; "" when it has none) under the
    cost model: each virtual stage's modelled forward and backward (input and weight gradient
    where the order splits it) on one micro-batch (the batch, dim 0 of FIRST, divided by the
    micro-batches) and RANKS ranks a stage, the timeline they give (orders.simulate with each
    stage's costs; a list-scheduled order built for them), its bubble and each rank's peak
    activations; CHART: a PNG of it."""
    from coconetc.autodiff.saved import bwd_name, input_name, weight_name
    from coconetc.pipeline import orders
    from coconetc.schedule.pipeline import cut, directive, stage_name
    from coconetc.sourcefile import with_grads
    label = parse(schedule)  # a label, as a call takes it: "default" (the program) has no directive
    if label.default or label.name not in mod.schedules.get(program, {}):
        return ""
    d = directive(mod.schedule(program, label.name).directives)
    if d is None:
        return ""
    p = mod.programs[program]
    c = cut(p, d)
    q = p.param(first)
    if q is None or not q.type.shape or not isinstance(q.type.shape[0], str):
        raise ExplainError(f"explain: {program}'s parameter {first!r} (the batch the first stage reads) "
                           "has no size symbol for its dim 0")
    sizes = _sizes(mod, program, ranks, given, "cpu")
    batch, M = q.type.shape[0], c.order.microbatches
    if sizes[batch] % M:
        raise ExplainError(f"explain: {batch}={sizes[batch]} does not divide into microbatches={M}")
    micro = {**sizes, batch: sizes[batch] // M}
    full = with_grads(mod, [f"{program}@{schedule}:{first}"])
    lines = [f"pipeline {schedule}: {c.order.stages} virtual stages, {M} micro-batches of {batch}={micro[batch]}, "
             f"order {c.order.name}; {ranks} rank(s) a stage; the cost model's time of one micro-batch:"]
    costs = []
    for s in range(c.order.stages):
        name = stage_name(program, schedule, s)

        def t(prog: str) -> float:  # (under the stage's own schedule where it has one: its layers' directives)
            return cost(full.plans.get((prog, label.name), full.plans[(prog, DEFAULT)]), micro, ranks).seconds()
        f, b = t(f"{name}_fwd"), t(bwd_name(name))
        bi = t(input_name(name)) if input_name(name) in full.programs else b
        w = t(weight_name(name)) if weight_name(name) in full.programs else 0.0
        costs.append(orders.Costs(forward=f, backward=b, input_grad=bi, weight_grad=w))
        a, z = c.layers[s]
        lines.append(f"  stage {s} (layers {a}..{z - 1}): F {f * 1e3:.3f} ms, B {b * 1e3:.3f} ms"
                     + (f" (input gradient {bi * 1e3:.3f} ms + weight gradient {w * 1e3:.3f} ms)"
                        if c.order.split_backward else ""))
    order = c.order
    if order.name in orders.LIST_SCHEDULED:  # (built for these times, as the runtime builds it for its own)
        order = orders.make(order.name, order.ranks, order.microbatches, order.chunks, costs)
        lines.append(f"(order {order.name} built for these times, as a Pipeline builds it again for the times it measures)")
    timeline = orders.simulate(order, costs)
    lines.append(f"step {timeline.makespan * 1e3:.3f} ms; bubble {timeline.bubble():.3f}; peak micro-batches held: "
                 + ", ".join(f"rank {r} {timeline.peak_activations(r)}" for r in range(c.order.ranks)))
    lines += orders.render(timeline).splitlines()
    if chart:
        try:
            orders.chart(timeline, chart)
        except RuntimeError as err:  # no matplotlib: the message says what to install
            raise ExplainError(str(err)) from None
        lines.append(f"chart: {chart}")
    return "\n".join(lines) + "\n"

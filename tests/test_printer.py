"""The IR printer: golden files of every example schedule, directive by directive; printing
and re-parsing gives the same program; the Graphviz dot output parses.

Golden files live in tests/golden/. After an intended change to the printer or to a rewrite,
regenerate them and read the diff:

    COCONET_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_printer.py
"""

from __future__ import annotations

import difflib
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from coconetc.sourcefile import SourceFile, load_source
from coconetc.errors import NOWHERE, Span
from coconetc.ir import printer
from coconetc.ir.nodes import Program
from coconetc.schedule import apply
from coconetc.schedule.directives import text as directive_text  # what the tuner prints schedules with

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.ccn"))
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("COCONET_UPDATE_GOLDEN") == "1"
DOT_GOLDEN = ("mlp_out.ccn", "mlp_out", "overlapped")


@cache
def _module(path: Path) -> SourceFile:
    """Loaded from any cwd; spans (and so the golden headers) name the file from the repo."""
    return load_source(path.read_text(), str(path.relative_to(REPO)))


def _cases() -> list[tuple[Path, str, str | None]]:
    """(file, program, schedule): every named schedule; a program without one stands alone."""
    out = []
    for path in EXAMPLES:
        mod = _module(path)
        for prog, scheds in mod.schedules.items():
            named = [s for s, x in scheds.items() if not x.auto]
            out += [(path, prog, s) for s in named] or [(path, prog, None)]
    return out


CASES = _cases()
IDS = [".".join(x for x in (f.stem, p, s) if x) for f, p, s in CASES]


def steps(mod: SourceFile, prog: str, sched: str | None) -> tuple[str, Program]:
    """The golden text: the program, then the program after each directive, applied one by
    one; and the final program."""
    ir = mod.programs[prog]
    sections = [f"## program {prog}\n{printer.program(ir)}"]
    for d, applied in _written(mod, prog, sched):
        for x in applied:
            ir = apply(ir, x)
        sections.append(f"## after {directive_text(d)}\n{printer.program(ir)}")
    return "\n".join(sections), ir


def _written(mod: SourceFile, prog: str, sched: str | None) -> list[tuple[Any, list[Any]]]:
    """The schedule's directives as written, each with those it stands for (an each_layer(...):
    the block's schedule written out for every layer, the directives of its span)."""
    if not sched:
        return []
    s = mod.schedule(prog, sched)
    return [(d, [x for x in s.directives if x.span == d.span]) for d in (s.written or s.directives)]


def _header(path: Path, prog: str, sched: str | None) -> str:
    what = f"program {prog}" + (f", schedule {sched}" if sched else " (no schedule)")
    return (f"# {path.relative_to(REPO)}: {what}\n"
            "# generated: COCONET_UPDATE_GOLDEN=1 pytest tests/test_printer.py rewrites this file\n")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; generate it with COCONET_UPDATE_GOLDEN=1"
    want = path.read_text()
    if want != text:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            f"{name} (golden)", f"{name} (now)"))
        pytest.fail(f"printed IR differs from {path} (COCONET_UPDATE_GOLDEN=1 rewrites it):\n{diff}")


@pytest.mark.parametrize(("path", "prog", "sched"), CASES, ids=IDS)
def test_golden_after_each_directive(path: Path, prog: str, sched: str | None) -> None:
    mod = _module(path)
    text, final = steps(mod, prog, sched)
    if sched:
        assert final == mod.schedule(prog, sched).ir, "one-by-one apply differs from the module's"
    check_golden(f"{'.'.join(x for x in (path.stem, prog, sched) if x)}.txt", _header(path, prog, sched) + text)


def test_golden_dot() -> None:
    file, prog, sched = DOT_GOLDEN
    ir = _module(REPO / "examples" / file).schedule(prog, sched).ir
    check_golden(f"{Path(file).stem}.{prog}.{sched}.dot", printer.dot(ir))


def test_no_stale_golden_files() -> None:
    wanted = {f"{i}.txt" for i in IDS} | {f"{Path(DOT_GOLDEN[0]).stem}.{DOT_GOLDEN[1]}.{DOT_GOLDEN[2]}.dot"}
    stale = sorted(p.name for p in GOLDEN.glob("*") if p.is_file() and p.name not in wanted)  # code/: test_codegen_golden
    if UPDATE:
        for name in stale:
            (GOLDEN / name).unlink()
        return
    assert not stale, f"golden files no test writes (COCONET_UPDATE_GOLDEN=1 deletes them): {stale}"


def test_directive_text_matches_the_source_line() -> None:
    """The golden headers name each directive as the schedule wrote it."""
    for path, prog, sched in CASES:
        for d, _ in _written(_module(path), prog, sched):
            line = d.span.source.splitlines()[d.span.line - 1].split("#")[0].strip()
            assert directive_text(d) == re.sub(r"\s+", " ", line), (path, d)


# ---- round trip: print -> parse -> (apply the printed schedule) -> print ----

ROUND_TRIP = [(f, p, s) for f in EXAMPLES for p in _module(f).programs
              for s in (None, *(s for s, x in _module(f).schedules[p].items() if not x.auto))]
RT_IDS = [".".join(x for x in (f.stem, p, s) if x) for f, p, s in ROUND_TRIP]
# Known places where print -> parse does not give back the identical IR (none at present).
KNOWN_IR_DIFFERENCES: dict[str, str] = {}


def reparse(ir: Program) -> tuple[str, Program]:
    text = printer.program(ir)
    mod = load_source(text, "<printed>")
    again = mod.programs[ir.name]
    if "printed" in mod.schedules[ir.name]:
        again = mod.schedule(ir.name, "printed").ir
    return text, again


def _ir(path: Path, prog: str, sched: str | None) -> Program:
    mod = _module(path)
    return mod.schedule(prog, sched).ir if sched else mod.programs[prog]


@pytest.mark.parametrize(("path", "prog", "sched"), ROUND_TRIP, ids=RT_IDS)
def test_round_trip_text(path: Path, prog: str, sched: str | None) -> None:
    text, again = reparse(_ir(path, prog, sched))
    assert printer.program(again) == text


@pytest.mark.parametrize(("path", "prog", "sched"), [
    pytest.param(*case, marks=pytest.mark.xfail(reason=KNOWN_IR_DIFFERENCES[i], strict=True))
    if i in KNOWN_IR_DIFFERENCES else case for case, i in zip(ROUND_TRIP, RT_IDS)], ids=RT_IDS)
def test_round_trip_ir(path: Path, prog: str, sched: str | None) -> None:
    ir = _ir(path, prog, sched)
    assert reparse(ir)[1] == ir


def test_round_trip_updates_as_a_mapping() -> None:
    """What does survive for the known difference above: the same (parameter, stage) pairs."""
    for i, case in zip(RT_IDS, ROUND_TRIP):
        ir = _ir(*case)
        again = reparse(ir)[1]
        assert dict(again.updates) == dict(ir.updates), i


TRICKY = """\
program tricky(x: f32[B, H] local, y: f32[B, H] local, w: f32[H, H] replicated,
               g: f32[H] replicated, b: f32[H] replicated, img: f32[N, C, 8, 8] replicated,
               k: f32[O, C, 3, 3] replicated, h16: f16[B, H] local, s: f32, seed: i64) {
    p1 = (-2) ** x + (-2.5) ** (-y) + x ** -1 - -1 + 1e300 * 0 + -x ** 2 + (-x) ** 2
    p2 = where(x < y, -(x * y), x ** y ** 2) + (x ** y) ** 2 - (x - (y - 1)) / (x / (y * s))
    p3 = cast(h16, f32) + min(x, y) * max(y, 2) / sqrt(abs(x) + 1) - rsqrt(exp(log(abs(x) + 1)))
    p4 = tanh(sigmoid(relu(gelu(p3)))) + norm(p3) * sum(p1) - s ** -0.5 + cast(s, f32)
    a = broadcast(x, 1)
    r = reduce(max, x, 0)
    sl = scatter(a, dim=1)
    t = allgather(sl)
    u = send(r, prev)
    m = matmul(t, w)
    l = layernorm(m, g, b, 1e-5)
    d = dropout(where(l >= 0, l, -l), 0.25, seed)
    c = conv2d(img, k, stride=2, padding=1)
    q = reducescatter(avg, p4 + u, dim=1)
    return d, q as out, c, p2
}
"""


def test_round_trip_tricky_expressions() -> None:
    """Precedence, negative literals (left of **), huge (finite) literals, every kind of operation."""
    ir = load_source(TRICKY, "tricky.ccn").programs["tricky"]
    text, again = reparse(ir)
    assert again == ir, text
    assert printer.program(again) == text
    assert "(-2) ** x" in text and "(-2.5) ** -y" in text and "1e+300" in text


def test_equality_ignores_spans_but_not_structure() -> None:
    """Spans compare honestly (by file and position); IR nodes leave them out of ==, so the
    round-trip tests above compare what a program says, not where it was written."""
    ir = load_source(TRICKY, "tricky.ccn").programs["tricky"]
    shifted = load_source("\n\n# moved down\n" + TRICKY, "other.ccn").programs["tricky"]
    assert shifted == ir and shifted.stage("p1").span != ir.stage("p1").span
    assert hash(shifted.stage("p1")) == hash(ir.stage("p1"))
    for old, new in (("0.25", "0.5"), ("stride=2", "stride=1"), ("reduce(max", "reduce(min")):
        assert load_source(TRICKY.replace(old, new), "tricky.ccn").programs["tricky"] != ir, new
    a = Span("f.ccn", 1, 2, 1, 5, "the file's text")
    assert a == Span("f.ccn", 1, 2, 1, 5) and len({a, Span("f.ccn", 1, 2, 1, 5)}) == 1
    assert a != Span("f.ccn", 2, 2, 2, 5) and a != Span("g.ccn", 1, 2, 1, 5) and a != NOWHERE


def test_negative_literal_binds_like_unary_minus() -> None:
    ir = load_source("program n(x: f32[N] local) {\n    y = (-3) ** x - -3 + x ** -3\n}\n").programs["n"]
    assert "    y = (-3) ** x - -3 + x ** -3\n" in printer.program(ir)


# ---- Graphviz dot: a structural parse ----

_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<id>[A-Za-z_][A-Za-z0-9_.]*)'
                    r"|(?P<op>->|[{}\[\];,=]))")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        assert m, f"cannot tokenize dot at {text[pos:pos + 30]!r}"
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


class _Dot:
    """digraph ID { stmt* }; stmt: ID = ID ; | node [..] ; | subgraph ID { stmt* } |
    ID [-> ID] [attrs] ;  Records declared nodes, edges, clusters and lhead targets."""

    def __init__(self, text: str):
        self.toks, self.i = _tokens(text), 0
        self.nodes: set[str] = set()
        self.edges: list[tuple[str, str]] = []
        self.clusters: set[str] = set()
        self.lheads: list[str] = []
        self.expect("digraph")
        self.name = self.take()
        self.block()
        assert self.i == len(self.toks), f"text after the graph: {self.toks[self.i:]}"

    def take(self) -> str:
        assert self.i < len(self.toks), "unexpected end of dot text (unbalanced braces?)"
        self.i += 1
        return self.toks[self.i - 1]

    def expect(self, tok: str) -> None:
        got = self.take()
        assert got == tok, f"expected {tok!r}, got {got!r} at token {self.i}"

    def block(self) -> None:
        self.expect("{")
        while self.toks[self.i] != "}":
            self.stmt()
        self.expect("}")

    def stmt(self) -> None:
        first = self.take()
        if first == "subgraph":
            self.clusters.add(self.take().strip('"'))
            return self.block()
        if self.toks[self.i] == "=":
            self.i += 1
            self.take()
        elif first in ("node", "edge", "graph"):
            self.attrs()
        elif self.toks[self.i] == "->":
            self.i += 1
            self.edges.append((first.strip('"'), self.take().strip('"')))
            self.lheads += [v.strip('"') for k, v in self.attrs().items() if k == "lhead"]
        else:
            self.nodes.add(first.strip('"'))
            self.attrs()
        self.expect(";")

    def attrs(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.toks[self.i] != "[":
            return out
        self.i += 1
        while self.toks[self.i] != "]":
            key = self.take()
            self.expect("=")
            out[key] = self.take()
            if self.toks[self.i] == ",":
                self.i += 1
        self.i += 1
        return out


def check_dot(text: str) -> _Dot:
    assert text.count("{") == text.count("}"), "unbalanced braces"
    g = _Dot(text)
    undeclared = sorted({n for e in g.edges for n in e} - g.nodes)
    assert not undeclared, f"edge endpoints that are not declared nodes: {undeclared}"
    assert set(g.lheads) <= g.clusters, f"lhead names no cluster: {g.lheads}"
    return g


@pytest.mark.parametrize(("path", "prog", "sched"), ROUND_TRIP, ids=RT_IDS)
def test_dot_parses(path: Path, prog: str, sched: str | None) -> None:
    ir = _ir(path, prog, sched)
    g = check_dot(printer.dot(ir))
    assert g.name == f'"{prog}"'
    assert g.nodes == {q.name for q in ir.params} | {s.name for s in ir.stages}
    assert g.clusters == {f"cluster_{f.name}" for f in ir.fusions}
    assert len(g.lheads) == sum(1 for o in ir.overlaps if ir.stage(o.consumer) is None)


def test_dot_checker_rejects_broken_graphs() -> None:
    good = printer.dot(_ir(REPO / "examples" / "sgd.ccn", "sgd", "fused"))
    check_dot(good)
    with pytest.raises(AssertionError, match="not declared"):
        check_dot(good.replace('  "rs" -> "w1"', '  "nowhere" -> "w1"'))
    with pytest.raises(AssertionError, match="unbalanced"):
        check_dot(good.rstrip().rstrip("}"))

"""Property tests for the front half of the compiler: whatever text it is given, load_source
either succeeds or raises CompileError with well-formed diagnostics (line >= 1, col >= 1, a
render() that works). Any other exception is a compiler bug; minimized inputs found this way
are kept as explicit regression cases in tests/test_errors.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coconetc.driver import load_source
from coconetc.errors import CompileError

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.ccn"))

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def _load(src: str) -> None:
    """Load src; only a well-formed CompileError may escape."""
    try:
        load_source(src, "t.ccn")
    except CompileError as err:
        assert err.diagnostics, "a CompileError without diagnostics"
        lines = src.split("\n")
        for d in err.diagnostics:
            assert d.span.line >= 1 and d.span.col >= 1, (d.span.line, d.span.col, d.message)
            assert d.span.line <= len(lines), (d.span.line, d.message)
            text = d.render()
            assert text.startswith(f"t.ccn:{d.span.line}:{d.span.col}: error: "), text
            assert d.message
            # the quoted line is the one the location names, and the caret is under the column
            rendered = text.split("\n")
            assert rendered[1] == "    " + lines[d.span.line - 1].removesuffix("\r"), text
            assert len(rendered[2]) - len(rendered[2].lstrip(" \t")) == 4 + d.span.col - 1, text
        assert str(err)


# --- (a) random token soup from a grammar-aware alphabet ---------------------------------

KEYWORDS = ["program", "schedule", "for", "return", "as", "auto"]
DTYPES = ["f16", "bf16", "f32", "f64", "i32", "i64", "f33"]
LAYOUTS = ["local", "replicated", "sliced", "scattered", "sliced(0)", "sliced(1)", "sliced(9)"]
OPS = ["allreduce", "reducescatter", "allgather", "broadcast", "reduce", "scatter", "send",
       "update", "matmul", "layernorm", "conv2d", "dropout", "where", "cast", "sum", "norm",
       "segment_norm", "sqrt", "exp", "relu", "min", "max", "split", "reorder", "slice",
       "fuse", "overlap", "next", "prev", "avg", "prod", "dim", "chunks", "root", "stride",
       "padding", "foo"]
NAMES = ["x", "y", "w", "g", "g1", "m1", "p", "s", "rs", "ag", "N", "M", "K", "lr", "seed"]
NUMBERS = ["0", "1", "2", "3", "4", "0.5", "1e-5", "1.5", "-1", "00", "1e400", ".5", "9" * 30]
PUNCT = ["(", ")", "[", "]", "{", "}", ",", ":", "=", "+", "-", "*", "/", "**", "<", "<=",
         ">", ">=", "==", "!=", ".", "$", "@", ";"]
LAYOUT_TOKENS = ["\n", "\n", "\n", " ", "# comment\n", "\\\n", "\t", "\r\n", "\f", "# \u2028\n", "\u00d7"]
ALPHABET = KEYWORDS + DTYPES + LAYOUTS + OPS + NAMES + NUMBERS + PUNCT + LAYOUT_TOKENS


@FUZZ
@given(st.lists(st.sampled_from(ALPHABET), max_size=60))
def test_token_soup(tokens: list[str]) -> None:
    _load(" ".join(tokens))


HEADER = "program p(x: f32[N] local, w: f32[N] replicated, lr: f32, seed: i64) {\n"


@FUZZ
@given(st.lists(st.sampled_from(ALPHABET), max_size=40))
def test_token_soup_in_a_block(tokens: list[str]) -> None:
    """Start inside a valid header, so the soup reaches the statement grammar and checker."""
    _load(HEADER + "    y = " + " ".join(tokens) + "\n}\n")


# --- (b) mutations of the example files ---------------------------------------------------

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\*\*|[<>=!]=|#[^\n]*|\s+|.",
                    re.S)
SOURCES = [p.read_text() for p in EXAMPLES]


def _tokens(src: str) -> list[str]:
    return _TOKEN.findall(src)


@st.composite
def _mutated(draw) -> str:
    src = draw(st.sampled_from(SOURCES))
    level = draw(st.sampled_from(["token", "token", "char"]))
    parts = _tokens(src) if level == "token" else list(src)
    for _ in range(draw(st.integers(1, 4))):
        if not parts:
            break
        i = draw(st.integers(0, len(parts) - 1))
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "replace"]))
        if kind == "delete":
            del parts[i]
        elif kind == "duplicate":
            parts.insert(i, parts[i])
        elif kind == "swap":
            j = draw(st.integers(0, len(parts) - 1))
            parts[i], parts[j] = parts[j], parts[i]
        elif level == "token":
            parts[i] = draw(st.sampled_from(ALPHABET + [t for t in parts if t.strip()]))
        else:
            parts[i] = draw(st.sampled_from(list("(){}[],:=+-*/<>#\n .0123456789xyz_$\\\t\f\r\u2028")))
    return "".join(parts)


@FUZZ
@given(_mutated())
def test_mutated_examples(src: str) -> None:
    _load(src)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_fuzz_seeds(path: Path) -> None:
    load_source(path.read_text(), path.name)  # the unmutated seeds themselves load


# --- (c) well-formed-looking programs and schedules, random in their types --------------

_P_DTYPES = ["f16", "f32", "i32", "i64"]
_P_SHAPES = ["", "[N]", "[N]", "[M]", "[N, K]", "[B, N]", "[K, N]", "[1]", "[B, S, N]", "[N, C, H, W]"]
_P_LAYOUTS = ["local", "replicated", "sliced", "sliced(1)", "sliced(2)", "local scattered",
              "replicated scattered", ""]


@st.composite
def _expr(draw, names: list[str], depth: int = 0) -> str:
    leaf = st.sampled_from(names + ["1", "0.5", "2", "-1"])
    if depth > 2 or draw(st.booleans()):
        return draw(leaf)
    kind = draw(st.sampled_from(["bin", "un", "call2", "where", "cmp", "cast", "red", "tensor"]))
    sub = lambda: draw(_expr(names, depth + 1))  # noqa: E731
    if kind == "bin":
        return f"({sub()} {draw(st.sampled_from(['+', '-', '*', '/', '**']))} {sub()})"
    if kind == "un":
        return f"{draw(st.sampled_from(['sqrt', 'exp', 'relu', 'gelu', 'abs', '-']))}({sub()})"
    if kind == "call2":
        return f"{draw(st.sampled_from(['min', 'max']))}({sub()}, {sub()})"
    if kind == "where":
        return f"where({sub()} < {sub()}, {sub()}, {sub()})"
    if kind == "cmp":
        return f"{sub()} {draw(st.sampled_from(['<', '==', '>=']))} {sub()}"
    if kind == "cast":
        return f"cast({sub()}, {draw(st.sampled_from(_P_DTYPES))})"
    if kind == "red":
        return f"{draw(st.sampled_from(['sum', 'norm', 'segment_norm']))}({sub()})"
    op = draw(st.sampled_from(["matmul", "layernorm", "dropout", "conv2d"]))
    if op == "matmul":
        return f"matmul({sub()}, {sub()})"
    if op == "layernorm":
        return f"layernorm({sub()}, {sub()}, {sub()}, {draw(st.sampled_from(['1e-5', 'lr', 'x']))})"
    if op == "dropout":
        return f"dropout({sub()}, {draw(st.sampled_from(['0.1', 'lr', '1', '-0.5']))}, " \
               f"{draw(st.sampled_from(['seed', 'lr', '3']))})"
    return f"conv2d({sub()}, {sub()}, stride={draw(st.sampled_from(['1', '2', '0']))}, " \
           f"padding={draw(st.sampled_from(['0', '1', '-1']))})"


@st.composite
def _program(draw) -> str:
    params, names = [], []
    for i in range(draw(st.integers(1, 5))):
        name = f"p{i}"
        shape = draw(st.sampled_from(_P_SHAPES))
        lay = draw(st.sampled_from(_P_LAYOUTS)) if shape else ""
        params.append(f"{name}: {draw(st.sampled_from(_P_DTYPES))}{shape} {lay}".rstrip())
        names.append(name)
    params += ["lr: f32", "seed: i64"]
    names += ["lr"]
    lines = []
    for j in range(draw(st.integers(1, 6))):
        target = f"s{j}"
        kind = draw(st.sampled_from(["expr", "expr", "coll", "update"]))
        if kind == "coll":
            coll = draw(st.sampled_from([
                "allreduce(sum, {a})", "reducescatter(avg, {a}, dim=1)", "reducescatter(max, {a})",
                "allgather({a})", "broadcast({a}, 0)", "reduce(sum, {a}, 1)", "scatter({a})",
                "scatter({a}, dim=2)", "send({a}, next)", "send({a}, prev)"]))
            rhs = coll.format(a=draw(st.sampled_from(names)))
        elif kind == "update":
            rhs = f"update({draw(st.sampled_from(names))}, {draw(_expr(names))})"
        else:
            rhs = draw(_expr(names))
        lines.append(f"    {target} = {rhs}")
        names.append(target)
    if draw(st.booleans()):
        lines.append(f"    return {draw(st.sampled_from(names))}")
    body = "\n".join(lines)
    prog = f"program q({', '.join(params)}) {{\n{body}\n}}\n"
    stages = [n for n in names if n.startswith("s")] or ["s0"]
    directives = []
    for k in range(draw(st.integers(0, 5))):
        a = lambda k=k, stages=stages: draw(st.sampled_from(stages + ["p0", "lr", f"t{k}"]))  # noqa: E731
        form = draw(st.sampled_from(["split", "reorder", "slice", "fuse", "overlap"]))
        if form == "split":
            dim = draw(st.sampled_from(["", ", dim=1", ", dim=0", ", dim=5"]))
            directives.append(f"    r{k}, g{k} = split({a()}{dim})")
            stages += [f"r{k}", f"g{k}"]
        elif form == "reorder":
            outs = ", ".join(f"o{k}_{i}" for i in range(draw(st.integers(1, 3))))
            moved = ", ".join(a() for _ in range(draw(st.integers(1, 3))))
            directives.append(f"    {outs} = reorder({a()}, {moved})")
            stages += [f"o{k}_{i}" for i in range(3)]
        elif form == "slice":
            directives.append(f"    slice({draw(st.sampled_from(names))})")
        elif form == "fuse":
            members = ", ".join(a() for _ in range(draw(st.integers(1, 4))))
            directives.append(f"    f{k} = fuse({members})")
            stages.append(f"f{k}")
        else:
            extra = draw(st.sampled_from(["", ", dim=0", ", dim=1", ", dim=2"]))
            directives.append(f"    overlap({a()}, {a()}, chunks={draw(st.sampled_from(['1', '2', '0']))}{extra})")
    sched = "schedule z for q {\n" + "\n".join(directives) + "\n}\n" if directives else ""
    return prog + sched


@FUZZ
@given(_program())
def test_random_programs_and_schedules(src: str) -> None:
    _load(src)


@st.composite
def _example_schedule(draw) -> str:
    """An example file with one extra schedule made of random directives over its names."""
    src = draw(st.sampled_from(SOURCES))
    prog = draw(st.sampled_from(re.findall(r"^program (\w+)", src, re.M)))
    words = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]*\b", src)) - {"program", "schedule", "for"})
    pick = lambda: draw(st.sampled_from(words))  # noqa: E731
    bodies = re.findall(rf"^schedule \w+ for {prog} {{\n(.*?)^}}", src, re.M | re.S)
    lines = []
    if bodies and draw(st.booleans()):  # start from a legal prefix of an existing schedule
        legal = draw(st.sampled_from(bodies)).splitlines()
        lines = legal[:draw(st.integers(0, len(legal)))]
    for k in range(draw(st.integers(1, 3))):
        form = draw(st.sampled_from(["split", "reorder", "slice", "fuse", "overlap"]))
        args = ", ".join(pick() for _ in range(draw(st.integers(1, 4))))
        if form == "split":
            lines.append(f"    a{k}, b{k} = split({pick()}, dim={draw(st.integers(0, 3))})")
        elif form == "reorder":
            outs = ", ".join(f"c{k}_{i}" for i in range(draw(st.integers(1, 4))))
            lines.append(f"    {outs} = reorder({args})")
        elif form == "slice":
            lines.append(f"    slice({args})")
        elif form == "fuse":
            lines.append(f"    f{k} = fuse({args})")
        else:
            lines.append(f"    overlap({pick()}, {pick()}, chunks={draw(st.integers(0, 4))}, "
                         f"dim={draw(st.integers(0, 3))})")
    return src + f"\nschedule extra for {prog} {{\n" + "\n".join(lines) + "\n}\n"


@FUZZ
@given(_example_schedule())
def test_random_schedules_of_examples(src: str) -> None:
    _load(src)

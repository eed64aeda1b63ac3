"""Property tests for the front half of the compiler: whatever text it is given, load_source
either succeeds or raises CompileError with well-formed diagnostics (line >= 1, col >= 1, a
render() that works). Any other exception is a compiler bug; minimized inputs found this way
are kept as explicit regression cases in tests/test_errors.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coconetc.sourcefile import SourceFile, load_source
from coconetc.errors import CompileError

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.ccn"))

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def _load(src: str) -> SourceFile | None:
    """Load src (the module, None where it does not load); only a well-formed CompileError may
    escape."""
    try:
        return load_source(src, "t.ccn")
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
    return None


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


_INT_LITERAL = re.compile(r"(?<![\w.])(\d{19,})(?![\w.])")


def _generate(src: str, mod: SourceFile | None = None) -> str | None:
    """C++ for a mutant that loads (None if it does not; MOD: it loaded already): code
    generation may only refuse with a located CompileError, and the C++ must hold no literal a
    C++ compiler rejects."""
    from coconetc.codegen.cpu import generate
    if mod is None:
        try:
            mod = load_source(src, "t.ccn")
        except CompileError:
            return None
    if not mod.programs:
        return None
    try:
        cpp = generate(mod, "ccn_fuzz").cpp
    except CompileError as err:
        assert all(d.span.line >= 1 for d in err.diagnostics), str(err)
        return None
    for m in _INT_LITERAL.finditer(cpp):
        assert int(m.group(1)) <= 2**63 - 1, f"integer literal {m.group(1)} in the C++"
    assert not re.search(r"(?<![\w.])(inf|nan)f?(?![\w(])", cpp), "a non-finite literal in the C++"
    return cpp


@pytest.mark.slow  # random programs: make test's (the examples' schedules are checked one by one in test_schedules.py)
@FUZZ
@given(_mutated())
def test_mutated_examples(src: str) -> None:
    mod = _load(src)
    if mod is not None:
        _generate(src, mod)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(src=_mutated().filter(lambda s: _generate(s) is not None))
def test_mutants_that_check_compile_as_cpp(src: str, tmp_path_factory) -> None:
    """A few mutants that pass `check`, through the C++ compiler (syntax and types only, no
    build): what the compiler accepts, the C++ compiler accepts."""
    compile_only = _syntax_only_command()
    if compile_only is None:
        pytest.skip("the cpu extra (pybind11, mpicxx) is not installed")
    out = tmp_path_factory.mktemp("fuzzcpp") / "module.cpp"
    out.write_text(_generate(src))
    res = subprocess.run([*compile_only, str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{res.stderr[-3000:]}\n--- mutant:\n{src}"


def _syntax_only_command() -> list[str] | None:
    import shutil
    import sys
    import sysconfig
    try:
        import pybind11
    except ImportError:
        return None
    from coconetc.paths import runtime_dir
    here = Path(sys.executable).parent / "mpicxx"
    cxx = str(here) if here.exists() else shutil.which("mpicxx")
    if cxx is None:
        return None
    import scipy_openblas32
    # the examples' directory: a mutant of extern_ops.ccn includes its library's header (it
    # loads when the example was loaded before in this process: the reference resolves
    # through the registry entry)
    return [cxx, "-std=c++17", "-fsyntax-only", "-fopenmp", f"-I{runtime_dir()}", f"-I{EXAMPLES[0].parent}",
            f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
            f"-I{scipy_openblas32.get_include_dir()}"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_fuzz_seeds(path: Path) -> None:
    load_source(path.read_text(), str(path))  # the unmutated seeds themselves load (extern references beside them)


# --- (c) well-formed-looking programs and schedules, random in their types --------------

_P_SHAPES = ["[N]"] * 4 + ["[M]", "[1]", "[B, N]", "[N, K]", "[K, N]", "[B, S, N]"]
_P_DTYPES = ["f32"] * 4 + ["f16", "i32", "i64"]


def _layouts(ndim: int) -> list[str]:
    good = ["local", "local", "replicated", "replicated", "sliced", f"sliced({ndim - 1})"]
    if ndim == 1:
        good += ["local scattered", "replicated scattered"]
    return good + ["sliced(3)", ""]


@st.composite
def _expr(draw, names: list[str], depth: int = 0) -> str:
    leaf = st.sampled_from(names + ["1", "0.5", "2", "-1"])
    if depth > 2 or draw(st.booleans()):
        return draw(leaf)
    kind = draw(st.sampled_from(["bin", "bin", "un", "call2", "where", "cmp", "cast", "red", "tensor"]))
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
        return f"({sub()} {draw(st.sampled_from(['<', '==', '>=']))} {sub()})"
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


_COLLECTIVES = ["allreduce(sum, {a})", "allreduce(sum, {a})", "allreduce(avg, {a})",
                "reducescatter(avg, {a}, dim=1)", "reducescatter(max, {a})", "allgather({a})",
                "broadcast({a}, 0)", "reduce(sum, {a}, 1)", "scatter({a})", "scatter({a}, dim=1)",
                "send({a}, next)", "send({a}, prev)"]


@st.composite
def _directives(draw, names: list[str], params: list[str]) -> list[str]:
    """Random directives whose arguments are mostly names the schedule can see (the program's
    stages, then what earlier directives defined), sometimes parameters or unknown names."""
    names = list(names)
    arg = lambda: draw(st.sampled_from(names * 4 + params + ["nope"]))  # noqa: E731
    lines = []
    for k in range(draw(st.integers(1, 5))):
        form = draw(st.sampled_from(["split", "split", "reorder", "reorder", "slice", "fuse", "overlap"]))
        if form == "split":
            dim = draw(st.sampled_from(["", "", ", dim=1", ", dim=0", ", dim=2"]))
            lines.append(f"    r{k}, g{k} = split({arg()}{dim})")
            names += [f"r{k}", f"g{k}"]
        elif form == "reorder":
            outs = [f"o{k}_{i}" for i in range(draw(st.integers(0, 3)))]
            moved = ", ".join(arg() for _ in range(draw(st.integers(1, 4))))
            ag = draw(st.sampled_from([n for n in names if n.startswith("g")] or names))
            lines.append(f"    {', '.join(outs) + ' = ' if outs else ''}reorder({ag}, {moved})")
            names += outs
        elif form == "slice":
            lines.append(f"    slice({', '.join(draw(st.sampled_from(params)) for _ in range(draw(st.integers(1, 2))))})")
        elif form == "fuse":
            members = ", ".join(arg() for _ in range(draw(st.integers(1, 5))))
            lines.append(f"    f{k} = fuse({members})")
            names.append(f"f{k}")
        else:
            extra = draw(st.sampled_from(["", "", ", dim=0", ", dim=1", ", dim=2"]))
            lines.append(f"    overlap({arg()}, {arg()}, chunks={draw(st.sampled_from(['1', '2', '4']))}{extra})")
    return lines


@st.composite
def _program(draw) -> str:
    params, names, tensors = [], [], []
    for i in range(draw(st.integers(1, 4))):
        name = f"p{i}"
        shape = draw(st.sampled_from(_P_SHAPES))
        lay = draw(st.sampled_from(_layouts(shape.count(",") + 1)))
        params.append(f"{name}: {draw(st.sampled_from(_P_DTYPES))}{shape} {lay}".rstrip())
        names.append(name)
        tensors.append(name)
    params += ["lr: f32", "seed: i64"]
    names += ["lr"]
    lines, stages = [], []
    for j in range(draw(st.integers(1, 6))):
        target = f"s{j}"
        kind = draw(st.sampled_from(["expr", "expr", "coll", "coll", "update"]))
        if kind == "coll":
            rhs = draw(st.sampled_from(_COLLECTIVES)).format(a=draw(st.sampled_from(names)))
        elif kind == "update":
            rhs = f"update({draw(st.sampled_from(tensors + ['lr']))}, {draw(_expr(names))})"
        else:
            rhs = draw(_expr(names))
        lines.append(f"    {target} = {rhs}")
        names.append(target)
        stages.append(target)
    if draw(st.booleans()):
        lines.append(f"    return {draw(st.sampled_from(names))}")
    prog = f"program q({', '.join(params)}) {{\n" + "\n".join(lines) + "\n}\n"
    if draw(st.booleans()):
        return prog
    return prog + "schedule z for q {\n" + "\n".join(draw(_directives(stages, tensors + ["lr"]))) + "\n}\n"


@FUZZ
@given(_program())
def test_random_programs_and_schedules(src: str) -> None:
    _load(src)


def _program_texts(src: str) -> dict[str, tuple[list[str], list[str]]]:
    """For each program of a file: its stage names and its parameter names."""
    out = {}
    src = re.sub(r"[ \t]*#[^\n]*", "", src)  # comments may hold parentheses (tp_mlp.ccn's parameters)
    for m in re.finditer(r"^program (\w+)\((.*?)\)\s*\{\n(.*?)^\}", src, re.M | re.S):
        params = re.findall(r"(\w+)\s*:", m.group(2))
        stages = re.findall(r"^\s+(\w+)\s*=", m.group(3), re.M)
        out[m.group(1)] = (stages, params)
    return out


@st.composite
def _example_schedule(draw) -> str:
    """An example file with one extra schedule: sometimes a legal prefix of one of its own
    schedules, then random directives over the program's names."""
    src = draw(st.sampled_from(SOURCES))
    progs = _program_texts(src)
    prog = draw(st.sampled_from(sorted(progs)))
    stages, params = progs[prog]
    bodies = re.findall(rf"^schedule \w+ for {prog} {{\n(.*?)^}}", src, re.M | re.S)
    lines = []
    if bodies and draw(st.booleans()):
        legal = draw(st.sampled_from(bodies)).splitlines()
        lines = legal[:draw(st.integers(0, len(legal)))]
        stages = stages + re.findall(r"\b(\w+)\b(?=[^=]*=)", "\n".join(lines))
    lines += draw(_directives(stages, params))
    return src + f"\nschedule extra for {prog} {{\n" + "\n".join(lines) + "\n}\n"


@pytest.mark.slow  # random schedules: make test's, as the other random programs
@FUZZ
@given(_example_schedule())
def test_random_schedules_of_examples(src: str) -> None:
    _load(src)

"""Source text -> AST with Lark (LALR). Syntax errors become CompileErrors at line:col."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import lark
from lark import Token, Transformer, v_args

from coconetc.errors import CompileError, Diagnostic, Span
from coconetc.frontend import ast
from coconetc.paths import grammar_file

_OPEN = {"LPAR", "LSQB"}
_CLOSE = {"RPAR", "RSQB"}


class _DropNewlinesInBrackets:
    """Post-lexer: a newline inside ( ) or [ ] is whitespace; elsewhere it ends a statement."""

    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        for tok in stream:
            if tok.type in _OPEN:
                depth += 1
            elif tok.type in _CLOSE:
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


@cache
def _parser() -> lark.Lark:
    text = grammar_file().read_text()
    return lark.Lark(text, parser="lalr", lexer="contextual", postlex=_DropNewlinesInBrackets(),
                     propagate_positions=True, maybe_placeholders=True)


_TOKEN_WORDS = {
    "NAME": "a name", "INT": "an integer", "NUMBER": "a number", "_NL": "end of line",
    "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "LBRACE": "'{'",
    "RBRACE": "'}'", "COMMA": "','", "COLON": "':'", "EQUAL": "'='", "$END": "end of file",
}


def _word(term: str) -> str:
    if term in _TOKEN_WORDS:
        return _TOKEN_WORDS[term]
    pattern = _parser().get_terminal(term).pattern
    return f"'{pattern.value}'" if pattern.type == "str" else term.lower()


def _syntax_error(err: lark.exceptions.UnexpectedInput, file: str, source: str) -> Diagnostic:
    line, col = max(err.line, 1), max(err.column, 1)
    width = 1
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        message = f"unexpected character {source[err.pos_in_stream]!r}"
    elif isinstance(err, lark.exceptions.UnexpectedToken) and err.token.type != "$END":
        tok = err.token
        shown = "end of line" if tok.type == "_NL" else repr(str(tok))
        expected = sorted({_word(t) for t in err.expected if not t.startswith("__")})
        message = f"unexpected {shown}" + (f"; expected {', '.join(expected)}" if expected else "")
        width = max(1, len(str(tok).strip()))
    else:
        lines = source.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
        message = "unexpected end of file (missing '}' or ')'?)"
    return Diagnostic(Span(file, line, col, line, col + width, source), message)


def parse(source: str, file: str = "<string>") -> ast.Module:
    """Parse a whole .ccn file. Raises CompileError on the first syntax error."""
    text = source if source.endswith("\n") else source + "\n"
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as err:
        raise CompileError([_syntax_error(err, file, source)]) from None
    items = _ToAst(file, source).transform(tree)
    progs = tuple(i for i in items if isinstance(i, ast.Program))
    scheds = tuple(i for i in items if isinstance(i, ast.Schedule))
    return ast.Module(file, source, progs, scheds)


@v_args(meta=True)
class _ToAst(Transformer):
    """Lark tree -> ast nodes. One method per grammar rule."""

    def __init__(self, file: str, source: str):
        super().__init__()
        self.file, self.source = file, source

    def _span(self, m) -> Span:
        return Span(self.file, m.line, m.column, m.end_line, m.end_column, self.source)

    def _tspan(self, t: Token) -> Span:
        return Span(self.file, t.line, t.column, t.end_line, t.end_column, self.source)

    def start(self, meta, items):
        return list(items)

    def program(self, meta, ch):
        name, *rest = ch
        params, body = tuple(p for p in rest[:-1] if p is not None), rest[-1]
        return ast.Program(str(name), params, body, self._span(meta), self._tspan(name))

    def param(self, meta, ch):
        name, dtype, shape, layout = ch
        return ast.Param(str(name), str(dtype), shape, layout, self._span(meta), self._tspan(dtype))

    def shape(self, meta, ch):
        return tuple(d for d in ch if d is not None)

    def dim_name(self, meta, ch):
        return ast.DimName(str(ch[0]), self._tspan(ch[0]))

    def dim_int(self, meta, ch):
        return ast.DimInt(int(ch[0]), self._tspan(ch[0]))

    def layout(self, meta, ch):
        kind, dim, extra = ch
        return ast.LayoutDecl(str(kind), None if dim is None else int(dim),
                              None if extra is None else str(extra), self._span(meta))

    def schedule(self, meta, ch):
        name, prog, body = ch
        return ast.Schedule(str(name), str(prog), body, self._span(meta), self._tspan(prog))

    def block(self, meta, ch):
        return tuple(s for s in ch if s is not None)

    def assign(self, meta, ch):
        *targets, value = ch
        names = tuple(ast.Name(str(t), self._tspan(t)) for t in targets)
        return ast.Assign(names, value, self._span(meta))

    def ret(self, meta, ch):
        return ast.Return(tuple(ch), self._span(meta))

    def retitem(self, meta, ch):
        name, alias = ch
        return ast.ReturnItem(ast.Name(str(name), self._tspan(name)),
                              None if alias is None else ast.Name(str(alias), self._tspan(alias)),
                              self._span(meta))

    def exprstmt(self, meta, ch):
        return ast.ExprStmt(ch[0], self._span(meta))

    def number(self, meta, ch):
        return ast.Number(str(ch[0]), self._tspan(ch[0]))

    def name(self, meta, ch):
        return ast.Name(str(ch[0]), self._tspan(ch[0]))

    def call(self, meta, ch):
        fn, *args = ch
        args = [a for a in args if a is not None]
        pos = tuple(a for a in args if not isinstance(a, ast.Kwarg))
        kws = tuple(a for a in args if isinstance(a, ast.Kwarg))
        return ast.Call(str(fn), pos, kws, self._span(meta), self._tspan(fn))

    def kwarg(self, meta, ch):
        return ast.Kwarg(str(ch[0]), ch[1], self._span(meta))

    def neg(self, meta, ch):
        return ast.Neg(ch[0], self._span(meta))

    def _bin(op):  # noqa: N805 - a factory for the binary-operator rules
        def rule(self, meta, ch):
            return ast.BinOp(op, ch[0], ch[1], self._span(meta))
        return rule

    add, sub, mul, div, pow = _bin("+"), _bin("-"), _bin("*"), _bin("/"), _bin("**")
    lt, le, gt, ge, eq, ne = _bin("<"), _bin("<="), _bin(">"), _bin(">="), _bin("=="), _bin("!=")

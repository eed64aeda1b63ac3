"""Source text -> AST with Lark (LALR). Syntax errors become CompileErrors at line:col."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import cache, lru_cache
from typing import Any

import lark
from lark import Token, Transformer, v_args

from coconetc.errors import CompileError, Diagnostic, Span
from coconetc.frontend import syntax
from coconetc.paths import grammar_file

_OPEN = {"LPAR", "LSQB"}
_CLOSE = {"RPAR", "RSQB"}


_PAIRS = {"LPAR": "RPAR", "LSQB": "RSQB", "LBRACE": "RBRACE"}
_SOFT = ("OP", "EXTERN")  # the soft keywords' terminals (SOFT_KEYWORDS below)


class _DropNewlinesInBrackets:
    """Post-lexer: a newline inside ( ) or [ ] is whitespace; elsewhere it ends a statement.
    It also keeps the brackets and braces still open, so that a syntax error can name the one
    that was never closed."""

    always_accept = ("_NL",)

    def __init__(self) -> None:
        self.open: list[Token] = []
        self.params = False  # the outermost open bracket is a program's parameter list
        self.last: list[Token] = []  # the last two tokens seen (the newest last)

    def _item_start(self, tok: Token) -> bool:
        """`op` / `extern` where a definition starts (first on a line outside any bracket or
        block, or `op` after `extern`); anywhere else the lexer's keyword is a name."""
        prev = self.last[-1].type if self.last else "_NL"
        return not self.open and (prev in ("_NL", "RBRACE") or (tok.type == "OP" and prev == "EXTERN"))

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        self.open, self.last = [], []
        for tok in stream:
            if tok.type in _SOFT and not self._item_start(tok):
                tok = Token.new_borrow_pos("NAME", str(tok), tok)
            if tok.type in _PAIRS:
                if not self.open:
                    self.params = len(self.last) == 2 and str(self.last[0]) == "program"
                self.open.append(tok)
            elif self.open and tok.type == _PAIRS[self.open[-1].type]:
                self.open.pop()
            self.last = [*self.last[-1:], tok]
            if tok.type in _OPEN:
                depth += 1
            elif tok.type in _CLOSE:
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


_THREAD = threading.local()


def _parser() -> lark.Lark:
    """This thread's parser: its post-lexer keeps the state of the parse in progress (and of the
    last one, for the syntax error's message), so threads parsing at once (coconetc.load from a
    thread pool) each need their own."""
    p = getattr(_THREAD, "parser", None)
    if p is None:
        p = _THREAD.parser = _new_parser()
    return p


def _new_parser() -> lark.Lark:
    # cache=True: Lark keeps the analysed grammar in a temp file, keyed by its text and options
    return lark.Lark(_grammar(), parser="lalr", lexer="contextual", postlex=_DropNewlinesInBrackets(), cache=True,
                     propagate_positions=True, maybe_placeholders=True)


@cache
def _grammar() -> str:
    return grammar_file().read_text()


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


def _lines(source: str) -> list[str]:
    """The source's lines as the lexer counts them (only '\\n' ends a line)."""
    return [ln.removesuffix("\r") for ln in source.split("\n")]


def _tok_span(tok: Token, file: str, source: str) -> Span:
    line, col = tok.line or 0, tok.column or 0  # Lark leaves them None only for tokens it made up
    return Span(file, line, col, line, col + len(str(tok)), source)


def _postlex() -> _DropNewlinesInBrackets:
    """The cached parser's post-lexer: what it saw of the last parse (open brackets, ...)."""
    post = _parser().options.postlex
    assert isinstance(post, _DropNewlinesInBrackets)
    return post


# After these tokens, a bracket or brace left open on an earlier line is the likely mistake.
_ENDERS = {"RBRACE", "$END"}
_ITEM_WORDS = {"program", "schedule", "op", "extern"}


def _unclosed(err: lark.exceptions.UnexpectedInput, file: str, source: str) -> Diagnostic | None:
    """'(' is never closed: when the parser ran into a '}', the end of the file, or the next
    program/schedule while a bracket or brace opened on an earlier line is still open."""
    if not isinstance(err, lark.exceptions.UnexpectedToken):
        return None
    tok, opened = err.token, _postlex().open
    if not opened:
        return None
    last = opened[-1]  # the innermost one
    if tok.type != "$END" and (not (tok.type in _ENDERS or str(tok) in _ITEM_WORDS)
                               or tok.line <= last.line):
        return None
    found = "the end of the file" if tok.type == "$END" else f"'{tok}' at line {tok.line}"
    return Diagnostic(_tok_span(last, file, source),
                      f"'{last}' is never closed (found {found})")


def _missing_comma(err: lark.exceptions.UnexpectedInput, file: str, source: str) -> Diagnostic | None:
    """`x: f32[N] local  w: f32`: the ':' of a parameter whose ',' is missing."""
    post = _postlex()
    if not (isinstance(err, lark.exceptions.UnexpectedToken) and err.token.type == "COLON"
            and post.params and len(post.open) == 1 and len(post.last) == 2):
        return None
    # the token before the ':' (the contextual lexer may reject ':' before this post-lexer sees it)
    seen_colon = post.last[-1].start_pos == err.token.start_pos
    name = post.last[0] if seen_colon else post.last[-1]
    if name.type != "NAME":
        return None
    return Diagnostic(_tok_span(name, file, source), f"missing ',' before parameter '{name}'")


def _keyword_as_name(err: lark.exceptions.UnexpectedInput, file: str, source: str) -> Diagnostic | None:
    """`program = x`, `y = schedule + 1`: a keyword where it cannot start what it starts (an
    item, a return) is a keyword used as a name."""
    if not isinstance(err, lark.exceptions.UnexpectedToken) or err.token.type in ("NAME", "$END"):
        return None
    tok, text = err.token, str(err.token)
    if text not in keywords():
        return None
    line = _lines(source + "\n")[tok.line - 1]
    before, after = line[:tok.column - 1].strip(), line[tok.column - 1 + len(text):].lstrip()
    if not before and after[:1].isidentifier():
        return None  # `program p(...` where it may not be: the other rules say why
    return Diagnostic(_tok_span(tok, file, source), f"'{text}' is a keyword and cannot be a name")


def _digits_then_name(err: lark.exceptions.UnexpectedInput, file: str, source: str) -> Diagnostic | None:
    """`order=1f1b`, `2y`: a name right after a number's digits, no space between, is read as
    the number and then the name: most often a string without its quotes."""
    if not isinstance(err, lark.exceptions.UnexpectedToken) or err.token.type != "NAME":
        return None
    tok = err.token
    start = tok.start_pos or 0
    i = start
    while i > 0 and (source[i - 1].isdigit() or source[i - 1] == "."):
        i -= 1
    if i == start or not source[i].isdigit():
        return None
    word = source[i:tok.end_pos]
    col = (tok.column or 1) - (start - i)
    return Diagnostic(Span(file, tok.line or 1, col, tok.line or 1, col + len(word), source),
                      f"'{word}' is a number followed by a name: a string is written in quotes "
                      f"(\"{word}\"), a product with an operator ({source[i:start]} * {tok})")


def _syntax_error(err: lark.exceptions.UnexpectedInput, file: str, source: str) -> Diagnostic:
    found = (_keyword_as_name(err, file, source) or _unclosed(err, file, source)
             or _missing_comma(err, file, source) or _digits_then_name(err, file, source))
    if found is not None:
        return found
    line, col = max(err.line, 1), max(err.column, 1)
    width = 1
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        return Diagnostic(Span(file, line, col, line, col + 1, source),
                          f"unexpected character {source[err.pos_in_stream or 0]!r}")
    tok = getattr(err, "token", None)
    expected = sorted({_word(t) for t in getattr(err, "expected", ()) if not t.startswith("__")})
    wanted = f"; expected {', '.join(expected)}" if expected else ""
    if tok is not None and tok.type != "$END":
        shown = "end of line" if tok.type == "_NL" else repr(str(tok))
        message = f"unexpected {shown}{wanted}"
        width = max(1, len(str(tok).strip()))
        opened = _postlex().open
        first = not _lines(source + "\n")[line - 1][:col - 1].strip()
        if opened and opened[-1].type != "LBRACE" and opened[-1].line < tok.line and first:
            o = opened[-1]
            message += f" (is the '{o}' at line {o.line}, col {o.column} closed?)"
    else:
        lines = _lines(source)
        while len(lines) > 1 and not lines[-1].strip():
            lines.pop()
        line, col = len(lines), len(lines[-1]) + 1
        message = f"unexpected end of file{wanted}"
    return Diagnostic(Span(file, line, col, line, col + width, source), message)


# Deeper expressions than this are an error: every later pass walks expressions recursively.
MAX_DEPTH = 100


def _too_deep(tree: lark.Tree, file: str, source: str) -> Diagnostic | None:
    """The first statement whose expression nests deeper than MAX_DEPTH (found without
    recursion, before anything recursive walks the tree)."""
    stack: list[tuple[lark.Tree, int, lark.Tree | None]] = [(tree, 0, None)]
    while stack:
        node, depth, stmt = stack.pop()
        if node.data in ("assign", "exprstmt", "ret", "opdef"):
            stmt, depth = node, 0
        if depth > MAX_DEPTH and stmt is not None:
            m = stmt.meta
            return Diagnostic(Span(file, m.line, m.column, m.end_line, m.end_column, source),
                              f"expression nested more than {MAX_DEPTH} levels deep; "
                              "split it into several stages")
        stack.extend((c, depth + 1, stmt) for c in reversed(node.children) if isinstance(c, lark.Tree))
    return None


# Words that start a definition only where an item starts (`op lerp(...)`, `extern op ...`);
# elsewhere they stay names (`reducescatter(op=sum, x)`, a stage called `op`).
SOFT_KEYWORDS = frozenset({"op", "extern"})


@cache
def keywords() -> frozenset[str]:
    """The words the grammar reserves ("program", "for", ...): never names."""
    return frozenset(t.pattern.value for t in _parser().terminals
                     if t.pattern.type == "str" and t.pattern.value.isidentifier()) - SOFT_KEYWORDS


INT64_MAX = 2**63 - 1


def _bad_token(tok: Token) -> str | None:
    text = str(tok)
    if tok.type == "NAME" and text in keywords():
        return f"'{text}' is a keyword and cannot be a name"
    if tok.type == "INT" or (tok.type == "NUMBER" and not any(c in text for c in ".eE")):
        if int(text) > INT64_MAX:
            return f"integer literal {text} does not fit int64"
    elif tok.type == "NUMBER" and float(text) == float("inf"):
        return f"number literal {text} is out of range for f64"
    return None


def _bad_tokens(tree: lark.Tree, file: str, source: str) -> list[Diagnostic]:
    """Names that are keywords (the contextual lexer lets `program for(...)` through) and
    literals that no dtype can hold, each located."""
    out = []
    for tok in tree.scan_values(lambda v: isinstance(v, Token)):
        why = _bad_token(tok)
        if why:
            out.append(Diagnostic(_tok_span(tok, file, source), why))
    return sorted(out, key=lambda d: (d.span.line, d.span.col))


def parse(source: str, file: str = "<string>") -> syntax.File:
    """Parse a whole .ccn file. Raises CompileError on the first syntax error. The trees of the
    last files parsed are kept (immutable: a file imported or each_layer's block file is read
    again by each schedule that names it)."""
    return _parse(source, file)


@lru_cache(maxsize=32)
def _parse(source: str, file: str) -> syntax.File:
    text = source if source.endswith("\n") else source + "\n"
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as err:
        raise CompileError([_syntax_error(err, file, source)]) from None
    deep = _too_deep(tree, file, source)
    if deep is not None:
        raise CompileError([deep])
    bad = _bad_tokens(tree, file, source)
    if bad:
        raise CompileError(bad)
    try:
        items = _ToAst(file, source).transform(tree)
    except lark.exceptions.VisitError as err:  # a rule's own located error (`for nope(p)`)
        if isinstance(err.orig_exc, CompileError):
            raise err.orig_exc from None
        raise
    def of(cls):
        return tuple(i for i in items if isinstance(i, cls))
    return syntax.File(file, source, of(syntax.Program), of(syntax.Schedule), of(syntax.OpDecl),
                       of(syntax.ExternDecl), of(syntax.Import))


def _bin(op: str) -> Callable[[_ToAst, Any, list], syntax.BinOp]:
    """The rule of one binary operator (a method of _ToAst)."""
    def rule(self: _ToAst, meta: Any, ch: list) -> syntax.BinOp:
        return syntax.BinOp(op, ch[0], ch[1], self._span(meta), self._op_span(op, ch[0], ch[1]))
    return rule


def _no_options(e) -> None:
    """A string or a list as a keyword's value is a schedule directive's option
    (`pipeline(order="1f1b", layers=[3, 1])`); in a program or a definition, an error at it."""
    if isinstance(e, syntax.Call):
        for a in (*e.args, *(k.value for k in e.kwargs)):
            if isinstance(a, (syntax.String, syntax.ShapeArg)) and any(k.value is a for k in e.kwargs):
                what = "a string" if isinstance(a, syntax.String) else "a list"
                raise CompileError.at(a.span, f"{e.fn}()'s {next(k.name for k in e.kwargs if k.value is a)} "
                                      f"is {what}: only a schedule's directives take one")
            _no_options(a)
    elif isinstance(e, syntax.BinOp):
        _no_options(e.left)
        _no_options(e.right)
    elif isinstance(e, syntax.Neg):
        _no_options(e.operand)


@v_args(meta=True)
class _ToAst(Transformer):
    """Lark tree -> syntax nodes. One method per grammar rule."""

    def __init__(self, file: str, source: str):
        super().__init__()
        self.file, self.source = file, source
        self._starts: list[int] | None = None  # offsets of the line starts, for _op_span

    def _span(self, m) -> Span:
        return Span(self.file, m.line, m.column, m.end_line, m.end_column, self.source)

    def _tspan(self, t: Token) -> Span:
        return Span(self.file, t.line or 0, t.column or 0, t.end_line or 0, t.end_column or 0, self.source)

    def start(self, meta, items):
        return list(items)

    def program(self, meta, ch):
        name, *rest = ch
        params, body = tuple(p for p in rest[:-1] if p is not None), rest[-1]
        for stmt in body:
            _no_options(getattr(stmt, "value", None))
        return syntax.Program(str(name), params, body, self._span(meta), self._tspan(name))

    def use(self, meta, ch):
        path, *names = ch
        return syntax.Import(syntax.String(str(path)[1:-1], self._tspan(path)), self._names(names), self._span(meta))

    def _names(self, toks) -> tuple[syntax.Name, ...]:
        return tuple(syntax.Name(str(t), self._tspan(t)) for t in toks if t is not None)

    def opdef(self, meta, ch):
        name, *params, body = ch
        _no_options(body)
        return syntax.OpDecl(str(name), self._names(params), body, self._span(meta), self._tspan(name))

    def extern(self, meta, ch):
        name, *rest = ch
        params = self._names(t for t in rest if isinstance(t, Token))
        settings = tuple(s for s in rest if isinstance(s, syntax.Setting))
        return syntax.ExternDecl(str(name), params, settings, self._span(meta), self._tspan(name))

    def setting(self, meta, ch):
        key, *values = ch
        return syntax.Setting(str(key), tuple(values), self._span(meta), self._tspan(key))

    def sstring(self, meta, ch):
        return syntax.String(str(ch[0])[1:-1], self._tspan(ch[0]))

    def sword(self, meta, ch):
        word, *ints = ch
        given = tuple(int(i) for i in ints if i is not None)
        written = "(" in self.source[meta.start_pos:meta.end_pos]
        return syntax.Word(str(word), given if written else None, self._span(meta))

    def param(self, meta, ch):
        name, dtype, shape, layout = ch
        return syntax.Param(str(name), str(dtype), shape, layout, self._span(meta), self._tspan(dtype))

    def shape(self, meta, ch):
        return tuple(d for d in ch if d is not None)

    def dim_name(self, meta, ch):
        return syntax.DimName(str(ch[0]), self._tspan(ch[0]))

    def dim_int(self, meta, ch):
        return syntax.DimInt(int(ch[0]), self._tspan(ch[0]))

    def dim_neg(self, meta, ch):
        return syntax.DimInt(-int(ch[0]), self._span(meta))

    def shape_arg(self, meta, ch):
        return syntax.ShapeArg(tuple(d for d in ch if d is not None), self._span(meta))

    def layout(self, meta, ch):
        kind, dim, extra = ch
        return syntax.LayoutDecl(str(kind), None if dim is None else int(dim),
                              None if extra is None else str(extra), self._span(meta))

    def schedule(self, meta, ch):
        name, prog, inner, body = ch
        if inner is None:
            return syntax.Schedule(str(name), str(prog), body, self._span(meta), self._tspan(prog),
                                   self._tspan(name))
        if str(prog) != "grad":
            raise CompileError.at(self._tspan(prog), f"a schedule is for a program NAME or for grad(NAME), "
                                  f"its derived program; got '{prog}(...)'")
        return syntax.Schedule(str(name), str(inner), body, self._span(meta), self._tspan(inner),
                               self._tspan(name), grad=True)

    def block(self, meta, ch):
        return tuple(s for s in ch if s is not None)

    def assign(self, meta, ch):
        *targets, value = ch
        names = tuple(syntax.Name(str(t), self._tspan(t)) for t in targets)
        return syntax.Assign(names, value, self._span(meta))

    def ret(self, meta, ch):
        return syntax.Return(tuple(ch), self._span(meta))

    def retitem(self, meta, ch):
        name, alias = ch
        return syntax.ReturnItem(syntax.Name(str(name), self._tspan(name)),
                              None if alias is None else syntax.Name(str(alias), self._tspan(alias)),
                              self._span(meta))

    def exprstmt(self, meta, ch):
        return syntax.ExprStmt(ch[0], self._span(meta))

    def number(self, meta, ch):
        return syntax.Number(str(ch[0]), self._tspan(ch[0]))

    def name(self, meta, ch):
        return syntax.Name(str(ch[0]), self._tspan(ch[0]))

    def call(self, meta, ch):
        fn, *args = ch
        args = [a for a in args if a is not None]
        pos = tuple(a for a in args if not isinstance(a, syntax.Kwarg))
        kws = tuple(a for a in args if isinstance(a, syntax.Kwarg))
        return syntax.Call(str(fn), pos, kws, self._span(meta), self._tspan(fn))

    def kwarg(self, meta, ch):
        value = ch[1]
        if isinstance(value, Token):  # a STRING
            value = syntax.String(str(value)[1:-1], self._tspan(value))
        return syntax.Kwarg(str(ch[0]), value, self._span(meta))

    def kwarg_list(self, meta, ch):
        name, *dims = ch
        return syntax.Kwarg(str(name), syntax.ShapeArg(tuple(d for d in dims if d is not None), self._span(meta)),
                            self._span(meta))

    def neg(self, meta, ch):
        return syntax.Neg(ch[0], self._span(meta))

    def _op_span(self, op: str, left: syntax.Expr, right: syntax.Expr) -> Span | None:
        """The operator between two operands: only ')', blanks and line continuations can
        precede it there, so its first occurrence after the left operand is the one."""
        if self._starts is None:
            self._starts = [0]
            for i, ch in enumerate(self.source):
                if ch == "\n":
                    self._starts.append(i + 1)
        a, b = left.span, right.span
        if not (1 <= a.end_line <= len(self._starts) and 1 <= b.line <= len(self._starts)):
            return None
        lo = self._starts[a.end_line - 1] + a.end_col - 1
        hi = self._starts[b.line - 1] + b.col - 1
        i = lo
        while i < hi and not self.source.startswith(op, i):
            i = self.source.find("\n", i, hi) if self.source[i] == "#" else i + 1
            if i < 0:
                return None
        if i >= hi:
            return None
        line = self.source.count("\n", 0, i) + 1
        col = i - self._starts[line - 1] + 1
        return Span(self.file, line, col, line, col + len(op), self.source)

    add, sub, mul, div, pow = _bin("+"), _bin("-"), _bin("*"), _bin("/"), _bin("**")
    lt, le, gt, ge, eq, ne = _bin("<"), _bin("<="), _bin(">"), _bin(">="), _bin("=="), _bin("!=")

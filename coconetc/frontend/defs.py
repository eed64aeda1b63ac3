"""Operations a .ccn file defines at file scope (docs/language.md, "Defined operations"):

    op lerp(a, b, t) = a + t * (b - a)       # expanded where it is called (checker.py)
    extern op rmsnorm(x, w, eps) { ... }     # a registry entry (frontend/externs.py)

`check_defs` checks every `op` definition on its own, before any program: the names its body
reads must be its parameters, the operations it calls must exist (built-in, extern or defined
in the file, in any order) and take the arguments given, it may not communicate, and no
definition may call itself, directly or through others. Each error points into the
definition. A program then calls a definition like any operation; the checker types the body
with the call's operands (so parameters take their types from the call, broadcasting as
built-ins do) and the program holds only built-in and extern operations: the interpreter,
the schedules, the planner and every backend see nothing new."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from coconetc.errors import CompileError, Diagnostic, Span
from coconetc.frontend import gradexpr, syntax
from coconetc.ir import ops
from coconetc.ir.typerules import TypeErr

RESERVED = ("update",)  # statement forms that look like calls


@dataclass
class Scope:
    """What one file adds to the language: its checked definitions (by name), the names of
    definitions with errors (a call of one is skipped: reported once, at the definition), and
    the extern operations it declares (only those may be called in this file)."""

    defs: dict[str, syntax.OpDecl] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    externs: set[str] = field(default_factory=set)
    # the file's programs (the first of a name), which a program may call (checker.py, "calls"),
    # and each one's check once done: its IR, or the CompileError it raised
    programs: dict[str, syntax.Program] = field(default_factory=dict)
    checked: dict[str, tuple[syntax.Program, object]] = field(default_factory=dict)

    def known(self, name: str) -> bool:
        return name in self.defs or name in self.failed


def programs_of(tree: syntax.File) -> dict[str, syntax.Program]:
    """The file's programs by name (the first of a name defined twice), for calls."""
    out: dict[str, syntax.Program] = {}
    for p in tree.programs:
        out.setdefault(p.name, p)
    return out


def builtin(name: str, nargs: int | None = None) -> ops.OpDef | None:
    """The built-in (or extern) operation called `name(...)` (with `nargs` arguments), if any."""
    return ops.called(name, nargs)


def builtin_of(call: syntax.Call) -> ops.OpDef | None:
    """The built-in (or extern) operation a call names. A name written for several operations
    is decided by the number of arguments (`max(x)`: the reduction, `max(a, b)`: pointwise);
    another number is an error at the call (or at the first argument too many)."""
    arities = ops.arities(call.fn)
    n = len(call.args) + len(call.kwargs)
    if arities and n not in arities:
        forms = sorted((d for d in ops.REGISTRY.values() if d.written == call.fn or d.name == call.fn),
                       key=lambda d: len(d.values))
        said = " or ".join(f"{len(d.values)} ({call.fn}({', '.join(a.name for a in d.values)}))" for d in forms)
        extra = (list(call.args) + [k.value for k in call.kwargs if not isinstance(k.value, (syntax.String, syntax.ShapeArg))])[max(arities):]
        raise TypeErr(extra[0].span if extra else call.span, f"{call.fn}() takes {said} arguments, got {n}")
    return ops.called(call.fn, n if arities else None)


def bind(call: syntax.Call, names: tuple[str, ...], defaults: dict[str, object]
         ) -> tuple[list[syntax.Expr], dict[str, object]]:
    """Match a call's arguments to parameters `names` (required) and `defaults` (keyword
    settings): positional list, keyword values. Raises a TypeErr at the call's mistake."""
    allowed = names + tuple(defaults)
    if len(call.args) > len(allowed):
        n = len(allowed)
        raise TypeErr(call.args[n].span, f"{call.fn}() takes at most {n} argument{'s' * (n != 1)}, "
                      f"got {len(call.args)}")
    bound: dict[str, syntax.Expr] = dict(zip(allowed, call.args))
    for kw in call.kwargs:
        if kw.name not in allowed:
            raise TypeErr(kw.span, f"{call.fn}() has no argument '{kw.name}'")
        if kw.name in bound:
            raise TypeErr(kw.span, f"{call.fn}() got '{kw.name}' twice")
        assert not isinstance(kw.value, (syntax.String, syntax.ShapeArg)), kw  # the parser refuses them here
        bound[kw.name] = kw.value
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeErr(call.span, f"{call.fn}() is missing its argument '{missing[0]}' "
                      f"({call.fn}({', '.join(names)}))")
    return [bound[n] for n in names], {k: bound.get(k, v) for k, v in defaults.items()}


SITE_KEYWORDS = ("site", "draw")  # a random operation's RNG site (docs/language.md, "Random operations")


def without_site(call: syntax.Call) -> tuple[syntax.Call, dict[str, syntax.Kwarg]]:
    """A random operation's call without its `site=NAME` / `draw=k` keywords, and those."""
    given: dict[str, syntax.Kwarg] = {}
    for k in call.kwargs:
        if k.name in SITE_KEYWORDS:
            if k.name in given:
                raise TypeErr(k.span, f"{call.fn}() got '{k.name}' twice")
            given[k.name] = k
    if not given:
        return call, {}
    return replace(call, kwargs=tuple(k for k in call.kwargs if k.name not in SITE_KEYWORDS)), given


def bind_def(call: syntax.Call, d: syntax.OpDecl) -> list[syntax.Expr]:
    """The operands of a call of a definition, in its parameters' order. A wrong number of
    arguments is an error at the call."""
    names = tuple(p.id for p in d.params)
    if len(call.args) > len(names) or len(call.args) + len(call.kwargs) != len(names):
        n = len(names)
        got = len(call.args) + len(call.kwargs)
        raise TypeErr(call.span, f"{call.fn}() takes {n} argument{'s' * (n != 1)} "
                      f"({call.fn}({', '.join(names)})), got {got}")
    return bind(call, names, {})[0]


def check_defs(tree: syntax.File) -> tuple[Scope, list[Diagnostic]]:
    """Every `op` definition of the file, checked; the scope programs are checked in."""
    scope = Scope(externs={e.name for e in tree.externs})
    errors: list[Diagnostic] = []
    decls: dict[str, syntax.OpDecl] = {}
    for d in tree.ops:
        why = _name_problem(d, decls, scope)
        if why:
            errors.append(Diagnostic(d.name_span, why))
            continue
        decls[d.name] = d
    calls: dict[str, list[str]] = {}
    for d in decls.values():
        found = _check_body(d, decls, scope, calls)
        if found:
            errors.extend(found)
            scope.failed.add(d.name)
    for d in decls.values():
        cycle = _cycle(d.name, calls)
        if cycle:
            errors.append(Diagnostic(d.name_span, f"operation '{d.name}' is recursive "
                                     f"({' -> '.join(cycle)}); an operation cannot call itself"))
            scope.failed.add(d.name)
    scope.defs = {n: d for n, d in decls.items() if n not in scope.failed}
    for e in tree.externs:  # the derivatives extern operations declare (grad_p = "...")
        errors += check_grads(e, {d.name for d in tree.ops}, scope)
    return scope, errors


def _name_problem(d: syntax.OpDecl, decls: dict[str, syntax.OpDecl], scope: Scope) -> str:
    if d.name in RESERVED or (builtin(d.name) is not None and d.name not in scope.externs):
        return f"'{d.name}' is a built-in operation; choose another name"
    if d.name in scope.externs:
        return f"'{d.name}' is already declared as an extern operation"
    if d.name in decls:
        return f"operation '{d.name}' is defined twice (first at line {decls[d.name].span.line})"
    seen: set[str] = set()
    for p in d.params:
        if p.id in seen:
            return f"parameter '{p.id}' of '{d.name}' is declared twice"
        seen.add(p.id)
    return ""


def _check_body(d: syntax.OpDecl, decls: dict[str, syntax.OpDecl], scope: Scope,
                calls: dict[str, list[str]]) -> list[Diagnostic]:
    """Names, calls and arities in d's body, each error at its place in the body."""
    params = {p.id for p in d.params}
    errors: list[Diagnostic] = []
    calls[d.name] = []

    def err(span: Span, msg: str) -> None:
        errors.append(Diagnostic(span, msg))

    def visit(e: syntax.Expr) -> None:
        if isinstance(e, syntax.Name):
            if e.id not in params and e.id != syntax.INF:
                shown = ", ".join(p.id for p in d.params) or "none"
                err(e.span, f"unknown name '{e.id}' in the body of '{d.name}' "
                    f"(an operation reads only its parameters: {shown})")
        elif isinstance(e, syntax.Neg):
            visit(e.operand)
        elif isinstance(e, syntax.BinOp):
            visit(e.left)
            visit(e.right)
        elif isinstance(e, syntax.Call):
            for operand in _call_operands(e, d, decls, scope, calls, err):
                visit(operand)
    visit(d.body)
    return errors


def _call_operands(call: syntax.Call, d: syntax.OpDecl, decls: dict[str, syntax.OpDecl],
                   scope: Scope, calls: dict[str, list[str]], err) -> list[syntax.Expr]:
    """The operand expressions of a call in d's body (words and integers left out), after
    checking that the call names an operation that may stand there and fits its arguments."""
    if call.fn in decls:
        calls[d.name].append(call.fn)
        try:
            return bind_def(call, decls[call.fn])
        except TypeErr as e:
            errors = e.diagnostics
            err(errors[0].span, errors[0].message)
            return list(call.args) + [k.value for k in call.kwargs if not isinstance(k.value, (syntax.String, syntax.ShapeArg))]
    try:
        entry = builtin_of(call)
    except TypeErr as e:
        err(e.diagnostics[0].span, e.diagnostics[0].message)
        return list(call.args) + [k.value for k in call.kwargs if not isinstance(k.value, (syntax.String, syntax.ShapeArg))]
    if call.fn in RESERVED or entry is None or (entry.extern is not None and call.fn not in scope.externs):
        err(call.fn_span, f"unknown operation '{call.fn}' in the body of '{d.name}'")
        return list(call.args) + [k.value for k in call.kwargs if not isinstance(k.value, (syntax.String, syntax.ShapeArg))]
    if entry.kind == "collective":
        err(call.fn_span, f"{call.fn}() communicates; an operation's body computes only "
            "(call the collective in the program)")
        return []
    names = tuple(a.name for a in entry.params if a.required)
    try:
        if entry.kind == "random":
            call, _ = without_site(call)  # site=NAME, draw=k: words, checked with the program
        pos, _ = bind(call, names, entry.defaults())
    except TypeErr as e:
        err(e.diagnostics[0].span, e.diagnostics[0].message)
        return []
    kinds = {a.name: a.kind for a in entry.params}
    return [x for n, x in zip(names, pos) if kinds[n] == "value"]


def _cycle(start: str, calls: dict[str, list[str]]) -> list[str]:
    """A path start -> ... -> start through the call graph, if there is one."""
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen: set[str] = set()
    while stack:
        name, path = stack.pop()
        for callee in calls.get(name, ()):
            if callee == start:
                return [*path, start]
            if callee not in seen:
                seen.add(callee)
                stack.append((callee, [*path, callee]))
    return []


def check_grads(decl: syntax.ExternDecl, defined: set[str], scope: Scope) -> list[Diagnostic]:
    """The `grad_<p>` settings of one extern declaration (frontend/gradexpr.py): p a
    parameter, the value one string, the expression's names, operations and arities, each
    error at its place in the string. defined: the file's `op` definitions, which a derivative
    may not call (write the expression out: a printed declaration goes without them)."""
    params = tuple(p.id for p in decl.params)
    errors: list[Diagnostic] = []
    for s in decl.settings:
        if not s.key.startswith(gradexpr.PREFIX):
            continue
        p = gradexpr.operand(s.key)
        if p not in params:
            errors.append(Diagnostic(s.key_span, f"'{s.key}': '{p}' is not a parameter of '{decl.name}' "
                                     f"(grad_p = \"...\" declares the derivative of parameter p: "
                                     f"one of {', '.join(params)})"))
            continue
        if len(s.values) != 1 or not isinstance(s.values[0], syntax.String):
            errors.append(Diagnostic(s.span, f"'{s.key}' takes one string: an expression of "
                                     f"{', '.join(gradexpr.names(params))} (g: the result's cotangent, y: the result)"))
            continue
        try:
            body = gradexpr.parse_string(s.values[0], params)
        except CompileError as err:
            errors += err.diagnostics
            continue
        errors += _check_grad(decl, s.key, body, defined, Scope(externs=scope.externs))
    return errors


def _check_grad(decl: syntax.ExternDecl, key: str, body: syntax.Expr, defined: set[str],
                scope: Scope) -> list[Diagnostic]:
    allowed = gradexpr.names(tuple(p.id for p in decl.params))
    where = f"{decl.name}'s {key}"
    owner = syntax.OpDecl(where, decl.params, body, decl.span, decl.name_span)
    errors: list[Diagnostic] = []

    def err(span: Span, msg: str) -> None:
        errors.append(Diagnostic(span, msg.replace(f"in the body of '{where}'", f"in {where}")))

    def visit(e: syntax.Expr) -> None:
        if isinstance(e, syntax.Name):
            if e.id not in allowed:
                err(e.span, f"unknown name '{e.id}' in {where} (a derivative reads "
                    f"{', '.join(allowed)}: the parameters, g the result's cotangent, y the result)")
        elif isinstance(e, syntax.Neg):
            visit(e.operand)
        elif isinstance(e, syntax.BinOp):
            visit(e.left)
            visit(e.right)
        elif isinstance(e, syntax.Call):
            entry = builtin(e.fn)
            if e.fn in defined:
                err(e.fn_span, f"'{e.fn}' is a defined operation (op {e.fn}(...) = ...): a derivative "
                    "may call built-in and extern operations only; write its expression out")
            elif entry is not None and entry.kind == "collective":
                err(e.fn_span, f"{e.fn}() communicates: a derivative computes on each rank (the "
                    "derivation adds the communication the layouts need)")
            elif entry is not None and entry.kind == "random":
                err(e.fn_span, f"{e.fn}() draws random numbers: a derivative may not")
            else:
                for x in _call_operands(e, owner, {}, scope, {where: []}, err):
                    visit(x)
    visit(body)
    return errors

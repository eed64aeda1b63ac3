"""What the checker needs to know about calls of programs before it inlines one
(docs/language.md, "Calling programs" and "Repeating a program over layers"): which
statements call a program, the cycle a call would close, and the names of the inlined stages.

    y = block(x, w, b)                  # block's stages inlined as y__<stage>; its result is y
    y = repeat(block, x, ws, bs)        # layer l's stages as y__l<l>__<stage>; the last result is y

The inlining itself is the checker's (checker.py, `_program_call`)."""

from __future__ import annotations

from coconetc.frontend import syntax
from coconetc.frontend.defs import Scope
from coconetc.ir import ops

REPEAT = "repeat"  # repeat(program, carried, args...): the program over the layers of stacked arguments
SEP = "__"  # between a call's name and its stages' names


def is_call(call: syntax.Call, scope: Scope) -> bool:
    """Whether `call` calls a program of the file (or repeats one): not an operation's name."""
    if call.fn in scope.defs or call.fn in scope.failed or ops.called(call.fn) is not None or ops.arities(call.fn):
        return False
    if call.fn == REPEAT:
        return True
    return call.fn in scope.programs


def callee(call: syntax.Call) -> str | None:
    """The program a call (or a repeat) names; None for a repeat without a program's name."""
    if call.fn != REPEAT:
        return call.fn
    first = call.args[0] if call.args else None
    return first.id if isinstance(first, syntax.Name) else None


def calls_of(prog: syntax.Program, scope: Scope) -> list[str]:
    """The programs a program calls (statements whose right-hand side is a call of one)."""
    out = []
    for stmt in prog.body:
        value = getattr(stmt, "value", None)
        if isinstance(value, syntax.Call) and is_call(value, scope):
            name = callee(value)
            if name is not None and name in scope.programs:
                out.append(name)
    return out


def cycle(name: str, stack: tuple[str, ...], scope: Scope) -> list[str]:
    """The cycle a call of program `name` closes, from the programs being checked (`stack`,
    the outermost first): [a, b, ..., a], or [] when there is none."""
    if name in stack:
        return [*stack[stack.index(name):], name]
    seen: set[str] = set()

    def walk(n: str, path: list[str]) -> list[str]:
        if n in stack:
            return [*stack[stack.index(n):], *path, n]
        if n in seen or n not in scope.programs:
            return []
        seen.add(n)
        for m in calls_of(scope.programs[n], scope):
            found = walk(m, [*path, n])
            if found:
                return found
        return []
    return walk(name, [])


def stage_name(lhs: str, stage: str, layer: int | None = None) -> str:
    """The name of a callee's stage inlined by the call `lhs = ...`: `lhs__stage`, or, in layer
    l of a repeat, `lhs__l<l>__stage`."""
    return f"{lhs}{SEP}{stage}" if layer is None else f"{lhs}{SEP}l{layer}{SEP}{stage}"

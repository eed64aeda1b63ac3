"""The whole front half of the compiler, top to bottom:

    source --parse--> syntax tree --check--> typed IR --schedule (each directive checked)--> scheduled IR
           --plan (coconetc/plan; what no backend can run is an error at its directive)

`load_file`/`load_source` return a SourceFile (one .ccn file, checked: every program and every
schedule applied), or raise one CompileError listing every error of the file. ("Module" is kept
for the generated Python extension module and the loader's CompiledModule.)"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from coconetc import cache
from coconetc.autodiff import vjp
from coconetc.autodiff.saved import accumulating, bwd_name, split, split_input_weight
from coconetc.errors import CompileError, Diagnostic
from coconetc.frontend import syntax
from coconetc.frontend import externs
from coconetc.frontend.checker import check_program
from coconetc.frontend.defs import Scope, check_defs, programs_of
from coconetc.frontend.parser import parse
from coconetc.ir import ops
from coconetc.ir.nodes import Op, Program, walk
from coconetc.ir.ops import OpDef
from coconetc.paths import imported_texts
from coconetc.plan import Plan, plan_program
from coconetc.plan.label import DEFAULT
from coconetc.schedule import apply_all, from_ast
from coconetc.schedule.directives import Directive, Fuse
from coconetc.schedule.each_layer import Layers
from coconetc.schedule.fusion import FUSE_ADVICE, REORDER_FIRST_ADVICE
from coconetc.schedule.prefetch import keep_refused, keeps_gathered




@dataclass(frozen=True)
class ScheduleIR:
    name: str
    program: str
    directives: tuple[Directive, ...]
    ir: Program | None  # None for `schedule auto` (the autotuner decides)
    # the directives as the schedule wrote them, where an each_layer(...) stands for several of
    # `directives` (those with its span); None: the same
    written: tuple[Directive, ...] | None = None

    @property
    def auto(self) -> bool:
        return self.ir is None

    @property
    def keeps_gathered(self) -> bool:
        """Does it say keep_gathered() (a grad schedule: autodiff/saved.py pairing)?"""
        return keeps_gathered(self.directives)


@dataclass
class SourceFile:
    """A checked .ccn file: its typed programs and, per program, its scheduled variants."""

    file: str
    source: str
    programs: dict[str, Program] = field(default_factory=dict)
    schedules: dict[str, dict[str, ScheduleIR]] = field(default_factory=dict)
    # (program, schedule) -> its execution plan, made once here for every backend ("default":
    # the program itself; none for `schedule auto`)
    plans: dict[tuple[str, str], Plan] = field(default_factory=dict)
    # the extern operations the file declares (their registry entries), by name
    externs: dict[str, OpDef] = field(default_factory=dict)
    # derived programs (docs/autodiff.md): `<p>_grad`, `<p>_fwd`, `<p>_bwd` -> p, the program
    # they differentiate
    derived: dict[str, str] = field(default_factory=dict)
    # (program, pipeline schedule) -> its stages' schedules (stage_schedules), made as the file
    # loads (where they are checked) and read by with_grads and from_schedule
    staged: dict[tuple[str, str], dict[str, ScheduleIR]] = field(default_factory=dict)

    def program(self, name: str | None) -> Program:
        if name is None:  # the file's only program (its derived programs do not count)
            own = [p for n, p in self.programs.items() if n not in self.derived]
            if len(own) != 1:
                raise KeyError(f"{self.file} holds {len(own)} programs "
                               f"({', '.join(p.name for p in own)}); choose one with --program")
            return own[0]
        if name not in self.programs:
            raise KeyError(f"no program '{name}' in {self.file} (programs: {', '.join(self.programs)})")
        return self.programs[name]

    def variants(self) -> dict[tuple[str, str], Program]:
        """Every (program, schedule) that compiles to a function; the program itself as 'default'."""
        out = {}
        for name, prog in self.programs.items():
            out[(name, DEFAULT)] = prog
            for sname, sched in self.schedules[name].items():
                if sched.ir is not None:
                    out[(name, sname)] = sched.ir
        return out

    def extern_headers(self, backend: str = "cpp") -> list[str]:
        """The headers of the file's extern operations, for one backend ('cpp' or 'cuda')."""
        impls = [getattr(d.extern, backend) for d in self.externs.values() if d.extern is not None]
        return list(dict.fromkeys(i.header for i in impls if i is not None))

    def schedule(self, program: str, name: str) -> ScheduleIR:
        scheds = self.schedules.get(program, {})
        if name not in scheds:
            raise KeyError(f"no schedule '{name}' for program '{program}' "
                           f"(schedules: {', '.join(scheds) or 'none'})")
        return scheds[name]


def load_file(path: str | Path) -> SourceFile:
    path = Path(path)
    return load_source(path.read_text(), str(path))


def load_source(source: str, file: str = "<string>") -> SourceFile:
    """SOURCE (the text of FILE) parsed, checked, scheduled and planned; remembered in the cache
    (coconetc/cache.py: parsed files), so that the same text loads from its record next time."""
    imported = imported_texts(file, source)
    remembered = None if ops.added() else cache.recall_parsed(file, source, imported)
    if isinstance(remembered, SourceFile):
        return remembered
    tree = parse(source, file)
    mod = SourceFile(file, source)
    with ops.extern_scope(mod.externs):  # the names the file writes mean its own declarations
        mod = _checked(mod, tree)
    if not mod.externs and not ops.added():
        cache.remember_parsed(file, source, imported, mod)
    return mod


def _checked(mod: SourceFile, tree) -> SourceFile:
    errors = list[Diagnostic]()
    for i, ext in enumerate(tree.externs):
        _collect(errors, _extern, mod, ext, tree.externs[:i])
    scope, found = check_defs(tree)
    errors += found
    scope.failed |= {e.name for e in tree.externs if e.name not in mod.externs}
    scope.externs = set(mod.externs)
    scope.programs = programs_of(tree)
    errors += _imports(mod, tree, scope)
    for i, prog in enumerate(tree.programs):
        _collect(errors, _program, mod, prog, tree.programs[:i], scope)
    for sched in tree.schedules:
        if sched.grad and sched.program in mod.programs and sched.target not in mod.programs:
            _collect(errors, _derive, mod, sched.program, sched.program_span)
    for i, sched in enumerate(tree.schedules):
        _collect(errors, _schedule, mod, sched, tree, tree.schedules[:i])
    if errors:
        raise CompileError(sorted(errors, key=lambda d: (d.span.line, d.span.col)))
    return mod


def _imports(mod: SourceFile, tree: syntax.File, scope: Scope) -> list[Diagnostic]:
    """`from "other.ccn" import p`: p (and the programs of that file it calls) become programs
    this file's programs may call (inlined, as the file's own are; not programs of this file's
    module). The other file holds programs and schedules only (no op, extern or import)."""
    from coconetc.frontend.calls import calls_of
    from coconetc.paths import import_path
    errors: list[Diagnostic] = []
    for imp in tree.imports:
        path = import_path(mod.file, imp.path.text)
        try:
            other = parse(path.read_text(), str(path))
        except OSError:
            errors.append(Diagnostic(imp.path.span, f"no file {imp.path.text!r} to import from (looked beside "
                                     "this file, and among the examples that ship with coconet)"))
            continue
        except CompileError as err:
            errors.extend(err.diagnostics)
            continue
        if other.ops or other.externs or other.imports:
            errors.append(Diagnostic(imp.path.span, f"{imp.path.text} declares operations (op, extern) or imports "
                                     "from other files: programs are imported only from a file of programs "
                                     "and schedules"))
            continue
        theirs = programs_of(other)
        for n in imp.names:
            if n.id not in theirs:
                errors.append(Diagnostic(n.span, f"{imp.path.text} has no program '{n.id}' (its programs: "
                                         f"{', '.join(theirs) or 'none'})"))
                continue
            todo = [n.id]
            while todo:
                name = todo.pop()
                if scope.programs.get(name) is theirs[name]:
                    continue
                if name in scope.programs:
                    errors.append(Diagnostic(n.span, f"program '{name}' (imported from {imp.path.text}"
                                             f"{'' if name == n.id else ', which ' + n.id + ' calls'}) is "
                                             "defined in this file too"))
                    break
                scope.programs[name] = theirs[name]
                todo += calls_of(theirs[name], Scope(programs=dict(theirs)))
    return errors


def grad_name(program: str) -> str:
    """The name of a program's derived program in its file (`schedule s for grad(p)`)."""
    return f"{program}_grad"


def _derive(mod: SourceFile, program: str, span=None) -> str:
    """Add the derived (vector-Jacobian) program of `program` to mod, with respect to every
    floating tensor parameter, planned as any program is."""
    name = grad_name(program)
    if name in mod.programs:
        if mod.derived.get(name) == program:
            return name
        raise CompileError.at(span or mod.programs[name].span,
                              f"program '{name}' is defined in the file: grad({program}) needs the name")
    ir = vjp(mod.programs[program], name=name)
    mod.plans[(name, DEFAULT)] = plan_program(ir)
    mod.programs[name] = ir
    mod.schedules[name] = {}
    mod.derived[name] = program
    return name


def with_grads(mod: SourceFile, programs) -> SourceFile:
    """A copy of mod with, for each program p of `programs` (names), its derived program
    `<p>_grad` and that program cut at the forward's saved values (autodiff/saved.py):
    `<p>_fwd` (p returning the saved values too) and `<p>_bwd` (the backward reading them),
    each with the schedules of p (of grad(p)) that apply to it unchanged. An entry
    `p:x1,x2` also cuts `<p>_bwd` at the gradients of p's parameters x1, x2 (the inputs a
    pipeline stage sends gradients back for): `<p>_bwd_input` and `<p>_bwd_weight`
    (autodiff/saved.py, split_input_weight), with grad(p)'s schedules that apply; `p:x1+acc`
    also `<p>_bwd_acc` and `<p>_bwd_weight_acc`, which add the other tensor parameters'
    gradients into accumulators in place (autodiff/saved.py accumulating). An entry
    `p@s:x` adds the virtual stages of schedule s's pipeline directive as programs
    (`<p>_<s>_stage<k>`: schedule/pipeline.py, stage_program), each derived and cut at the
    activation it receives (x, p's parameter, on stage 0)."""
    new = replace(mod, programs=dict(mod.programs), schedules={p: dict(s) for p, s in mod.schedules.items()},
                  plans=dict(mod.plans), derived=dict(mod.derived))
    todo = list(programs)
    while todo:
        entry = todo.pop(0)
        if "@" in entry:  # the stages first added to new, then each derived as an entry of its own
            entry, plus, acc = entry.partition("+")
            todo[:0] = [e + plus + acc for e in _pipeline_stages(new, entry)]
            continue
        p, _, inputs = entry.partition(":")
        inputs, plus, acc = inputs.partition("+")
        if "+" in p or (plus and not inputs.strip()):
            raise ValueError(f"grad entry {entry!r}: '+acc' follows the inputs the backward is cut at "
                             f"('{p.partition('+')[0]}:x+acc', x the input a stage sends back the gradient of)")
        if plus and acc.strip() != "acc":
            raise ValueError(f"grad entry {entry!r}: after '+' only 'acc' (the accumulating backwards), "
                             f"got {acc.strip()!r}")
        new.program(p)  # a KeyError naming the file's programs
        grad = _derive(new, p)
        staged = next((s[grad] for s in new.staged.values() if grad in s), None)
        if staged is not None and staged.name not in new.schedules[grad]:  # a pipeline stage's backward
            _add_schedule(new, staged)  # under its layers' directives
        _split(new, p, grad)
        if inputs:
            xs = tuple(x.strip() for x in inputs.split(","))
            cut = split_input_weight(new.programs[p], new.programs[bwd_name(p)], xs)
            for ir in (cut.input_grad, cut.weight_grad):
                _add_derived(new, ir, p, grad)
            if plus:  # the backwards that add the weights' gradients into accumulators
                weights = tuple(q.name for q in new.programs[p].params if not q.scalar and q.name not in xs)
                for ir in (new.programs[bwd_name(p)], cut.weight_grad):
                    _add_derived(new, accumulating(ir, weights), p, grad)
    return new


def _add_schedule(mod: SourceFile, sched: ScheduleIR) -> None:
    assert sched.ir is not None
    mod.schedules[sched.program][sched.name] = sched
    mod.plans[(sched.program, sched.name)] = plan_program(sched.ir, sched.name)


def _pipeline_stages(mod: SourceFile, entry: str) -> list[str]:
    """`p@s:x`: add the stage programs of schedule s's pipeline directive to MOD; their
    with_grads entries (each cut at the activation it receives)."""
    from coconetc.schedule.pipeline import cut, directive, stage_input, stage_name, stage_program
    target, _, first = entry.partition(":")
    program, _, schedule = target.partition("@")
    p = mod.program(program)
    d = directive(mod.schedule(program, schedule).directives)
    if d is None:
        raise CompileError.at(p.span, f"schedule {schedule} of {program} has no pipeline(...) directive")
    c = cut(p, d)
    entries = []
    scheduled = stage_schedules(mod, program, schedule)
    for k in range(c.order.stages):
        sp = stage_program(p, c, k, stage_name(program, schedule, k))
        if sp.name not in mod.programs:
            mod.plans[(sp.name, DEFAULT)] = plan_program(sp)
            mod.programs[sp.name] = sp
            mod.schedules[sp.name] = {}
            mod.derived[sp.name] = program
            if sp.name in scheduled:  # its layers' directives: the stage's own schedule of the same name
                _add_schedule(mod, scheduled[sp.name])
        entries.append(f"{sp.name}:{stage_input(p, sp, k, first or 'x')}")
    return entries


def _split(mod: SourceFile, program: str, grad: str) -> None:
    """The training cut of PROGRAM, and where a schedule of its derived program GRAD says
    keep_gathered(), the cut that keeps the gathered weights (`<p>_fwd_kept`, `<p>_bwd_kept`):
    that schedule applies to the kept cut's backward, not to the other's."""
    kept = any(keeps_gathered(s.directives) for s in mod.schedules[grad].values())
    for keep in (False, True) if kept else (False,):
        cut = split(mod.programs[program], mod.programs[grad], keep_gathered=keep)
        for ir, base in ((cut.forward, program), (cut.backward, grad)):
            _add_derived(mod, ir, program, base, keep if base == grad else None)


def _add_derived(mod: SourceFile, ir: Program, program: str, base: str, kept: bool | None = None) -> None:
    """Add IR, derived from PROGRAM, with the schedules of BASE that apply to it unchanged
    (kept: only those whose keep_gathered() says so, True or False; None: every one)."""
    if ir.name in mod.programs:
        if mod.derived.get(ir.name) == program:
            return
        raise CompileError.at(mod.programs[ir.name].span, f"program '{ir.name}' is defined in the file: "
                              f"the derived programs of {program} need the name")
    mod.plans[(ir.name, DEFAULT)] = plan_program(ir)
    mod.programs[ir.name] = ir
    mod.derived[ir.name] = program
    mod.schedules[ir.name] = {}
    for sname, sched in mod.schedules[base].items():
        if sched.ir is None or (kept is not None and keeps_gathered(sched.directives) != kept):
            continue
        try:  # the same directives; one that names a value this program does not have fails
            again = apply_all(ir, sched.directives)
            mod.plans[(ir.name, sname)] = plan_program(again, sname)
        except CompileError:
            continue
        mod.schedules[ir.name][sname] = ScheduleIR(sname, ir.name, sched.directives, again)


DERIVED_CALLS = {"_grad": "the derived program", "_bwd": "the backward of the training cut"}


def _derived_callees(prog: syntax.Program, scope: Scope, stack: tuple[str, ...]) -> None:
    """A program may call the derived program of another, `q_grad(...)` (or the backward of its
    training cut, `q_bwd(...)`), by the name the file gives it (docs/language.md, "Calling
    programs"): each such callee is derived here from q's checked IR, printed and read back as a
    program of the scope, and then inlined by the checker as any called program is; so are
    those of the programs PROG calls (which the checker inlines into it), wherever they stand."""
    from coconetc.frontend.calls import callee, is_call
    from coconetc.ir.printer import program as printed
    for stmt in prog.body:
        call = getattr(stmt, "value", None)
        if not isinstance(call, syntax.Call):
            continue
        if is_call(call, scope):  # a program of the file: its own calls of derived programs first
            name = callee(call)
            if name in scope.programs and name not in stack:
                _derived_callees(scope.programs[name], scope, (*stack, name))
            continue
        if ops.called(call.fn) is not None or ops.arities(call.fn) or call.fn in scope.defs:
            continue
        q, suffix = next(((call.fn[:-len(k)], k) for k in DERIVED_CALLS if call.fn.endswith(k)), ("", ""))
        if q not in scope.programs:
            continue
        if q in stack:
            raise CompileError.at(call.fn_span, f"recursive call: {' -> '.join(stack)} -> {call.fn} "
                                  f"({DERIVED_CALLS[suffix]} of '{q}')")
        _derived_callees(scope.programs[q], scope, (*stack, q))
        ir = vjp(check_program(scope.programs[q], scope), name=grad_name(q))
        if any(isinstance(n, Op) and ops.get(n.op).kind == "random" for st in ir.stages for n in walk(st.expr)):
            raise CompileError.at(call.fn_span, f"{call.fn}(): {DERIVED_CALLS[suffix]} of '{q}' draws random "
                                  "numbers (dropout), whose masks are keyed by its own stages' names, not the "
                                  f"call's: it cannot be called yet; run it from Python (coconetc.load(file, "
                                  f"grad=['{q}']).{call.fn})")
        if suffix == "_bwd":
            ir = split(check_program(scope.programs[q], scope), ir).backward
        tree = parse(printed(ir), f"<{call.fn}: {DERIVED_CALLS[suffix]} of {q}>")
        scope.programs[call.fn] = _at(tree.programs[0], call.span)


def _at(node, span):
    """A syntax tree read from text the compiler printed, every span at SPAN (the call that
    inlines it: its stages' lines in a plan, its errors at the call)."""
    from dataclasses import fields, is_dataclass
    if isinstance(node, tuple):
        return tuple(_at(x, span) for x in node)
    if not is_dataclass(node) or isinstance(node, type):
        return node
    changes = {f.name: span if f.type in ("Span", "Span | None") and getattr(node, f.name) is not None
               else _at(getattr(node, f.name), span) for f in fields(node)}
    return replace(node, **changes)


def _collect(errors: list[Diagnostic], fn, *args) -> None:
    try:
        fn(*args)
    except CompileError as err:
        errors.extend(err.diagnostics)


def _extern(mod: SourceFile, decl: syntax.ExternDecl, earlier: tuple[syntax.ExternDecl, ...]) -> None:
    if any(e.name == decl.name for e in earlier):
        raise CompileError.at(decl.name_span, f"extern operation '{decl.name}' is declared twice")
    mod.externs[decl.name] = externs.declare(decl, mod.file, mod.externs)


def _program(mod: SourceFile, prog: syntax.Program, earlier: tuple[syntax.Program, ...],
             scope: Scope) -> None:
    if any(p.name == prog.name for p in earlier):  # even when the first one has errors
        raise CompileError.at(prog.name_span, f"program '{prog.name}' is defined twice")
    _derived_callees(prog, scope, (prog.name,))
    ir = check_program(prog, scope)
    mod.plans[(prog.name, DEFAULT)] = plan_program(ir)  # raises where no backend can run it
    mod.programs[prog.name] = ir
    mod.schedules[prog.name] = {}


def _schedule(mod: SourceFile, sched: syntax.Schedule, tree: syntax.File,
              earlier: tuple[syntax.Schedule, ...]) -> None:
    what = f"grad({sched.program})" if sched.grad else sched.program
    if sched.program in mod.programs or any(p.name == sched.program for p in tree.programs):
        if any(s.target == sched.target and s.name == sched.name for s in earlier):
            raise CompileError.at(sched.name_span or sched.span,
                                  f"schedule '{sched.name}' for '{what}' is defined twice")
    if sched.program not in mod.programs:
        if any(p.name == sched.program for p in tree.programs):
            return  # the program itself has errors, reported already
        raise CompileError.at(sched.program_span, f"schedule '{sched.name}' is for unknown program "
                              f"'{sched.program}'")
    if sched.target not in mod.programs:
        return  # its derivation failed, reported already
    known = mod.schedules[sched.target]
    body = sched.body or ()
    directives = tuple(from_ast(body))
    if sched.name == "auto":
        if directives:
            raise CompileError.at(body[0].span, "schedule auto takes no directives: the autotuner chooses")
        known[sched.name] = ScheduleIR("auto", sched.target, (), None)
        return
    written = directives
    directives = _each_layer(mod, tree, sched, directives)
    refused = keep_refused(mod.programs[sched.target], directives, sched.grad)
    if refused is not None:
        raise refused
    try:
        ir = apply_all(mod.programs[sched.target], directives)
        mod.plans[(sched.target, sched.name)] = plan_program(ir, sched.name)
        _check_stages(mod, sched, directives, ir)
    except CompileError as err:
        raise _written_out(_settled(err, mod.programs[sched.target], directives, sched.name), written) from None
    known[sched.name] = ScheduleIR(sched.name, sched.target, directives, ir,
                                   written if written != directives else None)


def _check_stages(mod: SourceFile, sched: syntax.Schedule, directives: tuple[Directive, ...], ir: Program) -> None:
    """A pipeline schedule's stages' schedules, made (mod.staged) and so checked when the later
    of a program's schedule s and grad(p)'s schedule s is: each applies to its stage's program."""
    from coconetc.schedule.pipeline import directive
    if sched.grad:
        if sched.name not in mod.schedules.get(sched.program, {}):
            return  # (made with the program's schedule s, if the file has one, after this)
    elif directive(directives) is None:
        return
    trial = replace(mod, schedules={**mod.schedules, sched.target: {
        **mod.schedules.get(sched.target, {}), sched.name: ScheduleIR(sched.name, sched.target, directives, ir)}})
    staged = _staged(trial, sched.program, sched.name)
    if staged:
        mod.staged[(sched.program, sched.name)] = staged


def _written_out(err: CompileError, written: tuple[Directive, ...]) -> CompileError:
    """ERR with each diagnostic at an each_layer(...) of WRITTEN (a refusal of one of the
    directives it stands for) saying so: its names are the layers' (`y__l<l>__<name>`)."""
    from coconetc.schedule.each_layer import EachLayer
    def of(g: Diagnostic) -> EachLayer | None:
        return next((d for d in written if isinstance(d, EachLayer)
                     and d.span.line <= g.span.line <= max(d.span.line, d.span.end_line)), None)
    return CompileError([replace(g, message=f"each_layer(): the block's schedule '{d.schedule}', written out for "
                                 f"each layer, is refused: {g.message}") if (d := of(g)) is not None else g
                         for g in err.diagnostics])


def _each_layer(mod: SourceFile, tree: syntax.File, sched: syntax.Schedule,
                directives: tuple[Directive, ...]) -> tuple[Directive, ...]:
    """DIRECTIVES with each each_layer(...) replaced by the repeated block's schedule written
    once per layer (schedule/each_layer.py)."""
    from coconetc.schedule.each_layer import EachLayer, expand
    from coconetc.schedule.pipeline import repeat_of
    from coconetc.ir.layers import layer_ranges
    out: list[Directive] = []
    for d in directives:
        if not isinstance(d, EachLayer):
            out.append(d)
            continue
        p = mod.programs[sched.program]  # (in a schedule of grad(p), the layers are p's)
        repeat = repeat_of(p, d, "each_layer")
        block, at, body, forward = _repeated(mod, tree, sched.program, repeat, len(layer_ranges(p, repeat)), d,
                                             sched.grad)
        out += expand(d, at, block, from_ast(body), forward if sched.grad else None)
    return tuple(out)


def _repeated(mod: SourceFile, tree: syntax.File, program: str, repeat: str, layers: int, d,
              grad: bool) -> tuple[str, Layers, tuple, frozenset[str]]:
    """For `REPEAT = repeat(block, ...)` in PROGRAM (of TREE): the block's name, how its names
    are renamed in each of the LAYERS, the body of its schedule d.schedule (of its derived
    program where GRAD; in TREE, or in the file it is imported from) and the block's names
    (parameters and stages)."""
    from coconetc.paths import import_path
    prog = next((pr for pr in tree.programs if pr.name == program), None)
    call = next((st.value for st in (prog.body if prog else ()) if isinstance(st, syntax.Assign)
                 and isinstance(st.value, syntax.Call) and st.value.fn == "repeat"
                 and [t.id for t in st.targets] == [repeat]), None)
    if call is None:
        raise CompileError.at(d.at("()"), f"each_layer(): {program} does not write {repeat} as `{repeat} = "
                              "repeat(block, ...)` in its own body (a repeat of a program it calls is that program's)")
    block = call.args[0].id if call.args and isinstance(call.args[0], syntax.Name) else ""
    source = call.args[1].id if len(call.args) > 1 and isinstance(call.args[1], syntax.Name) else None
    trees = [tree]
    for imp in tree.imports:
        try:
            trees.append(parse(import_path(mod.file, imp.path.text).read_text(), imp.path.text))
        except (OSError, CompileError):
            continue  # (reported by _imports)
    for t in trees:
        defined = next((pr for pr in t.programs if pr.name == block), None)
        if defined is None:
            continue
        result = next((st.items[0].name.id for st in defined.body if isinstance(st, syntax.Return) and st.items), "")
        names = [s.name for s in t.schedules if s.program == block and s.grad == grad]
        found = next((s for s in t.schedules if s.program == block and s.grad == grad and s.name == d.schedule), None)
        if found is None or found.body is None:
            whose = f"grad({block})" if grad else f"{block} (the block {repeat} repeats)"
            raise CompileError.at(d.at("block_schedule="), f"each_layer(): {whose} has no schedule "
                                  f"'{d.schedule}' (its schedules: {', '.join(names) or 'none'})")
        forward = frozenset([q.name for q in defined.params] + [tg.id for st in defined.body
                                                                if isinstance(st, syntax.Assign) for tg in st.targets])
        at = Layers(repeat, layers, result, defined.params[0].name if defined.params else "", source)
        return block, at, found.body, forward
    raise CompileError.at(d.at("()"), f"each_layer(): {repeat} repeats {block or 'a block'}, which is not a "
                          "program of this file or of a file it imports")


def stage_schedules(mod: SourceFile, program: str, schedule: str) -> dict[str, ScheduleIR]:
    """PROGRAM's pipeline schedule SCHEDULE's stages' schedules, by program (_staged), as the
    file made them when it loaded; {} for a schedule without a pipeline."""
    return mod.staged.get((program, schedule), {})


def _staged(mod: SourceFile, program: str, schedule: str) -> dict[str, ScheduleIR]:
    """Where PROGRAM's schedule SCHEDULE holds a pipeline(...): the schedules SCHEDULE of its
    virtual stages' programs (`<p>_<s>_stage<k>`: schedule/pipeline.py stage_program), each the
    stage under the directives beside the pipeline that name its stages
    (schedule/stage_directives.py), and, where grad(PROGRAM) has a schedule SCHEDULE too, of
    their derived programs (`<stage>_grad`), each under that schedule's directives that name
    its values; by program name, only those that have any. {} without a pipeline."""
    from coconetc.schedule.pipeline import cut, directive, stage_name, stage_program
    from coconetc.schedule.stage_directives import stage_directives, stage_grad_directives
    sched = mod.schedules.get(program, {}).get(schedule)
    d = directive(sched.directives) if sched is not None else None
    if sched is None or d is None:
        return {}
    p = mod.programs[program]
    c = cut(p, d)
    stages = [stage_program(p, c, k, stage_name(program, schedule, k)) for k in range(len(c.layers))]
    out = {}
    for sp, mine in zip(stages, stage_directives(p, c, sched.directives)):
        if mine:
            out[sp.name] = ScheduleIR(schedule, sp.name, tuple(mine), apply_all(sp, mine))
    grad = mod.schedules.get(grad_name(program), {}).get(schedule)
    if grad is not None and grad.directives:
        backs = [vjp(sp, name=grad_name(sp.name)) for sp in stages]
        for q, mine in zip(backs, stage_grad_directives(backs, grad.directives, program, schedule)):
            if mine:
                out[q.name] = ScheduleIR(schedule, q.name, tuple(mine), apply_all(q, mine))
    return out


def _nothing_left(err: CompileError, program: Program, directives: tuple[Directive, ...], at: int, name: str,
                  given: str, said: str) -> CompileError:
    """The advised fusion is refused in turn with 'remove this fuse directive': say that at once
    (when the schedule without the directive is accepted)."""
    if not said.endswith("remove this fuse directive"):
        return err
    try:
        plan_program(apply_all(program, directives[:at] + directives[at + 1:]), name)
    except CompileError:
        return err
    first = err.diagnostics[0]
    head = first.message[:first.message.rindex(given)].rstrip()
    head = head[:head.rfind("; ")] if "; " in head else head
    why = said.removeprefix("fuse: ").split("; ")[0]
    message = f"{head}; {given} would be refused too ({why}): remove this fuse directive"
    return CompileError([Diagnostic(first.span, message), *err.diagnostics[1:]])


def _settled(err: CompileError, program: Program, directives: tuple[Directive, ...], name: str) -> CompileError:
    """A refused fuse whose advice is a fuse directive: the schedule is checked with the advice
    followed, and with the advice of that check's refusal followed in turn (a fusion the
    planner refuses after the schedule accepted it, or one that needs a reorder first), so
    that the advice given is the one that ends in an accepted schedule: following an advice
    never ends in another refusal of the same fusion. The error unchanged where the first
    advice is accepted, or where no advice leads to an accepted schedule."""
    first = err.diagnostics[0]
    m = FUSE_ADVICE.search(first.message)
    at = next((i for i, d in enumerate(directives) if isinstance(d, Fuse)
               and d.span.line <= first.span.line <= max(d.span.line, d.span.end_line)), None)
    if m is None or at is None or REORDER_FIRST_ADVICE.search(first.message):
        return err
    refused = directives[at]
    assert isinstance(refused, Fuse)
    given, text = m[1], m[1]
    instead: tuple[Directive, ...] = (replace(refused, stages=tuple(x.strip() for x in m[2].split(","))),)
    for _ in range(3):
        tried = directives[:at] + instead + directives[at + 1:]
        try:
            plan_program(apply_all(program, tried), name)
        except CompileError as again:
            said = again.diagnostics[0].message
            line = again.diagnostics[0].span.line
            if not refused.span.line <= line <= max(refused.span.line, refused.span.end_line):
                return err
            nxt = FUSE_ADVICE.search(said)
            if nxt is None:
                return _nothing_left(err, program, directives, at, name, given, said)
            both = REORDER_FIRST_ADVICE.search(said)
            if both is not None:  # a reorder, then the fuse: both take the refused one's place
                text = both[0].strip()
                instead = tuple(replace(x, span=refused.span) for x in _advised_directives(text))
            else:
                text = nxt[1]
                instead = (replace(refused, stages=tuple(x.strip() for x in nxt[2].split(","))),)
            continue
        if text == given:
            return err
        head = first.message[:first.message.rindex(given)]
        if ";" in text:  # a reorder first: say why
            head = head.rstrip().removesuffix(":") + ", then move the stages that read an all-gather onto the slices: "
        return CompileError([Diagnostic(first.span, head + text), *err.diagnostics[1:]])
    return err


def _advised_directives(text: str) -> tuple[Directive, ...]:
    """The directives of an advice written 'reorder(...); fuse(...)'."""
    body = "\n".join(f"    {x.strip()}" for x in text.split(";"))
    return tuple(from_ast(parse(f"schedule advice for p {{\n{body}\n}}\n", "<advice>").schedules[0].body or ()))


def add_schedules(mod: SourceFile, text: str, file: str = "<tuned>") -> SourceFile:
    """A copy of MOD with the schedule blocks of TEXT added (each checked and planned as the
    file's own are); the autotuner's generated schedules join a file this way."""
    tree = parse(text, file)
    new = replace(mod, programs=dict(mod.programs), schedules={p: dict(s) for p, s in mod.schedules.items()},
                  plans=dict(mod.plans), derived=dict(mod.derived), staged=dict(mod.staged))
    errors = list[Diagnostic]()
    for i, sched in enumerate(tree.schedules):
        if sched.grad and sched.program in new.programs and sched.target not in new.programs:
            _collect(errors, _derive, new, sched.program, sched.program_span)
        if sched.name in new.schedules.get(sched.target, {}):
            continue  # a schedule of the file itself keeps its own text
        _collect(errors, _schedule, new, sched, tree, tree.schedules[:i])
    if errors:
        raise CompileError(errors)
    return new

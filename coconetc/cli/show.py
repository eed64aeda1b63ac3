"""`coconetc show`: a program as .ccn text, Graphviz dot or its execution plan; its derived
program (--grad); the tuner's choice (-s auto)."""

from __future__ import annotations

import click

from coconetc.cli.files import fail, load_ccn, parse_label, pick_program
from coconetc.cli.options import checked_target, records_options
from coconetc.errors import CompileError
from coconetc.plan.label import DEFAULT, parse
from coconetc.plan.planner import PASS_NAMES, plan_program
from coconetc.sourcefile import SourceFile


@click.command()
@click.argument("file", type=click.Path())
@click.option("--program", "-p", help="The program (default: the file's only program).")
@click.option("--schedule", "-s", help="Show the program after this schedule.")
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "plan"]), default="text")
@click.option("--grad", is_flag=True, help="Show the program's derived vector-Jacobian program (docs/autodiff.md); "
              "of a file of several programs without --program, each one's in turn.")
@click.option("--wrt", help="With --grad: the inputs to differentiate, comma-separated (default: every "
              "floating tensor parameter).")
@click.option("--after", type=click.Choice(PASS_NAMES), help="With --format plan: the plan as the planner's pass of "
              "this name left it (the passes in order: " + ", ".join(PASS_NAMES) + ").")
@records_options("-s auto shows the choice of the records measured on that backend (the plan "
                  "itself is every backend's)")
def show(file: str, program: str | None, schedule: str | None, fmt: str, grad: bool, wrt: str | None,
         after: str | None, backend: str, emulate: bool) -> None:
    """Print a program's IR as .ccn text, its stage graph as Graphviz dot, or its execution
    plan (what every backend runs: buffers, then one unit a line with its .ccn line)."""
    from coconetc.ir import printer
    target = checked_target("show", backend, emulate, "read the records measured under the host emulation")
    if after is not None and fmt != "plan":
        fail(f"coconetc: --after {after} shows a plan: add --format plan")
    mod = load_ccn(file)
    if grad or wrt is not None:
        own = [n for n in mod.programs if n not in mod.derived]
        if grad and program is None and schedule is None and wrt is None and fmt == "text" and len(own) > 1:
            for i, name in enumerate(own):  # every program's derived program, in the file's order
                if i:
                    click.echo()
                _show_grad(mod, name, None, fmt, None)
            return
        _show_grad(mod, pick_program(mod, program, None), schedule, fmt, wrt, after)
        return
    name = pick_program(mod, program, schedule)
    ir = mod.programs[name]
    if schedule == "auto":  # with or without `schedule auto for P` in the file
        _show_auto(mod, name, fmt, target)
        return
    label = parse_label(schedule) if schedule else parse(None)  # -s zero@p2p: the schedule zero
    if not label.default:
        try:
            sched = mod.schedule(name, label.name)
        except KeyError as err:
            fail(f"coconetc: {err.args[0]}")
        if sched.ir is None:
            _show_auto(mod, name, fmt, target)
            return
        ir = sched.ir
    if fmt == "plan":
        from coconetc.plan.show import show as show_plan
        plan = mod.plans[(name, label.name)] if after is None else plan_program(ir, label.name, after=after)
        click.echo(show_plan(plan), nl=False)
        if not label.default:
            _show_pipeline(mod, name, label.name)
        return
    click.echo(printer.dot(ir) if fmt == "dot" else printer.program(ir), nl=False)


def _show_pipeline(mod, name: str, schedule: str) -> None:
    """A pipeline directive's stages, each rank's actions and the simulated timeline."""
    from coconetc.schedule.pipeline import directive, timeline_text
    d = directive(mod.schedule(name, schedule).directives)
    if d is not None:
        click.echo(timeline_text(mod.programs[name], d))


def _show_grad(mod: SourceFile, name: str, schedule: str | None, fmt: str, wrt: str | None,
               after: str | None = None) -> None:
    """show --grad: the derived program of the program (text, dot or plan), under one of the
    file's `schedule s for grad(p)` with -s; what the forward saves as a comment."""
    from coconetc.autodiff.saved import pairing
    from coconetc.autodiff.text import unfaithful_sites
    from coconetc.autodiff.vjp import recomputed
    from coconetc.ir import printer
    from coconetc.sourcefile import grad_name
    if name in mod.derived:
        fail(f"coconetc: '{name}' is a derived program already; show --grad -p {mod.derived[name]}")
    ir, plan, full = _derived(mod, name, schedule, fmt, wrt)
    if fmt == "plan":
        from coconetc.plan.show import show as show_plan
        assert plan is not None
        if after is not None:
            plan = plan_program(ir, plan.schedule, after=after)
        click.echo(show_plan(plan), nl=False)
        return
    bad = unfaithful_sites(ir)
    if bad and fmt == "text":
        fail("coconetc: the derived program reuses the forward's dropout masks, which .ccn text cannot say yet "
              f"(the RNG site of a dropout is its stage's name): {'; '.join(bad)} (--format dot or plan shows it)")
    if fmt == "dot":
        click.echo(printer.dot(ir), nl=False)
        return
    if full is not None:  # what a training step runs under this grad schedule (coconetc.torch.function's pair)
        pair = pairing(full.programs, full.schedules, name, grad_name(name), DEFAULT, schedule or DEFAULT, DEFAULT)
        if pair.cut:
            click.echo(f"# saved by the forward ({pair.forward} returns them): {', '.join(pair.saved) or 'none'}; "
                       f"recomputed by the backward ({pair.backward}): {', '.join(pair.recomputed) or 'none'}")
        else:
            click.echo(f"# schedule {schedule} does not apply to {name}'s cut backward: a training step runs {name}, "
                       f"then the whole {pair.backward}, which recomputes {', '.join(pair.recomputed) or 'nothing'}")
    else:
        click.echo(f"# the forward values the backward reads: {', '.join(recomputed(ir, mod.programs[name])) or 'none'}")
    click.echo(printer.program(ir), nl=False)


def _derived(mod: SourceFile, name: str, schedule: str | None, fmt: str, wrt: str | None):
    """show --grad's program: (the derived IR, its plan, the file with its derived programs;
    the last two None with --wrt, which derives with respect to some inputs only)."""
    from coconetc.autodiff.vjp import vjp
    from coconetc.sourcefile import grad_name, with_grads
    try:
        if wrt is not None:
            if schedule is not None or fmt == "plan":
                fail("coconetc: show --grad --wrt derives with respect to some inputs only; the file's "
                      "derived program (its schedules and plans) is with respect to every floating tensor "
                      "input: drop --wrt")
            return vjp(mod.programs[name], [w.strip() for w in wrt.split(",") if w.strip()]), None, None
        full, gname = with_grads(mod, [name]), grad_name(name)
        label = parse_label(schedule) if schedule else parse(None)
        if label.default:
            return full.programs[gname], full.plans[(gname, DEFAULT)], full
        try:
            scheduled = full.schedule(gname, label.name).ir
        except KeyError as err:
            fail(f"coconetc: {err.args[0]} (write one as `schedule {label.name} for grad({name}) {{ ... }}`)")
        if scheduled is None:
            fail(f"coconetc: schedule auto for grad({name}): the autotuner chooses (coconetc tune)")
        return scheduled, full.plans[(gname, label.name)], full
    except CompileError as err:
        fail(err.render())
    raise AssertionError


def _show_auto(mod: SourceFile, name: str, fmt: str, target: str = "cpu") -> None:
    """show -s auto: the autotuner's newest choice for the program on this machine's TARGET (the
    records `coconetc tune` measured there), as the schedule block (text), its plan or its
    stage graph."""
    from coconetc.sourcefile import add_schedules
    from coconetc.ir import printer
    from coconetc.oracle.inputs import size_symbols
    from coconetc.plan.targets import Target
    from coconetc.runtime import tuned as cache
    recs = cache.records(mod.source, name, target)
    if not recs:
        cmd = cache.tune_command(mod.file, name, "R", dict.fromkeys(size_symbols(mod.programs[name]), "INT"), target)
        fail(f"coconetc: the autotuner has no choice for '{name}' in {mod.file}{Target(target).facts.measured_on}; "
              f"run `{cmd}` first")
    rec = recs[-1]
    choice, text = rec["choice"], rec["schedules"].get(rec["choice"], "")
    label = parse(choice).name  # "zero@p2p": zero, with point-to-point fused collectives
    if text:
        mod = add_schedules(mod, text)
    if fmt == "plan":
        from coconetc.plan.show import show as show_plan
        click.echo(show_plan(mod.plans[(name, label)]), nl=False)
        return
    ir = mod.programs[name] if label == "default" else mod.schedule(name, label).ir
    if fmt == "dot":
        assert ir is not None
        click.echo(printer.dot(ir), nl=False)
        return
    shown = ", ".join(f"{k}={v}" for k, v in rec["sizes"].items())
    click.echo(f"# schedule auto for {name}: the tuner's choice for {shown} on {rec['ranks']} ranks"
               f"{Target(target).facts.measured_on} ({rec['measured'][choice] * 1e3:.3f} ms): {choice}"
               + (" (its fused collectives point-to-point: call it as schedule=" + repr(choice) + ")"
                  if choice != label else ""))
    click.echo(text or f"# (the program itself, unscheduled)\n{printer.program(mod.programs[name])}", nl=False)

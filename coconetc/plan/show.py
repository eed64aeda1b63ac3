"""The execution plan as text (`coconetc show --format plan`): the buffers (where each lives),
then one unit a line with the .ccn line it came from (a fused collective also with each
target's algorithms and chunking), then per target what it does not implement.
Deterministic: the same plan prints the same text."""

from __future__ import annotations

from coconetc.ir import ops, printer
from coconetc.plan.colsums import fused_sums
from coconetc.plan.epilogue import BACKENDS
from coconetc.plan.targets import TARGETS, gathered_lives
from coconetc.plan.vectors import loop_width, phase_width, symmetric_width
from coconetc.plan.units import (Algorithm, Attention, Buffer, Chunking, ColSum, Collective, Copy, Fused, GatherChunks, Item, LayernormGrads, Let, Library, Loop,
                                 GatherMatmul, Overlap, Partials, Plan, Reduce, Require, StartGather, Strategy, Unit, title)


def show(plan: Plan) -> str:
    lines = [f"plan {plan.program} [{plan.schedule}]", "buffers:"]
    lines += [f"  {_buffer(plan, b)}" for b in plan.buffers]
    lives = gathered_lives(plan)
    if lives:  # when each whole gathered value is made and when its memory is free again
        lines.append("gathered (made by -> last read by; where two share memory, the later is in the earlier's):")
        for n, (first, last) in lives.items():
            lines.append(f"  {n:<12} {_said(plan.units[first])} -> {_said(plan.units[last])}")
    lines.append("units:")
    for u in plan.units:
        lines += _unit(plan, u, "  ")
    if plan.attention:
        lines.append("attention:")
        lines += [f"  {_attention(plan, a)}" for a in plan.attention]
    lines.append("targets:")
    for t in TARGETS:
        gaps = plan.unsupported(t)
        lines.append(f"  {t:<15} {'every unit' if not gaps else 'not:'}")
        lines += [f"    {_at(g.line)} {g.what}" for g in gaps]
    return "\n".join(lines) + "\n"


def _said(u: Unit) -> str:
    line = getattr(u, "line", 0) or (u.gather.line if isinstance(u, StartGather) else 0)
    return f"{title(u)}{f' (L{line})' if line else ''}"


def _attention(plan: Plan, a: Attention) -> str:
    """A causal attention core run as one call (Plan.attention, plan/attention.py)."""
    names = []
    for i in a.members:
        u = plan.units[i]
        names += [it.name for it in u.items] if isinstance(u, Loop) else [u.dst] if isinstance(u, Library) else []
    how = [f"scale {a.scale}" if a.scale else "", f"causal diagonal {a.diagonal}",
           f"dropout({a.drop_p}, {a.seed}, site {a.site})" if a.drop_p else ""]
    if a.kind == "forward":
        head = f"forward {a.o} = attention({a.q}, {a.k}, {a.v}; {', '.join(h for h in how if h)})"
        also = [n for n in (a.s, a.w, a.p, a.a) if n]
    else:
        src = f"scores {a.s_in}" if a.s_in else f"softmax {a.p_in}{' (every entry)' if a.p_whole else ''}"
        aa = f"dropout result {a.a_in}{' (every entry)' if a.a_whole else ''}" if a.a_in else \
            ("the dropout result drawn again from it" if a.drop_p else "no dropout result")
        head = f"backward {a.dq}, {a.dk}, {a.dv} = attention_grad({a.q}, {a.k}, {a.v}, {a.g}; {src}, {aa}; {', '.join(h for h in how if h)})"
        also = []
    others = [t for t in BACKENDS if t not in a.fused]
    where = (f"({', '.join(a.fused)}: one call at the last unit, the masked half of the scores skipped"
             f"{'; ' + ', '.join(others) + ': the units one by one' if others else ''})")
    writes = f"; also writes {', '.join(also)}" if also else ""
    return f"{head}{writes}\n    replaces {', '.join(names)} {where}"


def _buffer(plan: Plan, b: Buffer) -> str:
    where = {"output": f"output '{b.of}'", "alias": f"in place in {b.of}",
             "view": f"inside {b.of} (this rank's part)", "into": f"into {b.of}'s segments"}
    if b.shared:
        where["scratch"] = "scratch in the group's shared window"
    none = f" (no memory on {', '.join(b.unallocated)}: the collective reads the segments)" if b.unallocated else ""
    if b.same_as:
        row = "" if b.same_at is None else f"row {b.same_at} of "
        what = (f"{row}{b.same_as}, the accumulator its GEMM adds into" if plan.buffer(b.same_as).kind == "alias"
                else f"the memory of {b.same_as}: a reshape" if b.same_at is None
                else f"row {b.same_at} of {b.same_as}: an index" if plan.is_index(b.name)
                else f"row {b.same_at} of {b.same_as}: a layer's gradient made in its row, not unindexed and summed")
        none += f" ({what}, no copy)"
    if b.reuses:
        none += f" (in {b.reuses}'s memory: gathered after its last reader)"
    if b.one_rank_as:
        none += f" (at one rank: {b.one_rank_as}'s memory, the all-reduce copies nothing)"
    if b.kind == "param" and b.type.ndim and plan.own_part_only(b.name):  # (DistributedOptimizer's shared_weights)
        none += " (each rank writes only its own part: the ranks of a node may hold one copy)"
    return f"{b.name:<12} {str(b.type):<28} {where.get(b.kind, b.kind)}{none}"


def _at(line: int) -> str:
    return f"L{line:<4}" if line else "     "


def _items(items: tuple[Item, ...]) -> str:
    return "; ".join(f"{i.name}{'' if i.store else ' (register)'} = {printer.expr(i.expr)}" for i in items)


def _lets(lets: tuple[Let, ...]) -> str:
    return f" with {', '.join(f'{k.name} = {printer.expr(k.expr)}' for k in lets)}" if lets else ""


def _vectors(width: int) -> str:
    """A CUDA kernel's vector width (plan/vectors.py)."""
    return f"vectors of {width} elements" if width else "one element at a time"


def _fused_on(plan: Plan, u: Library) -> str:
    """Where a matmul's epilogue is fused (Library.fused, plan/epilogue.py); a bias gradient not
    fused in the GEMM may be summed by the loop computing its input (plan/colsums.py)."""
    call = "GEMM" if ops.has(u.op, ops.GEMM) else "call"  # (a row-wise call's residual: layernorm_dx)

    def apart(b: str) -> str:
        if u.epilogue is None or u.epilogue.kind != "bgrad":
            return f"the loop runs after the {call}"
        return "summed by the loop computing it" if u.epilogue.value in fused_sums(plan.units, b) \
            else "the sum_lead runs on its own"
    return "; ".join(f"{b}: {f'fused in the {call}' if b in u.fused else apart(b)}" for b in BACKENDS)


def _colsum_on(plan: Plan, c: ColSum) -> str:
    """Where a loop's column sums are added (Loop.colsums, plan/colsums.py): in the loop, in a
    GEMM's bgrad epilogue, or by the sum_lead on its own."""
    gemm = {b for u in plan.units if isinstance(u, Library) and u.epilogue and u.epilogue.kind == "bgrad"
            and u.epilogue.value == c.dst for b in u.fused}

    def where(b: str) -> str:
        return "in this loop" if b in c.on else "in the GEMM's bgrad epilogue" if b in gemm else "the sum_lead on its own"
    return "; ".join(f"{b}: {where(b)}" for b in BACKENDS)


def _grads(g: LayernormGrads) -> str:
    """What a layernorm_dx call also computes (Library.grads, plan/lngrads.py), and where."""
    also = " and ".join(f"{what} {n}" for what, n in (("dgamma", g.dgamma), ("dbeta", g.dbeta)) if n)
    return f"also {also} ({'; '.join(f'{b}: ' + ('in this call' if b in g.on else 'their calls on their own') for b in BACKENDS)})"


def _unit(plan: Plan, u: Unit, ind: str) -> list[str]:
    if isinstance(u, Loop):
        dst = f" into {u.seg_dst}'s segments" if u.seg_dst else ""
        sums = [f"{ind}        column sums {c.dst} = sum_lead({c.value}) ({_colsum_on(plan, c)})" for c in u.colsums]
        return [f"{ind}{_at(u.line)} loop over {u.type}{dst}: {_items(u.items)}{_lets(u.lets)}",
                f"{ind}        on cuda: {_vectors(loop_width(plan, u))}", *sums]
    if isinstance(u, Reduce):
        cross = f" + {'sum' if u.op in ('sum', 'norm', 'segment_norm') else u.op} across ranks" if u.cross_rank else ""
        return [f"{ind}{_at(u.line)} reduce {u.dst} = {u.op}({u.src}){cross}"]
    if isinstance(u, Library):
        attrs = "".join(f", {k}={v}" for k, v in u.attrs)
        epi = [f"{ind}        epilogue {u.epilogue} ({_fused_on(plan, u)})"] if u.epilogue else []
        epi += [f"{ind}        {_grads(u.grads)}"] if u.grads else []
        epi += [f"{ind}        adds into {plan.buffer(u.dst).same_as}, the accumulator (beta = 1; its update's "
                "loop left out)"] if u.accumulate else []  # (the buffer looked up for such a GEMM only)
        return [f"{ind}{_at(u.line)} library {u.dst} = {ops.shown(u.op)}({', '.join(u.args)}{attrs})", *epi]
    if isinstance(u, Collective):
        wait = " (prefetched: waits for its start above)" if u.prefetched else ""
        return [f"{ind}{_at(u.line)} collective {u.dst} = {_coll(u)}{wait}"]
    if isinstance(u, StartGather):
        return [f"{ind}{_at(u.line)} start {u.gather.dst} = {_coll(u.gather)} (prefetch: in flight until its wait below)"]
    if isinstance(u, Copy):
        return [f"{ind}      copy {u.src} -> {u.dst} ({u.what})"]
    if isinstance(u, Require):
        return [f"{ind}      require root {u.root} of {u.op} < group size"]
    if isinstance(u, Fused):
        return _fused(plan, u, ind)
    if isinstance(u, GatherMatmul):
        how = {GatherChunks.ROWS: "rows in place", GatherChunks.PIECES: "piece i of every rank's slice, in place",
               GatherChunks.PACKED: "each chunk packed"}[u.how]
        head = (f"{ind}{_at(u.line)} overlap {u.gather.dst} = {_coll(u.gather)} in {u.chunks} chunks along dim "
                f"{u.dim} ({how}) -> {u.consumer} = {u.gemm}({u.a}, {u.b}) per chunk, as it arrives")
        if not u.right:
            return [head]
        part = "rows" if u.dim == 0 else "columns"
        t = "" if u.gemm == "matmul" else "^T"
        each = (f"{u.consumer} += {u.a}[..., the chunk's columns] x (the chunk's {part} of {u.b}){t} (the first chunk "
                f"writes it)" if u.accumulates
                else f"the chunk's columns of {u.consumer} = {u.a} x (the chunk's {part} of {u.b}){t}")
        return [head, f"{ind}        per chunk: {each}; {u.b} is whole only after chunk {u.chunks}"]
    assert isinstance(u, Overlap)
    how = "rows in place" if u.direct else "each chunk packed"
    gemms = " + ".join(f"{t.gemm}({t.a}, {t.b})" for t in u.gemms)
    head = (f"{ind}{_at(u.line)} overlap {u.producer} = {gemms} in {u.chunks} chunks along "
            f"dim {u.dim} ({how}){'' if u.keep_producer else ' (not kept)'} -> ")
    if u.fused is None:
        return [head + f"{u.collective} = {u.op}({u.reduce + ', ' if u.reduce else ''}{u.producer}) per chunk"]
    then = [] if u.then is None else [
        f"{ind}  {_at(u.then.line)} then {u.then.consumer} = {u.then.gemm}({u.then.a}, {u.then.b}) per chunk, as its "
        f"rows of {u.then.a} are gathered (chunk i while chunk i+1's fused collective is in flight)"]
    return [head + f"fused {u.fused.name} per chunk"] + _fused(plan, u.fused, ind + "  ") + then


def _coll(u: Collective) -> str:
    args = [a for a in (u.reduce, u.src) if a]
    if u.op in ("broadcast", "reduce"):
        args.append(f"root={u.root}")
    if u.direction:
        args.append(u.direction)
    extra = f" straight into {u.into}'s segments" if u.into else ""
    extra += f" (packed into {u.packed})" if u.packed else ""
    return f"{u.op}({', '.join(args)}){extra}"


def _fused(plan: Plan, u: Fused, ind: str) -> list[str]:
    rows = f", chunks of whole rows of {u.rows}" if u.rows is not None else ""
    along = f" along dim {u.dim}" if u.op == "reducescatter" else ""
    out = [f"{ind}{_at(u.line)} fused {u.name}: {u.collective} = {u.op}({u.reduce}, {u.src}){along} chunk by "
           f"chunk{rows}{' (reduced value kept)' if u.store_reduced else ''}{_lets(u.lets)}"]
    out += [f"{ind}        on {s.target}: {_strategy(s)}" for s in u.strategies]
    if any(Algorithm.SYMMETRIC in s.algorithms for s in u.strategies):
        out.append(f"{ind}        on cuda, the symmetric kernel: {_vectors(symmetric_width(plan, u))}")
    for ph in u.phases:
        vec = f" (on cuda: {_vectors(phase_width(plan, u, ph))})" if ph.kind == "pointwise" else ""
        out.append(f"{ind}        per chunk ({ph.kind}): {_items(ph.items)}{vec}")
    if u.gather:
        out.append(f"{ind}        per chunk: {u.gather} = allgather({u.gathered}) as each piece is computed")
    partial = [a for a in u.after if isinstance(a, Reduce) and a.dst in u.partials]
    if partial:
        out.append(f"{ind}        per chunk (accumulated): " + "; ".join(
            f"{a.dst} {'max=' if a.op == 'max' else 'min=' if a.op == 'min' else '+='} partial {a.op}({a.src})"
            for a in partial))
        summed = [a.dst for a in partial if a.op not in ("max", "min")]
        extreme = [a.dst for a in partial if a.op in ("max", "min")]
        combined = ([f"one allreduce(sum) of the partial results of {', '.join(summed)}"] if summed else []) + (
            [f"one allreduce(max) of the partial maxima{' (minima negated)' * any(a.op == 'min' for a in partial)} "
             f"of {', '.join(extreme)}"] if extreme else [])
        out.append(f"{ind}        after all chunks: {' and '.join(combined)} across ranks, then "
                   f"{', '.join(f'{a.dst} = {_finish(a)}' for a in partial)}")
    rest = [a for a in u.after if a not in partial]
    if rest:
        out.append(f"{ind}        after {'the reductions (on this rank' + chr(39) + 's slice)' if partial else 'all chunks'}:")
        for a in rest:
            out += _unit(plan, a, ind + "    ")
            if isinstance(a, Collective) and a.dst == u.gather_after:
                loops = "the loop above computes" if u.piece_loops == 1 else f"the {u.piece_loops} loops above compute"
                out[-1] += f" (piece by piece as {loops} it, where the target says so)"
    return out


def _finish(r: Reduce) -> str:
    return {"sum": "the sum", "norm": "sqrt(the sum of squares)",
            "segment_norm": "sqrt(its segment's sum of squares) per element",
            "max": "the largest", "min": "the smallest"}[r.op]


def _strategy(s: Strategy) -> str:
    partials = f"; reductions {s.partials}" if s.partials else ""
    if s.partials == Partials.PER_CHUNK and Algorithm.SYMMETRIC in s.algorithms:  # one kernel, no chunks (targets.py)
        partials += " (after the symmetric kernel: over the slice it kept)"
    partials += f"; the closing allgather {s.gather_after}" if s.gather_after else ""
    return (f"{' | '.join(s.algorithms)}{' (chosen per call)' if len(s.algorithms) > 1 else ''}; "
            f"{_chunking(s.target, s.chunking)}{partials}")


# The chunk sizes as the runtime computes them: CPU runtime_cpp/coconet/module.h
# (fused_chunk_elems, overlap_task_chunk_elems), fused_shm.h (kProgressElems); CUDA
# runtime_cpp/coconet/cuda/runtime.cuh (chunk_elems).
_ELEMS = {
    ("cpu", "default"): "chunks of COCONET_CHUNK elements (default 2^16)",
    ("cpu", "task"): "chunks of COCONET_CHUNK elements if set, else the overlap task's share "
                     "(max(2^16, half its elements per rank))",
    ("cuda", "default"): "chunks of COCONET_CUDA_CHUNK elements (default 2^22)",
}


def _chunking(target: str, c: Chunking) -> str:
    out = _ELEMS[target, c.elems]
    if c.rows is not None:
        out += f" rounded up to whole rows of {c.rows}"
        if c.progress_rows:
            out += "; progress pieces of 2^15 elements (kProgressElems) rounded up to whole rows"
    return out + ("; on one rank, COCONET_CUDA_CHUNK unset, the whole part as one chunk" if c.whole_alone else "")

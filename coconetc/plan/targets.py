"""The per-target pass of the plan: how each target runs the planned units, and which units a
target does not implement. `plan_program` runs `decide` on every plan, after the planner (which
decides what runs, for every target) and before the verifier, so every per-target choice is a
field of the plan, printed by `coconetc show --format plan`; a renderer reads them and decides
nothing.

Targets (`Target`, the one spelling of each, used by every layer: the toolchain's backends, the
tuner's records): `cpu` (C++, MPI), `cuda` (CUDA, NCCL, cuBLAS) and `cuda-emulated` (the generated
CUDA code run on the host, `run --backend cuda --emulate`: what cuda implements, except an
extern operation's own CUDA code, which is not emulated).

What it decides:

- `Fused.strategies`, per target (cpu, cuda): the algorithms a fused collective may run (the
  first always possible; each later one chosen when the call runs, where the group or the run
  time allows it) and its chunking:
    cpu   p2p (point to point, fused.h) | shm (the group's MPI-3 shared window, fused_shm.h):
          shm for a reduce-scatter outside an overlap, where every rank of the group shares a
          node and the call did not ask for p2p; chunks of COCONET_CHUNK elements (an overlap
          task: its share), whole rows (and progress pieces of whole rows) for a row-wise phase
    cuda  pipeline (chunks on two streams) | symmetric (one kernel over NCCL symmetric memory,
          where NCCL allows it at run time): symmetric for a reduce-scatter along dim 0 of a
          contiguous tensor with pointwise phases only (its reduced value, where kept, in
          scratch), outside an overlap; chunks of
          COCONET_CUDA_CHUNK (2^22) elements, whole rows for a row-wise phase, the whole part
          in one chunk on one rank when the chunk kernels read the source itself
  and where its reductions run (`Strategy.partials`, for a fused collective with
  `Fused.partials`): both targets accumulate them chunk by chunk as the chunks arrive ("per
  chunk") and combine the partial results across the group in one small all-reduce: cpu in
  the chunk callback; cuda after each chunk's kernels, on the call's stream, into device
  doubles (the Reduce units' block reductions, runtime.cuh: Partials), one grouped
  ncclAllReduce after the last chunk, on every path of the pipeline (one rank reading the
  source, a scattered source, row-wise phases); the symmetric kernel has no chunks, so there
  they are accumulated after it over the slice it kept (the plan says so). And how phase B's
  closing allgather runs (`Strategy.gather_after`, for `Fused.gather_after`): cpu sends each
  piece of the slice as soon as the loop computes it (point to point, the reduce-scatter's
  chunks), cuda after the loop
- `Buffer.shared`: a scratch buffer that a fused collective or an all-reduce reads (outside an
  overlap, whose chunks go point to point) lives in the group's shared window, where the
  collectives read it in place; other scratch is private to its rank.
- `Buffer.unallocated`: the packed copy of a scattered parameter that a broadcast, reduce,
  scatter or send reads (`Collective.packed`) has no memory on cuda, whose collectives read the
  segments piece by piece (the host emulation runs that code too); the CPU copies the segments
  into it.
- `Plan.gaps`: per target, each unit it does not implement, located at the directive that
  asked for it (or the stage). `coconetc check --backend X` reports `Plan.unsupported(X)` and
  X's generator leaves exactly those (program, schedule)s out, so the two agree by
  construction; `plan_program(..., target=X)` raises them as a PlanError.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from coconetc.errors import NOWHERE, Diagnostic, Span
from coconetc.ir import ops
from coconetc.ir.nodes import Op, Ref, walk
from coconetc.plan.fusion_legality import row_op
from coconetc.plan.units import (Algorithm, Buffer, Choice, ChunkElems, Chunking, Collective, Fused, Gap, GatherAfter,
                                 GatherMatmul, Library, Loop, Overlap, Partials, Plan, Reduce, StartGather, Strategy, Unit,
                                 _may_write, _touches)


class Target(Choice):
    """A target, as every layer spells it (a str: equal to its value, printed as it)."""

    CPU = "cpu"
    CUDA = "cuda"
    EMULATED = "cuda-emulated"  # the generated CUDA code run on the host (`--backend cuda --emulate`)

    @classmethod
    def named(cls, word: str, emulate: bool = False) -> Target:
        """The target a user's word names (`--backend WORD`, `backend=WORD`): "cuda" with EMULATE
        (`--emulate`, or COCONET_CUDA_EMULATE=1 for a Python caller) is the host emulation; a word
        that names no target is a ValueError listing those there are."""
        try:
            target = cls(word)
        except ValueError:
            raise ValueError(f"unknown backend {word!r} (one of {', '.join(t.value for t in cls)})") from None
        return cls.EMULATED if target is cls.CUDA and emulate else target

    @property
    def facts(self) -> Facts:
        """Every fact a layer asks about this target (FACTS)."""
        return FACTS[self]


@dataclass(frozen=True)
class Facts:
    """What each layer knows about one target, in one place: the toolchain's names, where its
    tensors live and what its module takes, what the tuner and `explain` can say about it, and
    the words its errors use. What a backend does its own way (code, not facts) is its
    runtime.backends.Backend's."""

    prefix: str  # its modules' names begin so (toolchain/compiler.py)
    device: str  # where its tensor arguments live (a torch device type)
    gpu: bool  # it needs a CUDA device here
    emulated: bool  # the CUDA module built for the host
    torch_tensors: bool  # CPU torch tensors given: updated ones' versions bumped, outputs as tensors
    noun: str  # what to pass instead, in errors
    tag: str  # its part of a name (coconetc.torch's operators)
    algorithms: bool  # a schedule label's "@algorithm" (a CPU fused collective's) means something
    schedules_left_out: str  # where its module may lack a schedule of the file, why (in errors)
    modelled: bool  # the cost model's times are its own (tune prunes by them; explain shows them)
    measured_on: str  # where its tuning records were measured, in words
    tune_flags: str  # the `coconetc tune` options that measure on it
    worker_flags: tuple[str, ...]  # the tuner's rank program's options for it (jobs/tune.py)


_LEFT_OUT = ("; the CUDA module leaves out what the CUDA backend does not implement: `coconetc check --backend cuda` "
             "says why")
FACTS: dict[Target, Facts] = {
    Target.CPU: Facts("ccn", "cpu", gpu=False, emulated=False, torch_tensors=True, noun="arrays",
                      tag="cpu", algorithms=True, schedules_left_out="", modelled=True,
                      measured_on=" on this machine", tune_flags="", worker_flags=()),
    # CUDA tensors: the checks refuse in-place updates of ones that require grad; the module's
    # collectives are chosen when it is compiled
    Target.CUDA: Facts("ccn_cuda", "cuda", gpu=True, emulated=False, torch_tensors=False, noun="tensors",
                       tag="cuda", algorithms=False, schedules_left_out=_LEFT_OUT, modelled=False,
                       measured_on=" on this machine's GPU", tune_flags=" --backend cuda", worker_flags=("--cuda",)),
    # NumPy arrays (or CPU tensors) stand for device memory
    Target.EMULATED: Facts("ccn_emu", "cpu", gpu=False, emulated=True, torch_tensors=False,
                           noun="arrays", tag="emu", algorithms=False, schedules_left_out=_LEFT_OUT, modelled=False,
                           measured_on=" under the CUDA host emulation on this machine",
                           tune_flags=" --backend cuda --emulate", worker_flags=("--emulate-cuda",)),
}

TARGETS = tuple(Target)

Locate = Callable[[Unit], Span]


def decide(plan: Plan, locate: Locate = lambda u: NOWHERE) -> Plan:
    """The plan with every per-target decision taken (locate: a unit's span, for the gaps)."""
    plan = replace(plan, buffers=tuple(_placed(b, plan) for b in plan.buffers))
    views = _reshape_views(plan)
    rows = _index_views(plan, views)
    plan = replace(plan, buffers=tuple(replace(b, same_as=views[b.name]) if b.name in views else
                                       replace(b, same_as=rows[b.name][0], same_at=rows[b.name][1])
                                       if b.name in rows else b for b in plan.buffers))
    plan = accumulated_in_place(assembled_stacks(plan))
    held = gathered_reuse(plan)
    plan = replace(plan, buffers=tuple(replace(b, reuses=held[b.name]) if b.name in held else b for b in plan.buffers))
    alone = one_rank_results(plan)
    plan = replace(plan, buffers=tuple(replace(b, one_rank_as=alone[b.name]) if b.name in alone else b
                                       for b in plan.buffers))
    kinds = {b.name: b.kind for b in plan.buffers}
    plan = replace(plan, units=tuple(_with_strategies(u, kinds) for u in plan.units))
    gaps = [_gap(t, u, what, locate) for t in TARGETS for u, what in GAPS[t](plan)]
    return replace(plan, gaps=tuple(gaps))


def _updated_in_place(plan: Plan) -> set[str]:
    """The parameters the plan writes in place: those an update's alias, an allgather's view or
    a scattered parameter's segments (into) are."""
    return {b.of for b in plan.buffers if b.kind in ("alias", "view", "into")}


def _reshape_views(plan: Plan) -> dict[str, str]:
    """The reshapes whose result needs no copy (Buffer.same_as): row-major order is kept, so
    the result is its source's memory, read as another shape. Where: a top-level reshape whose
    result is private scratch (not in a shared window, read by no collective) and whose source
    is a scratch value or a parameter that nothing updates in place; or whose result is an
    output and whose source is private scratch read by no collective (then the source is held in
    the output's memory); every backend."""
    kinds = {b.name: b for b in plan.buffers}
    updated = _updated_in_place(plan)
    sent = {n for u in _every(plan.units) for n in _collective_reads(u)}
    views: dict[str, str] = {}
    for u in plan.units:
        if not (isinstance(u, Library) and u.op == "reshape"):
            continue
        dst, src = kinds[u.dst], kinds[u.args[0]]
        if dst.kind == "scratch" and dst.private and dst.name not in sent \
                and src.kind in ("scratch", "param") and src.name not in updated and src.type.dtype == dst.type.dtype:
            views[dst.name] = src.name
        elif dst.kind == "output" and src.kind == "scratch" and src.private \
                and src.name not in sent and src.name not in views and src.type.dtype == dst.type.dtype:
            # the other way: a returned reshape (a saving forward's saved value) whose source is
            # computed straight into the output's memory; the renderers check the reshape's sizes
            # before anything runs (dispatch.function), so a source larger than the output raises
            views[src.name] = dst.name
    return views


def _index_views(plan: Plan, views: dict[str, str]) -> dict[str, tuple[str, int]]:
    """The indexes whose result needs no copy (Buffer.same_as, same_at): `index(w, i)` is row i of
    w's memory (dim 0 is never sliced, so this rank's row is contiguous in its part). Where: the
    result is private scratch (not in a shared window, read by no collective) and the source a
    parameter nothing updates in place or a scratch value, neither held elsewhere itself (a layer
    of a stacked parameter: repeat, docs/language.md); every backend."""
    kinds = {b.name: b for b in plan.buffers}
    updated = _updated_in_place(plan)
    sent = {n for u in _every(plan.units) for n in _collective_reads(u)}
    rows: dict[str, tuple[str, int]] = {}
    for u in plan.units:
        if not (isinstance(u, Library) and u.op == "index"):
            continue
        dst, src = kinds[u.dst], kinds[u.args[0]]
        if dst.kind == "scratch" and dst.private and dst.name not in sent \
                and dst.name not in views and src.name not in views and src.kind in ("scratch", "param") \
                and src.name not in updated and src.type.dtype == dst.type.dtype:
            rows[dst.name] = (src.name, int(dict(u.attrs)["i"]))  # type: ignore[call-overload]
    return rows


def assembled_stacks(plan: Plan) -> Plan:
    """A stacked parameter's gradient assembled in its own memory (docs/language.md, "Repeating
    a program over layers"): the derivation adds one `unindex(g_l, l, L)` per layer (each a
    stacked-size buffer, zeros but row l) and sums them, `L` stacked buffers and `L - 1` passes
    over them. Where every row 0..L-1 is one layer's gradient g_l, each g_l is made straight into
    row l of the sum (Buffer.same_as, same_at: this rank's part of a stacked value is L
    contiguous rows) and the unindex units and the sum's loops are left out. Where: the sum is
    private scratch or an output; each g_l private scratch read only by its unindex, or a
    reshape held in such a source's memory (then the source is made in the row: _made_in); each
    partial sum and unindex result read only by the next sum; every backend. In gpt_block's
    stack of 4 layers (examples/gpt_pipeline.ccn, H=256, B=2, S=128, one thread) the q, k, v and
    o weights' gradients, [H, NH, HD] reshapes of their GEMMs, were each unindexed and summed:
    about 1 ms of a 4.8 ms weight-gradient call a layer."""
    made, gone = _stack_sums(plan)
    if not made:
        return plan

    def kept(_: int, u: Unit) -> Unit | None:
        if isinstance(u, Library) and u.dst in gone:
            return None
        if isinstance(u, Loop) and any(it.name in gone for it in u.items):
            items = tuple(it for it in u.items if it.name not in gone)
            return replace(u, items=items) if items else None
        return u
    roots = {r for r, _ in made.values()}
    buffers = tuple(replace(b, same_as=made[b.name][0], same_at=made[b.name][1]) if b.name in made else b
                    for b in plan.buffers if b.name not in gone or b.name in roots)
    return _with_units(plan, kept, buffers)


def _with_units(plan: Plan, kept: Callable[[int, Unit], Unit | None], buffers: tuple[Buffer, ...]) -> Plan:
    """PLAN with BUFFERS and each unit as KEPT(index, unit) gives it (None: left out), the
    attention calls' members (unit indexes) following their units."""
    units: list[Unit] = []
    new_index: dict[int, int] = {}
    for i, u in enumerate(plan.units):
        v = kept(i, u)
        if v is not None:
            new_index[i] = len(units)
            units.append(v)
    attention = tuple(replace(a, members=tuple(new_index[m] for m in a.members)) for a in plan.attention)
    return replace(plan, buffers=buffers, units=tuple(units), attention=attention)


def _stack_sums(plan: Plan) -> tuple[dict[str, tuple[str, int]], set[str]]:
    """assembled_stacks' choice: each layer's gradient -> (the stacked sum, its row), and the
    unindexes and partial sums (the sums themselves too) whose units are left out."""
    bufs = {b.name: b for b in plan.buffers}
    unindexed = {u.dst: u for u in plan.units if isinstance(u, Library) and u.op == "unindex"}
    added = {it.name: (it.expr.args[0].name, it.expr.args[1].name) for u in plan.units  # type: ignore[union-attr]
             if isinstance(u, Loop) and not u.seg_dst and not u.colsums for it in u.items
             if isinstance(it.expr, Op) and it.expr.op == "add" and all(isinstance(a, Ref) for a in it.expr.args)}

    def private(name: str, kinds: tuple[str, ...] = ("scratch",), once: bool = True) -> bool:
        """A buffer of its own (once: touched by its writer and one reader only)."""
        b = bufs.get(name)
        return (b is not None and b.kind in kinds and b.private and not b.same_as and not b.reuses
                and (not once or sum(_touches(u, {name}) for u in plan.units) == 2))

    def rows(name: str, nodes: list[str]) -> dict[int, str] | None:
        """The layers' gradients whose unindexes sum to NAME (row -> value), the sum's nodes in NODES."""
        nodes.append(name)
        if name in unindexed:
            u = unindexed[name]
            return {int(dict(u.attrs)["i"]): u.args[0]}  # type: ignore[call-overload]
        out: dict[int, str] = {}
        for part in added.get(name, ()):
            got = rows(part, nodes)
            if got is None or set(got) & set(out):
                return None
            out.update(got)
        return out or None

    made: dict[str, tuple[str, int]] = {}
    gone: set[str] = set()
    for root in reversed([*unindexed, *added]):  # (the whole sum before its partial sums)
        nodes: list[str] = []
        layers = rows(root, nodes) if root not in gone else None
        count = bufs[root].type.shape[0] if layers is not None and bufs[root].type.ndim else None
        if layers is None or not private(root, ("scratch", "output"), once=False) or not isinstance(count, int) \
                or sorted(layers) != list(range(count)):
            continue  # (a row no layer's gradient makes needs the unindexes' zeros)
        held = {i: _made_in(plan, bufs, g, private) for i, g in layers.items()}
        if all(private(n) for n in nodes[1:]) and all(
                h is not None and bufs[h].type.dtype == bufs[root].type.dtype for h in held.values()):
            gone.update(nodes)
            made.update({h: (root, i) for i, h in held.items() if h is not None})
    return made, gone


def accumulated_in_place(plan: Plan) -> Plan:
    """An accumulating backward's update of a weight's accumulator, `acc = acc + d_w`
    (autodiff/saved.py accumulating), made by the weight gradient's GEMMs themselves: each
    matmul_tn that makes d_w (or a row of it: a stacked weight's gradient, assembled_stacks;
    or the source of a reshape that is d_w, held in its memory) adds its product into its place
    in the accumulator (Library.accumulate: beta = 1, on every backend), and the update's loop
    and the gradient's own memory are left out. Where: the loop computes only that sum, into
    the accumulator's memory (the update's alias of a parameter), and no other unit touches the
    accumulator, the update or d_w; each GEMM's result is private scratch that only its GEMM
    writes and nothing else reads but a reshape held in its memory that nothing reads; no GEMM
    carries an epilogue of its loop (plan/epilogue.py fuses the one-GEMM case on the CPU
    already; a bias-gradient epilogue stays). In gpt_block's stack (examples/gpt_pipeline.ccn's
    stage programs) the 6 weights' accumulations were a pass over each stacked accumulator (130
    us for w_fc's 4 layers, H=256, F=1024, one thread)."""
    bufs = {b.name: b for b in plan.buffers}
    placed: dict[str, tuple[str, int | None]] = {}
    gemms: set[int] = set()
    drop: set[int] = set()
    roots: set[str] = set()
    for k in range(len(plan.units)):
        found = _accumulator_update(plan, bufs, k)
        if found is None:
            continue
        z, r, places = found
        if any(bufs[g].type.dtype != bufs[z].type.dtype for g in places):
            continue
        drop.add(k)
        for g, (row, gemm) in places.items():
            placed[g] = (z, row)
            gemms.add(gemm)
        if any(row is not None for row, _ in places.values()):
            roots.add(r)  # (a stacked gradient whose rows are now the accumulator's)
    if not drop:
        return plan

    def kept(i: int, u: Unit) -> Unit | None:
        return None if i in drop else replace(u, accumulate=True) if i in gemms and isinstance(u, Library) else u
    buffers = tuple(replace(b, same_as=placed[b.name][0], same_at=placed[b.name][1]) if b.name in placed else b
                    for b in plan.buffers if b.name not in roots)
    return _with_units(plan, kept, buffers)


def _accumulator_update(plan: Plan, bufs: dict[str, Buffer],
                        k: int) -> tuple[str, str, dict[str, tuple[int | None, int]]] | None:
    """For plan.units[k] an accumulator's update accumulated_in_place can leave to GEMMs: (the
    update's buffer, d_w, each GEMM result -> (its row of the update, None: the whole; the
    GEMM's unit index)); else None."""
    u = plan.units[k]
    if not (isinstance(u, Loop) and len(u.items) == 1 and u.items[0].store and not u.colsums and not u.seg_dst
            and not u.lets):
        return None
    z, e = u.items[0].name, u.items[0].expr
    if not (isinstance(e, Op) and e.op == "add" and len(e.args) == 2 and all(isinstance(a, Ref) for a in e.args)):
        return None
    names = [a.name for a in e.args]  # type: ignore[union-attr]
    zb = bufs[z]
    if zb.kind != "alias" or zb.of not in names or names[0] == names[1]:
        return None
    acc, r = zb.of, names[1 - names.index(zb.of)]
    rb = bufs.get(r)
    if bufs[acc].kind != "param" or rb is None or rb.kind != "scratch" or not rb.private or rb.reuses \
            or any(_touches(v, {acc, z}) for i, v in enumerate(plan.units) if i != k):
        return None
    touching = [v for i, v in enumerate(plan.units) if i != k and _touches(v, {r})]
    rows = [b for b in plan.buffers if b.same_as == r and b.same_at is not None and not plan.is_index(b.name)]
    view = ""
    if rows:  # d_w stacked, its rows made by the layers' GEMMs (assembled_stacks)
        if touching or not isinstance(rb.type.shape[0], int) or sorted(b.same_at or 0 for b in rows) != list(
                range(rb.type.shape[0])):
            return None
        wanted: dict[str, int | None] = {b.name: b.same_at for b in rows}
    elif rb.same_as:  # d_w whole, a reshape held in a GEMM's result's memory: the reshape touches it only
        src = _reshape_source(plan, bufs, r)
        if not src or len(touching) != 1:
            return None
        wanted, view = {src: None}, r
    elif rb.same_at is None:  # d_w whole: a GEMM's result
        wanted = {r: None}
    else:
        return None
    places: dict[str, tuple[int | None, int]] = {}
    for g, row in wanted.items():
        gemm = _adding_gemm(plan, bufs, g, k, allowed=view)
        if gemm is None:
            return None
        places[g] = (row, gemm)
    return z, r, places


def _adding_gemm(plan: Plan, bufs: dict[str, Buffer], g: str, update: int, allowed: str = "") -> int | None:
    """The unit index of the matmul_tn whose result G is, where that GEMM may add into its
    accumulator's memory instead: G private scratch written only by that GEMM (no epilogue of
    its loop), read by nothing but the update (plan.units[UPDATE]) or a reshape held in its
    memory that nothing else reads (ALLOWED: such a reshape that is the update's d_w itself);
    None otherwise."""
    b = bufs.get(g)
    if b is None or b.kind != "scratch" or not b.private or b.reuses:
        return None
    writers = [i for i, v in enumerate(plan.units) if isinstance(v, Library) and v.dst == g]
    gemm = plan.units[writers[0]] if len(writers) == 1 else None
    if not isinstance(gemm, Library) or gemm.op != "matmul_tn" or g in gemm.args \
            or (gemm.epilogue is not None and gemm.epilogue.kind != "bgrad"):
        return None
    for i, v in enumerate(plan.units):
        if i in (update, writers[0]) or not _touches(v, {g}):
            continue
        view = v.dst if isinstance(v, Library) and v.op == "reshape" and _reshape_source(plan, bufs, v.dst) == g else ""
        if not view or view != allowed and sum(_touches(x, {view}) for x in plan.units) != 1:
            return None
    return writers[0]


def _reshape_source(plan: Plan, bufs: dict[str, Buffer], name: str) -> str:
    """The value NAME is a reshape of, held in its memory (Buffer.same_as, no row: _reshape_views),
    where a reshape unit makes NAME from it; "" otherwise."""
    b = bufs.get(name)
    if b is None or not b.same_as or b.same_at is not None or b.reuses:
        return ""
    made = any(isinstance(u, Library) and u.op == "reshape" and u.dst == name and u.args == (b.same_as,)
               for u in plan.units)
    return b.same_as if made else ""


def _made_in(plan: Plan, bufs: dict[str, Buffer], g: str, private: Callable[[str], bool]) -> str | None:
    """The buffer _stack_sums makes in a layer's row for the layer's gradient G: G itself where
    it is a buffer of its own (PRIVATE), or, where G is a reshape held in its source's memory
    (`d_w = reshape(matmul_tn(x, g))`, a weight of more than 2 dims: gpt_block's [H, NH, HD]),
    that source, read by the reshape only (G stays its view); None otherwise. (The reshape's
    sizes are checked before the function runs anything: codegen/dispatch.py.)"""
    if private(g):
        return g
    src = _reshape_source(plan, bufs, g)
    b = bufs[g] if src else None
    if b is None or b.kind != "scratch" or not b.private or sum(_touches(u, {g}) for u in plan.units) != 2 \
            or not private(src):
        return None
    return src


def gathered_lives(plan: Plan) -> dict[str, tuple[int, int]]:
    """The all-gathered values whose memory may be shared (a whole weight gathered where it is
    used: FSDP), each with its life: the first and the last unit (indexes into plan.units) that
    touch it, its start included (a prefetched gather's StartGather writes it from there on).
    Which: the results of top-level allgathers (a Collective, prefetched or not) in private
    scratch (not in a shared window, allocated on every target, not a reshape's or an index's
    memory) that no other buffer lies in (no view inside it, no reshape or index of it held in
    its memory). A value an attention call reads lives until the call (its last member)."""
    bufs = {b.name: b for b in plan.buffers}
    inside = {b.same_as for b in plan.buffers if b.same_as} | {b.of for b in plan.buffers if b.kind == "view"}
    names = []
    for u in plan.units:
        if isinstance(u, Collective) and u.op == "allgather" and not u.into:
            b = bufs.get(u.dst)
            if b is not None and b.kind == "scratch" and b.private and not b.same_as and b.name not in inside:
                names.append(b.name)
    lives = {}
    for n in names:
        touched = [i for i, u in enumerate(plan.units) if _touches(u, {n})]
        for a in plan.attention:  # (an attention call reads its members' operands at its last member)
            if set(touched) & set(a.members):
                touched.append(max(a.members))
        lives[n] = (min(touched), max(touched))
    return lives


def gathered_reuse(plan: Plan) -> dict[str, str]:
    """Each all-gathered value (gathered_lives) that is held in the memory of an earlier one of
    the same type whose life has ended before its own begins (Buffer.reuses: the earliest such
    value, whose memory a chain of them shares): so a rank holds at once only the gathered
    values alive (a model's whole weights: the layers in flight and in use), not each one for
    the whole call; every backend (a CUDA stream's order, and the joins of an overlap's comm
    stream, keep their lives apart as the units' order does)."""
    lives = gathered_lives(plan)
    types = {b.name: b.type for b in plan.buffers}
    slots: list[list] = []  # [the value whose memory it is, its type, the last unit of its last life]
    out: dict[str, str] = {}
    for n in sorted(lives, key=lambda x: lives[x][0]):
        first, last = lives[n]
        slot = next((s for s in slots if s[1] == types[n] and s[2] < first), None)
        if slot is None:
            slots.append([n, types[n], last])
        else:
            out[n] = slot[0]
            slot[2] = last
    return out


def one_rank_results(plan: Plan) -> dict[str, str]:
    """The all-reduces whose result and source can be one memory where the group is one rank
    (Buffer.one_rank_as: the value -> the one whose memory it is there; the CPU and CUDA, which
    then skip the call: an all-reduce over one rank is its source, and MPI and NCCL copy it where
    the result has memory of its own: 0.1 ms a layer of the GPT block at a micro-batch of 2 x 128
    tokens on the CPU, four times a forward and backward at tensor parallelism 1, as in a
    pipeline stage of one rank; Adam's gradient at one rank). Where: a top-level all-reduce of a
    whole (not sliced) value of the result's type, scratch or a parameter nothing updates in
    place, whose result no other unit writes and whose source no later unit writes, neither
    sharing memory with another value (same_as, reuses); a result that is private scratch is held
    in the source's memory, an output holds a scratch source (a backward's input gradient kept
    for its weight gradient). So from the all-reduce on both are read only, and the one memory
    holds the values the two would."""
    bufs = {b.name: b for b in plan.buffers}
    lent = {n for b in plan.buffers if b.same_as or b.reuses for n in (b.name, b.same_as, b.reuses)}
    updated = _updated_in_place(plan)
    out: dict[str, str] = {}
    for i, u in enumerate(plan.units):
        if not (isinstance(u, Collective) and u.op == "allreduce" and not u.into and not u.packed):
            continue
        dst, src = bufs[u.dst], bufs[u.src]
        held = (dst.kind == "scratch" and dst.private and (src.kind == "scratch" or
                                                            (src.kind == "param" and src.name not in updated))) \
            or (dst.kind == "output" and src.kind == "scratch")
        if not held or src.unallocated or {dst.name, src.name} & lent or dst.type.dtype != src.type.dtype \
                or dst.type.shape != src.type.shape or dst.type.layout.sliced or src.type.layout.sliced:
            continue
        if any(_may_write(x, dst.name) for j, x in enumerate(plan.units) if j != i) \
                or any(_may_write(x, src.name) for x in plan.units[i + 1:]):
            continue
        if dst.kind == "output":
            out[src.name] = dst.name
        else:
            out[dst.name] = src.name
    return out


def _collective_reads(u: Unit) -> tuple[str, ...]:
    """The values a collective unit (or a fused collective, or an overlap's) reads."""
    if isinstance(u, (Collective, Fused)):
        return (u.src,)
    if isinstance(u, Overlap):
        return (u.producer,)
    if isinstance(u, GatherMatmul):
        return (u.gather.src,)
    if isinstance(u, StartGather):
        return (u.gather.src,)
    return ()


def _placed(b: Buffer, plan: Plan) -> Buffer:
    """The buffer with its per-target placement: shared (in the group's window), unallocated."""
    if b.kind != "scratch":
        return b
    shared = {u.src for u in plan.units if isinstance(u, Fused) or (isinstance(u, Collective) and u.op == "allreduce")}
    packed = {c.packed for c in _every(plan.units) if isinstance(c, Collective) and c.packed}
    return replace(b, shared=b.name in shared, unallocated=(Target.CUDA, Target.EMULATED) if b.name in packed else ())


def diagnostics(plan: Plan, target: str) -> list[Diagnostic]:
    """The target's gaps as located errors (one per place and reason)."""
    seen = dict.fromkeys((g.span, g.what) for g in plan.unsupported(target))
    return [Diagnostic(span, f"{plan.program} (schedule {plan.schedule}): {what} (--backend {target})")
            for span, what in seen]


def _gap(target: str, u: Unit, what: str, locate: Locate) -> Gap:
    span = locate(u)
    line = getattr(u, "line", 0)
    return Gap(target, line or span.line, what, span)


# --- fused collectives: algorithms and chunking -------------------------------------------
def _with_strategies(u: Unit, kinds: dict[str, str]) -> Unit:
    if isinstance(u, Fused):
        return _fused(u, kinds, False)
    if isinstance(u, Overlap) and u.fused is not None:
        return replace(u, fused=_fused(u.fused, kinds, True))
    return u


def _fused(u: Fused, kinds: dict[str, str], overlapped: bool) -> Fused:
    after = tuple(_with_strategies(a, kinds) for a in u.after)
    return replace(u, after=after, strategies=(_cpu(u, overlapped), _cuda(u, kinds, overlapped)))


def _cpu(u: Fused, overlapped: bool) -> Strategy:
    shm = u.op == "reducescatter" and not overlapped
    # a row-wise phase computes whole rows: the chunks and the pieces computed between two MPI
    # progress calls are whole rows, an overlap's task's as well
    chunking = Chunking(ChunkElems.TASK if overlapped else ChunkElems.DEFAULT, u.rows, u.rows is not None)
    return Strategy("cpu", (Algorithm.P2P, Algorithm.SHM) if shm else (Algorithm.P2P,), chunking,
                    Partials.PER_CHUNK if u.partials else Partials.NONE,
                    GatherAfter.PER_PIECE if u.gather_after else GatherAfter.NONE)


def _cuda(u: Fused, kinds: dict[str, str], overlapped: bool) -> Strategy:
    symmetric = not overlapped and _symmetric_ok(u, kinds)
    chunking = Chunking(ChunkElems.DEFAULT, u.rows, whole_alone=kinds[u.src] != "segments")
    return Strategy("cuda", (Algorithm.PIPELINE, Algorithm.SYMMETRIC) if symmetric else (Algorithm.PIPELINE,), chunking,
                    Partials.PER_CHUNK if u.partials else Partials.NONE,
                    GatherAfter.AFTER_LOOP if u.gather_after else GatherAfter.NONE)


def _symmetric_ok(u: Fused, kinds: dict[str, str]) -> bool:
    """Can the fused unit also run as one kernel over symmetric memory (symmetric.cuh)? A
    reduce-scatter along dim 0 of a contiguous tensor, pointwise phases only; a reduced value
    that is kept is kept in scratch (the kernel's `keep` buffer), and one that a reduction
    accumulated chunk by chunk reads is kept (the kernel has no chunks: the reduction reads it
    after)."""
    refs = {r.name for p in u.phases for i in p.items for r in walk(i.expr) if isinstance(r, Ref)}
    scattered = {n for n, k in kinds.items() if k == "segments"}
    return (u.op == "reducescatter" and u.type.layout.dim == 0 and u.rows is None
            and u.reduce in ("sum", "avg", "max", "min") and all(p.kind == "pointwise" for p in u.phases)
            and not ({u.src, u.gather} | refs) & scattered
            and (not u.store_reduced or kinds[u.collective] == "scratch")
            and (u.store_reduced or not any(isinstance(a, Reduce) and a.dst in u.partials and a.src == u.collective
                                            for a in u.after)))


# --- what each target does not implement ----------------------------------------------------
def _every(units: tuple[Unit, ...]) -> Iterator[Unit]:
    """Every unit, with those inside fused collectives and overlaps, in order."""
    for u in units:
        yield u
        if isinstance(u, Overlap) and u.fused is not None:
            yield from _every((u.fused,))
        elif isinstance(u, Fused):
            yield from _every(u.after)


def _cpu_gaps(plan: Plan) -> list[tuple[Unit, str]]:
    """The CPU backend implements every unit (an extern operation without a C++ implementation
    is refused where it is declared)."""
    return []


def _cuda_gaps(plan: Plan) -> list[tuple[Unit, str]]:
    """What of this plan the CUDA backend does not implement, one entry per unit."""
    out: list[tuple[Unit, str]] = []
    kinds = {b.name: b.kind for b in plan.buffers}
    ndims = {b.name: b.type.ndim for b in plan.buffers}
    scattered = {b.name for b in plan.buffers if b.kind == "segments"}

    def unit(u: Unit) -> None:
        if isinstance(u, Overlap) and u.fused is not None:
            f = u.fused
            if not u.direct or (f.op == "reducescatter" and f.type.layout.dim == 0) or f.src != u.producer:
                out.append((u, "overlap into a fused collective other than an all-reduce or a reduce-scatter along "
                               "a dim other than 0 fed by rows of the matmul is not in the CUDA backend yet"))
            else:
                unit(f)
        elif isinstance(u, Library) and ops.get(u.op).extern is not None:
            out.extend((u, what) for what in _extern_problems(u, kinds, ndims))
        elif isinstance(u, Collective) and u.src in scattered and u.op == "allgather":  # (the CPU's neither)
            out.append((u, f"an allgather of a sliced scattered tensor ('{u.src}') is not in the CUDA backend yet"))
        elif isinstance(u, Fused):
            out.extend((u, what) for what in _fused_problems(u, kinds))
            for a in u.after:
                unit(a)
    for u in plan.units:
        unit(u)
    types = {b.name: b.type for b in plan.buffers}
    out += [(u, "a reduction whose result dtype differs from its input's") for u in _every(plan.units)
            if isinstance(u, Reduce) and types[u.src].dtype != types[u.dst].dtype]
    return out


def _extern_problems(u: Library, kinds: dict[str, str], ndims: dict[str, int]) -> list[str]:
    ext = ops.get(u.op).extern
    assert ext is not None
    if ext.cuda is None:
        return [f"extern operation '{u.op}' declares no cuda implementation ('cuda = \"header\", \"function\"')"]
    computed = [a for a in u.args if ndims.get(a) == 0 and kinds.get(a) != "scalar"]
    if computed:
        return [f"a computed 0-d operand ('{computed[0]}') of extern operation '{u.op}' is not in the CUDA "
                "backend yet (it lives on the device)"]
    return []


def _fused_problems(u: Fused, kinds: dict[str, str]) -> list[str]:
    for p in u.phases:
        if p.kind != "rows":
            continue
        e = row_op(p.items[0].expr)
        read = ([] if e is None else [e.args[0]] if e.op == "layernorm"
                else [n for n in walk(p.items[0].expr) if isinstance(n, Ref) and n.type.ndim > 0])
        if (not read or any(not isinstance(x, Ref) or (x.name != u.collective and kinds.get(x.name) in (None, "register"))
                            for x in read) or u.type.layout.dim == u.type.ndim - 1):
            return ["a row-wise phase reading a value kept in registers, or sliced along its rows, is not in "
                    "the CUDA backend yet"]
    if kinds.get(u.collective) not in ("register", "scratch", "output", "alias"):
        return [f"a fused collective whose reduced value is '{kinds.get(u.collective)}' is not in the CUDA "
                "backend yet"]
    return []


def _emulation_gaps(plan: Plan) -> list[tuple[Unit, str]]:
    """What cuda does not implement, and each extern operation (its own CUDA code is not run
    under the host emulation)."""
    return _cuda_gaps(plan) + [(u, "an extern operation's own CUDA code is not run under the host emulation")
                               for u in _every(plan.units)
                               if isinstance(u, Library) and ops.get(u.op).extern is not None]


GAPS: dict[str, Callable[[Plan], list[tuple[Unit, str]]]] = {
    Target.CPU: _cpu_gaps, Target.CUDA: _cuda_gaps, Target.EMULATED: _emulation_gaps}

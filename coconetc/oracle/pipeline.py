"""A pipeline schedule run by the interpreter, as coconetc.torch.pipeline runs it: each virtual
stage's program (schedule/pipeline.py, stage_program) derived and cut as a training step runs it
(autodiff/saved.py: the forward that saves, the backward; under the zero-bubble order the
backward cut into its input-gradient and weight-gradient programs), each micro-batch's rows
through the stages in the order's actions, the gradients added over the micro-batches. Its
result is the gradients of the whole batch, to compare with the unpipelined derived program's
(tests/test_pipeline.py): a pipeline schedule is proven equal to its program that way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coconetc.autodiff.saved import split, split_input_weight
from coconetc.autodiff.vjp import vjp
from coconetc.interp.interpreter import run
from coconetc.ir.dtypes import FLOATS
from coconetc.ir.nodes import Program
from coconetc.pipeline import orders
from coconetc.schedule.pipeline import Pipeline, cut, stage_program, stage_rows


class _Stage:
    """One virtual stage's programs: forward (saving), backward, and its B/W cut."""

    def __init__(self, p: Program, carry: str | None, batch: Sequence[str], rows: dict[str, tuple[int, int]]):
        self.p = p
        self.rows = rows  # the stacked parameters' rows it takes (its layers')
        self.wrt = [q.name for q in p.params if not q.scalar and q.type.dtype in FLOATS]
        cutp = split(p, vjp(p, self.wrt))
        self.fwd, self.bwd, self.saved = cutp.forward, cutp.backward, cutp.saved
        self.carry = carry  # the parameter that receives the previous stage's activation
        # B: the gradients a stage sends back (the carry's), or the batch inputs' (the first stage)
        at = tuple(x for x in ((carry,) if carry else batch) if x in self.wrt)
        self.bw = split_input_weight(p, self.bwd, at) if at else None


def interpret(p: Program, d: Pipeline, inputs: Sequence[Mapping[str, Any]],
              cotangents: Sequence[Mapping[str, Any]], batch: Sequence[str],
              groups: int = 1) -> list[dict[str, np.ndarray]]:
    """The gradients (`d_<x>` for every floating tensor parameter x, per rank, as vjp(p)'s
    outputs are) of p's loss sum(<out, d_out>) run through pipeline D: INPUTS and COTANGENTS
    per rank (the cotangents `d_<output>`, as vjp(p) takes them); BATCH: the parameters whose
    dim 0 is the batch that micro-batches cut (the outputs' dim 0 is cut the same way)."""
    return _Run(p, d, inputs, cotangents, batch, groups).result()


class _Run:
    def __init__(self, p: Program, d: Pipeline, inputs: Sequence[Mapping[str, Any]],
                 cotangents: Sequence[Mapping[str, Any]], batch: Sequence[str], groups: int):
        c = cut(p, d)
        self.order, self.M, self.batch, self.groups = c.order, d.microbatches, set(batch), groups
        self.stages: list[_Stage] = []
        prev: str | None = None
        for s in range(self.order.stages):
            sp = stage_program(p, c, s)
            self.stages.append(_Stage(sp, prev, batch, stage_rows(p, c, s)))
            prev = sp.outputs[0][1] if s < self.order.stages - 1 else None
        self.ranks = len(inputs)
        self.shapes = [{k: np.shape(v) for k, v in inputs[r].items()} for r in range(self.ranks)]
        self.args = [[{k: self._rows(v, m) if k in self.batch else v for k, v in inputs[r].items()}
                      for r in range(self.ranks)] for m in range(self.M)]
        self.cot = [[{k: self._rows(v, m) for k, v in cotangents[r].items()} for r in range(self.ranks)]
                    for m in range(self.M)]
        self.acts: dict[tuple[int, int], list] = {}  # (stage, m) -> per rank, the activation sent on
        self.held: dict[tuple[int, int], list] = {}  # (stage, m) -> per rank, its backward's arguments
        self.kept: dict[tuple[int, int], list] = {}  # (stage, m) -> per rank, B's kept values for W
        self.back: dict[tuple[int, int], list] = {}  # (stage, m) -> per rank, the carry's gradient
        self.grads: list[dict[str, np.ndarray]] = [{} for _ in range(self.ranks)]
        self.cut_grads: dict[tuple[str, int], list] = {}  # (a batch input's gradient, m) -> per rank

    def _rows(self, v: Any, m: int) -> Any:
        n = np.shape(v)[0]
        if n % self.M:
            raise ValueError(f"a batch of {n} rows does not divide into microbatches={self.M}")
        return v[m * (n // self.M):(m + 1) * (n // self.M)]

    def result(self) -> list[dict[str, np.ndarray]]:
        act = {"F": self._forward, "B": self._backward, "W": self._weight}
        for slot in sorted(orders.simulate(self.order).slots, key=lambda t: (t.start, t.rank)):
            act[slot.action.kind](slot.stage, slot.action.microbatch)
        for k in dict.fromkeys(k for k, _ in self.cut_grads):  # the batch inputs' gradients: rows joined
            for r in range(self.ranks):
                self.grads[r][k] = np.concatenate([self.cut_grads[(k, m)][r] for m in range(self.M)])
        return self.grads

    def _add(self, r: int, k: str, v: np.ndarray, m: int, st: _Stage) -> None:
        x = k[len("d_"):]
        if x in self.batch:
            self.cut_grads.setdefault((k, m), [None] * self.ranks)[r] = v
            return
        g = self.grads[r]
        if k not in g:
            g[k] = np.zeros(self.shapes[r][x], dtype=np.asarray(v).dtype)
        if x in st.rows:  # a stacked parameter's gradient: the rows of this stage's layers
            a, b = st.rows[x]
            g[k][a:b] += v
        else:
            g[k] += v

    def _forward(self, s: int, m: int) -> None:
        st = self.stages[s]
        call = [{q.name: (self.acts[(s - 1, m)][r] if q.name == st.carry else self._arg(st, m, r, q.name))
                 for q in st.fwd.params} for r in range(self.ranks)]
        res = run(st.fwd, call, self.groups)
        if s < self.order.stages - 1:
            self.acts[(s, m)] = [x.outputs[st.p.outputs[0][0]] for x in res]
        self.held[(s, m)] = [{**call[r], **{v: res[r].outputs[f"saved_{v}"] for v in st.saved}}
                             for r in range(self.ranks)]

    def _arg(self, st: _Stage, m: int, r: int, name: str) -> Any:
        v = self.args[m][r][name]
        if name in st.rows:
            a, b = st.rows[name]
            return np.ascontiguousarray(v[a:b])
        return v

    def _backward(self, s: int, m: int) -> None:
        st, last = self.stages[s], s == self.order.stages - 1
        ins = []
        for r in range(self.ranks):
            a = dict(self.held[(s, m)][r])
            for q in st.bwd.params[len(st.fwd.params) + len(st.saved):]:  # the cotangents
                a[q.name] = self.cot[m][r][q.name] if last else self.back[(s + 1, m)][r]
            ins.append(a)
        split_here = self.order.split_backward and st.bw is not None
        res = run(st.bw.input_grad if split_here and st.bw is not None else st.bwd, ins, self.groups)
        for r in range(self.ranks):
            for k, v in res[r].outputs.items():
                if st.carry is not None and k == f"d_{st.carry}":
                    self.back.setdefault((s, m), [None] * self.ranks)[r] = v
                elif not k.startswith("kept_"):
                    self._add(r, k, v, m, st)
        if split_here:
            self.held[(s, m)] = ins
            self.kept[(s, m)] = [{k[len("kept_"):]: v for k, v in x.outputs.items() if k.startswith("kept_")}
                                 for x in res]

    def _weight(self, s: int, m: int) -> None:
        st = self.stages[s]
        assert st.bw is not None, "W of a stage whose backward was not cut"
        res = run(st.bw.weight_grad, [{**self.held[(s, m)][r], **self.kept[(s, m)][r]} for r in range(self.ranks)],
                  self.groups)
        for r in range(self.ranks):
            for k, v in res[r].outputs.items():
                self._add(r, k, v, m, st)

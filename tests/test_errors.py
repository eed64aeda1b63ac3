"""Compile errors: each malformed program or schedule is reported at the token a user would want
to be pointed at (line, col), with a message that says what is wrong; several independent errors
are reported at once; the rendered text is `file:line:col: error: ...`, the line and a caret.
Also: every example file and the examples of the language contract load without error."""

from __future__ import annotations

import re
from pathlib import Path
from textwrap import dedent

import pytest

from coconetc.sourcefile import load_source
from coconetc.errors import CompileError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.ccn"))
PROGRAMS = Path(__file__).with_name("programs")


def src(text: str) -> str:
    return dedent(text).lstrip("\n")


def errors_of(source: str) -> CompileError:
    with pytest.raises(CompileError) as info:
        load_source(source, "t.ccn")
    return info.value


# Programs the schedule cases refer to (each ends with its closing brace and a newline).
SGD = src("""
    program sgd(g: f32[N] local, w: f32[N] replicated, lr: f32) {
        g1 = allreduce(sum, g)
        w1 = update(w, w - lr * g1)
    }
""")  # 4 lines

ADAM = src("""
    program adam(g: f32[N] local, w: f32[N] replicated, m: f32[N] replicated,
                 v: f32[N] replicated, lr: f32, beta1: f32, beta2: f32, eps: f32, step: f32) {
        g1 = allreduce(sum, g)
        m1 = update(m, beta1 * m + (1 - beta1) * g1)
        v1 = update(v, beta2 * v + (1 - beta2) * g1 * g1)
        mh = m1 / (1 - beta1 ** step)
        vh = v1 / (1 - beta2 ** step)
        w1 = update(w, w - lr * mh / (sqrt(vh) + eps))
    }
""")  # 9 lines

MLP = src("""
    program mlp(x: f16[B, S, K] sliced(2), w: f16[K, H] sliced(0), b: f16[H] replicated,
                r: f16[B, S, H] replicated, seed: i64) {
        y = matmul(x, w)
        s = allreduce(sum, y)
        out = dropout(s + b, 0.1, seed) + r
        return out
    }
""")  # 7 lines

ATTN = src("""
    program attn(y: f32[B, S, H] local, b: f32[H] replicated, gamma: f32[H] replicated,
                 beta: f32[H] replicated) {
        s = allreduce(sum, y)
        h = s + b
        out = layernorm(h, gamma, beta, 1e-5)
        return out
    }
""")  # 7 lines

TWO = src("""
    program two(g: f32[N] local, h: f32[N] local, w: f32[N] replicated) {
        a = allreduce(sum, g)
        b = allreduce(sum, h)
        c = broadcast(h, 0)
        k = w * 2
        w1 = update(w, k - a - b)
    }
""")  # 7 lines

TP = src("""
    program tp(x: f32[B, K] local, w: f32[K, H] replicated) {
        s = allreduce(sum, x)
        y = matmul(s, w)
        return y
    }
""")  # 5 lines


def P(body: str, params: str = "x: f32[N] local") -> str:
    """A one-program file: line 1 is the header, the body starts on line 2 (4 spaces in)."""
    return f"program p({params}) {{\n" + "".join(f"    {ln}\n" for ln in body.splitlines()) + "}\n"


def S(program: str, body: str, name: str = "s", prog: str | None = None) -> str:
    """program, then `schedule name for prog {` on the next line, the body after it."""
    prog = prog or re.match(r"program (\w+)", program).group(1)
    return (program + f"schedule {name} for {prog} {{\n"
            + "".join(f"    {ln}\n" for ln in body.splitlines()) + "}\n")


# (id, source, line, col, message fragment)
CASES = [
    # ---- syntax -------------------------------------------------------------------------
    ("missing_rparen_in_params", "program p(x: f32[N] local {\n    y = x\n}\n",
     1, 27, "unexpected '{'"),
    ("missing_rparen_in_expr", P("y = (x + 1"), 2, 9, "'(' is never closed (found '}' at line 3)"),
    ("missing_rparen_before_next_stmt", P("y = (x + 1\nz = y"),
     3, 5, "is the '(' at line 2, col 9 closed?"),
    ("missing_rbrace_at_eof", "program p(x: f32[N] local) {\n    y = x\n",
     1, 28, "'{' is never closed (found the end of the file)"),
    ("missing_rbrace_before_next_program",
     "program a(x: f32[N] local) {\n    y = x\n\nprogram b(x: f32[N] local) {\n    y = x\n}\n",
     1, 28, "'{' is never closed (found 'program' at line 4)"),
    ("bad_character", P("y = x $ 2"), 2, 11, "unexpected character '$'"),
    ("bad_unicode_character", P("y = x \u00d7 2"), 2, 11, "unexpected character '\u00d7'"),
    ("stray_token", P("y = x 2"), 2, 11, "unexpected '2'"),
    ("stray_rbrace", P("y = x") + "}\n", 4, 1, "unexpected '}'"),
    ("unterminated_program", "program p(x: f32", 1, 10, "'(' is never closed (found the end of the file)"),
    ("program_without_block", "program p(x: f32)\n", 1, 18, "expected '{'"),
    ("expression_as_statement", P("x + 1"), 2, 5, "an expression on its own does nothing"),
    ("dangling_operator", P("y = x +"), 2, 12, "unexpected end of line"),
    ("missing_comma_between_params", "program p(x: f32[N] local\n          w: f32) {\n    y = x\n}\n",
     2, 11, "missing ',' before parameter 'w'"),
    ("missing_comma_after_shape", "program p(x: f32[N] w: f32) {\n    y = x\n}\n",
     1, 21, "missing ',' before parameter 'w'"),
    ("number_as_name", P("2 = x"), 2, 7, "unexpected '='"),
    ("several_names_in_a_program", P("a, b = x"), 2, 8, "a program statement defines one name"),
    # ---- names and declarations -----------------------------------------------------------
    ("unknown_name", P("y = x + z"), 2, 13, "unknown name 'z'"),
    ("unknown_operation", P("y = foo(x)"), 2, 9, "unknown operation 'foo'"),
    ("unknown_dtype", P("y = x", "x: f33[N] local"), 1, 14, "unknown dtype 'f33'"),
    ("unknown_layout", P("y = x", "x: f32[N] lokal"), 1, 21, "unknown layout 'lokal'"),
    ("sliced_out_of_range", P("y = x", "x: f32[N, M] sliced(2)"), 1, 24,
     "sliced(2) is out of range for a 2-d tensor"),
    ("scattered_2d", P("y = x", "x: f32[N, M] local scattered"), 1, 24, "only a 1-d tensor can be scattered"),
    ("scattered_misspelt", P("y = x", "x: f32[N] local scatered"), 1, 21, "did you mean 'scattered'"),
    ("layout_on_scalar", P("y = x", "x: f32 local"), 1, 18, "scalar 'x' takes no layout"),
    ("zero_dim", P("y = x", "x: f32[0] local"), 1, 18, "a dimension must be at least 1"),
    ("duplicate_parameter", P("y = x", "x: f32[N] local, x: f32[N] local"), 1, 28,
     "parameter 'x' is declared twice"),
    ("reassignment", P("y = x\ny = x + 1"), 3, 5, "'y' is already defined (names are single-assignment)"),
    ("assign_to_parameter", P("x = x + 1"), 2, 5, "'x' is already defined"),
    ("program_defined_twice", P("y = x") + P("y = x"), 4, 9, "program 'p' is defined twice"),
    ("return_unknown_name", P("y = x + 1\nreturn q"), 3, 12, "unknown name 'q'"),
    ("return_twice", P("y = x\nreturn y\nreturn x"), 4, 5, "a program has one return statement"),
    ("return_same_name_twice", P("y = x\nreturn y, y"), 3, 15, "'y' is returned twice"),
    # ---- types: shapes, dtypes, layouts ----------------------------------------------------
    ("shape_mismatch", P("y = x + z", "x: f32[N] local, z: f32[M] local"), 2, 11,
     "shapes do not broadcast: [N] vs [M]"),
    ("shape_mismatch_nested", P("y = (x * 2) - z", "x: f32[N, K] local, z: f32[K, N] local"), 2, 17,
     "shapes do not broadcast"),
    ("dtype_mismatch", P("y = x + z", "x: f16[N] local, z: f32[N] local"), 2, 11,
     "different dtypes f16 and f32; use cast"),
    ("float_scalar_int_tensor", P("y = x * 0.5", "x: i32[N] local"), 2, 13, "a float scalar with an i32 tensor"),
    ("float_param_scalar_int_tensor", P("y = lr * x", "x: i64[N] local, lr: f32"), 2, 9,
     "a float scalar with an i64 tensor"),
    ("local_plus_sliced", P("y = x + z", "x: f32[N] local, z: f32[N] sliced"), 2, 11,
     "cannot combine local and sliced(0) operands"),
    ("cast_to_unknown_dtype", P("y = cast(x, f8)"), 2, 17, "cast()'s dtype must be one of"),
    # ---- communication ----------------------------------------------------------------------
    ("allreduce_of_sliced", P("y = allreduce(sum, x)", "x: f32[N] sliced"), 2, 24,
     "allreduce needs a local (or replicated) input, not sliced(0)"),
    ("allgather_of_local", P("y = allgather(x)"), 2, 19, "allgather needs a sliced input, not local"),
    ("scatter_of_local", P("y = scatter(x)"), 2, 17, "scatter needs a replicated input"),
    ("collective_nested", P("y = 2 * allreduce(sum, x)"), 2, 13,
     "allreduce() must be the whole right-hand side"),
    ("collective_as_argument", P("y = sqrt(allgather(x))", "x: f32[N] sliced"), 2, 14,
     "allgather() must be the whole right-hand side"),
    ("bad_reduction_op", P("y = allreduce(total, x)"), 2, 19, "op must be one of sum, avg, prod, max, min"),
    ("bad_send_direction", P("y = send(x, up)"), 2, 17, "direction must be one of next, prev"),
    ("reducescatter_dim_out_of_range", P("y = reducescatter(sum, x, dim=1)"), 2, 35,
     "reducescatter dim=1 is out of range for a 1-d tensor"),
    ("float_dim", P("y = reducescatter(sum, x, dim=1.5)"), 2, 35, "dim must be an integer literal"),
    # ---- update ------------------------------------------------------------------------------
    ("update_of_scalar", P("y = update(lr, lr * 2)", "x: f32[N] local, lr: f32"), 2, 16,
     "cannot update scalar 'lr'"),
    ("update_twice", P("y = update(w, w + 1)\nz = update(w, w + 2)", "w: f32[N] replicated"), 3, 16,
     "'w' is already updated by 'y'"),
    ("update_wrong_shape", P("y = update(w, x)", "x: f32[N] local, w: f32[M] replicated"), 2, 19,
     "update of 'w' needs shape"),
    ("update_wrong_dtype", P("y = update(w, x)", "x: f16[N] replicated, w: f32[N] replicated"), 2, 19,
     "update of 'w' (f32) with a f16 value; use cast"),
    ("update_replicated_with_local", P("y = update(w, w - x)", "x: f32[N] local, w: f32[N] replicated"),
     2, 19, "update of replicated 'w' with a local value"),
    ("update_of_a_stage", P("y = x * 2\nz = update(y, x)"), 3, 16, "must be a parameter tensor"),
    ("update_nested", P("y = 2 * update(x, x)"), 2, 13, "update() must be the whole right-hand side"),
    ("update_with_comparison", P("y = update(x, x < 1)"), 2, 21, "a comparison can only be the condition"),
    # ---- comparisons and where ----------------------------------------------------------------
    ("comparison_outside_where", P("y = x < 2"), 2, 11, "a comparison can only be the condition of where()"),
    ("comparison_as_operand", P("y = (x < 2) + 1"), 2, 10, "a comparison can only be the condition of where()"),
    ("where_without_comparison", P("y = where(x, x, 0)"), 2, 15, "where's condition must be a comparison"),
    # ---- calls -----------------------------------------------------------------------------------
    ("too_many_arguments", P("y = sqrt(x, x)"), 2, 17, "sqrt() takes at most 1 argument, got 2"),
    ("missing_argument", P("y = allreduce(sum)"), 2, 9, "allreduce() is missing its argument 'x'"),
    ("unknown_keyword", P("y = reducescatter(sum, x, dimm=0)"), 2, 31, "reducescatter() has no argument 'dimm'"),
    ("keyword_given_twice", P("y = scatter(x, dim=0, dim=0)", "x: f32[N] replicated"), 2, 27,
     "scatter() got 'dim' twice"),
    ("matmul_inner_dims", P("y = matmul(x, w)", "x: f32[B, K] replicated, w: f32[H, N] replicated"), 2, 9,
     "matmul inner dims differ: K vs H"),
    ("matmul_1d", P("y = matmul(x, w)", "x: f32[K] replicated, w: f32[K, N] replicated"), 2, 9,
     "matmul needs [..., M, K] x [K, N]"),
    ("matmul_layouts", P("y = matmul(x, w)", "x: f32[B, K] sliced(0), w: f32[K, N] sliced(0)"), 2, 9,
     "matmul of sliced(0) x sliced(0) has no tensor-parallel meaning"),
    ("layernorm_gamma_shape",
     P("y = layernorm(x, g, b, 1e-5)", "x: f32[B, H] replicated, g: f32[B] replicated, b: f32[H] replicated"),
     2, 22, "layernorm's gamma/beta must have shape [H]"),
    ("layernorm_of_last_dim_sliced",
     P("y = layernorm(x, g, b, 1e-5)", "x: f32[B, H] sliced(1), g: f32[H] replicated, b: f32[H] replicated"),
     2, 9, "layernorm normalizes the last dim"),
    ("dropout_p_too_large", P("y = dropout(x, 1.5, seed)", "x: f32[N] local, seed: i64"), 2, 20,
     "dropout probability must be in [0, 1), got 1.5"),
    ("dropout_p_negative", P("y = dropout(x, -0.5, seed)", "x: f32[N] local, seed: i64"), 2, 20,
     "dropout probability must be in [0, 1), got -0.5"),
    ("dropout_float_seed", P("y = dropout(x, 0.1, s)", "x: f32[N] local, s: f32"), 2, 25,
     "dropout's seed must be an i64 scalar"),
    ("segment_norm_not_scattered", P("y = segment_norm(x)"), 2, 22,
     "segment_norm needs a tensor with the shape of a scattered parameter"),
    ("conv2d_channels", P("y = conv2d(x, k)", "x: f32[N, C, H, W] replicated, k: f32[O, D, 3, 3] replicated"),
     2, 9, "conv2d channels differ: C vs D"),
    ("conv2d_stride_zero", P("y = conv2d(x, k, stride=0)",
                             "x: f32[N, C, H, W] replicated, k: f32[O, C, 3, 3] replicated"),
     2, 29, "conv2d's stride must be at least 1"),
    ("broadcast_negative_root", P("y = broadcast(x, -1)"), 2, 22, "broadcast()'s root must not be negative"),
    # ---- schedules ---------------------------------------------------------------------------------
    ("schedule_for_unknown_program", SGD + "schedule s for nope {\n    rs, ag = split(g1)\n}\n", 5, 16,
     "schedule 's' is for unknown program 'nope'"),
    ("unknown_directive", S(SGD, "rs, ag = spilt(g1)"), 6, 14,
     "a schedule holds directives: split, reorder, slice, fuse, overlap"),
    ("schedule_return", S(SGD, "return g1"), 6, 5, "a schedule has no return statement"),
    ("split_unknown_stage", S(SGD, "rs, ag = split(g2)"), 6, 20, "no stage named 'g2' (stages: g1, w1)"),
    ("split_non_allreduce", S(SGD, "rs, ag = split(w1)"), 6, 20, "split on 'w1': only an allreduce can be split"),
    ("split_one_target", S(SGD, "rs = split(g1)"), 6, 5, "split defines 2 names, not 1"),
    ("split_two_stages", S(SGD, "rs, ag = split(g1, w1)"), 6, 14, "split() takes one stage name"),
    ("split_dim_out_of_range", S(SGD, "rs, ag = split(g1, dim=1)"), 6, 28,
     "split on 'g1': dim=1 is out of range for a 1-d tensor"),
    ("split_negative_dim", S(SGD, "rs, ag = split(g1, dim=-1)"), 6, 28, "split()'s dim must be an integer >= 0"),
    ("split_unknown_keyword", S(SGD, "rs, ag = split(g1, axis=0)"), 6, 24, "split() has no argument 'axis'"),
    ("reorder_stage_not_consuming_allgather", S(TWO, "ra, ga = split(a)\nkk = reorder(ga, k)"), 10, 22,
     "reorder on 'k': the stage does not consume 'ga'"),
    ("reorder_of_matmul", S(TP, "rs, ag = split(s)\nag2 = reorder(ag, y)"), 8, 23,
     "reorder on 'y': matmul does not commute with slicing"),
    ("reorder_wrong_number_of_names", S(ADAM, "rs, ag = split(g1)\nagm = reorder(ag, m1, v1)"), 12, 5,
     "2 reordered value(s) are still needed whole (m1, v1)"),
    ("reorder_layernorm_sliced_last_dim", S(ATTN, "rs, ag = split(s, dim=2)\nagh, ago = reorder(ag, h, out)"),
     10, 31, "reorder on 'out': layernorm normalizes the last dim, which the slice would cut"),
    ("reorder_of_non_allgather", S(ADAM, "rs, ag = split(g1)\nagm, agv = reorder(rs, m1, v1)"), 12, 24,
     "reorder on 'rs': the first argument must be an allgather stage"),
    ("reorder_listed_twice", S(ADAM, "rs, ag = split(g1)\nagm, agv = reorder(ag, m1, v1, m1)"), 12, 36,
     "reorder on 'm1': the stage is listed twice"),
    ("reorder_of_nothing", S(SGD, "rs, ag = split(g1)\nagw = reorder(ag, )"), 7, 19,
     "reorder on 'ag': no stage to move: name the stages that read it, as in reorder(ag, w1)"),
    ("reorder_not_on_slices", S(ADAM, "rs, ag = split(g1)\nagm = reorder(ag, mh)"), 12, 23,
     "reorder on 'mh': would run as replicated, not on slices"),
    ("slice_param_with_unsliced_use", S(ADAM, "rs, ag = split(g1)\nslice(m)"), 12, 11,
     "slice on 'm': every use must run on slices after reorder"),
    ("slice_of_scalar", S(ADAM, "rs, ag = split(g1)\nagm, agv, agw = reorder(ag, m1, v1, mh, vh, w1)\nslice(lr)"),
     13, 11, "slice on 'lr': only a tensor parameter can be sliced"),
    ("slice_of_stage", S(SGD, "slice(g1)"), 6, 11, "slice on 'g1': only a tensor parameter can be sliced"),
    ("fuse_two_allreduces", S(TWO, "f = fuse(a, b)"), 9, 17,
     "a fusion holds at most one collective, or one reducescatter/allgather pair"),
    ("fuse_allreduce_and_broadcast", S(TWO, "f = fuse(a, c)"), 9, 17, "here: a (allreduce), c (broadcast)"),
    ("fuse_cycle", S(ADAM, "rs, ag = split(g1)\nfuse(rs, m1)"), 12, 14,
     "'ag' reads the fusion and the fusion reads it: fusing would make a cycle"),
    ("fuse_matmul", S(MLP, "f = fuse(y, s)"), 9, 14, "fuse on 'y': matmul cannot be fused into a loop"),
    ("fuse_name_taken", S(SGD, "g = fuse(g1, w1)"), 6, 5, "fuse on 'g': the name 'g' is already taken"),
    ("fuse_twice", S(SGD, "f = fuse(g1, w1)\nf2 = fuse(w1)"), 7, 15, "fuse on 'w1': the stage is already fused"),
    ("split_after_fuse", S(SGD, "f = fuse(g1, w1)\nrs, ag = split(g1)"), 7, 20, "the stage is already fused; fuse last"),
    ("overlap_producer_not_matmul", S(MLP, "overlap(out, s, chunks=2)"), 9, 13,
     "overlap on 'out': the producer must be a matmul stage"),
    ("overlap_consumer_not_reading_producer",
     S(MLP, "rs, ag = split(s, dim=1)\noverlap(y, ag, chunks=2)"), 10, 16,
     "its collective 'ag' does not read 'y' directly"),
    ("overlap_consumer_not_collective", S(MLP, "overlap(y, out, chunks=2)"), 9, 16,
     "overlap on 'out': the consumer must be a collective or a fusion"),
    ("overlap_dim_scattered", S(MLP, "rs, ag = split(s, dim=1)\noverlap(y, rs, chunks=2, dim=1)"), 10, 34,
     "cannot chunk along dim 1; chunkable dims: 0, 2"),
    ("overlap_without_chunks", S(MLP, "overlap(y, s)"), 9, 5, "overlap() needs chunks=k"),
    ("overlap_zero_chunks", S(MLP, "overlap(y, s, chunks=0)"), 9, 26, "overlap()'s chunks must be an integer >= 1"),
    ("overlap_twice", S(MLP, "overlap(y, s, chunks=2)\noverlap(y, s, chunks=4)"), 10, 13,
     "overlap on 'y': the producer is already overlapped"),
    ("duplicate_schedule_name", S(SGD, "rs, ag = split(g1)") + "schedule s for sgd {\n}\n", 8, 10,
     "schedule 's' for 'sgd' is defined twice"),
    ("duplicate_schedule_after_a_bad_one", S(SGD, "rs, ag = split(w1)") + "schedule s for sgd {\n}\n", 8, 10,
     "schedule 's' for 'sgd' is defined twice"),
    ("schedule_reuses_a_name", S(SGD, "rs, w = split(g1)"), 6, 9, "split on 'w': the name 'w' is already taken"),
    ("schedule_reuses_its_own_name", S(SGD, "rs, ag = split(g1)\nrs = reorder(ag, w1)"),
     7, 5, "reorder on 'rs': the name 'rs' is already taken"),
    ("auto_schedule_with_directives", S(SGD, "rs, ag = split(g1)", name="auto"), 6, 5,
     "schedule auto takes no directives"),
    # ---- regressions found by tests/test_fuzz.py and by reviewing locations -------------------
    ("regression_deep_expression", P("y = " + " + ".join(["x"] * 1000)), 2, 5,
     "expression nested more than 100 levels deep"),
    ("regression_deep_negation", P("y = " + "-" * 500 + "x"), 2, 5, "expression nested more than 100 levels deep"),
    # ---- names and literals (issue 8) --------------------------------------------------------
    ("keyword_as_program_name", "program for(x: f32[N] local) {\n    y = x\n}\n", 1, 9,
     "'for' is a keyword and cannot be a name"),
    ("keyword_as_parameter", "program p(schedule: f32[N] local) {\n    y = schedule\n}\n", 1, 11,
     "'schedule' is a keyword"),
    ("keyword_as_stage", P("program = x"), 2, 5, "'program' is a keyword"),
    ("keyword_as_schedule_name", SGD + "schedule return for sgd {\n    rs, ag = split(g1)\n}\n",
     5, 10, "'return' is a keyword"),
    ("keyword_as_directive_output", SGD + "schedule s for sgd {\n    rs, as = split(g1)\n}\n",
     6, 9, "'as' is a keyword"),
    ("dim_literal_beyond_int64", "program p(x: f32[9223372036854775808] local) {\n    y = x\n}\n",
     1, 18, "integer literal 9223372036854775808 does not fit int64"),
    ("dim_literals_bytes_beyond_int64", "program p(x: f64[4, 2305843009213693952] local) {\n    y = x\n}\n",
     1, 11, "'x' is too large: 9223372036854775808 elements"),
    ("dim_literal_bytes_beyond_int64", "program p(x: f32[2305843009213693952] local) {\n    y = x\n}\n",
     1, 11, "(9223372036854775808 bytes) do not fit int64"),
    ("integer_literal_beyond_int64", P("y = x * 99999999999999999999"), 2, 13,
     "integer literal 99999999999999999999 does not fit int64"),
    ("float_literal_beyond_f64", P("y = x * 1e400"), 2, 13, "number literal 1e400 is out of range"),
    ("string_without_quotes", S(SGD, "rs, ag = split(g1, algorithm=1f1b)"), 6, 34,
     "'1f1b' is a number followed by a name: a string is written in quotes (\"1f1b\")"),
    ("number_then_name", P("y = 2x"), 2, 9, "a product with an operator (2 * x)"),
    ("regression_operator_after_comment", P("y = (x # a * comment\n+ z)", "x: f32[N] local, z: f32[M] local"),
     3, 5, "shapes do not broadcast"),
]


@pytest.mark.parametrize("source,line,col,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_location_and_message(source: str, line: int, col: int, fragment: str) -> None:
    err = errors_of(source)
    found = [(d.span.line, d.span.col, d.message) for d in err.diagnostics]
    assert any(d.span.line == line and d.span.col == col and fragment in d.message
               for d in err.diagnostics), f"wanted {line}:{col} '{fragment}', got {found}"


def test_largest_int64_dimension_is_accepted_for_bytes_that_fit() -> None:
    load_source("program p(x: i64[1152921504606846975] local) {\n    y = x\n}\n", "t.ccn")


def test_keywords_are_the_grammars() -> None:
    from coconetc.frontend.parser import keywords
    assert keywords() >= {"program", "schedule", "for", "return", "as"}


def test_case_ids_are_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 40


@pytest.mark.parametrize("params", ["x: f33[N] local", "x: f32[N] lokal", "x: f32[N, M] sliced(2)",
                                    "x: f32 local", "x: f32[N] local scatered"])
def test_a_bad_parameter_is_reported_once(params: str) -> None:
    """Regression: a parameter with a bad declaration also made every use 'unknown name'."""
    err = errors_of(P("y = x + 1\nz = y * x\nx1 = update(x, z)\nreturn z", params))
    assert [d.span.line for d in err.diagnostics] == [1], err.render()


def test_a_failed_stage_is_reported_once() -> None:
    err = errors_of(P("y = x + q\nz = y * 2\nw2 = z + y"))
    assert [(d.span.line, d.span.col) for d in err.diagnostics] == [(2, 13)], err.render()


def test_all_errors_of_a_file_at_once() -> None:
    source = src("""
        program a(x: f32[N] local, z: f32[M] local) {
            y = x + z
            u = y * 2
            v = allgather(x)
        }

        program b(g: f32[N] local, w: f32[N] replicated, lr: f32) {
            g1 = allreduce(sum, g)
            w1 = update(w, w - lr * g1)
        }

        program c(g: f32[N] local) {
            q = foo(g)
        }

        schedule s1 for b {
            rs, ag = split(w1)
        }

        schedule s2 for b {
            rs, ag = split(g1, dim=3)
        }

        schedule s3 for nope {
        }

        schedule s4 for a {
            rs, ag = split(y)
        }
    """)
    err = errors_of(source)
    assert [(d.span.line, d.span.col) for d in err.diagnostics] == [
        (2, 11),   # a: y = x + z, shapes (u, reading y, is not reported again)
        (4, 19),   # a: allgather of a local tensor
        (13, 9),   # c: unknown operation foo
        (17, 20),  # s1: split of a non-allreduce
        (21, 28),  # s2: dim out of range
        (24, 17),  # s3: unknown program   (s4 is for a program with errors: not reported)
    ], err.render()
    assert "unknown operation 'foo'" in err.diagnostics[2].message


def test_rendered_text() -> None:
    err = errors_of(P("y = x + z", "x: f32[N] local, z: f32[M] local") + S(SGD, "rs, ag = split(w1)"))
    assert str(err) == err.render() == (
        "t.ccn:2:11: error: shapes do not broadcast: [N] vs [M]\n"
        "        y = x + z\n"
        "              ^\n"
        "t.ccn:9:20: error: split on 'w1': only an allreduce can be split\n"
        "        rs, ag = split(w1)\n"
        "                       ^^"
    )


def test_rendered_caret_spans_the_token() -> None:
    err = errors_of(P("y = frobnicate(x)"))
    text = err.diagnostics[0].render()
    assert text.splitlines() == ["t.ccn:2:9: error: unknown operation 'frobnicate'",
                                 "        y = frobnicate(x)",
                                 "            ^^^^^^^^^^"]


def test_rendered_caret_under_tabs() -> None:
    """The caret line repeats the tabs of the source line, so it stays under the column."""
    err = errors_of("program p(x: f32[N] local) {\n\ty = z\n}\n")
    assert err.diagnostics[0].span.col == 6
    assert err.render().splitlines()[1:] == ["    \ty = z", "    \t    ^"]


@pytest.mark.parametrize("sep", ["\f", "\u2028", "\x0b", "\x1c"])
def test_rendered_line_is_the_lexers_line(sep: str) -> None:
    """Regression: render() used str.splitlines(), which also splits at form feeds, U+2028 etc.,
    so it quoted the wrong source line."""
    err = errors_of(f"# comment{sep}text\nprogram p(x: f32[N] local) {{\n    y = z\n}}\n")
    d = err.diagnostics[0]
    assert (d.span.line, d.span.col) == (3, 9)
    assert d.render().splitlines()[1] == "        y = z"


def test_crlf_source() -> None:
    err = errors_of("program p(x: f32[N] local) {\r\n    y = z\r\n}\r\n")
    d = err.diagnostics[0]
    assert (d.span.line, d.span.col) == (2, 9)
    assert d.render().splitlines()[1:] == ["        y = z", "            ^"]


def test_binary_operator_errors_point_at_the_operator_across_lines() -> None:
    err = errors_of(P("y = (x\n     *\n  z)", "x: f32[N] local, z: f32[M] local"))
    d = err.diagnostics[0]
    assert (d.span.line, d.span.col, d.span.end_col) == (3, 10, 11)


# ---- everything that should load, does ---------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path: Path) -> None:
    # the file's own path: extern_ops.ccn imports its reference module from beside it
    mod = load_source(path.read_text(), str(path))
    assert mod.programs


def test_the_languages_first_example_and_its_schedule_load() -> None:
    """The language's sgd program with its fused schedule, as written (tests/programs)."""
    path = PROGRAMS / "language_sgd.ccn"
    mod = load_source(path.read_text(), str(path))
    assert "fused" in mod.schedules["sgd"]


def test_the_languages_examples_load() -> None:
    """The examples that must work, each exactly as written (tests/programs): Adam with two
    schedules, LAMB, Megatron's row-parallel MLP output, a pipeline stage."""
    path = PROGRAMS / "language_examples.ccn"
    mod = load_source(path.read_text(), str(path))
    assert {"adam", "lamb", "mlp_out", "stage"} <= set(mod.programs)
    assert set(mod.schedules["adam"]) == {"rs_c_ag", "zero"}
    assert set(mod.schedules["mlp_out"]) == {"overlapped"}


def test_threads_parse_at_once_each_with_its_own_parser() -> None:
    """The parser's post-lexer keeps the state of the parse in progress (the brackets still
    open, for 'is never closed'), so each thread has its own parser: files loaded at once from
    a thread pool (tests/test_cpu_backend.py's builds) parsed as they are, and a syntax error
    in one thread names its own bracket."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from coconetc.frontend import parser
    other: list = []
    t = threading.Thread(target=lambda: other.append(parser._parser()))
    t.start()
    t.join()
    assert parser._parser() is parser._parser() and other[0] is not parser._parser()
    examples = Path(__file__).resolve().parents[1] / "examples"
    texts = [(f.read_text(), str(f)) for f in sorted(examples.glob("*.ccn"))]
    bad = "program p(x: f32[N] local) {\n    y = (x + 1\n}\n"

    def one(i: int):
        if i % 7 == 0:
            with pytest.raises(CompileError, match=r"'\(' is never closed \(found '\}' at line 3\)"):
                parser.parse(bad, "bad.ccn")
            return None
        return parser.parse(*texts[i % len(texts)]).programs
    with ThreadPoolExecutor(4) as pool:
        assert all(r is None or r for r in pool.map(one, range(8 * len(texts))))

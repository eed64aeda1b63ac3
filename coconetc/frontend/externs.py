"""`extern op` declarations -> operation registry entries (coconetc/ir/ops.py).

    extern op rmsnorm(x, w, eps) {
        type = x                              # the result: x's shape, dtype and layout
        slicing = rows                        # free | rows | dims(0, ...) | none
        reference = "rmsnorm_ref:rmsnorm"     # Python, on NumPy arrays (the interpreter's)
        cpp = "rmsnorm.h", "cclib::rmsnorm"   # header the module includes, function it calls
        cuda = "rmsnorm.cuh", "cclib::rmsnorm_cuda"
        grad_x = "..."                        # optional: operand x's derivative (gradexpr.py)
    }

The reference `module:function` is looked up first as `module.py` (dots: packages) in the
directory of the .ccn file, then on Python's path; `path/to/file.py:function` names a file
(relative to the .ccn file's directory). It is imported when the file is checked, so a
reference that does not exist is an error at its string."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from coconetc.errors import CompileError, Diagnostic
from coconetc.frontend import gradexpr, syntax
from coconetc.ir import ops
from coconetc.ir import typerules as tr

KEYS = ("type", "slicing", "reference", "cpp", "cuda")
SLICING_WORDS = {"free": ops.FREE, "rows": ops.ROWS, "dims": ops.DIMS, "none": ops.NEVER}


def declare(decl: syntax.ExternDecl, file: str, scope: dict[str, ops.OpDef] | None = None) -> ops.OpDef:
    """Check the declaration and register its operation (the file's own: ops.register_extern;
    SCOPE, the file's externs by name, which its derivatives call); raises CompileError (every
    error)."""
    errors: list[Diagnostic] = []
    settings: dict[str, syntax.Setting] = {}
    for s in decl.settings:
        if s.key not in KEYS and not s.key.startswith(gradexpr.PREFIX):
            errors.append(Diagnostic(s.key_span, f"unknown setting '{s.key}' of an extern operation "
                                     f"(one of {', '.join(KEYS)}, grad_<parameter>)"))
        elif s.key in settings:
            errors.append(Diagnostic(s.key_span, f"'{s.key}' is given twice"))
        else:
            settings[s.key] = s
    for key in ("type", "reference", "cpp"):
        if key not in settings and not errors:
            errors.append(Diagnostic(decl.name_span, f"extern operation '{decl.name}' needs "
                                     f"'{key} = ...'"))
    if errors:
        raise CompileError(errors)
    params = [p.id for p in decl.params]
    if len(set(params)) != len(params) or not params:
        raise CompileError.at(decl.name_span, f"extern operation '{decl.name}' needs distinct "
                              "parameters (at least one)")
    like = _like(settings["type"], params)
    slicing, dims = _slicing(settings.get("slicing"))
    fn, where = _reference(settings["reference"], file, decl.name)
    cpp, cuda = _impl(settings["cpp"]), _impl(settings.get("cuda"))
    # the derivatives: checked with the file's other declarations (gradexpr.check, from
    # defs.check_defs), kept as written
    grads = tuple((gradexpr.operand(k), s.values[0].text) for k, s in settings.items()
                  if gradexpr.operand(k) in params and len(s.values) == 1 and isinstance(s.values[0], syntax.String))
    ext = ops.Extern(like, _one_string(settings["reference"]).text, where, cpp, cuda,
                     _text(decl, like, slicing, dims, where, cpp, cuda, grads), file, grads)
    entry = ops.OpDef(decl.name, "tensor", tuple(ops.Arg(p) for p in params),
                      tr.extern_rule(like, slicing, dims), slicing, numpy=_checked(decl.name, fn, like),
                      fusable=False, slice_dims=dims, extern=ext,
                      doc=f"extern operation declared in {file}")
    try:
        return ops.register_extern(entry, scope)
    except ValueError as err:
        raise CompileError.at(decl.name_span, str(err)) from None


def _one_string(s: syntax.Setting) -> syntax.String:
    if len(s.values) != 1 or not isinstance(s.values[0], syntax.String):
        raise CompileError.at(s.span, f"'{s.key}' takes one string")
    return s.values[0]


def _like(s: syntax.Setting, params: list[str]) -> int:
    v = s.values[0]
    if len(s.values) != 1 or not isinstance(v, syntax.Word) or v.ints is not None or v.word not in params:
        raise CompileError.at(s.span, f"'type = p' names the parameter p whose shape and dtype the "
                              f"result has (one of {', '.join(params)})")
    return params.index(v.word)


def _slicing(s: syntax.Setting | None) -> tuple[str, tuple[int, ...]]:
    if s is None:
        return ops.NEVER, ()
    v = s.values[0]
    if len(s.values) != 1 or not isinstance(v, syntax.Word) or v.word not in SLICING_WORDS:
        raise CompileError.at(s.span, "slicing is one of free, rows, dims(d, ...), none")
    if (v.word == "dims") != (v.ints is not None):
        raise CompileError.at(v.span, "dims(d, ...) lists the dims a slice may cut; "
                              f"'{v.word}' takes no list")
    return SLICING_WORDS[v.word], tuple(v.ints or ())


def _impl(s: syntax.Setting | None) -> ops.Impl | None:
    if s is None:
        return None
    if len(s.values) != 2 or not all(isinstance(v, syntax.String) for v in s.values):
        raise CompileError.at(s.span, f"'{s.key} = \"header\", \"function\"': the header to "
                              "include and the function to call, two strings")
    header, function = (v.text for v in s.values if isinstance(v, syntax.String))
    if not header or not _c_name(function):
        raise CompileError.at(s.values[1].span, f"'{function}' is not a C++ function name")
    return ops.Impl(header, function)


def _c_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("::")) and bool(text)


def _reference(s: syntax.Setting, file: str, op: str) -> tuple[Callable[..., Any], str]:
    """The reference function and where it was found (a file path, or a module name). Text
    the printer wrote (no file of its own) finds it through the operation's entry."""
    lit = _one_string(s)
    old = ops.REGISTRY.get(op)
    if (old is not None and old.extern is not None and old.extern.reference == lit.text
            and not Path(file).exists() and old.numpy is not None):
        return getattr(old.numpy, "reference", old.numpy), old.extern.where
    module, _, name = lit.text.rpartition(":")
    if not module or not name.isidentifier():
        raise CompileError.at(lit.span, f"reference '{lit.text}' must be 'module:function' "
                              "(or 'path/file.py:function')")
    try:
        mod, where = _import(module, Path(file).parent)
    except Exception as err:  # noqa: BLE001  (a user's module may raise anything)
        raise CompileError.at(lit.span, f"cannot import the reference module '{module}': {err}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise CompileError.at(lit.span, f"the reference module '{module}' ({where}) has no function "
                              f"'{name}'")
    return fn, where


def _import(module: str, base: Path) -> tuple[Any, str]:
    path = Path(module) if module.endswith(".py") else Path(*module.split(".")).with_suffix(".py")
    found = path if path.is_absolute() else base / path
    if found.is_file():
        return _load_path(found.resolve()), str(found.resolve())
    if module.endswith(".py"):
        raise FileNotFoundError(f"no file {found}")
    return importlib.import_module(module), module


def _load_path(path: Path) -> Any:
    """A module from a file, imported once per process (keyed by its path)."""
    key = "coconet_ref_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[key]
        raise
    return mod


def _checked(name: str, fn: Callable[..., Any], like: int) -> Callable[..., Any]:
    """The reference, checked on every call: it must give an array of its model's shape."""
    def call(*args: Any) -> np.ndarray:
        """The reference, its result's shape checked."""
        out = np.asarray(fn(*args))
        want = np.shape(args[like])
        if out.shape != want:
            raise ValueError(f"the reference of {name} returned shape {out.shape}, not {want}")
        return out.astype(np.result_type(args[like]), copy=False)
    call.reference = fn  # type: ignore[attr-defined]
    return call


def _text(decl: syntax.ExternDecl, like: int, slicing: str, dims: tuple[int, ...], where: str,
          cpp: ops.Impl | None, cuda: ops.Impl | None, grads: tuple[tuple[str, str], ...] = ()) -> str:
    """The declaration as .ccn text (the printer's)."""
    word = {v: k for k, v in SLICING_WORDS.items()}[slicing]
    if slicing == ops.DIMS:
        word += f"({', '.join(map(str, dims))})"
    ref = _one_string(next(s for s in decl.settings if s.key == "reference")).text
    lines = [f"extern op {decl.name}({', '.join(p.id for p in decl.params)}) {{",
             f"    type = {decl.params[like].id}", f"    slicing = {word}", f'    reference = "{ref}"']
    for key, impl in (("cpp", cpp), ("cuda", cuda)):
        if impl is not None:
            lines.append(f'    {key} = "{impl.header}", "{impl.function}"')
    lines += [f'    {gradexpr.PREFIX}{p} = "{text}"' for p, text in grads]
    return "\n".join(lines) + "\n}\n"

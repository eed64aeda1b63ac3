"""The layers of coconetc/ and the rule between them: a module imports only modules of its own
layer or of layers below it, counting imports inside functions, and the shipping path
(codegen, toolchain, runtime) never imports the oracle (interp, oracle). docs/architecture.md
shows the picture; `python tests/test_layers.py` writes it again (docs/img/layers.dot, and
docs/img/layers.png where Graphviz's `dot` is installed)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "coconetc"

# bottom to top: (layer, its modules as prefixes, what it is)
LAYERS = [
    ("base", ("coconetc.version", "coconetc.errors", "coconetc.paths", "coconetc.cache"),
     "version, diagnostics, data files, the cache's folder and parsed files"),
    ("pipeline", ("coconetc.pipeline",), "pipeline orders: each rank's micro-batch actions, checked, simulated"),
    ("ir", ("coconetc.ir",), "typed IR, operation registry, the language's shared facts"),
    ("frontend", ("coconetc.frontend",), "parse and check .ccn text"),
    ("autodiff", ("coconetc.autodiff",), "derived programs: the vector-Jacobian program of a typed IR program"),
    ("schedule", ("coconetc.schedule",), "directives, each checked; IR verified after each"),
    ("plan", ("coconetc.plan",), "the execution plan: every decision, per target; its cost model"),
    ("sourcefile", ("coconetc.sourcefile",), "one checked file: programs, schedules, plans"),
    ("interp", ("coconetc.interp",), "the oracle: NumPy, R simulated ranks"),
    ("oracle", ("coconetc.oracle",), "random inputs, interpreted runs, comparison"),
    ("codegen", ("coconetc.codegen",), "render plans: cpu/ and cuda/ mirrored"),
    ("toolchain", ("coconetc.toolchain",), "CMake / nvcc / C++ compiler, the build cache"),
    ("runtime", ("coconetc.runtime",), "load, agree across ranks, call; CPU and CUDA"),
    ("api", ("coconetc",), "coconetc.load, coconetc.empty"),
    ("launch", ("coconetc.launch",), "mpiexec: start R ranks of a Python program"),
    ("tune", ("coconetc.tune",), "search space, tuner, explain"),
    ("jobs", ("coconetc.jobs",), "rank programs: run, tune, check against the oracle"),
    ("front", ("coconetc.torch", "coconetc.cli"), "PyTorch adoption, the command line"),
]
ORACLE = {"interp", "oracle"}
SHIPPING = {"codegen", "toolchain", "runtime"}


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def layer_of(module: str) -> int:
    best, index = -1, -1
    for i, (_, prefixes, _) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, index = len(p), i
    assert index >= 0, f"{module} is in no layer: add it to LAYERS"
    return index


def imports() -> dict[str, set[str]]:
    """module -> the coconetc modules it imports (module level and inside functions)."""
    mods = modules()

    def resolve(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                if t == "coconetc" or t.startswith("coconetc."):
                    r = resolve(t)
                    if r != m:
                        edges[m].add(r)
    return edges


def test_every_module_is_in_a_layer():
    for m in modules():
        layer_of(m)


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
           for m, ts in imports().items() for t in sorted(ts) if layer_of(t) > layer_of(m)]
    assert not bad, "\n".join(bad)


def test_the_shipping_path_never_imports_the_oracle():
    bad = [f"{m} imports {t}" for m, ts in imports().items() for t in sorted(ts)
           if LAYERS[layer_of(m)][0] in SHIPPING and LAYERS[layer_of(t)][0] in ORACLE]
    assert not bad, "\n".join(bad)


def test_no_import_loops():
    edges = imports()
    seen: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for t in sorted(edges[m]):
            assert seen.get(t) != 1, "import loop: " + " -> ".join([*path[path.index(t):], t])
            if t not in seen:
                visit(t, [*path, t])
        seen[m] = 2

    for m in sorted(edges):
        if m not in seen:
            visit(m, [m])


def picture(out: Path) -> None:
    """docs/img/layers.dot: the layers, top to bottom, an arrow where one imports another (only
    the arrows no longer path implies: the transitive reduction)."""
    edges = imports()
    used = {(layer_of(m), layer_of(t)) for m, ts in edges.items() for t in ts if layer_of(m) != layer_of(t)}

    def reaches(a: int, b: int, skip: tuple[int, int]) -> bool:
        todo, seen = [a], {a}
        while todo:
            x = todo.pop()
            for e in used - {skip}:
                if e[0] == x and e[1] not in seen:
                    if e[1] == b:
                        return True
                    seen.add(e[1])
                    todo.append(e[1])
        return False

    kept = sorted(e for e in used if not reaches(e[0], e[1], e))
    lines = ["digraph layers {", "  rankdir=TB; node [shape=box, fontname=Helvetica, fontsize=11];",
             "  edge [color=gray40, arrowsize=0.6];"]
    for i, (name, prefixes, what) in enumerate(LAYERS):
        mods = ", ".join(p.removeprefix("coconetc.") for p in prefixes)
        label = f"{name}\\n{what}" if mods == name else f"{name}: {mods}\\n{what}"
        color = ', style=filled, fillcolor="#fde8c8"' if name in ORACLE else ""
        lines.append(f'  L{i} [label="{label}"{color}];')
    lines += [f"  L{a} -> L{b};" for a, b in kept]
    lines.append("}")
    out.write_text("\n".join(lines) + "\n")
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tpng", "-Gdpi=72", str(out), "-o", str(out.with_suffix(".png"))], check=True)


if __name__ == "__main__":
    picture(Path(sys.argv[1]) if len(sys.argv) > 1 else PKG.parent / "docs" / "img" / "layers.dot")

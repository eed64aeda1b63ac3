"""The toolchain (coconetc/toolchain/): one compile(source_file, backend, options) for every
backend, taking a parsed file; paths made absolute once; cached modules verified by their
manifest before they are loaded (a partial or corrupt one is built again) and written
atomically, so that ranks building at once never see half a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from coconetc import toolchain
from coconetc.sourcefile import load_source
from coconetc.toolchain import artifacts, probes

REPO = Path(__file__).resolve().parent.parent

SCALE = """program scale(x: f32[N] local, a: f32) {{
    y = update(x, x * a + {k})
}}
"""


def _program(tmp: Path, name: str, k: float) -> Path:
    path = tmp / f"{name}.ccn"
    path.write_text(SCALE.format(k=k))
    return path


# ---- naming and options -----------------------------------------------------------------------
def test_module_stem_is_one_identifier() -> None:
    assert toolchain.module_stem("dir/my-model.v2.ccn") == "my_model_v2"
    assert toolchain.module_stem(Path("adam.ccn")) == "adam"


def test_options_paths_are_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    o = toolchain.Options(out_dir="out/", include_dirs=["inc"], library_dirs=["lib"], libraries=["m"])
    assert o.out_dir == tmp_path / "out"
    assert o.include_dirs == (str(tmp_path / "inc"),) and o.library_dirs == (str(tmp_path / "lib"),)
    assert o.libraries == ("m",)


def test_compile_takes_the_parsed_file() -> None:
    """No second parse: the file need not exist (it is never read again)."""
    mod = load_source(SCALE.format(k=1.0), "nowhere/scale.ccn")
    art = toolchain.compile(mod, "cpu", toolchain.Options(build=False))
    assert art.source_file is mod and art.path is None
    assert art.module == "ccn_scale" and "ccn_scale" in art.sources.cpp
    named = toolchain.compile(mod, "cuda", toolchain.Options(build=False, name="m1"))
    assert named.module == "m1" and "m1" in named.sources.cu
    with pytest.raises(ValueError, match="backend must be one of"):
        toolchain.compile(mod, "fpga")
    with pytest.raises(ValueError, match="name goes with build=False"):
        toolchain.compile(mod, "cpu", toolchain.Options(name="m1"))


@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_the_blas_is_mkl_on_intel_where_installed_and_chosen_by_coconet_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    """MKL's libraries (and gemm.h's macro for them) on an Intel CPU where its wheel is installed,
    OpenBLAS's on an AMD CPU and with COCONET_BLAS=openblas, MKL's with COCONET_BLAS=mkl whatever
    the CPU; another value is refused, naming the variable and its values."""
    monkeypatch.setenv(probes.ENV_BLAS, "openblas")
    libs, defines = probes.blas_libraries()
    assert defines == () and len(libs) == 1 and "openblas" in Path(libs[0]).name
    monkeypatch.setenv(probes.ENV_BLAS, "atlas")
    with pytest.raises(probes.BuildError, match="COCONET_BLAS='atlas': expected 'mkl' or 'openblas'"):
        probes.blas_libraries()
    monkeypatch.delenv(probes.ENV_BLAS)
    monkeypatch.setattr(probes, "cpu_vendor", lambda: "AuthenticAMD")
    libs, defines = probes.blas_libraries()
    assert defines == () and "openblas" in Path(libs[0]).name
    monkeypatch.setattr(probes, "cpu_vendor", lambda: "GenuineIntel")
    intel = probes.blas_libraries()
    if not probes.mkl_libs():
        assert intel[1] == () and "openblas" in Path(intel[0][0]).name
        monkeypatch.setenv(probes.ENV_BLAS, "mkl")
        with pytest.raises(probes.BuildError, match="MKL's wheel is not installed"):
            probes.blas_libraries()
        return
    monkeypatch.setenv(probes.ENV_BLAS, "mkl")
    monkeypatch.setattr(probes, "cpu_vendor", lambda: "AuthenticAMD")
    for libs, defines in (intel, probes.blas_libraries()):  # unset on Intel; COCONET_BLAS=mkl on AMD
        assert defines == ("COCONET_BLAS_MKL",)
        assert [Path(x).name.split(".so")[0] for x in libs[:3]] == list(probes.MKL_LIBS) and libs[3] == "-lgomp"


def test_cuda_architectures_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build that names no architectures takes COCONET_CUDA_ARCHS (as PyTorch's
    TORCH_CUDA_ARCH_LIST), else 80;90; named ones win."""
    mod = load_source(SCALE.format(k=1.0), "nowhere/scale.ccn")

    def archs(**kw) -> str:
        cmake = toolchain.compile(mod, "cuda", toolchain.Options(build=False, **kw)).sources.cmake
        return next(ln for ln in cmake.splitlines() if "set(CMAKE_CUDA_ARCHITECTURES" in ln)
    monkeypatch.delenv("COCONET_CUDA_ARCHS", raising=False)
    assert '80;90' in archs()
    monkeypatch.setenv("COCONET_CUDA_ARCHS", "90")
    assert '90' in archs() and '80' not in archs()
    assert '86' in archs(archs='86')


# ---- the artifact cache, without a compiler ---------------------------------------------------
def _fake_run(calls: list):
    def run(src: Path, build: Path, log) -> None:
        calls.append(build)
        (build / "m.cpython-x.so").write_bytes(b"\x7fELF" + b"x" * 1000)
    return run


def test_manifest_is_written_last_and_checked(tmp_path: Path) -> None:
    calls: list = []
    out = tmp_path / "m"
    so = artifacts.build("m", {"module.cpp": "text"}, out, _fake_run(calls))
    assert so == out / "build" / "m.cpython-x.so" and len(calls) == 1
    manifest = json.loads((out / artifacts.MANIFEST).read_text())
    assert manifest["size"] == 1004 and manifest["module"] == "m"
    assert not list(out.glob(".build-*")), "the temporary build folder is removed"
    assert artifacts.build("m", {"module.cpp": "text"}, out, _fake_run(calls)) == so and len(calls) == 1
    # truncated, or the same size with other bytes: built again
    so.write_bytes(so.read_bytes()[:100])
    assert artifacts.verified(out, "m") is None
    artifacts.build("m", {"module.cpp": "text"}, out, _fake_run(calls))
    assert len(calls) == 2 and artifacts.verified(out, "m") == so
    so.write_bytes(b"\x7fELF" + b"y" * 1000)
    assert artifacts.verified(out, "m") is None


def test_manifest_covers_the_units(tmp_path: Path) -> None:
    """The shared objects of a module's units (in the objects cache, listed by the build in
    UNITS_FILE) are in its manifest: one edited or deleted makes the module unverified, and the
    next build removes an edited one first, so that the build makes it again."""
    unit = tmp_path / "objects" / "unit-k.so"
    calls: list = []

    def run(src: Path, build: Path, log) -> None:
        calls.append(build)
        (build / "m.so").write_bytes(b"\x7fELF" + b"x" * 1000)
        if not unit.exists():  # as cached_object: made only when it is not there
            unit.parent.mkdir(exist_ok=True)
            unit.write_bytes(b"unit" * 100)
        (build / artifacts.UNITS_FILE).write_text(f"{unit}\n")

    out = tmp_path / "m"
    so = artifacts.build("m", {"module.cpp": "text"}, out, run)
    [rec] = json.loads((out / artifacts.MANIFEST).read_text())["units"]
    assert rec["path"] == str(unit) and rec["size"] == 400 and artifacts.verified(out, "m") == so
    unit.write_bytes(b"unit" * 99 + b"tinu")  # the same size, other bytes
    assert artifacts.verified(out, "m") is None
    assert artifacts.build("m", {"module.cpp": "text"}, out, run) == so and len(calls) == 2
    assert unit.read_bytes() == b"unit" * 100, "the edited unit was removed and made again"
    unit.unlink()
    assert artifacts.verified(out, "m") is None
    artifacts.build("m", {"module.cpp": "text"}, out, run)
    assert len(calls) == 3 and unit.exists() and artifacts.verified(out, "m") == so


def test_a_cached_object_is_reused_only_while_it_matches_its_record(tmp_path: Path) -> None:
    """What every build reuses from the objects cache (a unit's shared object, the bindings'
    objects, the runtime library, the precompiled header: cached_object) is compiled
    again when it is truncated, edited to the same size, or has no record (a build killed
    between the object and its record, a cache from before records)."""
    calls: list[str] = []

    def compile_(src: Path, obj: Path) -> None:
        calls.append(src.read_text())
        obj.write_bytes(b"\x7fELF" + src.read_text().encode() * 100)

    def get() -> Path:
        return artifacts.cached_object(tmp_path, "k", ".cpp", "text", compile_, product=".so")

    obj = get()
    assert obj == tmp_path / "k.so" and len(calls) == 1 and obj.stat().st_size == 404
    assert get() == obj and len(calls) == 1  # reused
    with open(obj, "r+b") as f:
        f.truncate(100)
    assert get() == obj and len(calls) == 2 and obj.stat().st_size == 404
    obj.write_bytes(b"\x7fELF" + b"txet" * 100)  # the same size, other bytes
    get()
    assert len(calls) == 3 and obj.read_bytes().endswith(b"text")
    (tmp_path / "k.so.sum").unlink()
    get()
    assert len(calls) == 4 and get() == obj and len(calls) == 4


def test_a_killed_builds_folder_is_swept(tmp_path: Path) -> None:
    out = tmp_path / "m"
    old, new = out / ".build-old", out / ".build-new"
    old.mkdir(parents=True)
    new.mkdir()
    os.utime(old, (0, 0))
    artifacts.build("m", {"module.cpp": "text"}, out, _fake_run([]))
    assert not old.exists() and new.exists()  # a recent one may be another node's build


def test_a_failed_build_leaves_no_module(tmp_path: Path) -> None:
    def fails(src: Path, build: Path, log) -> None:
        (build / "m.so").write_bytes(b"half")
        raise probes.BuildError("compiler died")

    out = tmp_path / "m"
    with pytest.raises(probes.BuildError, match="compiler died"):
        artifacts.build("m", {"module.cpp": "text"}, out, fails)
    assert artifacts.verified(out, "m") is None and not (out / "build").exists()
    assert not list(out.glob(".build-*"))


# ---- real builds ------------------------------------------------------------------------------
LOAD = textwrap.dedent("""
    import sys
    import numpy as np
    import coconetc
    said = []
    mod = coconetc.load(sys.argv[1], log=said.append)
    x = np.ones(5, np.float32)
    mod.scale(x=x, a=2.0)
    assert np.allclose(x, 2.0 + float(sys.argv[2])), x
    print("BUILT" if any(m.startswith("coconetc: linking") for m in said) else "CACHED", flush=True)
""")


def _load(path: Path, k: float, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD, str(path), str(k)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out.strip()


@pytest.fixture
def cache_env() -> dict:
    """The session's build cache (tests/conftest.py), whose once-per-machine runtime is built
    already: the programs below are new to it by their names (_fresh), not by a new cache."""
    if probes.missing_cpu_extra():
        pytest.skip("no cpu extra")
    return dict(os.environ)


def _fresh(name: str) -> str:
    """NAME made unique to this run, so that its module is not in the session's cache yet."""
    return f"{name}_{uuid.uuid4().hex[:12]}"


HEAL = textwrap.dedent("""
    import sys
    import numpy as np
    import coconetc
    said = []
    mod = coconetc.load(sys.argv[1], log=said.append)
    for schedule in mod.sgd_heal.schedules:
        g, w = np.arange(6, dtype=np.float32), np.ones(6, dtype=np.float32)
        mod.sgd_heal(g=g, w=w, lr=np.float32(0.5), schedule=schedule)
        assert np.allclose(w, 1 - 0.5 * np.arange(6)), w
    print("BUILT" if said else "CACHED")
""")

HEALED = {"shared objects (module, units, runtime library)": (".so",), "objects (the Python binding)": (".o",),
          "precompiled header": (".gch",)}


@pytest.fixture(scope="module")
def sgd_cache(tmp_path_factory) -> tuple[Path, Path]:
    """(a build cache of its own, examples/sgd.ccn built into it): the test below truncates what is in it, so no other test loads from it (a cache cannot be
    copied: its manifests and records name their files by absolute paths)."""
    if probes.missing_cpu_extra():
        pytest.skip("no cpu extra")
    root = tmp_path_factory.mktemp("heal")
    cache, first = root / "cache", root / "sgd.ccn"
    first.write_text((REPO / "examples" / "sgd.ccn").read_text().replace("sgd", "sgd_heal"))
    assert _heal(cache, first) == "BUILT"
    return cache, first


def _heal(cache: Path, file: Path) -> str:
    env = {**os.environ, probes.ENV_CACHE: str(cache)}
    res = subprocess.run([sys.executable, "-c", HEAL, str(file)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("kind", HEALED)
def test_the_cache_heals_every_artifact_it_reuses(sgd_cache, kind: str) -> None:
    """For each kind of cached file (a test each, on the one cache), every one truncated to 100
    bytes, and the module's .so with them (so that the load builds the module again, reusing
    what the objects cache holds: the units' shared objects, the binding's object, the runtime
    library, the precompiled header): the next load builds again what it needs and
    runs, every truncated file is whole again, and the load after it builds nothing. (The
    runtime library's truncated copy used to be linked as found: `file too short`.)"""
    cache, first = sgd_cache
    [module] = cache.glob("ccn_sgd_*/build/*.so")
    cut = [p for p in cache.rglob("*") if p.is_file() and p.suffix in HEALED[kind]]
    assert cut, f"no {kind} in the cache"
    for p in {*cut, module}:
        with open(p, "r+b") as f:
            f.truncate(100)
    assert _heal(cache, first) == "BUILT", kind
    assert all(p.stat().st_size > 100 for p in cut), (kind, [p for p in cut if p.stat().st_size <= 100])
    assert _heal(cache, first) == "CACHED"  # healed once, then reused


LAZY = textwrap.dedent("""
    import json, subprocess, sys
    import numpy as np
    import coconetc

    def mapped(what):
        return sorted({line.split()[-1] for line in open("/proc/self/maps") if what in line})

    mod = coconetc.load(sys.argv[1], log=lambda m: None)
    out = {"import": mapped("/unit-"), "runtime": mapped("/libccnrt-")}
    rng = np.random.default_rng(1)
    n = 1000
    g, w = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m, v = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    ref = [x.astype(np.float64) for x in (g, w, m, v)]
    for step in (1.0, 2.0):
        mod.adam(g=g, w=w, m=m, v=v, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6, step=step, schedule=sys.argv[2])
        rg, rw, rm, rv = ref
        rm = 0.9 * rm + 0.1 * rg
        rv = 0.99 * rv + 0.01 * rg * rg
        rw = rw - 0.01 * (rm / (1 - 0.9 ** step)) / (np.sqrt(rv / (1 - 0.99 ** step)) + 1e-6)
        ref = [rg, rw, rm, rv]
    out["call"] = mapped("/unit-")
    out["runtime_after"] = mapped("/libccnrt-")
    out["ext"] = sorted(mod.ext._units())
    out["symbols"] = subprocess.run(["nm", "-D", "--defined-only", out["call"][0]], capture_output=True,
                                    text=True, check=True).stdout if out["call"] else ""
    out["error"] = max(float(np.abs(x - r).max()) for x, r in zip((w, m, v), ref[1:]))
    print(json.dumps(out))
""")


def test_a_call_maps_only_its_unit(cache_env: dict) -> None:
    """Importing a module of several schedules maps none of its units' shared objects (nor
    builds anything: examples/adam.ccn is in the session's cache); a call maps exactly the one
    its schedule runs (the schedule's function is in it), from the module's manifest, beside
    the one runtime library every unit links; and it computes Adam (NumPy, in f64)."""
    adam = REPO / "examples" / "adam.ccn"
    toolchain.compile(load_source(adam.read_text(), str(adam)), "cpu")  # (built once per session)
    res = subprocess.run([sys.executable, "-c", LAZY, str(adam), "zero"], env=cache_env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["import"] == [], "importing the module maps no unit"
    assert len(out["call"]) == 1 and out["ext"] == out["call"], out
    assert " T coconet_unit_adam__zero" in out["symbols"] and "adam__default" not in out["symbols"]
    [folder] = {Path(p).parent for p in [*out["call"], *out["runtime"]]}
    assert len(out["runtime"]) == 1 and out["runtime_after"] == out["runtime"], "one runtime library"
    assert folder.name == "objects"
    manifests = [json.loads(m.read_text()) for m in Path(cache_env[probes.ENV_CACHE]).glob("ccn_adam_*/manifest.json")]
    assert any(out["call"][0] in [u["path"] for u in m.get("units", [])] and len(m.get("units", [])) == 4
               for m in manifests)  # (a module built before lazy loading, in a cache kept, lists none)
    assert out["error"] < 1e-5, out["error"]


UNIT_GONE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    import coconetc
    mod = coconetc.load(sys.argv[1], log=lambda m: None)
    [manifest] = Path(sys.argv[2]).glob(f"ccn_{Path(sys.argv[1]).stem}_*/manifest.json")
    [unit] = [u["path"] for u in json.loads(manifest.read_text())["units"]]
    Path(unit).unlink()
    try:
        mod.scale(x=np.ones(5, np.float32), a=2.0)
    except RuntimeError as e:
        print(json.dumps({"unit": unit, "error": str(e)}))
""")


@pytest.mark.slow
def test_a_missing_unit_raises_on_its_call_and_is_rebuilt(tmp_path: Path, cache_env: dict) -> None:
    """A unit's shared object deleted after the module was loaded: its call raises RuntimeError
    naming the file; the next load finds the module unverified and builds it again (the unit
    linked again from its cached object), and the call runs."""
    name = _fresh("gone")
    path = _program(tmp_path, name, 1.0)
    res = subprocess.run([sys.executable, "-c", UNIT_GONE, str(path), cache_env[probes.ENV_CACHE]], env=cache_env,
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["unit"] in out["error"] and "scale__default" in out["error"], out
    assert _done(_load(path, 1.0, cache_env)) == "BUILT" and Path(out["unit"]).exists()


@pytest.mark.slow
def test_two_processes_building_at_once(tmp_path: Path, cache_env: dict) -> None:
    """Two processes (two ranks) load the same new module at once: one builds, the other
    waits and loads the whole module it built."""
    path = _program(tmp_path, _fresh("both"), 3.0)
    procs = [_load(path, 3.0, cache_env) for _ in range(2)]
    assert sorted(_done(p) for p in procs) == ["BUILT", "CACHED"]


@pytest.mark.slow
def test_cuda_compile_with_a_relative_output_folder(tmp_path: Path) -> None:
    """`coconetc compile FILE --backend cuda -o out/` from the file's folder (docs/cuda.md): the
    module is built in out/ and found there (the binding compiled once per machine comes from
    the build cache)."""
    why = probes.cuda_missing()
    if why:
        pytest.skip(why)
    (tmp_path / "sgd.ccn").write_text((REPO / "examples" / "sgd.ccn").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    exe = Path(sys.executable).parent / "coconetc"
    res = subprocess.run([str(exe), "compile", "sgd.ccn", "--backend", "cuda",
                          "--arch", "90", "-o", "out/"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert "built " in res.stdout and list((tmp_path / "out" / "build").glob("ccn_cuda_sgd_*.so"))
    assert artifacts.verified(tmp_path / "out", next((tmp_path / "out" / "build").glob("*.so")).name.split(".")[0])


def test_cxxflags_reach_the_compile_line_and_every_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CXXFLAGS (as CMake reads it) goes last on the CPU compile line, so its -O wins, and into
    the module's key and the warm-load record's key, so no module built with other flags is
    reused."""
    from coconetc.runtime import warm
    from coconetc.toolchain import commands, compiler
    if probes.missing_cpu_extra():
        pytest.skip("needs the 'cpu' extra")
    monkeypatch.setenv("CXXFLAGS", "-O1 -g0")
    assert commands._cpu_flags()[-2:] == ["-O1", "-g0"]
    keys = [compiler._compiler("cpu", toolchain.Options()), warm.key(tmp_path / "a.ccn", "t", "", ())]
    monkeypatch.setenv("CXXFLAGS", "-O2")
    assert commands._cpu_flags()[-1] == "-O2"
    assert compiler._compiler("cpu", toolchain.Options()) != keys[0]
    assert warm.key(tmp_path / "a.ccn", "t", "", ()) != keys[1]


def test_an_objects_key_holds_the_runtime_files_it_includes_and_no_other(tmp_path: Path) -> None:
    """A CPU unit's key (through coconet/module.h) and an emulated module's (through
    coconet/cuda/runtime.cuh and the binding) hash the runtime files they include, found as the
    compiler finds them: an edit of a CUDA header keeps every CPU unit, an edit of a header only
    the CPU runtime includes keeps every emulated module, an edit of one both include changes
    both, and an edit of a header nobody includes changes neither."""
    import shutil

    from coconetc.paths import runtime_dir
    from coconetc.toolchain import commands, compiler
    rt = tmp_path / "runtime"
    shutil.copytree(runtime_dir(), rt)
    unit = commands.UNIT_HEADER + '\n#include "coconet/gemm.h"  // twice: counted once\n'

    def keys() -> tuple[str, str]:
        return probes.headers_key(unit, runtime=rt), probes.headers_key(compiler.EMULATED_INCLUDES, runtime=rt)

    names = {f.relative_to(rt).as_posix() for f in probes.included(unit, runtime=rt)}
    assert {"coconet/module.h", "coconet/gemm.h", "coconet/state.h"} <= names, names
    assert not [n for n in names if n.startswith("coconet/cuda/")], names
    emulated = {f.relative_to(rt).as_posix() for f in probes.included(compiler.EMULATED_INCLUDES, runtime=rt)}
    assert {"coconet/cuda/emulate.h", "coconet/cuda/bind.cu", "coconet/gemm.h"} <= emulated, emulated
    assert "coconet/fused_shm.h" in names and "coconet/fused_shm.h" not in emulated
    before = keys()
    for header, changes in [("coconet/cuda/emulate.h", (False, True)), ("coconet/fused_shm.h", (True, False)),
                            ("coconet/gemm.h", (True, True)), ("coconet/nobody_includes.h", (False, False))]:
        path = rt / header
        path.write_text((path.read_text() if path.exists() else "") + "\n// edited\n")
        after = keys()
        assert (after[0] != before[0], after[1] != before[1]) == changes, header
        before = after

"""The counter-based dropout RNG: NumPy reference vs. known answers and vs. the C++ header."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from coconetc.interp import rng

REPO = Path(__file__).resolve().parents[1]
RUNTIME_INCLUDE = REPO / "runtime_cpp"


def _words(out: tuple[np.ndarray, ...]) -> list[int]:
    return [int(w) for w in out]


# ---------------------------------------------------------------------------------------------
# (a) Random123 known-answer vectors (kat_vectors, philox4x32_10)

KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("ctr", "key", "expected"), KAT)
def test_philox_known_answers(ctr, key, expected):
    out = rng.philox4x32(*ctr, *key)
    assert all(w.dtype == np.uint32 for w in out)
    assert _words(out) == list(expected)


def test_philox_broadcasts_and_matches_scalar_calls():
    c0 = np.arange(5, dtype=np.uint32).reshape(5, 1)
    k0 = np.array([0, 7, 0xFFFFFFFF], dtype=np.uint32)
    out = rng.philox4x32(c0, 1, 2, 3, k0, 9)
    assert all(w.shape == (5, 3) for w in out)
    for i in range(5):
        for j in range(3):
            scalar = rng.philox4x32(i, 1, 2, 3, int(k0[j]), 9)
            assert [int(w[i, j]) for w in out] == _words(scalar)


# ---------------------------------------------------------------------------------------------
# (d) site_key is 32-bit FNV-1a of UTF-8


def _fnv1a_reference(data: bytes) -> int:
    h = 2166136261
    for b in data:
        h ^= b
        h = (h * 16777619) % (1 << 32)
    return h


@pytest.mark.parametrize(
    ("name", "expected"),
    [("", 0x811C9DC5), ("a", 0xE40C292C), ("foobar", 0xBF9CF968)],
)
def test_site_key_fnv1a_vectors(name, expected):
    assert rng.site_key(name) == expected


@pytest.mark.parametrize("name", ["layer0.attn.dropout", "héllo/ドロップ", "x" * 1000])
def test_site_key_matches_independent_fnv1a(name):
    assert rng.site_key(name) == _fnv1a_reference(name.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# threshold and keep-mask API


def test_dropout_threshold():
    assert rng.dropout_threshold(0.0) == 0
    assert rng.dropout_threshold(-0.5) == 0
    assert rng.dropout_threshold(1.0) == 1 << 24
    assert rng.dropout_threshold(7.0) == 1 << 24
    assert rng.dropout_threshold(0.5) == 1 << 23
    assert rng.dropout_threshold(0.1) == 1677721
    assert rng.dropout_threshold(np.nextafter(1.0, 0.0)) == (1 << 24) - 1
    assert rng.dropout_threshold(5e-324) == 0
    with pytest.raises(ValueError):
        rng.dropout_threshold(float("nan"))


def test_dropout_keep_shape_dtypes_and_definition():
    seed, key, p = -3, rng.site_key("blk.dropout"), 0.3
    idx = np.arange(24, dtype=np.int64).reshape(2, 3, 4) + (1 << 32) - 10
    keep = rng.dropout_keep(seed, key, idx, p)
    assert keep.shape == (2, 3, 4) and keep.dtype == np.bool_
    # Index dtype does not matter; only the value does.
    np.testing.assert_array_equal(keep, rng.dropout_keep(seed, key, idx.astype(np.uint64), p))
    # The definition, spelled out.
    s = seed % (1 << 64)
    u = idx.astype(np.uint64)
    out0 = rng.philox4x32(u & 0xFFFFFFFF, u >> 32, key, 0, s & 0xFFFFFFFF, s >> 32)[0]
    np.testing.assert_array_equal(keep, (out0 >> 8) >= rng.dropout_threshold(p))
    assert rng.dropout_keep(seed, key, 5, p).shape == ()


# ---------------------------------------------------------------------------------------------
# (c) statistical sanity


def test_dropout_keep_statistics():
    idx = np.arange(10**6, dtype=np.uint64)
    key = rng.site_key("stats")
    frac = rng.dropout_keep(12345, key, idx, 0.1).mean()
    assert abs(frac - 0.9) < 0.002
    assert rng.dropout_keep(12345, key, idx, 0.0).all()
    assert not rng.dropout_keep(12345, key, idx, 1.0).any()
    # Different seeds / sites give (nearly) independent masks: agreement ~ 0.5^2 + 0.5^2.
    a = rng.dropout_keep(1, key, idx, 0.5)
    b = rng.dropout_keep(2, key, idx, 0.5)
    c = rng.dropout_keep(1, rng.site_key("stats2"), idx, 0.5)
    assert abs((a == b).mean() - 0.5) < 0.005
    assert abs((a == c).mean() - 0.5) < 0.005


def test_dropout_keep_is_fast_enough():
    import time

    idx = np.arange(1 << 22, dtype=np.uint64)
    t0 = time.perf_counter()
    rng.dropout_keep(7, rng.site_key("perf"), idx, 0.1)
    assert time.perf_counter() - t0 < 2.0  # typically ~0.1 s; generous for loaded CI boxes


# ---------------------------------------------------------------------------------------------
# (b) bit-identical to runtime_cpp/coconet/rng.h on the host

CPP_PROGRAM = r"""
#include <coconet/rng.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

static_assert(coconet::site_key("") == 0x811c9dc5u, "fnv1a('')");
static_assert(coconet::site_key("a") == 0xe40c292cu, "fnv1a('a')");
static_assert(coconet::site_key("foobar") == 0xbf9cf968u, "fnv1a('foobar')");

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  FILE* f = std::fopen(argv[1], "r");
  if (!f) return 3;
  char tag;
  while (std::fscanf(f, " %c", &tag) == 1) {
    if (tag == 'P') {  // raw Philox: c0 c1 c2 c3 k0 k1
      unsigned long long a[6];
      if (std::fscanf(f, "%llu %llu %llu %llu %llu %llu", &a[0], &a[1], &a[2], &a[3], &a[4],
                      &a[5]) != 6) return 4;
      const coconet::Philox4 r = coconet::philox4x32(
          (uint32_t)a[0], (uint32_t)a[1], (uint32_t)a[2], (uint32_t)a[3], (uint32_t)a[4],
          (uint32_t)a[5]);
      std::printf("%u %u %u %u\n", r.v[0], r.v[1], r.v[2], r.v[3]);
    } else if (tag == 'D') {  // dropout: seed(int64) site(uint32) idx(uint64) p(double)
      long long seed;
      unsigned long long site, idx;
      char pbuf[64];
      if (std::fscanf(f, "%lld %llu %llu %63s", &seed, &site, &idx, pbuf) != 4) return 5;
      const double p = std::strtod(pbuf, nullptr);
      const uint64_t useed = (uint64_t)seed;
      const uint32_t thr = coconet::dropout_threshold(p);
      const coconet::Philox4 r = coconet::philox4x32(
          (uint32_t)idx, (uint32_t)(idx >> 32), (uint32_t)site, 0u, (uint32_t)useed,
          (uint32_t)(useed >> 32));
      const bool keep = coconet::dropout_keep(useed, (uint32_t)site, (uint64_t)idx, thr);
      std::printf("%u %u %u %u %u %d\n", r.v[0], r.v[1], r.v[2], r.v[3], thr, keep ? 1 : 0);
    } else if (tag == 'S') {  // site_key of hex-encoded UTF-8 bytes ('-' = empty)
      char hex[512];
      if (std::fscanf(f, "%511s", hex) != 1) return 6;
      std::string bytes;
      if (std::strcmp(hex, "-") != 0) {
        for (size_t i = 0; hex[i] && hex[i + 1]; i += 2) {
          const char two[3] = {hex[i], hex[i + 1], 0};
          bytes.push_back((char)std::strtoul(two, nullptr, 16));
        }
      }
      const uint32_t k1 = coconet::site_key(bytes.c_str());
      const uint32_t k2 = coconet::site_key(bytes.data(), bytes.size());
      std::printf("%u %u\n", k1, k2);
    } else {
      return 7;
    }
  }
  std::fclose(f);
  return 0;
}
"""


def _dropout_cases(n: int) -> list[tuple[int, int, int, float]]:
    g = np.random.default_rng(20240601)
    seeds = [0, 1, -1, -(1 << 63), (1 << 63) - 1, 0x123456789ABCDEF, -987654321]
    seeds += [int(s) for s in g.integers(-(1 << 63), (1 << 63) - 1, size=6, dtype=np.int64)]
    sites = [0, 0xFFFFFFFF, rng.site_key("layer0.dropout"), rng.site_key("héllo")]
    sites += [int(s) for s in g.integers(0, 1 << 32, size=4, dtype=np.uint64)]
    idxs = [0, 1, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, (1 << 64) - 1, 0xDEADBEEFCAFEF00D]
    ps = [0.0, 1.0, -0.25, 1.5, 0.1, 0.5, 0.9, 1e-9, float(np.nextafter(1.0, 0.0)), 5e-324]
    cases = []
    for i in range(n):
        seed = seeds[i % len(seeds)] if i < 3 * len(seeds) else int(g.choice(seeds))
        site = sites[i % len(sites)] if i < 3 * len(sites) else int(g.choice(sites))
        if i < len(idxs):
            idx = idxs[i]
        elif i % 3 == 0:
            idx = int(g.integers(0, 1 << 20))
        elif i % 3 == 1:
            idx = int(g.integers(1 << 32, 1 << 40))
        else:
            idx = int(g.integers(0, 1 << 64, dtype=np.uint64))
        p = ps[i % len(ps)] if i % 4 == 0 else float(g.random())
        cases.append((seed, site, idx, p))
    return cases


@pytest.fixture(scope="module")
def cpp_rng_exe(tmp_path_factory) -> Path:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found on PATH: cannot check the C++ header against NumPy")
    d = tmp_path_factory.mktemp("rng_cpp")
    src, exe = d / "rng_check.cpp", d / "rng_check"
    src.write_text(CPP_PROGRAM)
    cmd = [gxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Wshadow", "-Werror",
           f"-I{RUNTIME_INCLUDE}", str(src), "-o", str(exe)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"compile failed:\n{proc.stderr}"
    return exe


def _run(exe: Path, tmp_path: Path, lines: list[str]) -> list[list[int]]:
    inp = tmp_path / "input.txt"
    inp.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([str(exe), str(inp)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [[int(t) for t in ln.split()] for ln in proc.stdout.splitlines()]


def test_cpp_philox_matches_numpy(cpp_rng_exe, tmp_path):
    g = np.random.default_rng(7)
    rows = [list(c) + list(k) for c, k, _ in KAT]
    rows += g.integers(0, 1 << 32, size=(2000, 6), dtype=np.uint64).tolist()
    got = _run(cpp_rng_exe, tmp_path, ["P " + " ".join(map(str, r)) for r in rows])
    arr = np.array(rows, dtype=np.uint64)
    want = np.stack(rng.philox4x32(*arr.T), axis=1).tolist()
    assert got == want
    assert got[: len(KAT)] == [list(e) for _, _, e in KAT]


def test_cpp_dropout_matches_numpy(cpp_rng_exe, tmp_path):
    cases = _dropout_cases(3000)
    assert any(idx >= 1 << 32 for _, _, idx, _ in cases)
    assert any(seed < 0 for seed, _, _, _ in cases)
    got = _run(cpp_rng_exe, tmp_path, [f"D {s} {k} {i} {p!r}" for s, k, i, p in cases])
    assert len(got) == len(cases)
    mismatches = []
    for (seed, site, idx, p), row in zip(cases, got, strict=True):
        s = seed % (1 << 64)
        words = _words(
            rng.philox4x32(idx & 0xFFFFFFFF, idx >> 32, site, 0, s & 0xFFFFFFFF, s >> 32)
        )
        keep = bool(rng.dropout_keep(seed, site, np.array([idx], dtype=np.uint64), p)[0])
        want = [*words, rng.dropout_threshold(p), int(keep)]
        if row != want:
            mismatches.append(((seed, site, idx, p), row, want))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"
    kept = [row[-1] for row in got]
    assert 0 < sum(kept) < len(kept)


def test_cpp_site_key_matches_numpy(cpp_rng_exe, tmp_path):
    names = ["", "a", "foobar", "layer0.attn.dropout", "héllo/ドロップ", "\x7f\x80é" * 20]
    lines = [f"S {n.encode('utf-8').hex() or '-'}" for n in names]
    got = _run(cpp_rng_exe, tmp_path, lines)
    assert got == [[rng.site_key(n)] * 2 for n in names]


# ---------------------------------------------------------------------------------------------
# optional: the header compiles as CUDA device code

CUDA_PROGRAM = r"""
#include <coconet/rng.h>

__global__ void dropout_kernel(float* x, unsigned long long n, unsigned long long offset,
                               long long seed, unsigned int site, unsigned int thr, float scale) {
  const unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) {
    const bool keep = coconet::dropout_keep((uint64_t)seed, site, offset + i, thr);
    x[i] = keep ? x[i] * scale : 0.0f;
  }
}

__global__ void philox_kernel(coconet::Philox4* out) {
  out[threadIdx.x] = coconet::philox4x32(threadIdx.x, 0, coconet::site_key("dev"), 0, 1, 2);
}

void launch(float* x, unsigned long long n, long long seed, double p) {
  const unsigned int thr = coconet::dropout_threshold(p);
  dropout_kernel<<<(unsigned)((n + 255) / 256), 256>>>(
      x, n, 0, seed, coconet::site_key("layer0.dropout"), thr, (float)(1.0 / (1.0 - p)));
}
"""


def test_header_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found on PATH: skipping the CUDA compile check of rng.h")
    src = tmp_path / "rng_check.cu"
    src.write_text(CUDA_PROGRAM)
    cmd = [nvcc, "-std=c++17", "-x", "cu", "-c", f"-I{RUNTIME_INCLUDE}", str(src),
           "-o", str(tmp_path / "rng_check.o")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout}\n{proc.stderr}"


DROP = """program drop(x: f32[N] replicated, a: f32[N] replicated, p: f32, seed: i64) {
    y = x + dropout(a, p, seed)
    return y
}
"""


def test_compiled_dropout_at_rate_zero_is_its_input_and_draws_otherwise(tmp_path):
    """A compiled dropout loop over more than the loop threads' block (2^16 elements), one module
    called at p = 0 and at p = 0.3: at 0 the loop's copy for rate 0 (no draws) gives x + a
    bit for bit; at 0.3 it draws the interpreter's masks (rng.py), the kept elements scaled."""
    import coconetc
    from coconetc.interp.interpreter import run
    from coconetc.sourcefile import load_file
    path = tmp_path / "drop.ccn"
    path.write_text(DROP)
    mod, prog = coconetc.load(path, log=lambda msg: None), load_file(path).program("drop")
    g = np.random.default_rng(5)
    n = 3 * (1 << 16) + 5
    x, a = g.standard_normal(n).astype(np.float32), g.standard_normal(n).astype(np.float32)
    for p in (0.0, 0.3):
        args = {"x": x, "a": a, "p": np.float32(p), "seed": np.int64(-77)}
        got = mod.drop(**args)
        want = run(prog, [args])[0].outputs["y"]
        kept = got != x
        assert np.array_equal(kept, want != x)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
        if p == 0.0:
            np.testing.assert_array_equal(got, x + a)
        else:
            assert 0.25 < 1 - kept.mean() < 0.35

"""What a generated module's extern operations need from its build: header directories,
library directories and libraries to link. The CMakeLists templates lay them out; the
toolchain hashes them into the cache key."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Libs:
    """What extern operations need from the build (`coconetc compile -I -L -l`,
    `coconetc.load(include_dirs=, library_dirs=, libraries=)`): header directories, library
    directories and libraries to link (names as for -l, or paths)."""

    include_dirs: tuple[str, ...] = ()
    library_dirs: tuple[str, ...] = ()
    libraries: tuple[str, ...] = ()

    @staticmethod
    def of(file: str | Path, externs: bool, include_dirs=(), library_dirs=(), libraries=()) -> Libs:
        """Absolute paths; a file that declares extern operations also finds headers in its
        own directory (as its Python references are found there)."""
        inc = [str(Path(d).resolve()) for d in include_dirs]
        if externs:
            inc.append(str(Path(file).resolve().parent))
        return Libs(tuple(dict.fromkeys(inc)), tuple(str(Path(d).resolve()) for d in library_dirs),
                    tuple(libraries))

    def fingerprint(self, headers: list[str]) -> str:
        """For the cache key: the contents of the extern headers (found in include_dirs) and
        of the libraries found in library_dirs, so an edit rebuilds the module."""
        h = hashlib.sha256(repr(self).encode())
        for header in headers:
            for d in self.include_dirs:
                f = Path(d) / header
                if f.is_file():
                    h.update(f.read_bytes())
                    break
        found = [Path(lib) for lib in self.libraries if Path(lib).is_file()]  # given as paths
        found += [f for d in self.library_dirs for lib in self.libraries
                  for f in sorted(Path(d).glob(f"lib{lib}.*"))]
        for f in found:
            h.update(f.read_bytes())
        return h.hexdigest()

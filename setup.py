"""The C kernels of `kvq.quant.qdot`, built when kvq is installed.

Everything else about the package is in `pyproject.toml`; this file only adds the one shared
library, `kvq/quant/_qdot*.so`, compiled by setuptools from `kvq/quant/csrc/qdot.c` with the
flags the runtime build uses (`kvq.quant.qdot.FLAGS`), so that a machine or an image without a
C compiler at run time still gets the int8 kernels. The library is loaded with ctypes, not
imported. One build serves every x86 CPU: the C code picks AVX2, AVX-512 or AMX at run time.

The build is best effort: without a compiler (or where it fails) kvq installs without the
library and builds it at first use, as before, or computes with its float32 kernels. With
OpenMP first, then without. `KVQ_SOURCES_KEY` is the hash of the sources, which the runtime
compares with the sources it has, so an editable checkout whose C files changed since the
install is never served a stale library.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("kvq/quant/csrc")
# as kvq.quant.qdot.FLAGS, less what setuptools adds itself (-shared, -fPIC)
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"]


def sources_key() -> str:
    """sha256 over the C sources, as `kvq.quant.qdot.sources_key` computes it."""
    h = hashlib.sha256()
    for path in sorted(CSRC.glob("*.[ch]"), key=lambda p: p.name):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


class BestEffortBuild(build_ext):
    """Build with OpenMP, else without, else leave the library out (and say why)."""

    def build_extension(self, ext: Extension) -> None:
        plain = list(ext.extra_compile_args)
        for openmp in (["-fopenmp"], []):
            ext.extra_compile_args = [*plain, *openmp]
            ext.extra_link_args = list(openmp)
            try:
                super().build_extension(ext)
                return
            except Exception as exc:  # CompileError, LinkError, a missing compiler
                why = exc
        print(f"kvq: the C kernels were not built at install ({why}); kvq builds them at first use")


setup(
    ext_modules=[
        Extension(
            "kvq.quant._qdot",
            sources=[str(CSRC / "qdot.c")],
            define_macros=[("KVQ_SOURCES_KEY", f'"{sources_key()}"')],
            extra_compile_args=FLAGS,
            libraries=["m"],
        )
    ],
    cmdclass={"build_ext": BestEffortBuild},
)

"""Builds the C++ search engine and plan simulator as ``realloc._C`` (C++17, pybind11), and ships the
repository's ``profiles/`` (hardware specs and measured profiles) inside the package as ``realloc/profiles``,
where an installed realloc looks for them (``realloc.estimator.hardware.shipped_profiles_dir``)."""

import os
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

# every core compiles (NPY_NUM_BUILD_JOBS=N to limit): the six sources build in the time of the largest
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

ext = Pybind11Extension(
    "realloc._C",
    sorted(glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

# profiles/hardware, profiles/cpu, ... become data-only packages realloc.profiles.<folder>.
profiles = ["realloc.profiles", *(f"realloc.profiles.{d.name}" for d in sorted(Path("profiles").iterdir())
                                  if d.is_dir())]

setup(
    # REALLOC_SKIP_EXT=1: the Makefile's editable install, which leaves the extension to `build_ext --inplace`
    # (compiled once, in place; pip's editable build would compile it in a temporary folder first).
    ext_modules=[] if os.environ.get("REALLOC_SKIP_EXT") == "1" else [ext],
    cmdclass={"build_ext": build_ext},
    packages=[*find_packages(include=["realloc", "realloc.*"]), *profiles],
    package_dir={"realloc.profiles": "profiles"},
    package_data={p: ["*.json", "*.md"] for p in profiles},
)

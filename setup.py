"""Builds the C++ search engine and plan simulator as ``realloc._C`` (C++17, pybind11)."""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext = Pybind11Extension(
    "realloc._C",
    sorted(glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})

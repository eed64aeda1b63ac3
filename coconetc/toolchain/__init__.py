"""The toolchain: the only place that runs CMake, nvcc or the C++ compiler. Turns generated
sources into extension modules, cached by a content hash (builder.py: CPU; cuda_build.py:
CUDA and its host emulation)."""

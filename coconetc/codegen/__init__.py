"""Code generation: emit.py renders pointwise expressions as C++ (shared by the CPU and CUDA
backends); lower.py turns a program into C++ statements; cpu.py lays out a module."""

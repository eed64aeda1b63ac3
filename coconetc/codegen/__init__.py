"""Code generation: backends render execution plans (coconetc/plan). emit.py renders
pointwise expressions as C++ (shared by the CPU and CUDA backends); render.py (with loops.py and
fused.py) turns a plan into the C++ body of one function; cpu.py lays out a module."""

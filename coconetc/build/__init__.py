"""Building generated sources into extension modules with CMake (builder.py)."""

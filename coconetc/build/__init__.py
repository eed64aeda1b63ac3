"""Building generated sources into extension modules (builder.py) and calling them from
Python with NumPy arrays or PyTorch tensors (loader.py)."""

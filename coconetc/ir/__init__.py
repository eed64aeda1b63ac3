"""The typed IR: types.py (dtypes, dims, layouts), nodes.py (expressions, stages, programs),
ops.py (the operation registry: one entry per operation), typerules.py (the typing rules the
registry names), reference.py (the operations' NumPy math), rewrite.py, printer.py."""

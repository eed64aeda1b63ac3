"""The typed IR: types.py (dtypes, dims, layouts), nodes.py (expressions, stages, programs),
typerules.py (the typing rules shared by the checker and the schedule primitives), printer.py."""

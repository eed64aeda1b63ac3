"""The typed IR and the language's facts that every layer shares: types.py (dtypes, dims,
layouts), expr.py (expressions: a leaf that the typing rules and the registry read), nodes.py
(stages and programs; re-exports the expressions), ops.py (the operation registry: one entry
per operation, and `type_op`), typerules.py (the typing rules the registry names), reference.py (the
operations' NumPy math), rewrite.py, printer.py, verify.py (the IR verifier, run after every
schedule directive); storage.py (the NumPy dtype of each language
dtype), slices.py (the partition of a sliced dimension), rng_keys.py (dropout's per-site RNG
word), limits.py (what a size must fit), arguments.py (a call's arguments against a program's
parameters, for the interpreter and the runtime alike)."""

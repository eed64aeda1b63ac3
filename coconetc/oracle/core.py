"""Kept for importers not yet renamed (coconetc/cli.py): the oracle's inputs are in
inputs.py, the comparison in compare.py. Import from those."""

from coconetc.oracle.compare import compare, max_error
from coconetc.oracle.inputs import (DEFAULT_SIZE, adapt_inputs, default_segments, joined,
                                    random_inputs, size_symbols)

__all__ = ["DEFAULT_SIZE", "adapt_inputs", "compare", "default_segments", "joined", "max_error",
           "random_inputs", "size_symbols"]

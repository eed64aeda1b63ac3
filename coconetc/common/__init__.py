"""What the reference interpreter and the shipping path (the loader of compiled modules, the
code generator) share: storage dtypes, the slice partition, RNG site keys, argument checks.
Nothing here imports coconetc.interp."""

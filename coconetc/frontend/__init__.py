"""Front end: source text -> AST (parser.py) -> typed IR (checker.py)."""

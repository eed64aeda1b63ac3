"""Names every backend gives the same way."""


def function_name(program: str, schedule: str) -> str:
    """The module function of one (program, schedule)."""
    return f"{program}__{schedule}"

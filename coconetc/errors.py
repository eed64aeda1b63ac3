"""Source spans and compile errors, printed as `file:line:col: message`, the line, a caret."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """A region of a source file: 1-based line and column of its first and last character."""

    file: str
    line: int
    col: int
    end_line: int = 0
    end_col: int = 0
    source: str = field(default="", compare=False)  # the whole file, to quote a line

    def __repr__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def __bool__(self) -> bool:  # NOWHERE is false, so `node.span or fallback` works
        return self.line > 0


NOWHERE = Span("<builtin>", 0, 0)


@dataclass(frozen=True)
class Diagnostic:
    span: Span
    message: str

    def render(self) -> str:
        s = self.span
        head = f"{s.file}:{s.line}:{s.col}: error: {self.message}"
        lines = s.source.split("\n")  # as the lexer counts lines (not str.splitlines)
        if not 1 <= s.line <= len(lines):
            return head
        text = lines[s.line - 1].removesuffix("\r")
        end = s.end_col if s.end_line == s.line and s.end_col > s.col else s.col
        width = max(1, min(end, len(text) + 1) - s.col)
        pad = "".join(c if c == "\t" else " " for c in text[:s.col - 1])  # tabs keep the caret aligned
        return f"{head}\n    {text}\n    {pad.ljust(s.col - 1)}{'^' * width}"


class CompileError(Exception):
    """One or more diagnostics; str() renders them all."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = list(diagnostics)
        super().__init__(self.render())

    @classmethod
    def at(cls, span: Span, message: str) -> CompileError:
        return cls([Diagnostic(span, message)])

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


class ScheduleError(CompileError):
    """An illegal schedule directive: names the directive, the stage and the reason."""

    def __init__(self, span: Span, directive: str, stage: str, reason: str):
        self.directive, self.stage, self.reason = directive, stage, reason
        where = f" on '{stage}'" if stage else ""
        super().__init__([Diagnostic(span, f"{directive}{where}: {reason}")])

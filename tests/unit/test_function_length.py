"""No function in `kvq` over 60 lines (issue 31, "long functions"; STYLE.md habit 1 aims at ~50).

Lines are counted as the AST sees them: from the `def` (decorators not included) to the last
line of the body, docstring, comments and blank lines inside included. Nested functions count
on their own and inside their parent. Split a long function into named pieces that each read as
one idea rather than adding it below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvq

ROOT = Path(kvq.__file__).parent
MAX_LINES = 60
# functions allowed over MAX_LINES, as "path/under/kvq.py:name": each a split still owed
ALLOWED: set[str] = set()  # none: every function fits


def long_functions() -> dict[str, int]:
    """Every function in `kvq` over MAX_LINES: its lines, by "path:name"."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    out[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = lines
    return out


def test_no_function_is_over_the_limit() -> None:
    over = {name: n for name, n in long_functions().items() if name not in ALLOWED}
    assert not over, f"functions over {MAX_LINES} lines (split them): {over}"


def test_the_allow_list_only_shrinks() -> None:
    gone = ALLOWED - set(long_functions())
    assert not gone, f"{sorted(gone)} are {MAX_LINES} lines or fewer now: drop them from ALLOWED"

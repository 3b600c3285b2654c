"""The attention call stays a short pipeline (issue 26): ``inspector_attention`` under 60 lines with
a cyclomatic complexity of at most 15, measured here on its source as radon counts it (one, plus one
per branch: if, loop, conditional expression, except, assert, boolean operator, comprehension and
its filters, match case). Ruff's C901 leaves boolean operators out, so it counts no more than this
(5 for inspector_attention today, 6 here)."""

from __future__ import annotations

import ast
import inspect
import textwrap

from gpt_inspector.core.capture import attend

MAX_LINES, MAX_COMPLEXITY = 60, 15


def complexity(fn: ast.FunctionDef) -> int:
    n = 1
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler, ast.Assert)):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
        elif isinstance(node, ast.match_case):
            n += 1
    return n


def _function(source: str) -> ast.FunctionDef:
    fn = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn


def test_inspector_attention_is_short_and_simple():
    source = inspect.getsource(attend.inspector_attention)
    lines = len(source.splitlines())
    cc = complexity(_function(source))
    assert lines < MAX_LINES, f"inspector_attention is {lines} lines; keep it under {MAX_LINES}"
    assert cc <= MAX_COMPLEXITY, f"inspector_attention has complexity {cc}; at most {MAX_COMPLEXITY}"
    assert cc >= 4  # its recorder check, its two loops over the interventions, its record: the count sees them


def test_the_count_can_fail():
    branches = "\n".join(f"    if x == {i}:\n        y = {i}" for i in range(15))
    fn = _function(f"def f(x, a, b):\n{branches}\n    return [z for z in a if z] or b and x\n")
    assert complexity(fn) == 1 + 15 + 2 + 2  # 15 ifs, a filtered comprehension, an or and an and
    assert complexity(fn) > MAX_COMPLEXITY

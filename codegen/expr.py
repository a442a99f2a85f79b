"""Integer formulas in route specs (launch geometry, smem, constraints).

A formula is a small Python expression over the op's dims and params, the tile's params written
`tile.<name>`, integer literals, + - * // %, comparisons, and/or/not, and min/max/cdiv.
Codegen checks it and replaces `tile.<name>` by the tile's value, so the manifest carries formulas
over dims and params only; the runtime evaluates those once per plan, never per launch.
"""
from __future__ import annotations

import ast

FUNCS = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Name,
            ast.Attribute, ast.Constant, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod,
            ast.USub, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


class ExprError(ValueError):
    pass


def lower(text, names: set[str], tile: dict) -> str:
    """Check a formula and substitute tile params; returns the formula over `names` only."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ExprError(f"expected an integer or a formula string, got {text!r}")
    src = str(text)
    try:
        tree = ast.parse(src, mode="eval")
    except SyntaxError:
        raise ExprError(f"cannot parse formula {src!r}") from None

    class Sub(ast.NodeTransformer):
        def visit_Attribute(self, node):
            if not (isinstance(node.value, ast.Name) and node.value.id == "tile"):
                raise ExprError(f"in {src!r}: only tile.<param> attributes are allowed")
            if node.attr not in tile:
                raise ExprError(f"in {src!r}: unknown tile param {node.attr!r} (tile has: {', '.join(sorted(tile)) or 'none'})")
            return ast.copy_location(ast.Constant(tile[node.attr]), node)

    tree = Sub().visit(tree)
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"in {src!r}: {type(node).__name__} is not allowed (use + - * // %, comparisons, "
                            f"and/or, min/max/cdiv)")
        if isinstance(node, ast.Constant) and (isinstance(node.value, bool) or not isinstance(node.value, (int, float))):
            raise ExprError(f"in {src!r}: constant {node.value!r} is not a number")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCS):
            raise ExprError(f"in {src!r}: only the functions {', '.join(FUNCS)} are allowed")
        if isinstance(node, ast.Name) and node.id not in names and node.id not in FUNCS:
            raise ExprError(f"in {src!r}: unknown name {node.id!r} (allowed: {', '.join(sorted(names))})")
    return ast.unparse(tree)


def free_names(formula: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(formula, mode="eval")) if isinstance(n, ast.Name) and n.id not in FUNCS}


def evaluate(formula: str, env: dict):
    return eval(compile(formula, "<formula>", "eval"), {"__builtins__": {}, **FUNCS}, env)  # noqa: S307 (checked by lower)

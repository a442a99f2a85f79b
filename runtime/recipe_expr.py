"""A tiny, safe expression language for recipes: shapes ("2*Hk*Dk + Hv*Dv"), conditions
("mixer == 'linear_attention'", "not tied") and layer kinds (conditional expressions, `in`, list
indexing). Python syntax, evaluated over a dict of names; no calls, attributes or imports."""
from __future__ import annotations

import ast
import operator

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
        ast.NotIn: lambda a, b: a not in b}


class ExprError(ValueError):
    pass


def evaluate(expr, names, where: str = "expression"):
    """Evaluate `expr` (int/bool/str literal or a Python expression string) over `names` (a mapping;
    a missing name raises ExprError naming it)."""
    if isinstance(expr, (int, bool)) or expr is None:
        return expr
    if not isinstance(expr, str):
        raise ExprError(f"{where}: expected an expression string, got {expr!r}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"{where}: cannot parse {expr!r}: {e.msg}") from None
    return _eval(tree.body, names, where, expr)


def _eval(node, names, where, src):
    ev = lambda n: _eval(n, names, where, src)  # noqa: E731
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name):
        try:
            return names[node.id]
        except KeyError:
            raise ExprError(f"{where}: {src!r} uses unknown name {node.id!r}") from None
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = ev(node.left), ev(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise ExprError(f"{where}: {src!r} divides by zero")
        return _BIN[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp):
        v = ev(node.operand)
        if isinstance(node.op, ast.Not):
            return not v
        if isinstance(node.op, ast.USub):
            return -v
    if isinstance(node, ast.BoolOp):
        vals = (ev(v) for v in node.values)
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = ev(right_node)
            if type(op) not in _CMP or not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body) if ev(node.test) else ev(node.orelse)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [ev(e) for e in node.elts]
    if isinstance(node, ast.Subscript):
        seq, idx = ev(node.value), ev(node.slice)
        try:
            return seq[idx]
        except (IndexError, KeyError, TypeError):
            raise ExprError(f"{where}: {src!r}: index {idx!r} out of range") from None
    raise ExprError(f"{where}: {src!r}: unsupported syntax {type(node).__name__}")

"""Bind a call's tensors and params to an op contract: check dtypes, devices and shapes, resolve the dims.

Done once per plan (not per launch), for both backends, so a mismatched call fails the same way
everywhere, naming the argument, what it got and what the contract allows.
"""
from __future__ import annotations

import re

import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32,
                "u8": torch.uint8}
_SCALED = re.compile(r"^(?:([1-9][0-9]*)\*)?([A-Za-z_][A-Za-z0-9_]*)$")


class ContractError(ValueError):
    pass


def shape_of(spec: dict, dims: dict) -> list[int]:
    """A contract tensor's shape at these dims (entries are ints, dim names or k*name)."""
    out = []
    for d in spec["shape"]:
        if isinstance(d, int):
            out.append(d)
        else:
            mult, name = _SCALED.match(d).groups()
            out.append(int(mult or 1) * dims[name])
    return out


def bind(op_name: str, contract: dict, dtype: str, tensors: dict, params: dict) -> tuple[dict, dict]:
    """Returns (dims, params with defaults). Raises ContractError naming the offending argument."""
    inputs, outputs, states = contract["inputs"], contract["outputs"], contract["states"]
    expected = set(inputs) | set(outputs) | set(states)
    missing = sorted(expected - tensors.keys())
    extra = sorted(tensors.keys() - expected)
    if missing or extra:
        raise ContractError(f"{op_name}: missing tensor(s) {missing or '-'}, unexpected {extra or '-'} "
                            f"(the op takes: {', '.join([*inputs, *outputs, *states])})")
    if dtype not in contract["dtypes"]:
        raise ContractError(f"{op_name}: dtype {dtype} is not supported (allowed: {', '.join(contract['dtypes'])})")
    # a dim no tensor shape reveals (e.g. the rows of a packed weight, a byte string) is passed by name
    params = dict(params)
    given = {k: params.pop(k) for k in list(params) if k in contract["dims"]}
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ContractError(f"{op_name}: dim {k} must be a positive int, got {v!r}")
    dims: dict[str, int] = {}
    device = None
    for name, spec in {**inputs, **outputs, **states}.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise ContractError(f"{op_name}: argument {name} must be a torch.Tensor, got {type(t).__name__}")
        want = TORCH_DTYPES[dtype if spec["dtype"] == "$dtype" else spec["dtype"]]
        if t.dtype != want:
            raise ContractError(f"{op_name}: argument {name} has dtype {t.dtype}, expected {want}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ContractError(f"{op_name}: argument {name} is on {t.device}, the others on {device}")
        if not t.is_contiguous():
            raise ContractError(f"{op_name}: argument {name} must be contiguous (row-major, last axis fastest)")
        shape = spec["shape"]
        if t.dim() != len(shape):
            raise ContractError(f"{op_name}: argument {name} has shape {tuple(t.shape)}, expected rank {len(shape)} {shape}")
        for axis, (d, size) in enumerate(zip(shape, t.shape)):
            if isinstance(d, int):
                if size != d:
                    raise ContractError(f"{op_name}: argument {name} axis {axis} is {size}, expected {d}")
                continue
            m = _SCALED.match(d)
            mult, dim = int(m.group(1) or 1), m.group(2)
            if size % mult:
                raise ContractError(f"{op_name}: argument {name} axis {axis} is {size}, expected a multiple of {mult} ({d})")
            val = size // mult
            if dim in given and given[dim] != val:
                raise ContractError(f"{op_name}: argument {name} axis {axis} gives {dim}={val}, but {dim}={given[dim]} was passed")
            if dim in dims and dims[dim] != val:
                raise ContractError(f"{op_name}: argument {name} axis {axis} gives {dim}={val}, "
                                    f"but an earlier argument gave {dim}={dims[dim]} (shape {shape})")
            dims[dim] = val
    dims.update(given)
    unbound = sorted(set(contract["dims"]) - dims.keys())
    if unbound:
        raise ContractError(f"{op_name}: dim(s) {', '.join(unbound)} appear in no tensor shape: pass them by name")
    if dims.get("T", 1) < 1:
        raise ContractError(f"{op_name}: T (tokens) must be >= 1, got {dims['T']}")
    bound = {}
    for pname, pspec in contract["params"].items():
        if pname in params:
            bound[pname] = params[pname]
        elif "default" in pspec:
            bound[pname] = pspec["default"]
        else:
            raise ContractError(f"{op_name}: missing param {pname}")
    unknown = sorted(params.keys() - contract["params"].keys())
    if unknown:
        raise ContractError(f"{op_name}: unknown param(s) {', '.join(unknown)} "
                            f"(allowed: {', '.join(contract['params']) or 'none'})")
    from .manifest import evaluate
    for c in contract.get("constraints", []):
        if not evaluate(c, {**dims, **bound}):
            shown = ", ".join(f"{k}={v}" for k, v in {**dims, **bound}.items())
            raise ContractError(f"{op_name}: the contract requires {c}, which fails for {shown}")
    return dims, bound

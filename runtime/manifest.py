"""The manifest written by codegen: op contracts, kernel instances and route tables.

This is the only contract between codegen and the runtime. Route resolution happens once per
(problem, T) at plan time, never per launch.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .paths import manifest_path

_FUNCS = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}
_GLOBALS = {"__builtins__": {}, **_FUNCS}


class ManifestError(Exception):
    pass


class RouteError(LookupError):
    """No route admits this call, or a route's constraint rejects the problem."""


@functools.lru_cache(maxsize=4096)
def _compiled(formula: str):
    return compile(str(formula), "<manifest formula>", "eval")


def evaluate(formula, env: dict):
    """Evaluate a formula that codegen has already checked (ints, + - * // %, comparisons, cdiv/min/max).
    Compiled once per formula: plans are made per call in eager prefill, so this is on the hot path."""
    return eval(_compiled(formula), _GLOBALS, env)  # noqa: S307


@dataclass(frozen=True)
class KernelInfo:
    key: str
    data: dict

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def instance(self) -> str:
        return f"{self.data['route']}.{self.data['tile']}"


class Manifest:
    def __init__(self, data: dict, path: Path | None = None):
        self.data, self.path = data, path
        self.version = data.get("version")
        if self.version != 1:
            raise ManifestError(f"{path}: manifest version {self.version!r} is not supported (expected 1); "
                                f"run `make generate`")

    @classmethod
    def load(cls, path: Path | None = None) -> "Manifest":
        path = Path(path or manifest_path())
        if not path.is_file():
            raise ManifestError(f"no manifest at {path}: run `make generate` (and `make build` for GPU kernels)")
        try:
            return cls(json.loads(path.read_text(encoding="utf-8")), path)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: not valid JSON ({e}); run `make generate`") from None

    @cached_property
    def ops(self) -> dict:
        """Op contracts, with inputs/outputs/params as ordered {name: spec} mappings (contract order)."""
        def named(items):
            return {i["name"]: {k: v for k, v in i.items() if k != "name"} for i in items}
        return {name: {**c, "inputs": named(c["inputs"]), "outputs": named(c["outputs"]),
                       "states": named(c["states"]), "params": named(c["params"])}
                for name, c in self.data["ops"].items()}

    @property
    def tolerances(self) -> dict:
        return self.data["tolerances"]

    @cached_property
    def kernels(self) -> dict[str, KernelInfo]:
        return {k: KernelInfo(k, v) for k, v in self.data["kernels"].items()}

    def kernel(self, arch: str, op: str, instance: str, dtype: str) -> KernelInfo:
        key = f"{arch}/{op}/{instance}/{dtype}"
        if key not in self.kernels:
            have = sorted({k.instance for k in self.kernels.values() if k.op == op and k.arch == arch})
            raise RouteError(f"no kernel {instance} for {op} on {arch}/{dtype} (built: {', '.join(have) or 'none'})")
        return self.kernels[key]

    def workspace_bytes(self, arch: str, op: str, dims: dict) -> int:
        """The most workspace any route of `op` built for `arch` declares at these dims (0: none declares one)."""
        return max((int(evaluate(k.workspace, dims)) for k in self.kernels.values()
                    if k.op == op and k.arch == arch and "workspace" in k.data), default=0)

    def tuned_for(self, gpu: str | None, arch: str) -> dict:
        """The tuned tables (ninfer-tune) of this GPU, when they were measured on it and its arch matches."""
        t = self.data.get("tuned", {}).get(gpu or "")
        return t["tables"] if t and t["arch"] == arch else {}

    def table(self, arch: str, op: str, dtype: str, problem: dict, gpu: str | None = None) -> list:
        """The span list for an exact problem: this GPU's tuned table for that problem or op if there is one,
        else the default tables' (a table for that problem if listed, else the default)."""
        tuned = _matching(self.tuned_for(gpu, arch).get(op, {}).get(dtype, []), problem)
        if tuned is not None:
            return tuned
        try:
            entries = self.data["tables"][arch][op][dtype]
        except KeyError:
            if not any(k["op"] == op for k in self.data["kernels"].values()):
                raise RouteError(f"{op} has no generated kernels yet (reference backend only)") from None
            raise RouteError(f"no route table for {op} on {arch}/{dtype} (no kernels for that dtype)") from None
        spans = _matching(entries, problem)
        if spans is None:
            raise RouteError(f"no route table for {op} on {arch}/{dtype} admits problem {problem}")
        return spans

    def resolve(self, arch: str, op: str, dtype: str, problem: dict, T: int, gpu: str | None = None) -> KernelInfo:
        if T < 1:
            raise RouteError(f"{op}: T must be >= 1, got {T}")
        for lo, hi, use in self.table(arch, op, dtype, problem, gpu):
            if lo <= T and (hi is None or T <= hi):
                return self.kernel(arch, op, use, dtype)
        raise RouteError(f"{op} on {arch}/{dtype}: no span admits T={T}")  # codegen proves this cannot happen


def _matching(entries: list, problem: dict):
    """The spans of the first table entry for this problem (entries list specific problems before {})."""
    for e in entries:
        if all(problem.get(k) == v for k, v in e["problem"].items()):
            return e["spans"]
    return None

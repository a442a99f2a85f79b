"""Load and validate the spec tree (schema: specs/README.md).

Everything is checked before anything is rendered: a bad spec raises SpecError naming the file,
the key path, what is wrong and what is allowed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .expr import ExprError, evaluate, free_names, lower
from .yamlio import SpecError, load_yaml

DTYPES = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float", "i32": "int", "u8": "unsigned char"}
PARAM_TYPES = {"f32", "i32"}
# packed formats whose planes (0: codes, 1: q5 / q6 high bits) a route may read through TMA (runtime/cuda.py)
PACKED_TMA_PLANES = {"q4": 1, "q5": 2, "q6": 2, "fp8": 1}
TMA_SWIZZLES = ("NONE", "128B")   # of a packed plane's tensor map; a plain tensor's is 128B
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
TILE_RE = re.compile(r"^[a-z0-9][a-z0-9_]*$")
SCALED_DIM_RE = re.compile(r"^(?:([1-9][0-9]*)\*)?([A-Za-z_][A-Za-z0-9_]*)$")
INF = None  # an open span end


@dataclass
class Arch:
    name: str
    cc: int
    smem_per_block: int
    sm_count_hint: int
    features: list[str]


@dataclass
class TensorSpec:
    dtype: str          # a DTYPES key, or "$dtype" (the instance dtype)
    shape: list         # dim names or positive ints


@dataclass
class Op:
    name: str
    file: str
    doc: dict
    dims: dict
    problem: list[str]
    dtypes: list[str]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    states: dict[str, TensorSpec]      # read and written in place (caches, recurrent state)
    params: dict[str, dict]
    constraints: list[str]             # formulas over dims and params every call must satisfy
    reference: str
    tolerance: str
    aliases: dict[str, str]


@dataclass
class Route:
    op: str
    name: str
    file: str
    template: str
    archs: list[str]
    dtypes: list[str]
    requires: list[str]
    tiles: dict[str, dict]
    args: list                  # strings (tensor/dim/param names) or {tmap: tensor, box: [..]} dicts
    grid: list[str]
    block: list[str]
    smem: str
    constraints: list[str]
    pre: dict | None = None       # {grid, block, smem}: a kernel `<symbol>_pre` launched first with the same args
    workspace: str | None = None  # bytes of scratch global memory the route's kernels share (the `workspace` arg)
    lowered: dict = field(default_factory=dict)   # tile -> {grid, block, smem, constraints, args[, pre, workspace]}


@dataclass
class Table:
    op: str
    file: str
    archs: list[str]
    dtypes: list[str]
    problem: dict[str, int]
    spans: list[tuple[int, int | None, str]]    # (from, to or None for ∞, "route.tile")


@dataclass
class SpecSet:
    root: Path
    archs: dict[str, Arch]
    tolerances: dict[str, dict]
    ops: dict[str, Op]
    routes: dict[str, dict[str, Route]]         # op -> route name -> Route
    tables: list[Table]
    tuned: dict = field(default_factory=dict)   # GPU name -> (arch, [Table]) from tuned/*.yaml (ninfer-tune)


def _need(cond, file, path, msg):
    if not cond:
        raise SpecError(file, path, msg)


def _keys(obj, file, path, required: set, optional: set = frozenset()):
    _need(isinstance(obj, dict), file, path, f"expected a mapping, got {type(obj).__name__}")
    missing = sorted(required - obj.keys())
    _need(not missing, file, path, f"missing key(s) {', '.join(missing)}")
    unknown = sorted(set(obj) - required - set(optional))
    _need(not unknown, file, path,
          f"unknown key(s) {', '.join(map(str, unknown))} (allowed: {', '.join(sorted(required | set(optional)))})")


def _str_list(obj, file, path, allowed=None, what="value"):
    _need(isinstance(obj, list) and all(isinstance(x, str) for x in obj), file, path, "expected a list of strings")
    for i, x in enumerate(obj):
        if allowed is not None and x not in allowed:
            raise SpecError(file, f"{path}[{i}]", f"unknown {what} {x!r} (allowed: {', '.join(sorted(allowed))})")
    _need(len(set(obj)) == len(obj), file, path, "duplicate entries")
    return obj


def _pos_int(obj, file, path):
    _need(isinstance(obj, int) and not isinstance(obj, bool) and obj > 0, file, path,
          f"expected a positive integer, got {obj!r}")
    return obj


def load_archs(root: Path) -> dict[str, Arch]:
    file = "archs.yaml"
    data = load_yaml(root / file, root)
    _keys(data, file, "", {"archs"})
    archs = {}
    for name, a in data["archs"].items():
        p = f"archs.{name}"
        _need(re.fullmatch(r"sm_\d+a?", str(name)), file, p, "arch names look like sm_80 or sm_90a")
        _keys(a, file, p, {"compute_capability", "smem_per_block", "sm_count_hint", "features"})
        cc = a["compute_capability"]
        _need(isinstance(cc, list) and len(cc) == 2 and all(isinstance(v, int) for v in cc), file,
              f"{p}.compute_capability", "expected [major, minor]")
        archs[name] = Arch(name, cc[0] * 10 + cc[1], _pos_int(a["smem_per_block"], file, f"{p}.smem_per_block"),
                           _pos_int(a["sm_count_hint"], file, f"{p}.sm_count_hint"),
                           _str_list(a["features"], file, f"{p}.features"))
    return archs


def load_tolerances(root: Path) -> dict[str, dict]:
    file = "tolerances.yaml"
    data = load_yaml(root / file, root)
    _keys(data, file, "", {"tolerances"})
    fields = {"atol", "rtol", "tail_frac", "worst_ratio", "rel_l2"}
    for name, t in data["tolerances"].items():
        _keys(t, file, f"tolerances.{name}", fields)
        for k, v in t.items():
            _need(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, file,
                  f"tolerances.{name}.{k}", f"expected a non-negative number, got {v!r}")
    return {k: {f: float(v) for f, v in t.items()} for k, t in data["tolerances"].items()}


def _tensor(obj, file, path, dims, dtypes) -> TensorSpec:
    _keys(obj, file, path, {"dtype", "shape"})
    allowed = set(DTYPES) | {"$dtype"}
    _need(obj["dtype"] in allowed, file, f"{path}.dtype",
          f"unknown dtype {obj['dtype']!r} (allowed: {', '.join(sorted(allowed))})")
    shape = obj["shape"]
    _need(isinstance(shape, list), file, f"{path}.shape", "expected a list of dim names or positive ints")
    for i, d in enumerate(shape):
        if isinstance(d, int) and not isinstance(d, bool):
            _pos_int(d, file, f"{path}.shape[{i}]")
            continue
        m = SCALED_DIM_RE.match(str(d))
        _need(m and m.group(2) in dims, file, f"{path}.shape[{i}]",
              f"unknown dim {d!r} (a declared dim, a positive int, or <int>*<dim>; declared dims: {', '.join(dims)})")
    return TensorSpec(obj["dtype"], shape)


def load_op(root: Path, file: str, tolerances) -> Op:
    data = load_yaml(root / file, root)
    _keys(data, file, "", {"op", "summary", "formula", "dims", "problem", "dtypes", "inputs", "reference", "tolerance"},
          {"outputs", "params", "aliases", "notes", "states", "constraints"})
    name = data["op"]
    _need(isinstance(name, str) and NAME_RE.match(name), file, "op", "expected a lower_snake_case op name")
    _need(Path(file).stem == name, file, "op", f"op {name!r} must live in ops/{name}.yaml")
    dims = data["dims"]
    _need(isinstance(dims, dict) and "T" in dims, file, "dims", "expected a mapping of dim names that includes T (tokens)")
    problem = _str_list(data["problem"], file, "problem", set(dims) - {"T"}, "dim")
    dtypes = _str_list(data["dtypes"], file, "dtypes", set(DTYPES), "dtype")
    params = data.get("params") or {}
    _need(isinstance(params, dict), file, "params", "expected a mapping")
    for pname, p in params.items():
        _keys(p, file, f"params.{pname}", {"type"}, {"default"})
        _need(p["type"] in PARAM_TYPES, file, f"params.{pname}.type",
              f"unknown type {p['type']!r} (allowed: {', '.join(sorted(PARAM_TYPES))})")
    inputs = {k: _tensor(v, file, f"inputs.{k}", dims, dtypes) for k, v in data["inputs"].items()}
    outputs = {k: _tensor(v, file, f"outputs.{k}", dims, dtypes) for k, v in (data.get("outputs") or {}).items()}
    states = {k: _tensor(v, file, f"states.{k}", dims, dtypes) for k, v in (data.get("states") or {}).items()}
    _need(outputs or states, file, "outputs", "an op must write something (outputs or states)")
    names = [*inputs, *outputs, *states]
    clash = {n for n in names if names.count(n) > 1} | (set(names) & (set(dims) | set(params)))
    _need(not clash, file, "", f"names used twice among inputs/outputs/states/dims/params: {', '.join(sorted(clash))}")
    constraints = data.get("constraints") or []
    _need(isinstance(constraints, list), file, "constraints", "expected a list of formulas")
    for i, c in enumerate(constraints):
        try:
            constraints[i] = lower(c, set(dims) | set(params), {})
        except ExprError as e:
            raise SpecError(file, f"constraints[{i}]", str(e)) from None
    _need(data["tolerance"] in tolerances, file, "tolerance",
          f"unknown tolerance preset {data['tolerance']!r} (allowed: {', '.join(sorted(tolerances))})")
    aliases = data.get("aliases") or {}
    for out, inp in aliases.items():
        _need(out in outputs and inp in inputs, file, f"aliases.{out}", "expected output: input names")
    return Op(name, file, {"summary": data["summary"], "formula": data["formula"], "notes": data.get("notes", "")},
              dims, problem, dtypes, inputs, outputs, states, params, constraints, str(data["reference"]),
              data["tolerance"], aliases)


def _lower_route(r: Route, op: Op, tile: dict, file: str, path: str) -> dict:
    dims = set(op.dims)
    names = dims | set(op.params)

    def low(f, p, allowed=names):
        try:
            return lower(f, allowed, tile)
        except ExprError as e:
            raise SpecError(file, p, str(e)) from None

    def low_launch(lk, where):
        # grid formulas may also use SMS, the GPU's SM count (persistent kernels size their grid by it)
        return {"grid": [low(g, f"{path}.{where}.grid[{i}]", names | {"SMS"}) for i, g in enumerate(lk["grid"])],
                "block": [low(b, f"{path}.{where}.block[{i}]", set()) for i, b in enumerate(lk["block"])],
                "smem": low(lk["smem"], f"{path}.{where}.smem", set())}

    out = {**low_launch({"grid": r.grid, "block": r.block, "smem": r.smem}, "launch"),
           "constraints": [low(c, f"{path}.constraints[{i}]") for i, c in enumerate(r.constraints)], "args": []}
    if r.pre is not None:
        out["pre"] = low_launch(r.pre, "launch.pre")
    if r.workspace is not None:
        out["workspace"] = low(r.workspace, f"{path}.workspace")
    for i, a in enumerate(r.args):
        if isinstance(a, str):
            ok = a in op.inputs or a in op.outputs or a in op.states or a in dims or a in op.params
            ok = ok or (a == "workspace" and r.workspace is not None)
            _need(ok, file, f"{path}.args[{i}]", f"unknown argument {a!r} (allowed: tensors, dims and params of op "
                  f"{op.name}, and `workspace` when the route declares one)")
            out["args"].append(a)
        else:
            # a plane of a packed weight: `format`, `matrix` (its [rows, cols] as expressions of the dims), `plane`,
            # `swizzle` (NONE by default)
            _keys(a, file, f"{path}.args[{i}]", {"tmap", "box"}, {"format", "matrix", "plane", "swizzle"})
            _need(a["tmap"] in op.inputs or a["tmap"] in op.outputs, file, f"{path}.args[{i}].tmap",
                  f"unknown tensor {a['tmap']!r}")
            box = [int(eval(low(b, f'{path}.args[{i}].box', set()))) for b in a["box"]]  # noqa: S307 constants only
            arg = {"tmap": a["tmap"], "box": box}
            if "format" in a or "matrix" in a or "plane" in a or "swizzle" in a:
                _need("format" in a and "matrix" in a, file, f"{path}.args[{i}]", "`format` and `matrix` go together")
                _need(a["format"] in PACKED_TMA_PLANES, file, f"{path}.args[{i}].format",
                      f"unknown format {a['format']!r} (allowed: {', '.join(PACKED_TMA_PLANES)})")
                _need(isinstance(a["matrix"], list) and len(a["matrix"]) == 2, file, f"{path}.args[{i}].matrix",
                      "expected [rows, cols]")
                planes = PACKED_TMA_PLANES[a["format"]]
                _need(a.get("plane", 0) in range(planes), file, f"{path}.args[{i}].plane",
                      f"{a['format']} has no plane {a.get('plane')!r} (allowed: {', '.join(map(str, range(planes)))})")
                _need(a.get("swizzle", "NONE") in TMA_SWIZZLES, file, f"{path}.args[{i}].swizzle",
                      f"unknown swizzle {a.get('swizzle')!r} (allowed: {', '.join(TMA_SWIZZLES)})")
                arg.update(format=a["format"], plane=a.get("plane", 0),
                           matrix=[low(e, f"{path}.args[{i}].matrix[{j}]", dims) for j, e in enumerate(a["matrix"])])
                if "swizzle" in a:
                    arg["swizzle"] = a["swizzle"]
            out["args"].append(arg)
    return out


def load_routes(root: Path, file: str, ops: dict[str, Op], archs: dict[str, Arch], templates: Path):
    """routes/<op>.yaml (`op: <op>`), or one file whose routes and tables serve several ops alike (`ops: [...]`,
    e.g. the packed-expert ops of every weight format). Returns [(op name, routes, tables)]."""
    data = load_yaml(root / file, root)
    _keys(data, file, "", {"routes"}, {"op", "ops", "tables"})
    _need(("op" in data) != ("ops" in data), file, "", "expected exactly one of 'op' (one op) and 'ops' (a list)")
    key = "op" if "op" in data else "ops"
    names = [data["op"]] if key == "op" else data["ops"]
    _need(isinstance(names, list) and names and len(set(names)) == len(names), file, key,
          "expected a non-empty list of distinct op names")
    for n in names:
        _need(isinstance(n, str) and n in ops, file, key, f"unknown op {n!r} (known ops: {', '.join(sorted(ops))})")
    _need(key == "ops" or Path(file).stem == data["op"], file, "op", f"routes of op {data.get('op')!r} must live "
          f"in routes/{data.get('op')}.yaml (or in a file that lists it under 'ops')")
    return [_load_op_routes(data, file, ops[n], archs, templates) for n in names]


def _load_op_routes(data: dict, file: str, op: Op, archs: dict[str, Arch], templates: Path):
    routes: dict[str, Route] = {}
    _need(isinstance(data["routes"], list) and data["routes"], file, "routes", "expected a non-empty list")
    for i, r in enumerate(data["routes"]):
        p = f"routes[{i}]"
        _keys(r, file, p, {"name", "template", "archs", "dtypes", "tiles", "args", "launch"},
              {"requires", "constraints", "notes", "workspace"})
        name = r["name"]
        _need(isinstance(name, str) and NAME_RE.match(name), file, f"{p}.name", "expected a lower_snake_case route name")
        _need(name not in routes, file, f"{p}.name", f"duplicate route name {name!r} for op {op.name}")
        _need((templates / str(r["template"])).is_file(), file, f"{p}.template",
              f"unknown template {r['template']!r} (templates live in codegen/templates/)")
        rarchs = list(archs) if r["archs"] == "all" else _str_list(r["archs"], file, f"{p}.archs", set(archs), "arch")
        rdtypes = _str_list(r["dtypes"], file, f"{p}.dtypes", set(op.dtypes), "dtype")
        requires = _str_list(r.get("requires", []), file, f"{p}.requires")
        launch = r["launch"]
        _keys(launch, file, f"{p}.launch", {"grid", "block", "smem"}, {"pre"})
        pre = launch.get("pre")
        if pre is not None:
            _keys(pre, file, f"{p}.launch.pre", {"grid", "block", "smem"})
        for where, lk in [("launch", launch), *([("launch.pre", pre)] if pre is not None else [])]:
            for k in ("grid", "block"):
                _need(isinstance(lk[k], list) and len(lk[k]) == 3, file, f"{p}.{where}.{k}", "expected 3 formulas [x, y, z]")
        tiles = r["tiles"]
        _need(isinstance(tiles, dict) and tiles, file, f"{p}.tiles", "expected a non-empty mapping tile-id: {params}")
        route = Route(op.name, name, file, r["template"], rarchs, rdtypes, requires, {}, r["args"],
                      launch["grid"], launch["block"], launch["smem"], r.get("constraints", []), pre, r.get("workspace"))
        _need(isinstance(route.args, list), file, f"{p}.args", "expected a list")
        _need(isinstance(route.constraints, list), file, f"{p}.constraints", "expected a list of formulas")
        for tid, tile in tiles.items():
            tp = f"{p}.tiles.{tid}"
            _need(isinstance(tid, str) and TILE_RE.match(tid), file, tp, "tile ids are lower-case letters, digits and _")
            _need(isinstance(tile, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in tile.values()),
                  file, tp, "expected a mapping of integer tile params")
            route.tiles[tid] = tile
            low = route.lowered[tid] = _lower_route(route, op, tile, file, p)
            launches = [low, *([low["pre"]] if "pre" in low else [])]
            for lk in launches:
                threads = 1
                for b in lk["block"]:
                    threads *= int(evaluate(b, {}))  # constants only after lowering
                _need(0 < threads <= 1024, file, f"{tp}", f"block of {threads} threads breaks the limit of 1024")
            smem = max(int(evaluate(lk["smem"], {})) for lk in launches)
            for a in rarchs:
                arch = archs[a]
                lacking = [f for f in requires if f not in arch.features]
                _need(not lacking, file, f"{p}.archs",
                      f"route {op.name}/{name} requires {', '.join(lacking)}, which {a} lacks "
                      f"(its features: {', '.join(arch.features)})")
                _need(smem <= arch.smem_per_block, file, tp,
                      f"tile needs {smem} bytes of shared memory; {a} allows at most {arch.smem_per_block} per block")
        routes[name] = route
    tables = [_table(t, file, f"tables[{i}]", op, routes, archs) for i, t in enumerate(data.get("tables") or [])]
    return op.name, routes, tables


def _table(t, file, p, op: Op, routes: dict[str, Route], archs) -> Table:
    _keys(t, file, p, {"archs", "dtypes", "spans"}, {"problem"})
    tarchs = list(archs) if t["archs"] == "all" else _str_list(t["archs"], file, f"{p}.archs", set(archs), "arch")
    tdtypes = _str_list(t["dtypes"], file, f"{p}.dtypes", set(op.dtypes), "dtype")
    problem = t.get("problem") or {}
    _need(isinstance(problem, dict), file, f"{p}.problem", "expected a mapping dim: value ({} = any problem)")
    for k, v in problem.items():
        _need(k in op.problem, file, f"{p}.problem.{k}", f"unknown problem dim {k!r} (op {op.name} problem dims: {', '.join(op.problem)})")
        _pos_int(v, file, f"{p}.problem.{k}")
    _need(not problem or set(problem) == set(op.problem), file, f"{p}.problem",
          f"a specific problem must give every problem dim ({', '.join(op.problem)})")
    spans = []
    _need(isinstance(t["spans"], list) and t["spans"], file, f"{p}.spans", "expected a non-empty list")
    expect = 1
    for j, s in enumerate(t["spans"]):
        sp = f"{p}.spans[{j}]"
        _keys(s, file, sp, {"from", "to", "use"})
        lo, hi = _pos_int(s["from"], file, f"{sp}.from"), s["to"]
        _need(expect is not None, file, sp, f"span starts at T={lo} after an open span (to: null) already covered T..∞")
        if lo < expect:
            raise SpecError(file, sp, f"span T={lo}.. overlaps the previous span, which ends at T={expect - 1}")
        if lo > expect:
            raise SpecError(file, sp, f"gap: T={expect}..{lo - 1} is covered by no span (spans must cover T=1..∞)")
        if hi is not None:
            _pos_int(hi, file, f"{sp}.to")
            _need(hi >= lo, file, f"{sp}.to", f"span ends (T={hi}) before it starts (T={lo})")
        use = s["use"]
        rname, _, tid = str(use).partition(".")
        _need(rname in routes and tid in routes[rname].tiles, file, f"{sp}.use",
              f"unknown route instance {use!r} (allowed: {', '.join(f'{r}.{t}' for r in routes for t in routes[r].tiles)})")
        route = routes[rname]
        for a in tarchs:
            _need(a in route.archs, file, f"{sp}.use", f"route {rname} is not built for {a} (its archs: {', '.join(route.archs)})")
        for d in tdtypes:
            _need(d in route.dtypes, file, f"{sp}.use", f"route {rname} is not built for dtype {d}")
        _check_t_constraints(route, tid, lo, hi, file, f"{sp}.use")
        spans.append((lo, hi, use))
        expect = None if hi is None else hi + 1
    _need(expect is None, file, f"{p}.spans", f"gap: T={expect}..∞ is covered by no span (the last span needs to: null)")
    return Table(op.name, file, tarchs, tdtypes, problem, spans)


def _check_t_constraints(route: Route, tid: str, lo: int, hi, file, path):
    """A route whose constraints bound T (e.g. T <= tile.tmax) must not be used outside that bound."""
    for c in route.lowered[tid]["constraints"]:
        if free_names(c) <= {"T"}:
            for t in (lo, hi if hi is not None else 1 << 40):
                _need(evaluate(c, {"T": t}), file, path,
                      f"route {route.name}.{tid} admits only {c}; the span reaches T={'∞' if hi is None and t != lo else t}")


def load_specs(root: Path, templates: Path) -> SpecSet:
    root = Path(root)
    _need((root / "archs.yaml").is_file(), root, "", "no archs.yaml here (is this a specs/ directory?)")
    archs = load_archs(root)
    tolerances = load_tolerances(root)
    ops = {}
    for f in sorted((root / "ops").glob("*.yaml")):
        op = load_op(root, f"ops/{f.name}", tolerances)
        ops[op.name] = op
    routes, tables = {}, []
    for f in sorted((root / "routes").glob("*.yaml")):
        for name, rs, ts in load_routes(root, f"routes/{f.name}", ops, archs, templates):
            if name in routes:
                _need(False, f"routes/{f.name}", "", f"op {name!r} already has routes in "
                      f"{next(iter(routes[name].values())).file}")
            routes[name] = rs
            tables += ts
    _check_coverage(ops, routes, tables, archs)
    tuned = {}
    for f in sorted((root / "tuned").glob("*.yaml")) if (root / "tuned").is_dir() else []:
        gpu, arch, ts = load_tuned(root, f"tuned/{f.name}", ops, routes, archs)
        _need(gpu not in tuned, f"tuned/{f.name}", "gpu", f"a second tuned file for {gpu!r}")
        tuned[gpu] = (arch, ts)
    return SpecSet(root, archs, tolerances, ops, routes, tables, tuned)


def load_tuned(root: Path, file: str, ops, routes, archs):
    """tuned/<gpu>.yaml (written by ninfer-tune): route tables measured on one GPU, for its arch. Each table
    obeys the closed catalogue exactly like a default table; one per (op, dtype, problem)."""
    data = load_yaml(root / file, root)
    _keys(data, file, "", {"gpu", "arch", "tables"}, {"measured"})
    _need(isinstance(data["gpu"], str) and data["gpu"], file, "gpu", "expected the GPU's name (torch.cuda.get_device_name)")
    arch = data["arch"]
    _need(arch in archs, file, "arch", f"unknown arch {arch!r} (allowed: {', '.join(sorted(archs))})")
    _need(isinstance(data["tables"], list), file, "tables", "expected a list of tables")
    tables, seen = [], set()
    for i, t in enumerate(data["tables"]):
        p = f"tables[{i}]"
        _need(isinstance(t, dict) and t.get("op") in routes, file, f"{p}.op",
              f"unknown op or op without routes {t.get('op') if isinstance(t, dict) else t!r}")
        op = ops[t["op"]]
        table = _table({k: v for k, v in t.items() if k != "op"} | {"archs": [arch]}, file, p, op, routes[op.name], archs)
        for d in table.dtypes:
            key = (op.name, d, tuple(sorted(table.problem.items())))
            _need(key not in seen, file, p, f"two tuned tables for {op.name}/{d} problem {dict(table.problem) or 'any'}")
            seen.add(key)
        tables.append(table)
    return data["gpu"], arch, tables


def _check_coverage(ops, routes, tables, archs):
    """Every (arch, dtype) an op is built for has exactly one default table, and no problem is listed twice."""
    for name, op in ops.items():
        if name not in routes:
            continue  # reference-only until its kernels land: the cuda backend refuses it by name
        seen = {}
        for t in (t for t in tables if t.op == name):
            for a in t.archs:
                for d in t.dtypes:
                    key = (a, d, tuple(sorted(t.problem.items())))
                    _need(key not in seen, t.file, "tables",
                          f"two tables for {name} on {a}/{d} problem {dict(t.problem) or 'any'}")
                    seen[key] = t
        built = {(a, d) for r in routes[name].values() for a in r.archs for d in r.dtypes}
        for a, d in sorted(built):
            _need((a, d, ()) in seen, next(iter(routes[name].values())).file, "tables",
                  f"no default table (problem: any) for {name} on {a}/{d}: every T must be admitted")

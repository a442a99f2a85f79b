"""Interpret recipes/*.yaml: HF checkpoint names -> .ninfer tensors (names, shapes, roles, formats).

The YAML holds all model knowledge (schema: recipes/README.md); this module only expands it:
  expand(config, present)  -> PlannedTensor list: artifact name, shape, role, flags, and the source
                              tensor names/shapes that feed it (one list per alternative layout, e.g.
                              fused vs per-expert MoE). Needs config.json only, so `verify` can rebuild
                              the expected inventory of an artifact without the checkpoint.
  bind(planned, checkpoint) -> BoundTensor list: each artifact tensor as an ordered list of flat
                              element ranges of source tensors (concat, stack, un-grouping and
                              reshapes are all such ranges), after checking names and shapes.
"""
from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .formats import FLOAT_FORMATS, FORMATS, WEIGHT_FORMATS
from .recipe_expr import ExprError, evaluate

RECIPE_DIR = Path(os.environ.get("NINFER_RECIPES", Path(__file__).resolve().parent.parent / "recipes"))
KINDS = {"quant": WEIGHT_FORMATS, "float": FLOAT_FORMATS}

_TOP = {"recipe", "model_family", "model_types", "description", "config", "dims", "let", "prefixes",
        "roles", "role_prefixes", "rule_sets", "sections"}
_TOP_REQUIRED = {"recipe", "model_family", "model_types", "dims", "roles", "sections"}
_SECTION = {"name", "rules", "flag", "role_prefix", "present_if", "repeat", "vars", "let", "note"}
_RULE = {"name", "role", "shape", "when", "from", "variants", "ungroup", "note"}
_VARIANT = {"from", "repeat"}
_UNGROUP = {"groups", "parts", "take"}
_DIM = {"key", "section", "default"}


class RecipeError(ValueError):
    """The recipe file is invalid, or the model config does not fit it."""


class PlanError(ValueError):
    """The checkpoint does not match the recipe (missing/extra tensors, wrong shapes)."""


@dataclass(frozen=True)
class SourceRef:
    name: str          # may still contain "{P}" (text prefix, chosen when binding)
    shape: tuple
    shape_expr: tuple  # the recipe's expressions, for messages


@dataclass
class PlannedTensor:
    name: str
    shape: tuple
    role: str
    kind: str                      # quant | float
    default_format: str
    flags: tuple
    variants: list                 # list[list[SourceRef]]
    ungroup: tuple | None = None   # (groups, parts, take)


@dataclass
class BoundTensor:
    name: str
    shape: tuple
    role: str
    kind: str
    format: str
    flags: tuple
    segments: list = field(default_factory=list)   # [(source name, first element, count)]

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(s for s, _, _ in self.segments))


class _Missing:
    """A dim whose config key is absent: harmless until an expression uses it."""
    def __init__(self, message):
        self.message = message


class _Names(dict):
    def __getitem__(self, key):
        v = dict.__getitem__(self, key)
        if isinstance(v, _Missing):
            raise ExprError(v.message)
        return v


class _Template(dict):
    def __missing__(self, key):
        raise RecipeError(f"template placeholder {{{key}}} is not defined here")


def _check_keys(obj, allowed, where, required=()):
    if not isinstance(obj, dict):
        raise RecipeError(f"{where}: expected a mapping, got {type(obj).__name__}")
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise RecipeError(f"{where}: unknown key(s) {extra}; allowed: {sorted(allowed)}")
    missing = sorted(set(required) - set(obj))
    if missing:
        raise RecipeError(f"{where}: missing key(s) {missing}")


def available_recipes() -> list[Path]:
    return sorted(RECIPE_DIR.glob("*.yaml"))


def load_recipe(name_or_path) -> "Recipe":
    p = Path(name_or_path)
    if not p.suffix:
        p = RECIPE_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        names = ", ".join(r.stem for r in available_recipes())
        raise RecipeError(f"no recipe {str(name_or_path)!r} (looked for {p}); available: {names}")
    return Recipe(p.read_text("utf-8"), str(p))


def config_sections(config: dict, recipe: "Recipe") -> dict:
    text_key = recipe.config_keys.get("text")
    vision_key = recipe.config_keys.get("vision")
    text = config.get(text_key) if text_key and isinstance(config.get(text_key), dict) else config
    vision = config.get(vision_key) if vision_key and isinstance(config.get(vision_key), dict) else {}
    return {"root": config, "text": text, "vision": vision}


def detect_recipe(config: dict, where: str = "config.json") -> "Recipe":
    """The recipe whose model_types contain config's model_type (or its text_config's)."""
    types = [config.get("model_type")]
    if isinstance(config.get("text_config"), dict):
        types.append(config["text_config"].get("model_type"))
    recipes = [load_recipe(p) for p in available_recipes()]
    for t in types:
        for r in recipes:
            if t in r.model_types:
                return r
    known = sorted(t for r in recipes for t in r.model_types)
    raise RecipeError(f"{where}: unknown model_type {types[0]!r}"
                      + (f" (text_config.model_type {types[1]!r})" if len(types) > 1 else "")
                      + f"; recipes know: {', '.join(known)}")


class Recipe:
    def __init__(self, text: str, path: str = "<recipe>"):
        self.text, self.path = text, path
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: invalid YAML: {e}") from None
        _check_keys(d, _TOP, path, _TOP_REQUIRED)
        self.data = d
        self.name, self.model_family = d["recipe"], d["model_family"]
        self.model_types = list(d["model_types"])
        self.config_keys = d.get("config") or {}
        self.roles = d["roles"]
        self.role_prefixes = d.get("role_prefixes") or {}
        self.rule_sets = d.get("rule_sets") or {}
        self.sections = d["sections"]
        self._validate()

    # -- static validation ---------------------------------------------------------------------
    def _validate(self) -> None:
        p = self.path
        for dim, spec in self.data["dims"].items():
            if isinstance(spec, dict):
                _check_keys(spec, _DIM, f"{p}: dims.{dim}", ["key"])
                if spec.get("section", "text") not in ("text", "root", "vision"):
                    raise RecipeError(f"{p}: dims.{dim}.section must be text, root or vision")
            elif not isinstance(spec, str):
                raise RecipeError(f"{p}: dims.{dim}: expected a config key or a mapping")
        for role, spec in self.roles.items():
            _check_keys(spec, {"kind", "format"}, f"{p}: roles.{role}", ["kind", "format"])
            if spec["kind"] not in KINDS:
                raise RecipeError(f"{p}: roles.{role}.kind {spec['kind']!r}: allowed {sorted(KINDS)}")
            if spec["format"] not in KINDS[spec["kind"]]:
                raise RecipeError(f"{p}: roles.{role}.format {spec['format']!r} not allowed for kind "
                                  f"{spec['kind']} (allowed: {', '.join(KINDS[spec['kind']])})")
        for prefix, spec in self.role_prefixes.items():
            _check_keys(spec, {"format"}, f"{p}: role_prefixes.{prefix}", ["format"])
            if spec["format"] not in WEIGHT_FORMATS:
                raise RecipeError(f"{p}: role_prefixes.{prefix}.format {spec['format']!r} is not a weight format")
        names = set()
        for i, sec in enumerate(self.sections):
            where = f"{p}: sections[{i}]"
            _check_keys(sec, _SECTION, where, ["name", "rules"])
            if sec["name"] in names:
                raise RecipeError(f"{where}: duplicate section name {sec['name']!r}")
            names.add(sec["name"])
            if ("present_if" in sec) != ("flag" in sec):
                raise RecipeError(f"{where}: optional sections need both flag and present_if")
            for j, rule in enumerate(self._rules(sec, where)):
                rw = f"{where} ({sec['name']}) rule {j}"
                _check_keys(rule, _RULE, rw, ["name", "role", "shape"])
                if ("from" in rule) == ("variants" in rule):
                    raise RecipeError(f"{rw} ({rule['name']}): give exactly one of from / variants")
                for v in rule.get("variants", []):
                    _check_keys(v, _VARIANT, f"{rw} variant", ["from"])
                if "ungroup" in rule:
                    _check_keys(rule["ungroup"], _UNGROUP, f"{rw} ungroup", _UNGROUP)
                self.role_spec(rule["role"], sec.get("role_prefix"), rw)

    def _rules(self, sec, where):
        rules = sec["rules"]
        if isinstance(rules, str):
            if rules not in self.rule_sets:
                raise RecipeError(f"{where}: rules {rules!r} is not a rule_set (have {sorted(self.rule_sets)})")
            rules = self.rule_sets[rules]
        if not isinstance(rules, list):
            raise RecipeError(f"{where}: rules must be a list or a rule_set name")
        return rules

    def role_spec(self, role: str, prefix: str | None, where: str = "") -> tuple[str, str, str]:
        """(full role name, kind, default format) of a rule's role inside a section."""
        full = f"{prefix}{role}" if prefix else role
        if full in self.roles:
            return full, self.roles[full]["kind"], self.roles[full]["format"]
        if role not in self.roles:
            raise RecipeError(f"{self.path}: {where}: role {role!r} is not in roles")
        kind, fmt = self.roles[role]["kind"], self.roles[role]["format"]
        if prefix and kind == "quant" and prefix in self.role_prefixes:
            fmt = self.role_prefixes[prefix]["format"]
        return full, kind, fmt

    def known_roles(self) -> dict[str, str]:
        """Every role this recipe can produce -> its kind."""
        out = {}
        for sec in self.sections:
            for rule in self._rules(sec, sec["name"]):
                full, kind, _ = self.role_spec(rule["role"], sec.get("role_prefix"))
                out[full] = kind
        return out

    def optional_sections(self) -> dict[str, str]:
        """flag -> source-name prefix for the optional (flagged) sections."""
        return {s["flag"]: s["present_if"] for s in self.sections if "flag" in s}

    # -- expansion ------------------------------------------------------------------------------
    def namespace(self, config: dict) -> _Names:
        secs = config_sections(config, self)
        names = _Names()
        for dim, spec in self.data["dims"].items():
            spec = {"key": spec} if isinstance(spec, str) else spec
            sec, key = spec.get("section", "text"), spec["key"]
            source = secs[sec]
            if key in source:
                names[dim] = source[key]
            elif sec == "text" and key in secs["root"]:
                names[dim] = secs["root"][key]
            elif "default" in spec:
                names[dim] = spec["default"]
            else:
                names[dim] = _Missing(f"config.json has no {sec} key {key!r} (recipe dim {dim})")
        for k, expr in (self.data.get("let") or {}).items():
            try:
                names[k] = evaluate(expr, names, f"{self.path}: let.{k}")
            except ExprError as e:
                names[k] = _Missing(str(e))
        return names

    def expand(self, config: dict, present: dict[str, bool]) -> list[PlannedTensor]:
        base = self.namespace(config)
        out, seen = [], set()
        for sec in self.sections:
            if "flag" in sec and not present.get(sec["flag"]):
                continue
            where = f"{self.path}: section {sec['name']}"
            repeat = sec.get("repeat") or {}
            if len(repeat) > 1:
                raise RecipeError(f"{where}: repeat takes one variable")
            var, count = next(iter(repeat.items())) if repeat else (None, 1)
            count = self._eval(count, base, f"{where} repeat")
            for idx in range(count):
                names, tmpl = _Names(base), _Template(P="{P}")
                if var:
                    names[var] = tmpl[var] = idx
                for k, t in (sec.get("vars") or {}).items():
                    tmpl[k] = t.format_map(tmpl)
                for k, expr in (sec.get("let") or {}).items():
                    names[k] = self._eval(expr, names, f"{where} let.{k}")
                for rule in self._rules(sec, where):
                    pt = self._expand_rule(rule, sec, names, tmpl, f"{where} ({rule['name']})")
                    if pt is None:
                        continue
                    if pt.name in seen:
                        raise RecipeError(f"{where}: artifact tensor {pt.name!r} is produced twice")
                    seen.add(pt.name)
                    out.append(pt)
        return out

    def _eval(self, expr, names, where):
        try:
            return evaluate(expr, names, where)
        except ExprError as e:
            raise RecipeError(str(e)) from None

    def _shape(self, exprs, names, where) -> tuple:
        shape = tuple(self._eval(e, names, where) for e in exprs)
        if not all(isinstance(d, int) and d > 0 for d in shape):
            raise RecipeError(f"{where}: shape {list(exprs)} evaluates to {list(shape)} (needs positive ints)")
        return shape

    def _expand_rule(self, rule, sec, names, tmpl, where) -> PlannedTensor | None:
        if "when" in rule and not self._eval(rule["when"], names, f"{where} when"):
            return None
        shape = self._shape(rule["shape"], names, f"{where} shape")
        role, kind, fmt = self.role_spec(rule["role"], sec.get("role_prefix"), where)
        variants = []
        for v in rule.get("variants") or [{"from": rule["from"]}]:
            rep = v.get("repeat") or {}
            rvar, rcount = next(iter(rep.items())) if rep else (None, 1)
            srcs = []
            for e in range(self._eval(rcount, names, f"{where} repeat")):
                n2, t2 = _Names(names), _Template(tmpl)
                if rvar:
                    n2[rvar] = t2[rvar] = e
                items = v["from"].items() if isinstance(v["from"], dict) else [(v["from"], None)]
                for src, sshape in items:
                    sexpr = tuple(rule["shape"] if sshape is None else sshape)
                    srcs.append(SourceRef(src.format_map(t2), self._shape(sexpr, n2, where), sexpr))
            variants.append(srcs)
        ungroup = None
        if "ungroup" in rule:
            u = rule["ungroup"]
            ungroup = (self._eval(u["groups"], names, where), [self._eval(x, names, where) for x in u["parts"]],
                       [int(t) for t in u["take"]])
        pt = PlannedTensor(rule["name"].format_map(tmpl), shape, role, kind, fmt,
                           (sec["flag"],) if "flag" in sec else (), variants, ungroup)
        self._check_counts(pt, where)
        return pt

    @staticmethod
    def _check_counts(pt: PlannedTensor, where: str) -> None:
        want = math.prod(pt.shape)
        for srcs in pt.variants:
            if pt.ungroup:
                groups, parts, take = pt.ungroup
                (src,) = srcs
                k = math.prod(src.shape[1:])
                if src.shape[0] != groups * sum(parts):
                    raise RecipeError(f"{where}: ungroup {groups} x {parts} does not tile {src.shape[0]} rows")
                got = groups * sum(parts[t] for t in take) * k
            else:
                got = sum(math.prod(s.shape) for s in srcs)
            if got != want:
                raise RecipeError(f"{where}: sources hold {got} elements, shape {list(pt.shape)} needs {want}")

    # -- binding to a checkpoint ---------------------------------------------------------------
    def present_sections(self, names, skip=()) -> dict[str, bool]:
        return {flag: flag not in skip and any(n.startswith(pre) for n in names)
                for flag, pre in self.optional_sections().items()}

    def choose_prefixes(self, names) -> dict[str, str]:
        chosen = {}
        for var, candidates in (self.data.get("prefixes") or {}).items():
            hit = next((c for c in candidates if any(n.startswith(c) for n in names)), None)
            if hit is None:
                raise PlanError(f"no checkpoint tensor name starts with any of {candidates} "
                                f"(recipe {self.name}, prefix {{{var}}})")
            chosen[var] = hit
        return chosen

    def bind(self, planned: list[PlannedTensor], shapes: dict[str, tuple], skip=()) -> list[BoundTensor]:
        """Check the checkpoint (`shapes`: source name -> shape) against the plan; raise one PlanError
        listing every problem (missing, wrong shape, unexpected)."""
        prefixes = self.choose_prefixes(shapes)

        def real(n):
            for var, val in prefixes.items():
                n = n.replace("{" + var + "}", val)
            return n

        problems, consumed, bound = [], set(), []
        for pt in planned:
            best = None
            for srcs in pt.variants:
                missing = [real(s.name) for s in srcs if real(s.name) not in shapes]
                if not missing:
                    best = (srcs, [])
                    break
                if best is None or len(missing) < len(best[1]):
                    best = (srcs, missing)
            srcs, missing = best
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                problems.append(f"missing tensor {missing[0]!r}{more}, needed for {pt.name}")
                continue
            ok = True
            for s in srcs:
                name = real(s.name)
                consumed.add(name)
                if tuple(shapes[name]) != s.shape:
                    expr = ", ".join(str(e) for e in s.shape_expr)
                    problems.append(f"tensor {name!r} has shape {list(shapes[name])}, expected [{expr}] = "
                                    f"{list(s.shape)} (for {pt.name})")
                    ok = False
            if ok:
                bound.append(BoundTensor(pt.name, pt.shape, pt.role, pt.kind, pt.default_format, pt.flags,
                                         _segments(pt, srcs, real)))
        ignored = tuple(pre for flag, pre in self.optional_sections().items() if flag in skip)
        extra = sorted(n for n in shapes if n not in consumed and not n.startswith(ignored))
        for n in extra[:20]:
            problems.append(f"unexpected tensor {n!r} (shape {list(shapes[n])}) is not mapped by recipe {self.name}")
        if len(extra) > 20:
            problems.append(f"... and {len(extra) - 20} more unexpected tensors")
        if problems:
            raise PlanError(f"checkpoint does not match recipe {self.name} ({self.path}):\n  "
                            + "\n  ".join(problems))
        return bound

    # -- checking an artifact ------------------------------------------------------------------
    def check_inventory(self, config: dict, tensors: dict) -> list[str]:
        """Compare an artifact's tensors (name -> entry with shape/role/flags/format) with what this
        recipe produces for `config`; optional sections count as present if any tensor carries
        their flag. Returns a list of problems (empty = consistent)."""
        flags = {f for t in tensors.values() for f in t.flags}
        expected = self.expand(config, {f: f in flags for f in self.optional_sections()})
        problems, names = [], set()
        for p in expected:
            names.add(p.name)
            t = tensors.get(p.name)
            if t is None:
                problems.append(f"missing tensor {p.name!r} (shape {list(p.shape)}, role {p.role})")
                continue
            if tuple(t.shape) != p.shape:
                problems.append(f"tensor {p.name!r} has shape {list(t.shape)}, recipe expects {list(p.shape)}")
            if t.role != p.role:
                problems.append(f"tensor {p.name!r} has role {t.role!r}, recipe expects {p.role!r}")
            if tuple(t.flags) != p.flags:
                problems.append(f"tensor {p.name!r} has flags {list(t.flags)}, recipe expects {list(p.flags)}")
            if t.format not in KINDS[p.kind]:
                problems.append(f"tensor {p.name!r} is {t.format}, but role {p.role} ({p.kind}) allows only "
                                f"{', '.join(KINDS[p.kind])}")
        for n in tensors:
            if n not in names:
                problems.append(f"unexpected tensor {n!r}: recipe {self.name} does not produce it")
        return problems

    # -- formats -------------------------------------------------------------------------------
    def apply_formats(self, tensors, default: str | None = None, overrides=()) -> None:
        """Set each tensor's format: recipe default per role; `default` for every quant role (and, for
        `fp32`, every float role too: an fp32 artifact is the whole model in fp32, as the oracle tests need);
        then `overrides` [(role or glob, format)] in order. An exact role must admit the format; a
        glob applies to the roles it matches that admit it (and must match at least one). Raises
        RecipeError for an unknown role/format or a format a role may not use."""
        roles = self.known_roles()
        if default is not None and default not in WEIGHT_FORMATS:
            raise RecipeError(f"--format {default!r}: allowed {', '.join(WEIGHT_FORMATS)}")
        targets = []
        for pattern, fmt in overrides:
            if fmt not in FORMATS:
                raise RecipeError(f"--override {pattern}={fmt}: unknown format (known: {', '.join(FORMATS)})")
            hit = [r for r in roles if fnmatch.fnmatchcase(r, pattern)]
            if not hit:
                raise RecipeError(f"--override {pattern}={fmt}: no role matches {pattern!r} in recipe "
                                  f"{self.name} (roles: {', '.join(sorted(roles))})")
            ok = {r for r in hit if fmt in KINDS[roles[r]]}
            if not ok:
                r = hit[0]
                raise RecipeError(f"--override {pattern}={fmt}: role {r} is {roles[r]} and may only use "
                                  f"{', '.join(KINDS[roles[r]])}")
            targets.append((ok, fmt))
        for t in tensors:
            if default is not None and (t.kind == "quant" or default == "fp32"):
                t.format = default
            for ok, fmt in targets:
                if t.role in ok:
                    t.format = fmt
            FORMATS[t.format].check_shape(t.shape, t.name)


def _segments(pt: PlannedTensor, srcs, real) -> list:
    """Flat element ranges, in artifact order, that make up the tensor."""
    if pt.ungroup:
        groups, parts, take = pt.ungroup
        (s,) = srcs
        k, width = math.prod(s.shape[1:]), sum(parts)
        segs = [(real(s.name), (g * width + sum(parts[:t])) * k, parts[t] * k)
                for t in take for g in range(groups)]
    else:
        segs = [(real(s.name), 0, math.prod(s.shape)) for s in srcs]
    merged = []   # join ranges that continue each other (fewer, larger reads)
    for seg in segs:
        if merged and merged[-1][0] == seg[0] and merged[-1][1] + merged[-1][2] == seg[1]:
            merged[-1] = (seg[0], merged[-1][1], merged[-1][2] + seg[2])
        else:
            merged.append(seg)
    return merged

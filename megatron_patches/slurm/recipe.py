"""Load a recipe (YAML) and apply `--set key=value` overrides, with type checks.

A recipe is `recipes/<name>/recipe.yaml` (a folder or the file itself may be given). Its
fields are declared in `schema`: unknown fields, missing required fields and values of the
wrong type fail here, each error naming the dotted field. `--set` values are read as YAML
scalars or lists (`--set parallelism.ep=16`, `--set train.extra_args=[--foo,1]`,
`--set env.NCCL_DEBUG=INFO`), then checked like the file.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os

import yaml

from . import schema as S

RECIPE_FILE = "recipe.yaml"


class RecipeError(ValueError):
    """One or more problems, each a (dotted field, rule) pair."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("\n".join(f"{field}: {rule}" for field, rule in self.problems))


@dataclasses.dataclass
class Recipe:
    """A loaded recipe: `data` is the nested mapping with every default filled in."""

    path: str
    data: dict
    overrides: list[str] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def kind(self) -> str:
        return self.data["kind"]

    def __getitem__(self, dotted: str):
        node = self.data
        for part in dotted.split("."):
            node = node[part]
        return node

    def get(self, dotted: str, default=None):
        try:
            return self[dotted]
        except (KeyError, TypeError):
            return default


def recipe_path(path: str) -> str:
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        path = os.path.join(path, RECIPE_FILE)
    if not os.path.isfile(path):
        raise RecipeError([("recipe", f"{path} does not exist (give recipes/<name> or a recipe.yaml)")])
    return path


def _check_type(field: str, kind: str, value) -> str | None:
    """None when value fits the declared type, else the rule it breaks."""
    nullable = kind.endswith("?")
    base = kind.rstrip("?")
    if value is None:
        return None if nullable else f"must be a {base}, got null"
    if base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base == "str":
        ok = isinstance(value, str)
    elif base == "bool":
        ok = isinstance(value, bool)
    elif base in ("list[str]", "list[int]"):
        item = str if base == "list[str]" else int
        ok = isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in value)
    elif base == "map":
        ok = isinstance(value, dict) and all(
            isinstance(v, (str, int, float, bool)) for v in value.values())
        if ok:
            return None
        return "must be a mapping of names to strings or numbers"
    else:
        raise AssertionError(f"schema type {kind!r} of {field}")
    if ok:
        return None
    return f"must be a {'nullable ' if nullable else ''}{base}, got {value!r} ({type(value).__name__})"


def _merge(schema: dict, given: dict, prefix: str, problems: list) -> dict:
    out = {}
    if not isinstance(given, dict):
        problems.append((prefix.rstrip(".") or "recipe", f"must be a mapping, got {given!r}"))
        given = {}
    for key in given:
        if key not in schema:
            known = ", ".join(schema)
            problems.append((f"{prefix}{key}", f"unknown field (known here: {known})"))
    for key, spec in schema.items():
        field = f"{prefix}{key}"
        if isinstance(spec, dict):
            out[key] = _merge(spec, given.get(key) or {}, field + ".", problems)
            continue
        kind, default = spec
        if key in given:
            value = given[key]
            if kind.rstrip("?") == "float" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            rule = _check_type(field, kind, value)
            if rule:
                problems.append((field, rule))
            out[key] = value
        elif default is S.REQUIRED:
            problems.append((field, "is required"))
            out[key] = None
        else:
            out[key] = copy.deepcopy(default)
    return out


def _parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise RecipeError([(text, "an override is key=value with a dotted key, e.g. parallelism.ep=16")])
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise RecipeError([(key, f"value {raw!r} is not valid YAML: {err}")]) from None
    return key, value


def _schema_leaf(schema: dict, key: str):
    """(type, parent mapping key path) of a dotted key, allowing one level under a `map`."""
    node, parts = schema, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
        if isinstance(node, tuple):
            if node[0] == "map" and i == len(parts) - 2:
                return "map-item"
            return node[0] if i == len(parts) - 1 else None
    return None


def _unknown_key_rule(schema: dict, key: str) -> str:
    """Why `key` is no field: a section given a value, or a name its section does not have."""
    node, parts = schema, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict):  # a leaf with more parts after it
            leaf = ".".join(parts[:i])
            return f"{leaf} is a {node[0]} field and has no sub-fields; set it as --set {leaf}=..."
        if part not in node:
            section = ".".join(parts[:i])
            where = f"in {section}" if section else "at the top level"
            close = difflib.get_close_matches(part, list(node), n=1)
            hint = f"; did you mean {'.'.join(parts[:i] + close + parts[i + 1:])}?" if close else ""
            return f"unknown field (fields {where}: {', '.join(node)}){hint} (docs/slurm.md, Recipe fields)"
        node = node[part]
    first = next(iter(node))
    return (f"is a section, not a field: set one of its fields ({', '.join(f'{key}.{k}' for k in node)}), "
            f"e.g. --set {key}.{first}=...")


def apply_overrides(data: dict, schema: dict, overrides: list[str]) -> None:
    problems = []
    for text in overrides:
        key, value = _parse_override(text)
        kind = _schema_leaf(schema, key)
        if kind is None:
            problems.append((key, _unknown_key_rule(schema, key)))
            continue
        if key in ("kind",):
            problems.append((key, "cannot be overridden"))
            continue
        parts = key.split(".")
        if kind == "map-item":
            if not isinstance(value, (str, int, float, bool)):
                problems.append((key, f"must be a string or number, got {value!r}"))
                continue
            value = str(value) if not isinstance(value, str) else value
        else:
            if kind.rstrip("?") == "float" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if kind.rstrip("?") == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = raw_str(text)
            if kind.rstrip("?") == "list[str]" and isinstance(value, list):
                value = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
            rule = _check_type(key, kind, value)
            if rule:
                problems.append((key, rule))
                continue
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    if problems:
        raise RecipeError(problems)


def raw_str(text: str) -> str:
    return text.split("=", 1)[1].strip()


def load(path: str, overrides: list[str] | None = None) -> Recipe:
    """Read, fill defaults, type-check, apply overrides. Raises RecipeError."""
    path = recipe_path(path)
    with open(path) as f:
        try:
            given = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:
            raise RecipeError([("recipe", f"{path} is not valid YAML: {err}")]) from None
    kind = given.get("kind", "pretrain") if isinstance(given, dict) else "pretrain"
    try:
        schema = S.schema_for(kind)
    except KeyError:
        raise RecipeError([("kind", f"must be one of {', '.join(S.KINDS)}, got {kind!r}")]) from None
    problems: list = []
    data = _merge(schema, given, "", problems)
    if problems:
        raise RecipeError([(f, f"{r} (in {path})") for f, r in problems])
    overrides = list(overrides or [])
    apply_overrides(data, schema, overrides)
    return Recipe(path=path, data=data, overrides=overrides)

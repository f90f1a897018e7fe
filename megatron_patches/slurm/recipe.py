"""Load a recipe (YAML) and apply `--set key=value` overrides, with type checks.

A recipe is a folder holding a recipe.yaml (the folder or the file may be given), or the
name of one the package ships: RECIPES_DIR, the package's recipes/ (a link to the checkout's
recipes/ in a clone, the same files copied there in a wheel: pyproject.toml's package data). Its
fields are declared in `schema`: unknown fields, missing required fields and values of the
wrong type fail here, each error naming the dotted field. `--set` values are read as YAML
scalars or lists (`--set parallelism.ep=16`, `--set train.extra_args=[--foo,1]`,
`--set env.NCCL_DEBUG=INFO`), then checked like the file.

Text fields (type str, list[str] and the values of `env`) keep the text as written, in the
file and in `--set`: YAML would read `010` as 8, `1:30` as 90, `1.10` as 1.1 and `yes` as
True, which would silently change an environment variable or a Megatron flag. Only `null`
(or `~`) stays null.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import io
import math
import os
import re

import yaml

from hybrid_ep.checks import is_int, is_real

from . import schema as S

RECIPE_FILE = "recipe.yaml"
# Schema types whose scalars keep the text as written (see the module docstring).
TEXT_TYPES = ("str", "list[str]", "map")


class _TextLoader(yaml.SafeLoader):
    """A safe loader that keeps numbers, booleans and dates as the text written (null stays null)."""


for _tag in ("int", "float", "bool", "timestamp"):
    _TextLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", yaml.SafeLoader.construct_scalar)


def _as_text(node):
    """The value of a composed YAML node, numbers, booleans and dates kept as their text."""
    return _TextLoader("").construct_object(node, deep=True)


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


# The recipes the package ships (a bare recipe name is looked up there): the checkout's recipes/
# through a link in a clone, package data in a wheel.
RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")


def recipe_names(folder: str) -> list[str]:
    """The recipes in a folder: its sub-folders that hold a recipe.yaml."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    return sorted(e for e in entries if os.path.isfile(os.path.join(folder, e, RECIPE_FILE)))


def shipped_name(path: str) -> str | None:
    """The name of the shipped recipe whose recipe.yaml `path` is (through any link), else None."""
    folder = os.path.dirname(os.path.realpath(path))
    if os.path.dirname(folder) == os.path.realpath(RECIPES_DIR):
        return os.path.basename(folder)
    return None


def recipe_path(path: str) -> str:
    """The recipe.yaml of a folder, a file, or the name of a shipped recipe."""
    path = os.path.expanduser(path)
    if not os.path.exists(path) and "/" not in path.rstrip("/") and path in recipe_names(RECIPES_DIR):
        path = os.path.join(RECIPES_DIR, path)
    if os.path.isdir(path):
        path = os.path.join(path, RECIPE_FILE)
    if not os.path.isfile(path):
        raise RecipeError([("recipe", _missing(path))])
    return path


def _missing(path: str) -> str:
    """Why a recipe path names none, with the recipes there are: beside it, else in recipes/
    (then by bare name, as recipe_path takes them)."""
    given = path[:-len(RECIPE_FILE)].rstrip("/") if path.endswith("/" + RECIPE_FILE) else path.rstrip("/")
    folder = os.path.dirname(given)
    names = recipe_names(folder or ".") if folder else []
    if not names:
        folder, names = "", recipe_names(RECIPES_DIR)
    if not names:
        return f"{path} does not exist (give a recipe's name, its folder or its recipe.yaml)"
    close = difflib.get_close_matches(os.path.basename(given), names, n=1)
    hint = f"; did you mean {os.path.join(folder, close[0])}?" if close else ""
    where = f"in {folder}" if folder else "by name"
    return f"no recipe at {given}{hint}\n  recipes {where}: {', '.join(names)}"


def _check_type(field: str, kind: str, value) -> str | None:
    """None when value fits the declared type, else the rule it breaks."""
    nullable = kind.endswith("?")
    base = kind.rstrip("?")
    if value is None:
        return None if nullable else f"must be a {base}, got null"
    if base == "int":
        ok = is_int(value)
    elif base == "float":
        ok = is_real(value)
        if ok and not math.isfinite(value):
            return f"must be a finite number{' or null' if nullable else ''}, got {value!r}"
    elif base == "str":
        ok = isinstance(value, str)
    elif base == "bool":
        ok = isinstance(value, bool)
    elif base in ("list[str]", "list[int]"):
        item = (lambda v: isinstance(v, str)) if base == "list[str]" else is_int
        ok = isinstance(value, list) and all(item(v) for v in value)
    elif base == "map":
        if not isinstance(value, dict):
            return f"must be a mapping of names to strings or numbers, got {value!r}"
        for name, item in value.items():
            rule = _env_rule(name, item)
            if rule:
                return f"{name}: {rule}" if isinstance(name, str) else rule
        return None
    else:
        raise AssertionError(f"schema type {kind!r} of {field}")
    if ok:
        return None
    return f"must be a {'nullable ' if nullable else ''}{base}, got {value!r} ({type(value).__name__})"


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_rule(name, value) -> str | None:
    """None when `name: value` is an environment variable the job can export, else the rule."""
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        return (f"{name!r} is not an environment variable name (letters, digits and _, not starting "
                "with a digit)")
    if not (isinstance(value, str) or is_real(value)):
        return f"must be a string or number, got {value!r}"
    return None


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
            if kind.rstrip("?") == "float" and is_int(value):
                value = float(value)
            if kind == "map" and isinstance(value, dict):
                problems += [(f"{field}.{name}", rule) for name, rule in
                             ((name, _env_rule(name, item)) for name, item in value.items()) if rule]
            else:
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


def _parse_override(text: str) -> tuple[str, str]:
    """(dotted key, the value's text) of `key=value`."""
    if "=" not in text:
        raise RecipeError([(text, "an override is key=value with a dotted key, e.g. parallelism.ep=16")])
    key, raw = text.split("=", 1)
    return key.strip(), raw


def _override_value(key: str, raw: str, kind: str):
    """The value of an override read as YAML; text types (and env values) keep numbers,
    booleans and dates as written."""
    if not raw.strip():
        return ""
    try:
        if kind == "map-item" or kind.rstrip("?") in TEXT_TYPES:
            return yaml.load(raw, Loader=_TextLoader)
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise RecipeError([(key, f"value {raw!r} is not valid YAML: {err}")]) from None


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
        key, raw = _parse_override(text)
        kind = _schema_leaf(schema, key)
        if kind is None:
            problems.append((key, _unknown_key_rule(schema, key)))
            continue
        if key in ("kind",):
            problems.append((key, "cannot be overridden"))
            continue
        try:
            value = _override_value(key, raw, kind)
        except RecipeError as err:
            problems += err.problems
            continue
        parts = key.split(".")
        if kind == "map-item":
            rule = _env_rule(parts[-1], value)
            if rule:
                problems.append((key, rule))
                continue
        else:
            if kind.rstrip("?") == "float" and is_int(value):
                value = float(value)
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


def _child(node, key: str):
    """The value node of `key` in a composed mapping node (the last one, as the loader keeps)."""
    if not isinstance(node, yaml.MappingNode):
        return None
    found = None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            found = value_node
    return found


def _keep_text(root, given: dict, schema: dict) -> None:
    """Replace the values of text fields in `given` by their text as written (TEXT_TYPES)."""
    for dotted, kind, _ in S.leaves(schema):
        if kind.rstrip("?") not in TEXT_TYPES:
            continue
        parts = dotted.split(".")
        node, mapping = root, given
        for part in parts[:-1]:
            node, mapping = _child(node, part), mapping.get(part)
            if not isinstance(mapping, dict):
                break
        else:
            node = _child(node, parts[-1])
            if node is not None and parts[-1] in mapping:
                mapping[parts[-1]] = _as_text(node)


def _read(path: str):
    """The recipe file as a mapping with its text fields kept as written; RecipeError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise RecipeError([("recipe", f"{path} is not UTF-8 text ({err})")]) from None
    except OSError as err:
        raise RecipeError([("recipe", f"{path} cannot be read: {err.strerror or err}")]) from None
    try:
        stream = io.StringIO(text)
        stream.name = path  # YAML errors name the file
        root = yaml.compose(stream, Loader=yaml.SafeLoader)
        given = yaml.SafeLoader("").construct_document(root) if root is not None else None
    except yaml.YAMLError as err:
        raise RecipeError([("recipe", f"{path} is not valid YAML: {err}")]) from None
    return root, given or {}


def _kind_of(given, path: str) -> str:
    kind = given.get("kind", "pretrain") if isinstance(given, dict) else "pretrain"
    if not isinstance(kind, str) or kind not in S.KINDS:
        raise RecipeError([("kind", f"must be one of {', '.join(S.KINDS)}, got {kind!r} (in {path})")])
    return kind


def load(path: str, overrides: list[str] | None = None) -> Recipe:
    """Read, fill defaults, type-check, apply overrides. Raises RecipeError."""
    path = recipe_path(path)
    root, given = _read(path)
    schema = S.schema_for(_kind_of(given, path))
    if isinstance(given, dict):
        _keep_text(root, given, schema)
    problems: list = []
    data = _merge(schema, given, "", problems)
    if problems:
        raise RecipeError([(f, f"{r} (in {path})") for f, r in problems])
    overrides = list(overrides or [])
    apply_overrides(data, schema, overrides)
    return Recipe(path=path, data=data, overrides=overrides)

"""Placements as YAML, in the shape of TensorRT-LLM's EPLB config.

    num_slots: 288
    num_experts: 256
    ep_size: 32
    num_nodes: 4
    initial_global_assignments:     # layer index -> expert id of every slot
      0: [0, 1, ...]

Slot s of layer l lives on rank s // (num_slots / ep_size), as in planner.Placement.
Loading checks every key and names the one that is wrong.
Legend: L layers, S slots.
"""

from __future__ import annotations

import torch
import yaml

from .planner import Placement

ASSIGNMENTS_KEY = "initial_global_assignments"
_SIZE_KEYS = ("num_slots", "num_experts", "ep_size", "num_nodes")


def save_placement_yaml(placement: Placement, path: str, extra: dict | None = None) -> str:
    """Write placement (validated) to path; extra keys (plain values) go at the top level."""
    placement.validate()
    doc = {"num_slots": placement.num_slots, "num_experts": placement.num_experts,
           "ep_size": placement.num_ranks, "num_nodes": placement.num_nodes,
           "num_layers": placement.num_layers}
    for key, value in (extra or {}).items():
        if key in doc or key == ASSIGNMENTS_KEY:
            raise ValueError(f"extra key {key!r} clashes with a placement key")
        doc[key] = value
    doc[ASSIGNMENTS_KEY] = {i: [int(e) for e in row] for i, row in enumerate(placement.slot_to_expert.tolist())}
    try:  # the whole text first: a value YAML cannot write must not leave an emptied file
        text = yaml.safe_dump(doc, default_flow_style=None, sort_keys=False, width=100000)
    except yaml.YAMLError as exc:
        raise ValueError(f"extra values must be plain (numbers, strings, lists, dicts): {exc}") from None
    with open(path, "w") as f:
        f.write(text)
    return path


def load_placement_yaml(path: str) -> Placement:
    """Read a placement written by save_placement_yaml (or by hand); ValueError names the problem."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(doc).__name__}")
    sizes = {}
    for key in _SIZE_KEYS:
        value = doc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
        sizes[key] = value
    table = doc.get(ASSIGNMENTS_KEY)
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: {ASSIGNMENTS_KEY} must map layer index -> list of expert ids")
    layers = list(range(len(table)))
    if any(isinstance(k, bool) or not isinstance(k, int) for k in table) or sorted(table) != layers:
        raise ValueError(f"{path}: {ASSIGNMENTS_KEY} keys must be the layer indices 0..{len(table) - 1}, "
                         f"got {sorted(map(str, table))[:5]}")
    rows = []
    for layer in layers:
        row = table[layer]
        if not isinstance(row, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in row):
            raise ValueError(f"{path}: {ASSIGNMENTS_KEY}[{layer}] must be a list of expert ids")
        outside = [e for e in row if not 0 <= e < sizes["num_experts"]]
        if outside:
            raise ValueError(f"{path}: {ASSIGNMENTS_KEY}[{layer}] has expert id {outside[0]}, outside "
                             f"[0, {sizes['num_experts'] - 1}] (num_experts={sizes['num_experts']})")
        if len(row) != sizes["num_slots"]:
            raise ValueError(f"{path}: {ASSIGNMENTS_KEY}[{layer}] has {len(row)} slots, num_slots is "
                             f"{sizes['num_slots']}")
        rows.append(row)
    if "num_layers" in doc and doc["num_layers"] != len(rows):
        raise ValueError(f"{path}: num_layers is {doc['num_layers']} but {ASSIGNMENTS_KEY} has {len(rows)} layers")
    placement = Placement(torch.tensor(rows, dtype=torch.int64), sizes["ep_size"], sizes["num_nodes"],
                          sizes["num_experts"])
    try:
        return placement.validate()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc

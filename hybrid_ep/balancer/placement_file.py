"""Placements as YAML, in the shape of TensorRT-LLM's EPLB config.

    num_slots: 288
    num_experts: 256
    ep_size: 32
    num_nodes: 4
    layer_numbers: [3, 5]           # optional: the model layer number of each row
    initial_global_assignments:     # layer index -> expert id of every slot
      0: [0, 1, ...]

Slot s of layer l lives on rank s // (num_slots / ep_size), as in placement.Placement.
layer_numbers are Megatron's global layer numbers (`layer.layer_number`, counted from 1, as
the balancer's statistics and reports name layers): a model takes the rows of its own MoE
layers by number (NumberedPlacement.rows_for), so one file serves every pipeline stage. A
file without them (older versions, by hand) is matched in order.
Loading checks every key and names the one that is wrong.
Legend: L layers, S slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import yaml

from ..checks import is_int
from .placement import Placement

ASSIGNMENTS_KEY = "initial_global_assignments"
LAYER_NUMBERS_KEY = "layer_numbers"
_SIZE_KEYS = ("num_slots", "num_experts", "ep_size", "num_nodes")


@dataclasses.dataclass(frozen=True, eq=False)
class NumberedPlacement(Placement):
    """A Placement with the model layer number of each row, as a file records them (None: a file
    of an older version or written by hand, matched to a model's MoE layers in order)."""

    layer_numbers: tuple[int, ...] | None = None

    def validate(self) -> "NumberedPlacement":
        super().validate()
        if self.layer_numbers is not None:
            problem = layer_numbers_problem(self.layer_numbers, self.num_layers)
            if problem:
                raise ValueError(f"{LAYER_NUMBERS_KEY} {problem}")
        return self

    def missing_layers(self, numbers: Sequence[int]) -> list[int]:
        """The model layer numbers of `numbers` that have no row here ([] without layer_numbers)."""
        if self.layer_numbers is None:
            return []
        return [int(n) for n in numbers if int(n) not in self.layer_numbers]

    def rows_for(self, numbers: Sequence[int]) -> torch.Tensor:
        """[len(numbers), S] int64: the rows of the model layers `numbers`, in their order. By
        layer number; without layer_numbers the rows in order, and then the counts must agree.
        ValueError names the layers missing (or both counts)."""
        numbers = [int(n) for n in numbers]
        if self.layer_numbers is None:
            if self.num_layers != len(numbers):
                raise ValueError(f"the placement has {self.num_layers} layers and no {LAYER_NUMBERS_KEY}, "
                                 f"{len(numbers)} layers ({numbers}) want rows")
            return self.slot_to_expert.clone()
        missing = self.missing_layers(numbers)
        if missing:
            raise ValueError(f"the placement has no rows for layers {missing} (its {LAYER_NUMBERS_KEY}: "
                             f"{list(self.layer_numbers)})")
        index = {n: i for i, n in enumerate(self.layer_numbers)}
        return self.slot_to_expert[[index[n] for n in numbers]].clone()


def layer_numbers_problem(numbers, num_layers: int) -> str | None:
    """What is wrong with numbers as the layer numbers of num_layers rows, or None."""
    if not isinstance(numbers, (list, tuple)) or not all(is_int(n) for n in numbers):
        return f"must be a list of integers (the model layer number of each row), got {numbers!r}"
    if len(numbers) != num_layers:
        return f"has {len(numbers)} entries for {num_layers} layers"
    if any(n < 1 for n in numbers):
        return f"must be layer numbers >= 1 (Megatron counts layers from 1), got {list(numbers)}"
    if len(set(numbers)) != len(numbers):
        return f"names a layer twice: {list(numbers)}"
    return None


def save_placement_yaml(placement: Placement, path: str, extra: dict | None = None) -> str:
    """Write placement (validated) to path; extra keys (plain values) go at the top level.

    extra["layer_numbers"], else a NumberedPlacement's own, is written as the model layer
    number of each row (checked as loading checks it)."""
    placement.validate()
    doc = {"num_slots": placement.num_slots, "num_experts": placement.num_experts,
           "ep_size": placement.num_ranks, "num_nodes": placement.num_nodes,
           "num_layers": placement.num_layers}
    own = getattr(placement, LAYER_NUMBERS_KEY, None)
    if own is not None:
        doc[LAYER_NUMBERS_KEY] = [int(n) for n in own]
    for key, value in (extra or {}).items():
        if (key in doc and key != LAYER_NUMBERS_KEY) or key == ASSIGNMENTS_KEY:
            raise ValueError(f"extra key {key!r} clashes with a placement key")
        doc[key] = value
    doc[ASSIGNMENTS_KEY] = {i: [int(e) for e in row] for i, row in enumerate(placement.slot_to_expert.tolist())}
    try:  # the whole text first: a value YAML cannot write must not leave an emptied file
        text = yaml.safe_dump(doc, default_flow_style=None, sort_keys=False, width=100000)
    except yaml.YAMLError as exc:
        raise ValueError(f"extra values must be plain (numbers, strings, lists, dicts): {exc}") from None
    if LAYER_NUMBERS_KEY in doc:
        problem = layer_numbers_problem(doc[LAYER_NUMBERS_KEY], placement.num_layers)
        if problem:
            raise ValueError(f"{LAYER_NUMBERS_KEY} {problem}")
    with open(path, "w") as f:
        f.write(text)
    return path


def load_placement_yaml(path: str) -> NumberedPlacement:
    """Read a placement written by save_placement_yaml (or by hand), with its layer_numbers
    (None where the file has none); ValueError names the problem."""
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
        if not is_int(value, 1):
            raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
        sizes[key] = value
    table = doc.get(ASSIGNMENTS_KEY)
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: {ASSIGNMENTS_KEY} must map layer index -> list of expert ids")
    layers = list(range(len(table)))
    if not all(is_int(k) for k in table) or sorted(table) != layers:
        raise ValueError(f"{path}: {ASSIGNMENTS_KEY} keys must be the layer indices 0..{len(table) - 1}, "
                         f"got {sorted(map(str, table))[:5]}")
    rows = []
    for layer in layers:
        row = table[layer]
        if not isinstance(row, list) or not all(is_int(e) for e in row):
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
    numbers = doc.get(LAYER_NUMBERS_KEY)
    if numbers is not None:
        problem = layer_numbers_problem(numbers, len(rows))
        if problem:
            raise ValueError(f"{path}: {LAYER_NUMBERS_KEY} {problem}")
        numbers = tuple(numbers)
    placement = NumberedPlacement(torch.tensor(rows, dtype=torch.int64), sizes["ep_size"], sizes["num_nodes"],
                                  sizes["num_experts"], numbers)
    try:
        return placement.validate()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc

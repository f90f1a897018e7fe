"""The timing model's constants for one GPU: one table, each value with where it came from.

One table per GPU: h100.json (the microbenchmarks of the H100 run of 2026-11-26, three
constants fitted to that run's W = 2 points; its other points held out) and h200.json (the
microbenchmarks of the H200 run of 2026-11-26, with h100.json's three fitted constants: the
same SM design at the same clock). Each holds every
constant the model costs (csrc/device/model/timing.h, listed by
hybrid_ep._model.timing_costs()), with its unit and source: an estimate ("est."), a fit to
measured kernel times ("fit", at most three constants), the GPU microbenchmarks'
measurement ("micro.json", derived where the model's constant is part of what they time), or
an instruction count read off the kernels' SASS ("SASS").
Replacing a value means editing that one entry.
"""

from __future__ import annotations

import dataclasses
import json
import os

SCHEMA = "hybrid-ep-timing-constants/1"
H100 = os.path.join(os.path.dirname(__file__), "h100.json")
H200 = os.path.join(os.path.dirname(__file__), "h200.json")


@dataclasses.dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


@dataclasses.dataclass(frozen=True)
class Table:
    device: str
    constants: dict  # name -> Constant

    def costs(self) -> dict[str, float]:
        """{name: value}, as hybrid_ep._model.set_timing takes it."""
        return {name: float(c.value) for name, c in self.constants.items()}

    def with_values(self, **values: float) -> "Table":
        """The same table with some values replaced (their sources kept: for trial fits)."""
        unknown = set(values) - set(self.constants)
        if unknown:
            raise ValueError(f"no timing constant named {', '.join(sorted(unknown))}")
        return Table(self.device, {n: dataclasses.replace(c, value=values.get(n, c.value))
                                   for n, c in self.constants.items()})

    def fitted(self) -> list[str]:
        return [n for n, c in self.constants.items() if c.source.startswith("fit")]


NOTE = ("Every constant of the timing model (csrc/device/model/timing.h) for one GPU, each with where its value "
        "comes from. 'est.' values are estimates within the range given, to be replaced by the project's GPU "
        "microbenchmarks (csrc/microbench) when they have run; 'fit' values were fitted to measured kernel times "
        "(tools/timing/README.md), at most three of them; 'SASS' values are instruction counts read off "
        "the kernels' SASS.")


def save_table(table: Table, path: str = H100) -> None:
    """The table as JSON, one line per constant."""
    lines = [f'  {json.dumps(n)}: {json.dumps(dataclasses.asdict(c))}' for n, c in table.constants.items()]
    head = {"schema": SCHEMA, "device": table.device, "note": NOTE}
    with open(path, "w") as f:
        f.write(json.dumps(head, indent=1)[:-2] + ',\n "constants": {\n' + ",\n".join(lines) + "\n }\n}\n")


def with_sources(table: Table, values: dict, source: str) -> Table:
    """The table with new values for some constants, each now from `source`."""
    return Table(table.device, {n: Constant(float(values[n]), c.unit, source) if n in values else c
                                for n, c in table.constants.items()})


def load_table(path: str = H100) -> Table:
    with open(path) as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    constants = {n: Constant(float(c["value"]), c["unit"], c["source"]) for n, c in data["constants"].items()}
    return Table(data["device"], constants)


def check_against_model(table: Table, model) -> None:
    """ValueError unless the table names exactly the constants the model costs."""
    want = {name for name, _ in model.timing_costs()}
    have = set(table.constants)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise ValueError(f"the timing table and the model differ: missing {missing}, not costed {extra}")

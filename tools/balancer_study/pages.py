"""A study's three outputs, written alike: NAME.json (every number), NAME.md (the page) and NAME.png."""

from __future__ import annotations

import json
import os


def write_page(doc: dict, out: str, name: str, markdown, plot) -> None:
    """Write doc as out/name.json, markdown(doc) as out/name.md and plot(doc, out/name.png); print the page."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    page = markdown(doc)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(page)
    plot(doc, os.path.join(out, f"{name}.png"))
    print(page)
    print(f"wrote {out}/{name}.json, .md and .png")

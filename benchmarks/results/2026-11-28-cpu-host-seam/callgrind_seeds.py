"""Instructions per pair per rank, before against after, over runs with several string-hash seeds.

    python callgrind_seeds.py N ROOT [OBJECT]
        # ROOT/seed*/before, ROOT/seed*/after: callgrind_pairs.py's folders; N: CG_N

Per point: the mean over the seeds of each tree, the change of the means, and the smallest and
largest change of one seed's pair of runs. OBJECT (libgomp): leave out the self cost of the
functions of the shared objects whose name holds it. Dump k of a run covers the code from
marker k - 1 to marker k: the measured blocks are the even-numbered dumps, one per point in
order.txt (as ../2026-11-28-cpu-host-house/callgrind_table.py reads them)."""

import ast
import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-11-28-cpu-host-house"))
from callgrind_self import self_costs  # noqa: E402


def blocks(folder: str, points: int, without: str | None) -> list[int]:
    """Instructions of each measured block of a run, less `without`'s self cost."""
    out = []
    for j in range(points):
        [path] = glob.glob(f"{folder}/cg.*.{2 * j + 2}")
        if without is None:
            with open(path) as lines:
                out.append(next(int(line.split()[1]) for line in lines if line.startswith(("totals:", "summary:"))))
        else:
            costs = self_costs(path)
            out.append(sum(c for name, c in costs.items() if without not in name.rsplit("[", 1)[-1]))
    return out


def main() -> None:
    n, root = int(sys.argv[1]), sys.argv[2]
    without = sys.argv[3] if len(sys.argv) > 3 else None
    seeds = sorted(glob.glob(root + "/seed*"))
    with open(seeds[0] + "/before/order.txt") as f:
        order = ast.literal_eval(f.read())
    runs = []
    for s in seeds:
        for tree in ("before", "after"):
            with open(f"{s}/{tree}/order.txt") as f:
                assert ast.literal_eval(f.read()) == order, f"{s}/{tree}: another order of points"
        runs.append((blocks(s + "/before", len(order), without), blocks(s + "/after", len(order), without)))
    names = ", ".join(s.rsplit("/", 1)[-1] for s in seeds)
    less = f", less the self cost in {without}" if without else ""
    print(f"Means over {names}{less}; the change per seed: smallest .. largest.\n")
    print("| W | path | level | before: k instructions per pair per rank | after | change | per seed |")
    print("|---|---|---|---|---|---|---|")
    for j, (world, path, level) in enumerate(order):
        b = [before[j] / n / world for before, _ in runs]
        a = [after[j] / n / world for _, after in runs]
        mb, ma = sum(b) / len(b), sum(a) / len(a)
        per = [100 * (y - x) / x for x, y in zip(b, a)]
        print(f"| {world} | {path} | {level} | {mb / 1e3:.1f} | {ma / 1e3:.1f} | {100 * (ma - mb) / mb:+.1f}% | "
              f"{min(per):+.1f} .. {max(per):+.1f}% |")


if __name__ == "__main__":
    main()

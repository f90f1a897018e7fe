"""Instructions per pair per rank, before against after, from two folders of callgrind_pairs.py.

    python callgrind_table.py N BEFORE AFTER    # N: the pairs per measured block (CG_N)

Dump k of a run covers the code from marker k - 1 to marker k: the measured blocks are the
even-numbered dumps, one per point in order.txt."""

import ast
import glob
import sys


def totals(folder: str) -> list[int]:
    files = sorted(glob.glob(folder + "/cg.*.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
    out = []
    for f in files:
        with open(f) as lines:
            for line in lines:
                if line.startswith(("totals:", "summary:")):
                    out.append(int(line.split()[1]))
                    break
    return out


def main() -> None:
    n, before_dir, after_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with open(before_dir + "/order.txt") as f:
        order = ast.literal_eval(f.read())
    before, after = totals(before_dir), totals(after_dir)
    print("| W | path | level | before: k instructions per pair per rank | after | change |")
    print("|---|---|---|---|---|---|")
    for j, (world, path, level) in enumerate(order):
        ib = before[2 * j + 1] / n / world
        ia = after[2 * j + 1] / n / world
        print(f"| {world} | {path} | {level} | {ib / 1e3:.1f} | {ia / 1e3:.1f} | {100 * (ia - ib) / ib:+.1f}% |")


if __name__ == "__main__":
    main()

"""Self cost by function of one measured block, before against after, per pair and rank.

    python callgrind_self.py BEFORE_DUMP AFTER_DUMP DIVISOR   # DIVISOR: pairs x ranks

Reads callgrind's uncompressed format (--compress-strings=no): the cost lines under each fn=,
without the inclusive cost line that follows each calls= line."""

import collections
import sys


def self_costs(path: str) -> collections.Counter:
    costs: collections.Counter = collections.Counter()
    fn, obj, after_call = None, "", False
    with open(path) as lines:
        for line in lines:
            if line.startswith("ob="):
                obj = line[3:].strip()
            elif line.startswith("fn="):
                fn = f"{line[3:].strip()}  [{obj.rsplit('/', 1)[-1]}]"
            elif line.startswith("calls="):
                after_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if after_call:
                    after_call = False
                    continue
                parts = line.split()
                if len(parts) >= 2 and fn:
                    costs[fn] += int(parts[1])
    return costs


def main() -> None:
    before, after, divisor = self_costs(sys.argv[1]), self_costs(sys.argv[2]), int(sys.argv[3])
    print("total self", sum(before.values()) / divisor, sum(after.values()) / divisor)
    names = sorted(set(before) | set(after), key=lambda k: -(after[k] - before[k]))
    for name in names[:30] + ["..."] + names[-15:]:
        if name == "...":
            print("...")
            continue
        print(f"{(after[name] - before[name]) / divisor:+8.0f} {before[name] / divisor:8.0f} "
              f"{after[name] / divisor:8.0f} {name[:150]}")


if __name__ == "__main__":
    main()

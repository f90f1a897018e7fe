import sys, collections
def self_costs(path):
    d = collections.Counter(); fn = None; skip = False; ob = ""
    for line in open(path):
        if line.startswith("fn="): fn = line[3:].strip() + "  [" + ob.rsplit("/",1)[-1] + "]"; continue
        if line.startswith("ob="): ob = line[3:].strip(); continue
        if line.startswith("calls="): skip = True; continue
        if line and (line[0].isdigit() or line[0] in "+-*"):
            if skip: skip = False; continue
            parts = line.split()
            if len(parts) >= 2 and fn: d[fn] += int(parts[1])
    return d
b = self_costs(sys.argv[1]); a = self_costs(sys.argv[2]); N = int(sys.argv[3])
print("total self", sum(b.values())/N, sum(a.values())/N)
keys = set(a)|set(b)
diff = sorted(keys, key=lambda k: -(a[k]-b[k]))
for k in diff[:30]: print(f"{(a[k]-b[k])/N:+8.0f} {b[k]/N:8.0f} {a[k]/N:8.0f} {k[:150]}")
print("...")
for k in diff[-15:]: print(f"{(a[k]-b[k])/N:+8.0f} {b[k]/N:8.0f} {a[k]/N:8.0f} {k[:150]}")

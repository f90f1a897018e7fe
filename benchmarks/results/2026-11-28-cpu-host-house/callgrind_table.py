import glob, sys, ast
N = int(sys.argv[1]); dirs = sys.argv[2:4]
def totals(d):
    files = sorted(glob.glob(d + '/cg.*.*'), key=lambda p: int(p.rsplit('.', 1)[1]))
    out = []
    for f in files:
        for line in open(f):
            if line.startswith('totals:') or line.startswith('summary:'):
                out.append(int(line.split()[1])); break
    return out
order = ast.literal_eval(open(dirs[0] + '/order.txt').read())
b, a = totals(dirs[0]), totals(dirs[1])
print("| W | path | level | before: k instructions per pair per rank | after | change |")
print("|---|---|---|---|---|---|")
for j, (W, path, level) in enumerate(order):
    ib = b[2 * j + 1] / N / W; ia = a[2 * j + 1] / N / W
    print(f"| {W} | {path} | {level} | {ib/1e3:.1f} | {ia/1e3:.1f} | {100*(ia-ib)/ib:+.1f}% |")

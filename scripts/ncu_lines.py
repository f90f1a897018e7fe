"""Warp stall samples of an `ncu --page source --csv --print-source cuda,sass` table summed per
source line: the 15 lines with the most samples and their two main stall reasons.

Usage: python3 scripts/ncu_lines.py TABLE.csv [...]  (gpu_check.sh ncu writes the report)
"""
import collections
import csv
import sys


def num(x):
    try: return float(x)
    except: return None
for path in sys.argv[1:]:
    rows = list(csv.reader(open(path)))
    cur_file = None; hdr = None; by_line = collections.Counter(); reason = collections.defaultdict(collections.Counter); text = {}
    for r in rows:
        if not r: continue
        if r[0] == "File Path" or r[0].startswith("File"): cur_file = r[-1]; continue
        if r[0] == "Line No": hdr = r; continue
        if hdr and len(r) == len(hdr) and num(r[0]) is not None:
            i = 4; v = num(r[i]) or 0
            key = (cur_file, int(num(r[0])))
            by_line[key] += v; text[key] = r[1].strip()[:90]
            for q in ("stall_barrier", "stall_branch_resolving", "stall_long_sb", "stall_wait", "stall_lg", "stall_membar"):
                if q in hdr: reason[key][q[6:]] += num(r[hdr.index(q)]) or 0
    tot = sum(by_line.values()) or 1
    print(path.split("/")[-1], "samples", int(tot))
    for key, v in by_line.most_common(15):
        f = (key[0] or "?").split("/")[-1]
        rs = ", ".join(f"{k} {c/v*100:.0f}%" for k, c in reason[key].most_common(2) if c)
        print(f"  {v/tot*100:5.1f}%  {f}:{key[1]}  {text[key]}  [{rs}]")

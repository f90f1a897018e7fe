"""Per kernel, before -> after: calls (CALL: the 64-bit division routine), generic / shared
128-bit loads (LD.E.128 / LDS.128), stack, spills and registers (ptxas -v), SASS instructions.
Compiles each loopback kernel file of two csrc trees for sm_90a:

    python benchmarks/results/2026-11-28-cpu-sass-calls/sass_stats.py BEFORE/csrc AFTER/csrc \
        --cuobjdump PATH/nvidia/cu13/bin/cuobjdump
"""

import argparse
import pathlib
import re
import subprocess
import tempfile

FILES = ("combine_receive", "dispatch_receive", "direct")
KINDS = ("CALL", "LD.E.128", "LDS.128")


def build(csrc: pathlib.Path, name: str, out: pathlib.Path) -> str:
    """Compiles kernels/<name>.cu into `out`; returns ptxas -v's report."""
    cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-I", str(csrc),
           "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-c", str(csrc / "kernels" / f"{name}.cu"),
           "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def sass(cuobjdump: str, obj: pathlib.Path) -> dict:
    """Per function: the count of each of KINDS and of all instructions."""
    out = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    res: dict = {}
    cur = None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = res[m.group(1)] = dict.fromkeys(KINDS + ("n",), 0)
        elif cur is not None and re.match(r"\s+/\*[0-9a-f]+\*/\s", line):
            cur["n"] += 1
            for k in KINDS:
                cur[k] += bool(re.search(r"\b" + re.escape(k) + r"\b", line))
    return res


def ptxas(report: str) -> dict:
    pat = (r"Function properties for (\S+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
           r"spill loads\n.*?Used (\d+) registers")
    return {m.group(1): "stack %s, spills %s/%s, %s regs" % m.groups()[1:] for m in re.finditer(pat, report)}


def short(name: str) -> str:
    name = re.sub(r"_ZN9hybrid_ep\d+\w+?_impl\d+", "", name).replace("INS_17LoopbackTransportE", "<")
    name = name.replace("EEvNS_10LaunchArgsE", ">")
    plain_names = (("13__nv_bfloat16S3_", "bf16, bf16"), ("6__halfS3_", "f16, f16"), ("13__nv_bfloat16f", "bf16, f32"),
                   ("6__halff", "f16, f32"), ("<ff>", "<f32, f32>"))
    for mangled, plain in plain_names:
        name = name.replace(mangled, plain)
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=pathlib.Path)
    p.add_argument("after", type=pathlib.Path)
    p.add_argument("--cuobjdump", default="cuobjdump")
    args = p.parse_args()
    print("| kernel | CALL | LD.E.128 / LDS.128 | ptxas -v | instructions |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in FILES:
            got = []
            for tree in (args.before, args.after):
                obj = pathlib.Path(tmp) / f"{name}_{len(got)}.o"
                report = build(tree, name, obj)
                got.append((sass(args.cuobjdump, obj), ptxas(report)))
            (a, pa), (b, pb) = got
            for k in a:
                if "selftest" in k or k not in b:
                    continue
                loads = f"{a[k]['LD.E.128']} / {a[k]['LDS.128']} -> {b[k]['LD.E.128']} / {b[k]['LDS.128']}"
                print(f"| {short(k)} | {a[k]['CALL']} -> {b[k]['CALL']} | {loads} | {pa.get(k)} -> {pb.get(k)} | "
                      f"{a[k]['n']} -> {b[k]['n']} |")


if __name__ == "__main__":
    main()

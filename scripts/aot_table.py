"""The table of docs/tpu.md: `python -m geo3k_jax.aot` for each model and TPU slice, one after
another, then one markdown table of what the compiler reported.

    python scripts/aot_table.py --out=runs/aot               # every cell (minutes to tens each)
    python scripts/aot_table.py --out=runs/aot --table_only  # the table of the reports kept
    python scripts/aot_table.py --cells=qwen3_vl_8b@v5p-16   # other cells

Each compile runs in its own process (`--json` into --out); a report already there is kept, so an
interrupted table resumes where it stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from absl import app, flags

flags.DEFINE_string("out", "runs/aot", "where the per-compile JSON reports go")
flags.DEFINE_list("cells", ["qwen3_vl_2b@v5p-8", "qwen3_vl_2b@v6e-8", "qwen3_vl_8b@v6e-8",
                           "qwen3_vl_8b@v5p-8", "qwen3_vl_8b@v6e-16", "qwen3_vl_2b@v6e-16"],
                  "model@slice pairs (configs/models names, TPU slices), compiled in this order")
flags.DEFINE_string("config", "configs/tpu.py", "the run's config")
flags.DEFINE_bool("table_only", False, "print the table of the reports in --out, compile nothing")
FLAGS = flags.FLAGS
GiB = 2 ** 30


def row(r: dict) -> str:
    """One markdown row: the peak of the step's programs, fit, compile time, flops, roofline."""
    progs = {p["program"]: p for p in r["programs"]}
    if any("refused" in p for p in progs.values()):
        refused = "; ".join(f"{k}: {p['refused']}" for k, p in progs.items() if "refused" in p)
        return (f"| {r['shapes']} | {r['topology']} | {r['attention']} | refused | no | "
                f"{sum(p['compile_s'] for p in progs.values()):.0f} | | | {refused} |")
    g, a = progs["grad"], progs["apply"]
    peak = max(g["peak"], a["peak"])
    return (f"| {r['shapes']} | {r['topology']} | {r['attention']} | {peak / GiB:.1f} / "
            f"{g['hbm'] / GiB:.2f} | "
            f"{'yes' if r['fits'] else 'no'} | {g['compile_s'] + a['compile_s']:.0f} | "
            f"{g.get('model_flops', 0) / 1e12:.0f} | {g['roofline_s'] * 1e3:.0f} + "
            f"{a['roofline_s'] * 1e3:.0f}"
            f" | grad {g['peak'] / GiB:.1f} (temp {g['temp'] / GiB:.1f}), apply "
            f"{a['peak'] / GiB:.1f} |")


def main(_):
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [c.split("@") for c in FLAGS.cells]
    for shapes, topology in cells:
        path = out / f"{shapes}_{topology}.json"
        if not (FLAGS.table_only or path.exists()):
            print(f"compiling {shapes} for {topology}", flush=True)
            subprocess.run([sys.executable, "-m", "geo3k_jax.aot", f"--config={FLAGS.config}",
                            f"--topology={topology}", f"--shapes={shapes}", f"--json={path}"],
                           check=False)
    print("| model | slice | attention | peak GiB per chip / HBM | fits | compile s "
          "| grad model TFLOP per chip | roofline ms (grad + update) | programs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shapes, topology in sorted(cells):
        path = out / f"{shapes}_{topology}.json"
        if path.exists():
            print(row(json.loads(path.read_text())))


if __name__ == "__main__":
    app.run(main)

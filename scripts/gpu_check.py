"""Check a GPU machine in one command: what runs, how fast, in how much memory.

    python scripts/gpu_check.py --out runs/gpu_check          # one H100 or H200: <= 20 minutes
    python scripts/gpu_check.py --tiny --out /tmp/gpu_check   # the same code paths on a CPU

Nothing is downloaded: the end-to-end runs use the quick CPU run's tiny checkpoint and synthetic
set, the throughput sections a random-initialised model with Qwen3-VL-2B's published shapes
(configs/models/qwen3_vl_2b.json). Sections (`scripts/gpu_sections.py`), each in a process of its
own, in this order:

    e2e_torch      configs/cpu.py for 10 steps on CUDA: torch learner, its local engine
    learner_torch  learner steps at 8k and 16k-token micro-batches, bf16 autocast, per attention
                   kernel (varlen and packed_sdpa): tokens/s, MFU, peak memory
    engine_torch   the local engine sampling 64 episodes x 512 tokens (bf16): tokens/s, memory
    e2e_jax, learner_jax, engine_jax   the same for the JAX learner and its engine

Writes OUT/gpu_check.json and OUT/gpu_check.md (a table per section; a failure's traceback below
it; each section's output in OUT/sections/<name>.log). A section that fails, times out or has
no time left is recorded and the others still run; the exit status is 1 if any did. MFU is
model FLOPs (`gpu_sections.train_flops`) over the card's dense bf16 peak, found from the device
name (H100 SXM and H200: 989 TFLOP/s) or given with --peak_tflops.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages

import gpu_sections  # noqa: E402

# Dense bf16 tensor-core peaks (NVIDIA data sheets), matched in order against the device name.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
# The most a section may take on an H100, cold compile caches included (the budget bounds their
# sum). One H200 took 110, 58, 87, 323, 148 and 208 s (docs/gpu_check.md).
CAPS_S = {"e2e_torch": 150, "learner_torch": 120, "engine_torch": 120, "e2e_jax": 420,
          "learner_jax": 240, "engine_jax": 300}
MIN_SECTION_S = 20.0  # less time left than this: the section is not started
VERSIONED = ("torch", "transformers", "jax", "jaxlib", "flax", "optax")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def settings(out: str, tiny: bool, peak: float | None) -> gpu_sections.Settings:
    if tiny:
        return gpu_sections.Settings.tiny_settings(out, peak)
    return gpu_sections.Settings(out, peak_tflops=peak)


# ---- one section, in its own process ------------------------------------------------------------
def run_here(name: str, s: gpu_sections.Settings, path: Path) -> None:
    """Run section `name`, writing its JSON after every row (a crash keeps what came before);
    a row or the section that raises is recorded with its traceback."""
    result = {"status": "running", "rows": []}

    def write():
        path.write_text(json.dumps(result, indent=1))

    write()
    try:
        for row in gpu_sections.SECTIONS[name](s):
            result["rows"].append({"status": "ok", **row})
            write()
        failed = any(r["status"] == "failed" for r in result["rows"])
        result["status"] = "failed" if failed else "ok"
    except Exception:  # noqa: BLE001  (recorded, and the exit status says so)
        result.update(status="failed", error=traceback.format_exc())
    write()


def run_child(name: str, out: Path, tiny: bool, peak: float | None, timeout: float) -> dict:
    """Section `name` in a fresh process, at most `timeout` seconds."""
    path, log = out / "sections" / f"{name}.json", out / "sections" / f"{name}.log"
    path.unlink(missing_ok=True)
    env = dict(os.environ)
    if tiny:
        env["JAX_PLATFORMS"] = "cpu"
    elif name in gpu_sections.JAX_SECTIONS:  # JAX takes 75% of the GPU by default
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    cmd = [sys.executable, __file__, f"--section={name}", f"--out={out}",
           f"--peak_tflops={peak or 0.0}"] + (["--tiny"] if tiny else [])
    start, cpu = time.perf_counter(), _children_cpu_s()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    result = json.loads(path.read_text()) if path.exists() else {"rows": []}
    result["seconds"] = time.perf_counter() - start
    result["cpu_s"] = _children_cpu_s() - cpu  # on a busy host, wall time says little
    if rc is None:
        result.update(status="timeout", error=f"stopped after {timeout:.0f} s\n" + _tail(log))
    elif result.get("status") not in ("ok", "failed"):  # it died before writing its end
        result.update(status="failed",
                      error=f"the process exited with status {rc}\n" + _tail(log))
    return result


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ---- the report -------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "",
             f"{report['date']} · {'tiny (CPU rehearsal)' if report['tiny'] else 'full'} · "
             f"peak {report['peak_tflops'] or 'unknown'} TFLOP/s bf16 · "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
             f"Shapes: {report['shapes']}. {report['seconds']:.0f} s in all. "
             f"Failed: {', '.join(report['failed']) or 'none'}.", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec.get('seconds', 0.0):.0f} s, "
                  f"{sec.get('cpu_s', 0.0):.0f} s CPU)", ""]
        rows = sec["rows"]
        cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "error"]
        if rows:
            lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_fmt(r.get(c, "")).replace("|", "/") for c in cols)
                      + " |" for r in rows]
            lines.append("")
        errors = [r["error"] for r in rows if "error" in r] + ([sec["error"]] if "error" in sec
                                                             else [])
        for e in errors:
            lines += ["```", "\n".join(e.strip().splitlines()[-40:]), "```", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (argparse, not absl: the module is imported by tests beside scripts
    whose absl flags share these names)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="Folder for gpu_check.json, .md and logs.")
    p.add_argument("--tiny", action="store_true", help="Tiny shapes and counts, on the CPU.")
    p.add_argument("--sections", default=",".join(gpu_sections.SECTIONS),
                   help="Comma-separated sections to run (default: all, in order).")
    p.add_argument("--budget_s", type=float, default=None, help="Wall-clock budget of all "
                   "sections, seconds (default 1200; --tiny: 1800, for slow shared CPUs).")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="Dense bf16 peak of the "
                   "accelerator, TFLOP/s (0: from the device name; unknown: no MFU).")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # one section, here
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).absolute()
    (out / "sections").mkdir(parents=True, exist_ok=True)
    if args.section:
        s = settings(str(out), args.tiny, args.peak_tflops or None)
        run_here(args.section, s, out / "sections" / f"{args.section}.json")
        return 0
    wanted = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(wanted) - set(gpu_sections.SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}: choose from "
                         f"{', '.join(gpu_sections.SECTIONS)}")
    name = "CPU" if args.tiny else device_name()
    if name == "CPU" and not args.tiny:
        raise SystemExit("no CUDA device is visible: this check is for a GPU machine (add --tiny "
                         "for its CPU rehearsal)")
    peak = args.peak_tflops or (None if args.tiny else peak_tflops(name))
    s = settings(str(out), args.tiny, peak)
    report = {"device": name, "tiny": args.tiny, "peak_tflops": peak, "shapes": s.shapes,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "settings": dataclasses.asdict(s), "versions": _versions(), "sections": {}}
    budget = args.budget_s or (1800.0 if args.tiny else 1200.0)
    start = time.perf_counter()
    for section in [n for n in gpu_sections.SECTIONS if n in wanted]:
        left = budget - (time.perf_counter() - start)
        if left < MIN_SECTION_S:
            report["sections"][section] = {"status": "not run", "rows": [], "seconds": 0.0,
                                           "error": f"{left:.0f} s of --budget_s left"}
            continue
        timeout = left if args.tiny else min(CAPS_S[section], left)
        report["sections"][section] = result = run_child(section, out, args.tiny, peak, timeout)
        print(f"{section}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    report["seconds"] = time.perf_counter() - start
    report["failed"] = [n for n, r in report["sections"].items() if r["status"] != "ok"]
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 1 if report["failed"] else 0


def _versions() -> dict:
    out = {}
    for pkg in VERSIONED:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


if __name__ == "__main__":
    sys.exit(main())

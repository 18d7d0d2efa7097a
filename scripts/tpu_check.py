"""Check a TPU host in one command: what compiles, what fits, how fast, whether it computes right.

    python scripts/tpu_check.py --out runs/tpu_check        # a TPU host (v5p-8, v6e-8, ...)
    python scripts/tpu_check.py --tiny --out /tmp/tpu_check # every section's code on a CPU
    python scripts/tpu_check.py --out runs/tpu_check --sections=decode,learner \
        --override=engine.slots=64                          # two sections, another slot count

The run is configs/tpu.py's on one host (`jax.distributed` off: on a slice of several hosts,
run it on one worker and it measures that host's chips), the synthetic set and the recipe's
model (`model.path`, Qwen3-VL-2B-Instruct from the Hub; --model names another, or a local
folder). Sections (`scripts/tpu_sections.py`), each in a process of its own, in this order:

    compile    the learner's two programs and the engine's whole compile set, JAX's persistent
               cache cold then warm (OUT/jax_cache, which the later sections then use)
    memory     HBM in use and its peak after each phase of a GRPO step (rollout, update, weight
               copy) beside the budget `python -m geo3k_jax.aot` compiles for the same config;
               again with each memory setting the config has (jax.free_engine, jax.offload)
    decode     the engine's tokens/s with every one of the recipe's slots decoding; on v5p also
               with the paged attention kernel's megacore_mode "kv_head" and "batch"
    rollout    the recipe's multi-turn rollouts: prefill's and decode's shares of their time
    learner    the learner's step against its roofline (model FLOPs / (chips x peak), bytes
               accessed / HBM bandwidth; the peaks: `tpu_sections.CHIPS`, Cloud TPU data sheets)
    numerics   torch against JAX on these devices under configs/tpu.py:cpu (the tiny
               checkpoint: needs torch, the CPU wheel, beside the tpu extra)

Writes OUT/tpu_check.json after every section and OUT/tpu_check.md at the end (a table per
section, a failure's traceback below it; each section's output in OUT/sections/<name>.log, its
rows in OUT/sections/<name>.json, rewritten after every row). A section that fails, times out or
has no time left is recorded and the others still run; the exit status is 1 if any did. Each
section may run for its cap (`CAPS_S`) plus what the sections before it left unused; the caps
sum to the default --budget_s, under an hour, so the whole check returns inside an hour's
booking; a section past its time is killed with every process it started (the chips are free
for the next one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages

import gpu_profile  # noqa: E402  (its markdown table)
import tpu_sections  # noqa: E402
from check_runner import record_rows, run_section, versions  # noqa: E402

# The seconds a section is sure of (it may also use what the sections before it left unused).
# No TPU has run them: sized from the compiles on a 2-core CPU host (docs/tpu.md: the 2B
# learner and engine of v5p-8, 771 s together; 49 engine programs at about 80 s each, which
# warm_up spreads over 8 threads) and a TPU host's many more cores; the compile section builds
# twice, cold and warm.
CAPS_S = {"compile": 1200, "memory": 600, "decode": 420, "rollout": 360, "learner": 480,
          "numerics": 240}
BUDGET_S = 3300.0  # the caps' sum: 55 minutes
TINY_BUDGET_S = 3000.0  # --tiny on a slow shared CPU (2 loaded cores: 6 to 20 minutes)
MIN_SECTION_S = 30.0  # less time left than this: the section is not started
VERSIONED = ("jax", "jaxlib", "libtpu", "flax", "optax", "transformers", "torch")


def section_timeout(section: str, order: list[str], left: float, tiny: bool) -> float:
    """Seconds section `section` may run with `left` of the budget: its cap, and whatever the
    caps of the sections after it leave over (with --tiny: all that is left)."""
    if tiny:
        return left
    later = sum(CAPS_S[n] for n in order[order.index(section) + 1:])
    return max(min(CAPS_S[section], left), left - later)


# ---- one section, in its own process -----------------------------------------------------------
def run_here(name: str, s: tpu_sections.Settings, path: Path) -> None:
    """Run section `name`, writing its rows to `path` after every row (a crash keeps what came
    before); a row or the section that raises is recorded with its traceback."""
    record_rows(lambda: tpu_sections.SECTIONS[name](s), path)


def child_command(args: argparse.Namespace, section: str, out: Path) -> list[str]:
    return ([sys.executable, __file__, f"--section={section}", f"--out={out}",
             f"--model={args.model}"] + ["--tiny"] * args.tiny
            + [f"--override={o}" for o in args.override])


def run_child(cmd: list[str], path: Path, log: Path, timeout: float, tiny: bool) -> dict:
    """`cmd` (a section) in a fresh process group, at most `timeout` seconds; then every
    process of the group is killed (a pass it started would hold the chips:
    `check_runner.run_section`)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu") if tiny else None
    return run_section(cmd, path, log, timeout, env)


def probe(tiny: bool) -> dict:
    """The devices JAX sees, from a process of its own (this one never holds the chips)."""
    code = ("import json, jax; d = jax.devices()[0]; print(json.dumps({'platform': d.platform,"
            " 'device_kind': d.device_kind, 'devices': jax.device_count(), "
            "'hosts': jax.process_count()}))")
    env = dict(os.environ, JAX_PLATFORMS="cpu") if tiny else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    if out.returncode:
        raise SystemExit(f"JAX could not start:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])




# ---- the report --------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    d = report["device"]
    lines = [f"# TPU check: {d['devices']} x {d['device_kind']} ({d['platform']})", "",
             f"{report['date']} · {'tiny (CPU rehearsal)' if report['tiny'] else 'full'} · "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
             f"Model: {report['model'] or 'the recipe'}; overrides: "
             f"{', '.join(report['overrides']) or 'none'}. {report['seconds']:.0f} s in all. "
             f"Failed: {', '.join(report['failed']) or 'none'}.", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec.get('seconds', 0.0):.0f} s)", ""]
        rows = [{k: v for k, v in r.items() if k != "error"} for r in sec["rows"]]
        if rows:
            lines += gpu_profile.table(rows) + [""]
        errors = [r["error"] for r in sec["rows"] if "error" in r] + (
            [sec["error"]] if "error" in sec else [])
        for e in errors:
            lines += ["```", "\n".join(e.strip().splitlines()[-40:]), "```", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="Folder for tpu_check.json, .md and logs.")
    p.add_argument("--tiny", action="store_true", help="Tiny shapes and counts, on the CPU.")
    p.add_argument("--sections", default="", help="Comma-separated sections to run, in the "
                   f"module's order (default: all of {', '.join(tpu_sections.SECTIONS)}).")
    p.add_argument("--budget_s", type=float, default=None, help="Wall-clock budget of all "
                   f"sections, seconds (default {BUDGET_S:.0f}; --tiny: {TINY_BUDGET_S:.0f}).")
    p.add_argument("--model", default="", help="model.path for every section (default: the "
                   "recipe's; --tiny: the tiny checkpoint).")
    p.add_argument("--override", action="append", default=[], help="A config override for "
                   "every section, key=value as --config.key=value takes it (repeatable).")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # one section, here
    return p.parse_args(argv)


def settings(args: argparse.Namespace, out: Path) -> tpu_sections.Settings:
    overrides = tuple(args.override)
    s = (tpu_sections.Settings.tiny_settings(str(out), overrides) if args.tiny
         else tpu_sections.Settings(str(out), overrides=overrides))
    return tpu_sections.dataclasses.replace(s, model=args.model)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).absolute()
    (out / "sections").mkdir(parents=True, exist_ok=True)
    if args.section:
        run_here(args.section, settings(args, out), out / "sections" / f"{args.section}.json")
        return 0
    wanted = [x for x in args.sections.split(",") if x] or list(tpu_sections.SECTIONS)
    unknown = sorted(set(wanted) - set(tpu_sections.SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}: choose from "
                         f"{', '.join(tpu_sections.SECTIONS)}")
    device = probe(args.tiny)
    if device["platform"] != "tpu" and not args.tiny:
        raise SystemExit(f"JAX sees {device['platform']} devices, no TPU: this check is for a "
                         "TPU host (add --tiny for its CPU rehearsal)")
    report = {"device": device, "tiny": args.tiny, "model": args.model,
              "overrides": args.override, "versions": versions(VERSIONED), "sections": {},
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    budget = args.budget_s or (TINY_BUDGET_S if args.tiny else BUDGET_S)
    start = time.perf_counter()
    order = [n for n in tpu_sections.SECTIONS if n in wanted]
    for section in order:
        left = budget - (time.perf_counter() - start)
        if left < MIN_SECTION_S:
            result = {"status": "not run", "rows": [], "seconds": 0.0,
                      "error": f"{left:.0f} s of --budget_s left"}
        else:
            result = run_child(child_command(args, section, out),
                               out / "sections" / f"{section}.json",
                               out / "sections" / f"{section}.log",
                               section_timeout(section, order, left, args.tiny), args.tiny)
        report["sections"][section] = result
        report["seconds"] = time.perf_counter() - start
        report["failed"] = [n for n, r in report["sections"].items() if r["status"] != "ok"]
        (out / "tpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"{section}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    (out / "tpu_check.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / 'tpu_check.json'} and {out / 'tpu_check.md'}")
    return 1 if report["failed"] else 0




if __name__ == "__main__":
    sys.exit(main())

"""Check a GPU machine in one command: what runs, how fast, where the time goes.

    python scripts/gpu_check.py --out runs/gpu_check          # one H100 or H200: at most ~9 minutes
    python scripts/gpu_check.py --tiny --out /tmp/gpu_check   # every section's code on a CPU
    python scripts/gpu_check.py --out runs/gpu_check --sections=e2e_torch --budget_s=150
    python scripts/gpu_check.py --out runs/gpu_check --sections=learner_jax,e2e_jax,engine_jax \
        --budget_s=870                                       # the JAX sections, another call

Nothing is downloaded: the end-to-end runs use the quick CPU run's tiny checkpoint and synthetic
set, the other sections a random-initialised model with Qwen3-VL-2B's published shapes
(configs/models/qwen3_vl_2b.json; learner_moe: Qwen3-VL-30B-A3B's with fewer layers). Sections
(`scripts/gpu_sections.py`), each in a process of its own, in this order; the default call runs
learner_torch to learner_moe, the others when named (--tiny: all of them):

    e2e_torch      configs/cpu.py for 3 steps on CUDA: torch learner, its local engine
    learner_torch  learner steps of 2 and 4 micro-batches of 32k tokens, bf16, per configuration
                   of `gpu_sections.LEARNER_PLAN`: the recipe as configured, the fused LM head,
                   then compiled blocks: tokens/s, MFU, peak memory, which fast paths were on
                   (the other kernel and checkpointing modes only in the --tiny rehearsal)
    engine_torch   the local engine sampling 64, then 256, episodes x 512 tokens (bf16), each
                   also with the decode fast paths on (fast_*): tokens/s, memory
    profile_torch  the learner's unprofiled step by phase (vision, text, head, backward,
                   optimizer: CUDA events), kernels a step from a profile without shapes, the GPU
                   idle share of the unprofiled step, the host's time waiting for the GPU, host
                   syncs per step by site, the top ops by input shape (a profile with shapes);
                   the engine's kernels and idle (also OUT/profile_torch.json and .md)
    whole_step     GRPO steps of 8 prompts x 8 episodes, learner and local engine on one GPU:
                   rollout, update and sync seconds; tokens per GPU-second as the learner
                   computed them (a group's shared prompt once) and as EasyR1 counts them
    learner_moe    the recipe's learner steps (as learner_torch's first rows) of a MoE model:
                   Qwen3-VL-30B-A3B's shapes with 3 of its 48 decoder layers (what fits one
                   80 GB card: `gpu_sections.MOE_SHAPES`), experts through grouped_mm: tokens/s
                   and MFU on the weights a token meets (router and top 8 experts)
    learner_jax, e2e_jax, engine_jax   the JAX learner's steps (as learner_torch's), end to end,
                   and its engine (cold, they compiled for 148, 323 and 208 s on an H200)

Writes OUT/gpu_check.json and OUT/gpu_check.md after every section (a table per section, a
least-squares fit of the learner's step time under its table, the planned learner rows left
out; a failure's traceback below it; each section's output in OUT/sections/<name>.log, its JSON
with the device and versions in OUT/sections/<name>.json). A section that fails, times out or has
no time left is recorded and the others still run; the exit status is 1 if any did. Each section
may run for its cap (`CAPS_S`) plus what the sections before it left unused of theirs, and is
then killed with everything it started: the whole check ends within --budget_s (the default
sections' caps sum to the default, `BUDGET_S`), whatever a section does. MFU is model FLOPs
(`gpu_sections.train_flops`) over the card's dense bf16 peak, found from the device name (H100
SXM and H200: 989 TFLOP/s) or given with --peak_tflops.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages

import gpu_profile  # noqa: E402
import gpu_sections  # noqa: E402
from check_runner import STOP_S, record_rows, run_section, versions  # noqa: E402

# Dense bf16 tensor-core peaks (NVIDIA data sheets), matched in order against the device name.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
# The seconds a section is sure of (it may also use what the sections before it left unused);
# the default sections' sum to BUDGET_S. From one H200 (docs/gpu_check.md): learner_torch,
# engine_torch, profile_torch and whole_step took 160 (cut, 11 rows), 31, 95 and 49 s on
# 2026-11-28, profile_torch 99 s and whole_step 61 s in its second session; e2e_torch, whose tiny
# model is first primed for 150 steps, passed 120 s unfinished (110 s for 10 steps on
# 2026-11-27); learner_jax, e2e_jax and engine_jax 148, 323 and 208 s. Not yet timed on a GPU:
# learner_torch's rows now (`gpu_sections.LEARNER_PLAN`: the recipe, the fused head, then
# compiled, at 32k tokens a micro-batch: about 30 s each at the measured MFU, besides building
# the shapes checkpoint and the compiles), engine_torch's fast engine (its own first calls
# capture and compile), profile_torch's unprofiled steps by phase and its profiles of one step
# each, without and with shapes, learner_moe (writing and loading 6 GB of random bf16 weights,
# then 5 steps of 1 to 3 s).
CAPS_S = {"e2e_torch": 130, "learner_torch": 180, "engine_torch": 75, "profile_torch": 115,
          "whole_step": 60, "learner_moe": 90, "learner_jax": 150, "e2e_jax": 420,
          "engine_jax": 300}
# The check of one short-lived machine: e2e_torch (minutes of a tiny model) runs when named.
DEFAULT_SECTIONS = ("learner_torch", "engine_torch", "profile_torch", "whole_step",
                    "learner_moe")
# The default sections' caps: the check stops by itself within this and `STOP_S` (8.8 minutes),
# so that its files come back from a command of at most 10 minutes that also installs wheels.
BUDGET_S = 520.0
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
def run_here(name: str, s: gpu_sections.Settings, path: Path, device: str) -> None:
    """Run section `name`, writing its JSON (the device, versions and rows) after every row (a
    crash keeps what came before); a row or the section that raises is recorded with its
    traceback."""
    record_rows(lambda: gpu_sections.SECTIONS[name](s), path,
                {"device": device, "versions": versions(VERSIONED)})


def run_child(name: str, out: Path, tiny: bool, peak: float | None, timeout: float,
              device: str) -> dict:
    """Section `name` in a fresh process on `device` (its name), at most `timeout` seconds,
    killed with everything it started (`check_runner.run_section`)."""
    env = dict(os.environ)
    if tiny:
        env["JAX_PLATFORMS"] = "cpu"
    elif name in gpu_sections.JAX_SECTIONS:  # JAX takes 75% of the GPU by default
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    cmd = [sys.executable, __file__, f"--section={name}", f"--out={out}",
           f"--peak_tflops={peak or 0.0}", f"--device_name={device}"] + (["--tiny"] if tiny else [])
    sections = out / "sections"
    return run_section(cmd, sections / f"{name}.json", sections / f"{name}.log", timeout, env)


# ---- the report -------------------------------------------------------------------------------
def fit_lines(rows: list[dict]) -> list[str]:
    """Per configuration (its `config` label and kernel) of a learner section's ok rows,
    where it can be computed (`gpu_profile.fit_step_cost`), the least-squares split of a step's
    seconds into its costs per step, per micro-batch and per token."""
    ok = [r for r in rows if r["status"] == "ok" and "micro_batches" in r]

    def setup(r: dict) -> str:
        return ", ".join(p for p in (r.get("config"), r["kernel"]) if p)

    lines = []
    for kernel in dict.fromkeys(map(setup, ok)):
        mine = [r for r in ok if setup(r) == kernel]
        fit = gpu_profile.fit_step_cost([r["micro_batches"] for r in mine],
                                        [r["tokens"] for r in mine], [r["seconds"] for r in mine])
        if fit is None:
            continue
        if "b" in fit:
            terms, why = f" + {fit['b']:.3g} x micro-batches", ""
        else:
            terms, why = "", " (these rows cannot tell a micro-batch's cost from its tokens')"
        lines += [f"Fit, {kernel} ({len(mine)} rows, least squares): step seconds = "
                  f"{fit['a']:.3g}{terms} + {fit['c'] * 1e3:.3g} x thousand tokens{why}.", ""]
    return lines


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
        if rows:
            lines += gpu_profile.table(rows) + [""] + fit_lines(rows)
        left = [c for c in sec.get("planned", []) if c not in {r.get("config") for r in rows}]
        if left:
            lines += [f"Left out (no time, or failed before its first row): {', '.join(left)}.",
                      ""]
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
    p.add_argument("--sections", default="", help="Comma-separated sections to run, in the "
                   f"module's order (default: {', '.join(DEFAULT_SECTIONS)}; --tiny: all).")
    p.add_argument("--budget_s", type=float, default=None, help="Wall-clock budget of all "
                   f"sections, seconds (default {BUDGET_S:.0f}; --tiny: 1800, for slow shared "
                   "CPUs).")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="Dense bf16 peak of the "
                   "accelerator, TFLOP/s (0: from the device name; unknown: no MFU).")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # one section, here
    p.add_argument("--device_name", default=None, help=argparse.SUPPRESS)  # found by the parent
    return p.parse_args(argv)


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    out = Path(args.out).absolute()
    (out / "sections").mkdir(parents=True, exist_ok=True)
    if args.section:
        s = settings(str(out), args.tiny, args.peak_tflops or None)
        device = args.device_name or ("CPU" if args.tiny else device_name())
        run_here(args.section, s, out / "sections" / f"{args.section}.json", device)
        return 0
    wanted = ([x for x in args.sections.split(",") if x]
              or list(gpu_sections.SECTIONS if args.tiny else DEFAULT_SECTIONS))
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
              "settings": dataclasses.asdict(s), "versions": versions(VERSIONED), "sections": {}}
    budget = args.budget_s or (1800.0 if args.tiny else BUDGET_S)
    order = [n for n in gpu_sections.SECTIONS if n in wanted]
    signal.signal(signal.SIGTERM, _interrupted)
    for i, section in enumerate(order):
        left = budget - (time.perf_counter() - start) - STOP_S  # room to stop it in time
        if left < MIN_SECTION_S:
            report["sections"][section] = {"status": "not run", "rows": [], "seconds": 0.0,
                                           "error": f"{left:.0f} s of --budget_s left"}
            continue
        later = sum(CAPS_S[n] for n in order[i + 1:])  # kept for the sections after this one
        timeout = left if args.tiny else max(min(CAPS_S[section], left), left - later)
        try:
            result = run_child(section, out, args.tiny, peak, timeout, name)
        except KeyboardInterrupt:  # the section's processes are gone: report what there is
            path = out / "sections" / f"{section}.json"
            rows = json.loads(path.read_text())["rows"] if path.exists() else []
            report["sections"][section] = {"status": "stopped", "rows": rows, "seconds": 0.0,
                                           "error": "the check was stopped in this section"}
            write_report(out, report, start)
            return 1
        if section in gpu_sections.PLANS:  # its planned rows: the report names those left out
            result["planned"] = [label for label, _ in gpu_sections.PLANS[section](s)]
        report["sections"][section] = result
        print(f"{section}: {result['status']} in {result['seconds']:.0f} s", flush=True)
        write_report(out, report, start)  # after every section: a stopped check keeps them
    write_report(out, report, start)
    print(markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 1 if report["failed"] else 0


def _interrupted(signum, frame):
    """SIGTERM (an outer timeout) stops the check as Ctrl-C does: the running section is
    killed with its group and the report written."""
    raise KeyboardInterrupt(f"signal {signum}")


def write_report(out: Path, report: dict, start: float) -> None:
    """OUT/gpu_check.json and .md of the sections run so far (`report`, given its seconds and
    failed sections here)."""
    report["seconds"] = time.perf_counter() - start
    report["failed"] = [n for n, r in report["sections"].items() if r["status"] != "ok"]
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))




if __name__ == "__main__":
    sys.exit(main())

"""The budget table of docs/tpu.md: `python -m geo3k_jax.aot` (the learner and the JAX engine on
the same chips) for each model and TPU slice, one after another, then one markdown table of what
the compiler reported, per chip.

    python scripts/aot_table.py --out=docs/aot               # every cell (tens of minutes each)
    python scripts/aot_table.py --out=docs/aot --table_only  # the table of the reports kept
    python scripts/aot_table.py --table_only --rebudget      # their budgets by today's rules
    python scripts/aot_table.py --table_only --rebudget --offload=moments  # and the moments
    python scripts/aot_table.py --cells=qwen3_vl_8b@v5p-16   # other cells
    python scripts/aot_table.py --cells=qwen3_vl_2b@v6e-8@48 # with 48 engine slots a host
    python scripts/aot_table.py --cells=qwen3_vl_8b@v6e-16@32@jax.mesh.tensor=4  # and settings
    python scripts/aot_table.py --config=configs/tpu_moe.py --cells=qwen3_vl_30b_a3b@v5p-16

Each compile runs in its own process (`--json` into --out); a report already there is kept, so an
interrupted table resumes where it stopped. docs/aot holds the reports the docs' table shows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
GiB = 2 ** 30
DEFAULT_CONFIG = "configs/tpu.py"


def cell(text: str) -> tuple[str, str, int, tuple[str, ...]]:
    """"model@slice[@slots][@key=value...]" -> (model, slice, engine slots or 0: the config's,
    the config's other settings as "key=value" overrides)."""
    parts = text.split("@")
    slots = parts[2] if len(parts) > 2 and "=" not in parts[2] else None
    settings = tuple(parts[3 if slots is not None else 2:])
    if (len(parts) < 2 or not all(parts[:2]) or (slots is not None and not slots.isdigit())
            or not all(k and v for k, _, v in (s.partition("=") for s in settings))):
        raise SystemExit(f"--cells: {text!r} is not model@slice[@slots][@key=value...]")
    return parts[0], parts[1], int(slots or 0), settings


def report_name(shapes: str, topology: str, slots: int, settings: tuple[str, ...] = ()) -> str:
    """The report's file name in --out."""
    return (f"{shapes}_{topology}" + (f"_slots{slots}" if slots else "")
            + "".join(f"_{s}" for s in settings) + ".json")


def temporaries(message: str) -> str:
    """The compiler's refusal in a few words: the temporaries it asked for, if it says."""
    m = re.search(r"HLO temporaries \(([\d.]+)G\)", message)
    return f"{m.group(1)} GB of temporaries" if m else message[:80]


def where(r: dict) -> str:
    """The slice, with the config (if not `DEFAULT_CONFIG`) and the settings its cell overrode."""
    return r["topology"] + "".join(f", {s}" for s in [r.get("config")] + r.get("settings", [])
                                   if s)


def row(r: dict) -> str:
    """One markdown row: the learner's and the engine's costliest programs, the budget's phases,
    its peak against the chip's HBM, the slots that fit, the compile seconds."""
    learner, engine, b = r["programs"], r.get("engine"), r.get("budget", {})
    progs = learner + (engine["programs"] if engine else [])
    seconds = sum(p["compile_s"] for p in progs)
    gib = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    top = lambda ps: max(ps, key=lambda p: p["peak"])  # noqa: E731
    refused = [p for p in progs if "refused" in p]
    if refused:
        done = [p for p in learner if "refused" not in p]
        lp = top(done) if len(done) == len(learner) else None
        return (f"| {r['shapes']} | {where(r)} | "
                + (f"{lp['program']} {gib(lp['peak'])}" if lp else "") + " | refused: "
                + ", ".join(f"{p['program']} ({temporaries(p['refused'])})" for p in refused)
                + f" | | | **no** | {engine['slots'] if engine else ''} / ? | {seconds:.0f} |")
    lp = top(learner)
    if engine:
        ep = top(engine["programs"])
        eng = (f"{ep['program']} {gib(ep['peak'])} (weights {gib(engine['weights'])}, cache "
               f"{gib(engine['cache'])})")
    else:
        eng = "elsewhere"
    phases = ", ".join(f"{k} {gib(v)}" for k, v in b["phases"].items())
    fits = "yes" if r["fits"] else "**no**"
    slots = f"{engine['slots']} / {b['slots_fit']}" if engine else ""
    return (f"| {r['shapes']} | {where(r)} | {lp['program']} {gib(lp['peak'])} | {eng} | "
            f"{phases} | {gib(b['peak'])} / {b['hbm'] / GiB:.2f} | {fits} | {slots} | "
            f"{seconds:.0f} |")


def main(_):
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [cell(c) for c in FLAGS.cells]
    for shapes, topology, slots, settings in cells:
        path = out / report_name(shapes, topology, slots, settings)
        if not (FLAGS.table_only or path.exists()):
            print(f"compiling {shapes} for {topology}", flush=True)
            subprocess.run([sys.executable, "-m", "geo3k_jax.aot", f"--config={FLAGS.config}",
                            f"--topology={topology}", f"--shapes={shapes}", f"--json={path}"]
                           + ([f"--config.engine.slots={slots}"] if slots else [])
                           + [f"--config.{s}" for s in settings], check=False)
            extra = dict(settings=list(settings)) if settings else {}
            if FLAGS.config != DEFAULT_CONFIG:
                extra["config"] = FLAGS.config
            if path.exists() and extra:
                path.write_text(json.dumps(dict(json.loads(path.read_text()), **extra),
                                           indent=1))
    print("| model | slice | learner's costliest program GiB | engine's costliest program GiB "
          "| phases GiB (rollout, weight copy, train) | peak / HBM GiB | fits | engine slots "
          "(asked / fit) | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in sorted(cells):
        path = out / report_name(*c)
        if path.exists():
            r = json.loads(path.read_text())
            print(row(rebudget(r, FLAGS.offload) if FLAGS.rebudget else r))


def rebudget(r: dict, offload: str = "none") -> dict:
    """`r` with its budget worked out again from its programs by `geo3k_jax.aot.budget` as a
    run of configs/tpu.py has it now (`jax.free_engine` on, rollouts and training taking
    turns), with `offload` (`jax.offload`) the learner's state kept in host memory during
    rollouts: the compiled programs do not depend on either, only the phases' sums do."""
    from geo3k_jax.aot import budget
    if any("refused" in p for p in r["programs"] + r.get("engine", {}).get("programs", [])):
        return r
    b = budget(r, r.get("engine"), r["budget"]["hbm"], False, free=True, offload=offload)
    settings = r.get("settings", []) + ([f"jax.offload={offload} (rebudget)"]
                                        if offload != "none" else [])
    return dict(r, budget=b, fits=b["fits"], settings=settings)


def define_flags() -> None:
    """The command's flags (defined when it runs, not when a test imports its functions)."""
    flags.DEFINE_string("out", "docs/aot", "where the per-compile JSON reports go")
    # docs/tpu.md's six cells, each at the engine slots and settings that fit, if any
    flags.DEFINE_list("cells", ["qwen3_vl_2b@v5p-8", "qwen3_vl_2b@v5p-8@256",
                               "qwen3_vl_2b@v6e-8@40",
                               "qwen3_vl_2b@v6e-16@40", "qwen3_vl_8b@v5p-8@128",
                               "qwen3_vl_8b@v6e-8@24@jax.mesh.tensor=4@train.micro_batch_tokens="
                               "8448@jax.slice.targets=8448",
                               "qwen3_vl_8b@v6e-16@32@jax.mesh.tensor=4@train.micro_batch_tokens="
                               "8448@jax.slice.targets=8448"],
                      "model@slice pairs (configs/models names, TPU slices), compiled in this "
                      "order; model@slice@slots sets engine.slots, a further @key=value any "
                      "setting of the config")
    flags.DEFINE_string("config", DEFAULT_CONFIG, "the run's config (a report names it "
                        "when it is another)")
    flags.DEFINE_bool("table_only", False,
                      "print the table of the reports in --out, compile nothing")
    flags.DEFINE_enum("offload", "none", ["none", "moments", "all"], "with --rebudget: the "
                      "learner's state kept in host memory during rollouts (jax.offload)")
    flags.DEFINE_bool("rebudget", False, "the reports' budgets worked out again from their "
                      "programs as configs/tpu.py has them now (jax.free_engine on)")


if __name__ == "__main__":
    define_flags()
    app.run(main)

"""Our GRPO step next to TRL's `GRPOTrainer` on the same work, each in a process of its own.

    pip install -e .[benchmark]          # TRL: a benchmark extra, never in the default install
    python scripts/benchmark_trl.py --config=configs/cpu.py [--steps=5] [--budgets=512,2048,4096]

The same work on both sides: the config's checkpoint (the quick CPU run's primed tiny Qwen3-VL),
the same prompts in the same order (`common.data`'s messages: system prompt, one diagram,
problem and choices), rendered by the checkpoint's chat template with the scoring tool's schema,
`train.prompts_per_step` prompts x `rollout.n_samples` samples per step, the same response budget,
temperature and learning rate, fp32, one optimizer step per rollout, no KL, clip 0.2 / 0.28,
token-mean loss (TRL's `loss_type="dapo"`). Single turn: the reward grades the first turn's
answer (tool call or box) with the environment's grader, as our single-turn reward does. Every
group is trained on both sides (our dynamic-sampling filter is off). TRL generates with
transformers' `generate` (no vLLM on this machine); we generate with the in-process engine.

Each side runs one warm-up step, then `--steps` measured steps; a step is the rollout plus the
optimizer step (TRL: `on_step_begin` to `on_step_end`, generation happens inside). Prints the
median seconds per step of each side and the ratio TRL / ours, for each micro-batch budget of
ours. Timing never decides a test; docs/benchmarks.md records the figures with the command.

Multi-turn: TRL 1.16 runs tool calls (`tools=` / `environment_factory`): after each call it
appends the tool's result and generates again, until the model calls no tool or
`max_tool_calling_iterations`. It cannot run this project's episode: the environment cannot end
an episode when the answer is right (TRL asks the model for another turn after a correct
answer), so the work differs turn by turn. The script measures single turn and says so.
"""

from __future__ import annotations

import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from common.micro_batch import require_fixed

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu.py", "Config.", lock_config=False)
_STEPS = flags.DEFINE_integer("steps", 5, "Measured steps per side (after one warm-up step).")
_BUDGETS = flags.DEFINE_list("budgets", ["512", "2048", "4096"],
                             "Our micro-batch token budgets, one process each.")
_SIDE = flags.DEFINE_enum("side", "both", ["both", "trl", "ours"],
                          "both: run every side in its own process and compare.")
_BUDGET = flags.DEFINE_integer("budget", 0, "Our micro-batch budget (--side=ours).")
_TRL_ACCUMULATE = flags.DEFINE_integer(
    "trl_accumulate", 4, "TRL's gradient accumulation steps: the batch of completions is trained in "
    "this many micro-batches (one optimizer step either way).")
_OUT = flags.DEFINE_string("out", "", "Where a side writes its step times (JSON).")


# What both sides must share, whatever the config says: one turn, every group trained, one
# optimizer step per fresh rollout, no KL, token-mean loss (TRL's "dapo").
FIXED = {"env.max_turns": 1, "advantage.filter_equal_groups": False,
         "train.updates_per_rollout": 1, "train.max_staleness": 0, "loss.kl_coef": 0.0,
         "loss.agg": "token-mean"}


def same_work(cfg, argv: list[str] = ()):
    """The config with the benchmark's fixed settings (`FIXED`); a command-line override of one
    of them is refused rather than silently replaced."""
    overridden = [k for k in FIXED for a in argv if a.startswith(f"--config.{k}=")]
    if overridden:
        raise app.UsageError(f"the benchmark fixes {', '.join(overridden)} (the work TRL can "
                             "do the same way); drop the override")
    with cfg.unlocked():
        for key, value in FIXED.items():
            section, name = key.split(".")
            cfg[section][name] = value
    return cfg


def step_prompts(cfg, steps: int) -> list:
    """The prompts of `steps` steps, in order (the first train prompts)."""
    from common.prepare import prepare_data

    train_set, _ = prepare_data(cfg)
    need = steps * cfg.train.prompts_per_step
    if need > len(train_set):
        raise SystemExit(f"{steps} steps need {need} prompts, the train split has "
                         f"{len(train_set)}")
    return [train_set[i] for i in range(need)]


def run_ours(cfg, steps: int, budget: int) -> list[float]:
    """Seconds of each step of `common.step.grpo_step` (rollout + update)."""
    import torch

    from common.grpo import LossConfig
    from common.processor import load_processor
    from common.prepare import make_renderer
    from common.train import step_config
    from configs import to_dataclass
    from geo3k_torch.engine import LocalEngine
    from geo3k_torch.learner import Learner
    from geo3k_torch.model import load_model
    from geo3k_torch.prepare import prepare_model_dir
    from common.step import grpo_step

    with cfg.unlocked():
        cfg.train.micro_batch_tokens = budget
    torch.manual_seed(cfg.seed)
    model_dir = prepare_model_dir(cfg)
    prompts = step_prompts(cfg, steps)
    processor = load_processor(model_dir)
    model = load_model(model_dir)
    pad = processor.tokenizer.pad_token_id
    engine = LocalEngine(model, processor, pad if pad is not None else 0, cfg.seed)
    learner = Learner(model, processor, to_dataclass(LossConfig, cfg.loss), cfg.train,
                      cfg.rollout.temperature, model_dir=model_dir)
    renderer, step_cfg = make_renderer(cfg, processor), step_config(cfg, processor)
    n = cfg.train.prompts_per_step
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        grpo_step(prompts[s * n:(s + 1) * n], engine, renderer, learner, step_cfg, s * n)
        engine.clear_cache()
        times.append(time.perf_counter() - t0)
    return times


def trl_dataset(prompts) -> list[dict]:
    """TRL's conversational rows: our messages (every content a list of parts, as an Arrow
    column must be), the images, what the reward needs."""
    def parts(content):
        return [{"type": "text", "text": content}] if isinstance(content, str) else content

    return [{"prompt": [dict(m, content=parts(m["content"])) for m in p.messages],
             "images": list(p.images), "answer": p.answer, "choices": list(p.choices or [])}
            for p in prompts]


def make_reward(cfg, renderer):
    """TRL reward function: the first turn's answer graded as our single-turn episode is (the
    completion's ids decoded by our renderer, as the rollout decodes a turn)."""
    from common.env import EnvConfig, Geo3kEnv
    from common.reward import RewardConfig, score_episode
    from configs import to_dataclass

    env_cfg, reward_cfg = to_dataclass(EnvConfig, cfg.env), to_dataclass(RewardConfig, cfg.reward)

    def geo3k_reward(completion_ids, answer, choices, **_):
        out = []
        for ids, gold, options in zip(completion_ids, answer, choices):
            text = renderer.decode(ids)
            env = Geo3kEnv(gold, env_cfg, choices=options or None, source=reward_cfg.source)
            env.reset()
            _, _, info = env.step(text)
            out.append(score_episode([text], [info], gold, reward_cfg, options or None,
                                     env_cfg).reward)
        return out

    return geo3k_reward


def schema_tool(schema: dict):
    """A Python function TRL renders as `schema` (transformers' `get_json_schema` reads its
    signature and docstring): how TRL takes tools. TRL never calls it here (single turn)."""
    from transformers.utils import get_json_schema

    fn = schema["function"]
    (arg, spec), = fn["parameters"]["properties"].items()
    if spec["type"] != "string":
        raise ValueError(f"tool argument {arg!r} is not a string")

    def tool(**kwargs):
        raise RuntimeError("the benchmark runs single turn: no tool is executed")

    tool.__name__ = fn["name"]
    tool.__doc__ = f"{fn['description']}\n\nArgs:\n    {arg}: {spec['description']}\n"
    tool.__signature__ = inspect.Signature([inspect.Parameter(
        arg, inspect.Parameter.KEYWORD_ONLY, annotation=str)])
    tool.__annotations__ = {arg: str}
    if get_json_schema(tool) != schema:
        raise SystemExit(f"TRL would render the tool as {get_json_schema(tool)}, not {schema}")
    return tool


def run_trl(cfg, steps: int) -> list[float]:
    """Seconds of each `GRPOTrainer` step (generation + optimizer step)."""
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e .[benchmark]") from None
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, TrainerCallback

    from common.processor import load_processor
    from common.prompts import prompt_style
    from common.prepare import make_renderer
    from geo3k_torch.prepare import prepare_model_dir

    torch.manual_seed(cfg.seed)
    _, tools = prompt_style(cfg.data.prompt_style)
    model_dir = prepare_model_dir(cfg)
    prompts = step_prompts(cfg, steps)
    processor = load_processor(model_dir)
    renderer = make_renderer(cfg, processor)
    if tools:  # TRL knows published templates only; ours writes Qwen's tool-call format
        from trl.chat_template_utils import qwen3_schema, qwen3_template
        processor.tokenizer.response_schema = qwen3_schema
        processor.tokenizer.response_template = qwen3_template
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    n_samples, per_step = cfg.rollout.n_samples, cfg.train.prompts_per_step
    accumulate = _TRL_ACCUMULATE.value
    if (per_step * n_samples) % accumulate:
        raise SystemExit(f"--trl_accumulate={accumulate} does not divide the batch of "
                         f"{per_step * n_samples} completions")
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, report_to="none", use_cpu=True, bf16=False, seed=cfg.seed,
            max_steps=steps, per_device_train_batch_size=per_step * n_samples // accumulate,
            gradient_accumulation_steps=accumulate, generation_batch_size=per_step * n_samples,
            num_generations=n_samples,
            num_iterations=1, max_completion_length=cfg.rollout.max_response_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=cfg.train.weight_decay, adam_beta1=cfg.train.beta1,
            adam_beta2=cfg.train.beta2, adam_epsilon=cfg.train.eps,
            max_grad_norm=cfg.train.grad_clip, beta=0.0, loss_type="dapo",
            epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high,
            shuffle_dataset=False, logging_steps=1, save_strategy="no",
            max_tool_calling_iterations=0, gradient_checkpointing=False,
            dataloader_num_workers=0, remove_unused_columns=False)
        trainer = GRPOTrainer(model=model, reward_funcs=make_reward(cfg, renderer), args=args,
                              train_dataset=datasets.Dataset.from_list(trl_dataset(prompts)),
                              processing_class=processor, callbacks=[StepTimer()],
                              tools=[schema_tool(t) for t in tools or []])
        trainer.train()
    return times


def _side(argv_extra: list[str], label: str) -> list[float]:
    """Run one side in a fresh process; its step times."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        config = config_flags.get_config_filename(flags.FLAGS["config"])
        cmd = [sys.executable, __file__, f"--out={f.name}", f"--steps={_STEPS.value}",
               f"--config={config}"] + argv_extra + [
            a for a in sys.argv[1:] if a.startswith("--config.")]
        print(f"[{label}] {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, check=False)
        if done.returncode:
            raise SystemExit(f"[{label}] failed with exit code {done.returncode}")
        return json.loads(Path(f.name).read_text())["times"]


def main(argv):
    del argv
    cfg = same_work(_CONFIG.value, sys.argv)
    steps = _STEPS.value + 1  # the first is the warm-up
    if _SIDE.value != "both":
        times = (run_trl(cfg, steps) if _SIDE.value == "trl"
                 else run_ours(cfg, steps, _BUDGET.value or require_fixed(
                     cfg.train.micro_batch_tokens, "scripts/benchmark_trl.py")))
        if len(times) != steps:
            raise SystemExit(f"{len(times)} steps timed, expected {steps}")
        Path(_OUT.value).write_text(json.dumps({"times": times}))
        return
    rows = [("TRL GRPOTrainer", _side(["--side=trl", f"--trl_accumulate={_TRL_ACCUMULATE.value}"],
                                      "trl"))]
    for budget in _BUDGETS.value:
        rows.append((f"geo3k-rl, budget {budget}",
                     _side(["--side=ours", f"--budget={int(budget)}"], f"ours {budget}")))
    trl = statistics.median(rows[0][1][1:])
    print(f"\n{cfg.train.prompts_per_step} prompts x {cfg.rollout.n_samples} samples, "
          f"{cfg.rollout.max_response_tokens}-token budget, single turn, fp32, "
          f"{_STEPS.value} measured steps after a warm-up (multi-turn: see the docstring; TRL "
          "cannot run this project's episode)")
    print(f"| {'':<26} | {'median s / step':>15} | {'TRL / this':>10} |")
    print(f"|{'-' * 28}|{'-' * 17}|{'-' * 12}|")
    for name, times in rows:
        med = statistics.median(times[1:])
        print(f"| {name:<26} | {med:>15.3f} | {trl / med:>10.2f} |")


if __name__ == "__main__":
    app.run(main)

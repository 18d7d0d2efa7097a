"""Capacity check: after a rejected first call w, SFT the retry to answer choice (w+1) % 4
(MODE next) or w itself (MODE copy), STEPS steps of 8 at LR, from checkpoint SRC into OUT. A
model that reads its earlier answer drives the value token's loss towards 0; `dep.py` on OUT
shows whether the retry now depends on w.

    python docs/replicates/probes/attention/det.py SRC OUT STEPS LR [MODE]
"""
import shutil, sys
sys.path.insert(0, ".")
import numpy as np
from configs import cpu_perception
from geo3k_torch.prepare import prepare_data, prompt_style, to_dataclass
from common.env import EnvConfig, Geo3kEnv
from common.chat import ChatRenderer
from common.processor import load_processor
from common.sft import sft_example
from geo3k_torch.model import load_model
from geo3k_torch.learner import SFTLearner, sft_step
from geo3k_torch.prime import format_target, prime_config, wrong_choices

src, out, steps, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "next"
cfg = cpu_perception.get_config(); 
train, test = prepare_data(cfg)
env_cfg = to_dataclass(EnvConfig, cfg.env); tools = prompt_style(cfg.data.prompt_style)[1]
shutil.rmtree(out, ignore_errors=True); shutil.copytree(src, out)
proc = load_processor(out); r = ChatRenderer(proc, tools=tools)
model = load_model(out)
learner = SFTLearner(model, proc, prime_config(lr, steps, True), model_dir=out)
rng = np.random.default_rng(0)
ps = train.prompts
def example(p, i):
    w = int(rng.choice(wrong_choices(p, env_cfg)))
    env = Geo3kEnv(p.answer, env_cfg, choices=p.choices)
    call = format_target(p.choices[w]); obs, _, _ = env.step(call)
    t = (w + 1) % 4 if mode == "next" else w
    msgs = list(p.messages) + [{"role": "assistant", "content": call}, Geo3kEnv.format_observation(obs),
                               {"role": "assistant", "content": format_target(p.choices[t])}]
    return sft_example(r, msgs, p.images, i)
for s in range(steps):
    seqs = [example(ps[i], int(i)) for i in rng.choice(len(ps), 8, replace=False)]
    loss = sft_step(learner, seqs, max(len(x) for x in seqs) * 8)["loss"]
    if s % 50 == 0 or s == steps - 1:
        print(s, round(loss, 4), flush=True)
from geo3k_torch.checkpoint import quiet_progress
with quiet_progress():
    model.save_pretrained(out, safe_serialization=True)

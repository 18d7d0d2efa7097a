"""Can (more) priming teach the tiny model to avoid the value it gave? Prime checkpoint SRC (a
primed one, or one before priming) into OUT for each chunk of CHUNKS in turn, measuring after
each the probability of the rejected value at a retry (60 test problems of replicate K, after a
first call giving a random wrong choice; 0.25: no avoidance) and how often it is the most likely.
A chunk "rN" primes N steps on second turns only (model.tiny_prime_later_steps); RETRY is
model.tiny_prime_retry (the `first` rows of docs/results.md ran an option of 149f698, since
reverted); WD=x in the
environment sets the priming's weight decay. From the repository's root:

    python docs/replicates/probes/attention/avoid.py SRC OUT K CHUNKS RETRY LR [BATCH]
    e.g. ... data/tiny-qwen2_5_vl-captioned-nar /tmp/more 0 300,700,1000,2000 new_after_repeats 3e-3
"""
import shutil, sys, time
sys.path.insert(0, ".")
import numpy as np, torch
from configs import cpu_perception
from geo3k_torch.prepare import prepare_data, prompt_style, to_dataclass
from common.env import EnvConfig, Geo3kEnv
from common.chat import ChatRenderer
from common.processor import load_processor
from common.sft import sft_example
from common.batching import pack
from geo3k_torch.model import load_model, packed_inputs
from geo3k_torch.prime import wrong_choices, format_target
import geo3k_torch.prime as P2

src, out, k, chunks, retry, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6])
batch = int(sys.argv[7]) if len(sys.argv) > 7 else 8
cfg = cpu_perception.get_config(); cfg.seed = k; cfg.model.tiny_seed = k; cfg.data.synthetic_seed = k
if k:
    cfg.data.synthetic_dir = f"data/rep{k}/synthetic"
train, test = prepare_data(cfg)
env_cfg = to_dataclass(EnvConfig, cfg.env)
tools = prompt_style(cfg.data.prompt_style)[1]


def diag(ck, n=60):
    proc = load_processor(ck); r = ChatRenderer(proc, tools=tools)
    model = load_model(ck).eval()
    rng = np.random.default_rng(0)
    rej, top = [], []
    for p in test.prompts[:n]:
        wrong = wrong_choices(p, env_cfg)
        w = int(rng.choice(wrong))
        env = Geo3kEnv(p.answer, env_cfg, choices=p.choices)
        call = format_target(p.choices[w]); obs, _, _ = env.step(call)
        ctx = list(p.messages) + [{"role": "assistant", "content": call}, Geo3kEnv.format_observation(obs)]
        scores = []  # each choice's reply, summed log-probability
        for c in p.choices:
            ex = sft_example(r, ctx + [{"role": "assistant", "content": format_target(c)}], p.images, 0)
            b = pack([ex], len(ex.token_ids))[0]
            with torch.no_grad():
                lp = model(**packed_inputs(b, proc, model.config)).logits[0].float().log_softmax(-1)
            ids = torch.as_tensor(ex.token_ids)
            m = torch.as_tensor(ex.loss_mask).bool()
            scores.append(float(lp[:-1].gather(1, ids[1:, None])[:, 0][m[1:]].sum()))
        s = np.array(scores); pr = np.exp(s - s.max()); pr /= pr.sum()
        rej.append(pr[w]); top.append(int(np.argmax(s)) == w)
    return dict(p_rejected=round(float(np.mean(rej)), 3), greedy_repeat=round(float(np.mean(top)), 3))


import os, types
import geo3k_torch.prime as P
_pc = P.prime_config
WD = float(os.environ.get("WD", "0"))
P.prime_config = lambda lr, steps, fv=False: types.SimpleNamespace(**{**vars(_pc(lr, steps, fv)), "weight_decay": WD})
shutil.rmtree(out, ignore_errors=True); shutil.copytree(src, out)
print("start", diag(out), flush=True)
done = 0
for c in chunks.split(","):
    t = time.time()
    later = c.startswith("r")
    c = int(c.lstrip("r"))
    losses = P2.prime_format(out, train.prompts, 0 if later else c, later_steps=c if later else 0, seed=100 + done, lr=lr, batch=batch, train_vision=False,
                          tools=tools, env_config=env_cfg, answer="value", retry=retry)
    done += c
    print(done, "loss", round(float(np.mean(losses[-20:])), 4), diag(out), f"{time.time()-t:.0f}s", flush=True)

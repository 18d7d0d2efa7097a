"""A retry's answer distribution over the 4 choices, on 60 test problems of replicate 1: after a
first call giving a random wrong choice and the environment's feedback, the probability of that
rejected choice's value (0.25 is no avoidance at all; a policy that avoids it gives it 0), and how
often it is the most likely one (the greedy repeat rate against a random first answer).

    python docs/replicates/probes/unlikelihood/diag.py CHECKPOINT [CHECKPOINT ...]
"""
import sys; sys.path.insert(0, ".")
import numpy as np, torch
from configs import cpu_perception
from geo3k_torch.prepare import prepare_data, prompt_style, to_dataclass
from common.env import EnvConfig
from common.chat import ChatRenderer
from common.processor import load_processor
from common.sft import sft_example
from common.batching import pack
from geo3k_torch.model import load_model, packed_inputs
from geo3k_torch.prime import wrong_choices, format_target
from common.env import Geo3kEnv
k = 1
cfg = cpu_perception.get_config(); cfg.seed = k; cfg.model.tiny_seed = k; cfg.data.synthetic_seed = k
cfg.data.synthetic_dir = f"data/rep{k}/synthetic"
_, test = prepare_data(cfg)
env_cfg = to_dataclass(EnvConfig, cfg.env)
for ck in sys.argv[1:]:
    proc = load_processor(ck); r = ChatRenderer(proc, tools=prompt_style(cfg.data.prompt_style)[1])
    model = load_model(ck).eval()
    tok = proc.tokenizer
    rej, first_top = [], []
    rng = np.random.default_rng(0)
    for p in test.prompts[:60]:
        wrong = wrong_choices(p, env_cfg)
        w = int(rng.choice(wrong))
        env = Geo3kEnv(p.answer, env_cfg, choices=p.choices)
        call = format_target(p.choices[w])
        obs, _, _ = env.step(call)
        msgs = list(p.messages) + [{"role": "assistant", "content": call}, Geo3kEnv.format_observation(obs)]
        # logits at the value position: render the context + a reply prefix up to the value
        lps = []
        for c in p.choices:
            ex = sft_example(r, msgs + [{"role": "assistant", "content": format_target(c)}], p.images, 0)
            batch = pack([ex], len(ex.token_ids))[0]
            inputs = packed_inputs(batch, proc, model.config)
            with torch.no_grad():
                logits = model(**inputs).logits[0].float().log_softmax(-1)
            start = len(ex.token_ids) - int(ex.loss_mask.sum())
            # the first token of the reply that depends on the choice
            lps.append((start, ex.token_ids, logits))
        # find first differing index among the 4 replies
        seqs = [l[1] for l in lps]
        j = next(i for i in range(lps[0][0], len(seqs[0])) if len({s[i] for s in seqs}) > 1)
        logits = lps[0][2][j - 1]
        vals = np.array([float(logits[s[j]]) for s in seqs])
        pr = np.exp(vals) / np.exp(vals).sum()
        rej.append(pr[w])
        first_top.append(int(np.argmax(vals)) == w)
    print(ck, "p(rejected) among the 4:", round(float(np.mean(rej)), 3), "greedy repeats:", round(float(np.mean(first_top)), 3))

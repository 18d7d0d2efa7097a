"""Probe (2026-11-28, not part of the recipe): replicate K's tiny checkpoint pretrained as the CPU
default builds it, then primed as `geo3k_torch.prime` primes it ("new_after_repeats", frozen
tower, lr 3e-3, 8 examples a step), plus, for every example whose trained call is a retry, a
second copy of it answering an earlier call's value, whose value token is scored with the
unlikelihood -ALPHA * log(1 - p). ALPHA 0 is the recipe's own priming.

    python docs/replicates/probes/unlikelihood/ul.py K STEPS ALPHA     # -> runs/unlikelihood/
    python -m geo3k_torch.evaluate --config=configs/cpu_perception.py --config.seed=K \
        --config.data.synthetic_seed=K --config.data.synthetic_dir=data/rep<K>/synthetic \
        --config.model.path=runs/unlikelihood/ul<K>_<STEPS>_<ALPHA> --noblank_images --out=...
    python docs/replicates/probes/unlikelihood/diag.py runs/unlikelihood/ul<K>_<STEPS>_<ALPHA>
"""
import sys, shutil
sys.path.insert(0, ".")
import numpy as np, torch
from configs import cpu_perception
from geo3k_torch.prepare import prepare_model_dir, prepare_data, prompt_style, to_dataclass
from common.env import EnvConfig
from common.chat import ChatRenderer
from common.processor import load_processor
from common.sft import sft_example
from common.batching import TrainSequence, pack
from geo3k_torch.model import load_model
from geo3k_torch.learner import SFTLearner
from geo3k_torch.prime import primer_messages, wrong_choices, prime_config
from geo3k_torch.checkpoint import quiet_progress
k, steps, alpha = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
cfg = cpu_perception.get_config()
cfg.seed = k; cfg.model.tiny_seed = k; cfg.data.synthetic_seed = k
cfg.data.synthetic_dir = f"data/rep{k}/synthetic"
cfg.model.tiny_prime_steps = 0; cfg.model.tiny_dir = f"runs/unlikelihood/cap{k}"
cap = prepare_model_dir(cfg)
out = f"runs/unlikelihood/ul{k}_{steps}_{alpha}"
shutil.rmtree(out, ignore_errors=True); shutil.copytree(cap, out)
train, _ = prepare_data(cfg)
env_cfg = to_dataclass(EnvConfig, cfg.env)
proc = load_processor(out)
r = ChatRenderer(proc, tools=prompt_style(cfg.data.prompt_style)[1])

class UL(SFTLearner):
    def micro_batch_loss(self, mb):
        logp, entropy = self._forward(self.model, mb, True)
        neg = mb.advantages < 0
        nll = torch.where(neg, -alpha * torch.log1p(-logp.exp().clamp(max=1 - 1e-6)), -logp)
        return nll.sum() / mb.n_tokens * self.world_size, {"entropy": entropy.sum()}

model = load_model(out)
learner = UL(model, proc, prime_config(3e-3, steps, True), model_dir=out)
rng = np.random.default_rng(k)
usable = [p for p in train.prompts if p.choices]
wrong = [wrong_choices(p, env_cfg) for p in usable]
tok = proc.tokenizer
for step in range(steps):
    seqs = []
    for i in rng.choice(len(usable), 8, replace=False):
        p = usable[i]
        m = primer_messages(p, rng, env_cfg, "value", wrong[i], "new_after_repeats")
        seqs.append(sft_example(r, m, p.images, int(i)))
        earlier = [x["content"] for x in m[len(p.messages):-1] if x["role"] == "assistant"]
        if earlier and alpha > 0:
            # a negative: the same context, the trained call giving an earlier answer; only the
            # value tokens (where it differs from the positive) are marked
            bad = earlier[int(rng.integers(len(earlier)))]
            neg = sft_example(r, m[:-1] + [{"role": "assistant", "content": bad}], p.images, int(i))
            pos = seqs[-1]
            n = len(neg.token_ids)
            mask = np.zeros(n, np.int8); adv = np.zeros(n, np.float32)
            start = n - int(neg.loss_mask.sum())
            for j in range(start, n):
                if j >= len(pos.token_ids) or pos.token_ids[j] != neg.token_ids[j]:
                    mask[j] = 1; adv[j] = -1.0
                    break  # the first differing token: the value
            if mask.any():
                seqs.append(TrainSequence(neg.token_ids, mask, np.zeros(n, np.float32), adv, list(p.images), int(i)))
    budget = max(len(s.token_ids) for s in seqs) * len(seqs)

    m = learner.train_step(pack(seqs, budget), float(sum(s.loss_mask.sum() for s in seqs)), float(len(seqs)))
    if step % 50 == 0: print(step, round(float(m["loss"]), 4), flush=True)
with quiet_progress():
    model.save_pretrained(out, safe_serialization=True)

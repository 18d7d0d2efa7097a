"""Does a checkpoint's retry depend on its earlier call? On 4 test problems of replicate 0, the
retry's probabilities of the four values after a first call giving each wrong choice w in turn
(identical rows: the retry does not read the earlier call at all).

    python docs/replicates/probes/attention/dep.py CHECKPOINT
"""
import sys; sys.path.insert(0, ".")
import numpy as np, torch
from configs import cpu_perception
from geo3k_torch.prepare import prepare_data, prompt_style, to_dataclass
from common.env import EnvConfig, Geo3kEnv
from common.chat import ChatRenderer
from common.processor import load_processor
from common.sft import sft_example
from common.batching import pack
from geo3k_torch.model import load_model, packed_inputs
from geo3k_torch.prime import format_target, wrong_choices
ck = sys.argv[1]
cfg = cpu_perception.get_config(); 
train, test = prepare_data(cfg)
env_cfg = to_dataclass(EnvConfig, cfg.env); tools = prompt_style(cfg.data.prompt_style)[1]
proc = load_processor(ck); r = ChatRenderer(proc, tools=tools); model = load_model(ck).eval()
for p in test.prompts[:4]:
    rows = []
    for w in wrong_choices(p, env_cfg):
        env = Geo3kEnv(p.answer, env_cfg, choices=p.choices)
        call = format_target(p.choices[w]); obs, _, _ = env.step(call)
        msgs = list(p.messages) + [{"role": "assistant", "content": call}, Geo3kEnv.format_observation(obs),
                                   {"role": "assistant", "content": format_target(p.choices[0])}]
        ex = sft_example(r, msgs, p.images, 0)
        b = pack([ex], len(ex.token_ids))[0]
        with torch.no_grad():
            lp = model(**packed_inputs(b, proc, model.config)).logits[0].float().log_softmax(-1)
        ids = list(ex.token_ids); start = len(ids) - int(ex.loss_mask.sum())
        # value position: the token after the reply's `answer": "`
        tok = proc.tokenizer
        vids = [tok.encode(c, add_special_tokens=False)[0] for c in p.choices]
        j = max(i for i in range(start, len(ids)) if ids[i] == vids[0])
        rows.append((w, np.round(np.exp(lp[j - 1, vids].numpy()), 2)))
    print(p.choices, rows)

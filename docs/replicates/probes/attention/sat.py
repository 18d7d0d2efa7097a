"""Attention at a retry's value position: for each layer and head, the mean over 12 test problems
of the largest weight, and of the summed weight on the earlier call's and feedback's value tokens
(replicate 0's test split; eager attention).

    python docs/replicates/probes/attention/sat.py CHECKPOINT [CHECKPOINT ...]
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
cfg = cpu_perception.get_config(); 
train, test = prepare_data(cfg)
env_cfg = to_dataclass(EnvConfig, cfg.env); tools = prompt_style(cfg.data.prompt_style)[1]
for ck in sys.argv[1:]:
    proc = load_processor(ck); r = ChatRenderer(proc, tools=tools); model = load_model(ck).eval()
    model.set_attn_implementation("eager"); tok = proc.tokenizer
    mx, on = [], []
    for p in test.prompts[:12]:
        w = wrong_choices(p, env_cfg)[0]
        env = Geo3kEnv(p.answer, env_cfg, choices=p.choices)
        call = format_target(p.choices[w]); obs, _, _ = env.step(call)
        msgs = list(p.messages) + [{"role": "assistant", "content": call}, Geo3kEnv.format_observation(obs),
                                   {"role": "assistant", "content": format_target(p.choices[0])}]
        ex = sft_example(r, msgs, p.images, 0)
        inp = {k: v for k, v in packed_inputs(pack([ex], len(ex.token_ids))[0], proc, model.config).items()
               if k not in ("packed_segments", "attention_mask")}
        with torch.no_grad():
            att = model(**inp, output_attentions=True).attentions
        ids = list(ex.token_ids); start = len(ids) - int(ex.loss_mask.sum())
        vids = [tok.encode(c, add_special_tokens=False)[0] for c in p.choices]
        j = max(i for i in range(start, len(ids)) if ids[i] == vids[0])
        first_user_end = next(i for i in range(len(ids)) if tok.decode([ids[i]]) == "<tool_call>")
        vpos = [i for i in range(first_user_end, start) if ids[i] == vids[w]]
        a = torch.stack([x[0, :, j - 1] for x in att]).numpy()  # layers, heads, T
        mx.append(a.max(-1)); on.append(a[..., vpos].sum(-1))
    print(ck, "max weight", np.round(np.mean(mx, 0), 3).tolist(), "on the rejected value", np.round(np.mean(on, 0), 4).tolist(), flush=True)

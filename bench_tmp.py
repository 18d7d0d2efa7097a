import time, jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from configs import cpu
from common.processor import load_processor
from common.grpo import LossConfig
from geo3k_jax.check_batch import batches_from_config
from geo3k_jax.learner import Learner
from geo3k_jax.model import split_params
from geo3k_jax.weights import load_model
from geo3k_jax.batch import host_row
from geo3k_jax.buckets import step_arrays, step_sizes
cfg = cpu.get_config(); d = "data/tiny-qwen3_vl-small"
proc = load_processor(d); batches, nt, ns = batches_from_config(proc, cfg.jax.check)
model, config = load_model(d); merge, params = split_params(model)
for rows, chunk in ((1, 1024), (3, 1024), (3, 0), (1, 0)):
    l = Learner(merge, params, LossConfig(), cfg.train, 1.0, processor=proc, config=config, row_len=1408, rows_per_slice=rows, chunk=chunk)
    l.train_step(batches, nt, ns)
    t = time.perf_counter(); [l.train_step(batches, nt, ns) for _ in range(3)]; tot = (time.perf_counter() - t) / 3
    t = time.perf_counter()
    for _ in range(3):
        hr = [host_row(b, proc, config, agg="token-mean", n_tokens=nt, n_seqs=ns) for b in batches]
        st = step_arrays(hr, config, rows_per_slice=rows, row_len=1408)
    host = (time.perf_counter() - t) / 3
    print(rows, chunk, "total", round(tot, 3), "host", round(host, 3), {k: v.shape for k, v in st.items() if k in ("input_ids", "targets", "pixel_values", "key_offsets")})

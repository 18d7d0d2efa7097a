"""The training loop end to end on CPU: what a run leaves in its workdir, exact resume, and the
GPU recipe refusing to start without CUDA."""

import contextlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import cpu
from common import checkpoints
from geo3k_torch import main as train_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


def small_config(shared, steps):
    cfg = cpu.get_config()
    cfg.model.tiny_dir = str(shared / "tiny")
    cfg.model.tiny_prime_steps = 0
    cfg.data.synthetic_dir = str(shared / "data")
    cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 16, 4
    cfg.train.steps, cfg.train.prompts_per_step = steps, 2
    cfg.rollout.n_samples, cfg.rollout.max_response_tokens = 3, 24
    cfg.rollout.max_context_tokens = 512
    cfg.train.lr = 1e-3
    cfg.eval.every, cfg.eval.max_prompts, cfg.eval.n_samples = 2, 2, 1
    cfg.checkpoint.every, cfg.checkpoint.keep = 2, 3
    # A random tiny model scores 0 everywhere: keep every group so that every step runs the
    # update (its weight decay moves the weights; after that the k3 KL term to the reference
    # has a gradient), with the reference-model and TIS paths. Learning itself is pinned by
    # tests/test_learning.py, exact learner state by tests/test_learners.py.
    cfg.advantage.filter_equal_groups = False
    cfg.loss.kl_coef, cfg.loss.kl_estimator, cfg.loss.tis_cap = 0.05, "k3", 2.0
    return cfg


def assert_same_metrics(rows: list[dict], workdir: Path) -> None:
    """The metrics.jsonl of `workdir` (a resumed run) equal `rows` (the uninterrupted run's)."""
    resumed = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [r["step"] for r in rows]
    for a, b in zip(rows, resumed):
        for k in ("train/reward_mean", "train/loss", "train/grad_norm", "train/entropy",
                  "train/response_len_mean"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (a["step"], k)


@contextlib.contextmanager
def crash_after_checkpoint(step: int, monkeypatch):
    """Inside the block, a run raises KeyboardInterrupt right after its step-`step` checkpoint
    is in place."""
    real_start = checkpoints.start

    def start_then_crash(root, at, *args, **kw):
        finish = real_start(root, at, *args, **kw)

        def finish_then_crash():
            out = finish()
            if at == step:
                raise KeyboardInterrupt("simulated crash")
            return out
        return finish_then_crash

    monkeypatch.setattr(checkpoints, "start", start_then_crash)
    try:
        yield
    finally:
        monkeypatch.setattr(checkpoints, "start", real_start)


@pytest.mark.slow
def test_workdir_layout_and_exact_resume(shared, tmp_path, monkeypatch, capsys):
    full = tmp_path / "full"
    capsys.readouterr()  # (what the fixtures printed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = train_main.train(small_config(shared, 3), str(full))
    # stdout is no terminal here: one plain line a step, as a batch job's log shows it; no
    # progress bar or warning repeated at every checkpoint
    printed = capsys.readouterr()
    assert "Writing model shards" not in printed.err
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    lines = [x for x in printed.out.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3", "3/3"]
    assert all(" reward " in x and " tools " in x and " eta " in x for x in lines)
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    step0, rows = rows[0], rows[1:]  # step 0: the evaluation before any update, alone
    assert "eval/greedy_accuracy" in step0 and all(k.startswith("eval/") for k in step0
                                                   if k != "step")
    for key in ("train/reward_mean", "train/reward_std", "train/accuracy",
                "train/tool_call_rate", "train/turns_mean", "train/response_len_mean",
                "train/truncated", "train/aborted", "train/filtered_groups", "train/time_rollout",
                "train/time_batching", "train/time_train", "train/time_weight_sync",
                "train/rollout_tokens_per_s", "train/train_tokens_per_s",
                "train/packing_efficiency", "train/grader_calls", "train/grader_timeouts"):
        assert key in rows[0], key
    trained = [r for r in rows if "train/loss" in r]
    for key in ("train/grad_norm", "train/entropy", "train/logp_diff_mean",
                "train/logp_diff_max", "train/lr"):
        assert all(key in r for r in trained), key
    # one update on rollouts of the current weights: these would compare the policy with itself
    assert not any("train/clip_frac" in r or "train/approx_kl" in r for r in trained)
    assert "eval/greedy_accuracy" in rows[1] and "eval/greedy_accuracy" not in rows[0]
    assert last["train/trajectories"] == 6.0
    assert (full / "curve.png").stat().st_size > 1000
    assert json.loads((full / "config.json").read_text())["config"]["train"]["steps"] == 3
    assert list(full.glob("events.out.tfevents.*"))
    dump = [json.loads(x) for x in (full / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(dump) == 6
    d = dump[0]
    assert len(d["token_ids"]) == len(d["loss_mask"]) == len(d["rollout_logprobs"])
    assert d["status"] in ("completed", "truncated") and d["turns"] and d["images"]
    assert (full / "rollouts" / d["images"][0]).exists()
    # every 2 steps, and the last
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step_2", "step_3"]

    # the run interrupted right after its step-2 checkpoint, then resumed
    part = tmp_path / "part"
    with crash_after_checkpoint(2, monkeypatch), pytest.raises(KeyboardInterrupt):
        train_main.train(small_config(shared, 3), str(part))
    cfg = small_config(shared, 3)
    cfg.train.resume = True
    train_main.train(cfg, str(part))
    assert_same_metrics([step0] + rows, part)
    w_full = load_file(str(full / "checkpoints" / "step_3" / "model.safetensors"))
    w_part = load_file(str(part / "checkpoints" / "step_3" / "model.safetensors"))
    assert w_full.keys() == w_part.keys()
    assert max(float(np.abs(w_full[k] - w_part[k]).max()) for k in w_full) == 0.0
    w0 = load_file(str(shared / "tiny" / "model.safetensors"))
    assert max(float(np.abs(w_full[k] - w0[k]).max()) for k in w_full) > 1e-4  # it trained

    # evaluations leave training as it was: a run without any evaluation (none at step 0,
    # none at step 2) samples and learns the same steps
    quiet = small_config(shared, 3)
    quiet.eval.every = 0
    train_main.train(quiet, str(tmp_path / "quiet"))
    alone = [json.loads(x) for x in (tmp_path / "quiet" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in alone] == [1, 2, 3]
    for key in ("train/reward_mean", "train/loss", "train/response_len_mean"):
        assert [r.get(key) for r in alone] == [r.get(key) for r in rows], key

    # a new run into a workdir that holds a run's checkpoints stops before it builds anything
    # and changes nothing there
    before = (full / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(train_main, "build", lambda *a: pytest.fail("built the run"))
    with pytest.raises(ValueError, match="resume=True"):
        train_main.train(small_config(shared, 3), str(full))
    assert (full / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step_2", "step_3"]


@pytest.mark.slow
def test_checkpoint_is_an_hf_model_directory(shared, tmp_path):
    from transformers import AutoModelForImageTextToText
    from common.processor import load_processor
    cfg = small_config(shared, 1)
    cfg.eval.every = 0
    train_main.train(cfg, str(tmp_path))
    ckpt = checkpoints.latest(tmp_path / "checkpoints")
    assert ckpt.name == "step_1"
    model = AutoModelForImageTextToText.from_pretrained(ckpt)
    processor = load_processor(ckpt)
    assert model.config.model_type == "qwen3_vl" and processor.image_processor is not None
    (tmp_path / "checkpoints" / "step_9.tmp").mkdir()  # a crash mid-write is never "latest"
    assert checkpoints.latest(tmp_path / "checkpoints").name == "step_1"


@pytest.mark.slow
def test_gpu_recipe_without_cuda_stops_with_a_clear_message(tmp_path):
    """configs/h100.py, and with it h100_single_turn and h100_areal (geo3k_torch.prepare)."""
    proc = subprocess.run([sys.executable, "-m", "geo3k_torch.main", "--config=configs/h100.py",
                           f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "CUDA" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_priming_teaches_the_format_and_only_the_format(shared, tmp_path):
    from common.data import load_split
    from common.synthetic import write_split
    from geo3k_torch.prime import format_target, prime_format
    from geo3k_torch.tiny import build_tiny_checkpoint
    write_split(tmp_path / "data", "train", 8, seed=1, image_size="112")
    prompts = load_split(tmp_path / "data", split="train").prompts
    out = build_tiny_checkpoint(tmp_path / "tiny", arch="qwen3_vl", vocab="small")
    w0 = load_file(str(out / "model.safetensors"))
    losses = prime_format(str(out), prompts, steps=12, seed=0)
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0]
    w1 = load_file(str(out / "model.safetensors"))
    assert any(float(np.abs(w1[k] - w0[k]).max()) > 0 for k in w0)
    assert format_target("B") == ('<tool_call>\n{"name": "calc_score", "arguments": '
                                  '{"answer": "B"}}\n</tool_call>')


def test_micro_batch_smaller_than_an_episode_is_refused_up_front(shared, tmp_path):
    cfg = small_config(shared, 1)
    cfg.train.micro_batch_tokens = 100
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        train_main.train(cfg, str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_staleness_without_a_correction_is_refused_up_front(shared, tmp_path):
    """max_staleness=1 with loss.tis_cap None used to train on stale rollouts as if on-policy
    (with one update per rollout the ratio is 1 by construction): now it does not start."""
    cfg = small_config(shared, 1)
    cfg.train.max_staleness, cfg.loss.tis_cap = 1, None
    with pytest.raises(ValueError, match="loss.tis_cap"):
        train_main.train(cfg, str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def load_payload(raw: bytes) -> list:
    """A /update_weights_from_tensor payload's [(name, tensor)] (CPU tensors: shared memory)."""
    import pickle
    return pickle.loads(raw)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["auto", "disk"])
def test_sglang_backend_in_the_loop(shared, tmp_path, sync):
    """The loop on the SGLang backend, against the fake server: rollouts come from it, weights go
    to it after every step (colocated: bf16 tensors in memory inside a weight-update session;
    "disk": bf16 safetensors shards), its memory is released around each update and never
    generates on weights or memory that are not in place."""
    import torch
    from safetensors.torch import load_file as load_torch
    from common.processor import load_processor
    from geo3k_torch.prepare import prepare_model_dir
    from tests.fake_sglang import Action, FakeSGLang
    cfg = small_config(shared, 2)
    cfg.data.synthetic_image_size = "112"  # 16 image tokens each, as the fake expands them
    cfg.eval.every = 0
    cfg.engine.backend, cfg.engine.sglang_colocated = "sglang", True
    cfg.engine.sglang_weight_sync, cfg.engine.sglang_bucket_mb = sync, 0.05  # several buckets
    tok = load_processor(prepare_model_dir(cfg)).tokenizer
    reply = tok.encode('<tool_call>\n{"name": "calc_score", "arguments": {"answer": "A"}}\n'
                       '</tool_call>', add_special_tokens=False)
    with FakeSGLang(image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                    tokens_per_image=16, responder=lambda body: Action(ids=reply),
                    tensor_loader=load_payload) as fake:
        with cfg.unlocked():
            cfg.engine.sglang_urls = fake.url
        last = train_main.train(cfg, str(tmp_path))
        paths = [p for _, p, _ in fake.requests]
    assert last["train/tool_call_rate"] == 1.0 and "train/loss" in last
    assert len(fake.bodies("/generate")) == 2 * 2 * 3  # steps x prompts x samples (one turn)
    assert fake.garbage == [] and not fake.released and not fake.wiped
    # the servers hold the step-2 weights: the learner's, in bf16, under the checkpoint's names
    learner = load_torch(str(tmp_path / "checkpoints" / "step_2" / "model.safetensors"))
    if sync == "auto":
        served = fake.tensors
        updates = fake.bodies("/update_weights_from_tensor")
        assert len(updates) > 2 * 2  # several buckets per step
        assert [b.get("weight_version") for b in updates].count("2") == 1
        order = ["/generate", "/abort_request", "/flush_cache", "/release_memory_occupation",
                 "/resume_memory_occupation", "/begin_weight_update",
                 "/update_weights_from_tensor", "/end_weight_update", "/model_info"]
        resumes = fake.bodies("/resume_memory_occupation")
        assert resumes == [{"tags": ["weights"]}, {"tags": ["kv_cache", "cuda_graph"]}] * 2
    else:
        out = tmp_path / "weights_for_sglang"
        synced = fake.bodies("/update_weights_from_disk")
        assert [b["model_path"] for b in synced] == [str(out.resolve())] * 2
        assert [b["weight_version"] for b in synced] == ["1", "2"]  # the steps
        served = {}
        for f in out.glob("model-*.safetensors"):
            served.update(load_torch(str(f)))
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(served) and len(set(
            index["weight_map"].values())) > 1  # sharded
        order = ["/generate", "/abort_request", "/flush_cache", "/release_memory_occupation",
                 "/resume_memory_occupation", "/update_weights_from_disk", "/model_info"]
    assert sorted(served) == sorted(learner)
    assert all(served[k].dtype == torch.bfloat16 and
               torch.equal(served[k], learner[k].to(torch.bfloat16)) for k in learner)
    # each step: generate, then release only once idle, train, resume, load the new weights,
    # and check the servers report that version
    for _ in range(2):  # steps
        seen = [p for p in paths if p in order]
        window = seen[:seen.index("/model_info") + 1]
        assert [order.index(p) for p in window] == sorted(order.index(p) for p in window), window
        assert set(window) == set(order), window
        paths = paths[paths.index("/model_info") + 1:]
        if sync == "auto":  # the KV cache's resume, after the new weights (checked above)
            assert paths[0] == "/resume_memory_occupation"
            paths = paths[1:]


@pytest.mark.slow
def test_bounded_staleness_overlaps_and_corrects(shared, tmp_path):
    """max_staleness=1: rollouts are generated ahead (the engine on its own copy of the
    weights) and every trained trajectory is at most one update old; from step 2 on they are
    exactly one old, so the learner's log-probs differ from the rollout's and the truncated
    importance weights act (tis_mean != 1); clip_frac and approx_kl, which compare the policy
    with the behaviour one, are reported (a synchronous run drops them: see
    test_workdir_layout_and_exact_resume)."""
    cfg = small_config(shared, 4)
    cfg.train.max_staleness = 1
    cfg.loss.kl_coef = 0.0
    cfg.eval.every = 0
    train_main.train(cfg, str(tmp_path))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["train/staleness_max"] <= 1 and r["train/stale_dropped"] == 0 for r in rows)
    assert rows[0]["train/staleness_0"] == 6 and rows[0]["train/staleness_mean"] == 0.0
    for r in rows[1:]:
        assert r["train/staleness_1"] == 6 and r["train/staleness_mean"] == 1.0
        assert r["train/logp_diff_mean"] > 1e-6 and r["train/tis_mean"] != 1.0
        # reported (off-policy: against the behaviour log-probs, pinned to the numpy reference
        # in tests/test_learners.py); here the policies differ by ~1e-4 a token, and float32's
        # k3 of that rounds to 0
        assert r["train/approx_kl"] >= 0.0 and "train/clip_frac" in r
    dump = [json.loads(x) for x in (tmp_path / "rollouts" / "step_3.jsonl").read_text()
            .splitlines()]
    assert len(dump) == 6


@pytest.mark.slow
def test_bounded_staleness_on_sglang(shared, tmp_path):
    """Generating ahead against the (0.5.23-like) fake SGLang: the next rollout is generated
    while the learner trains, the weights of every update go to the servers (tagged with the
    step) between rollouts; a colocated server (its memory released during training) is
    refused up front."""
    from common.processor import load_processor
    from geo3k_torch.prepare import prepare_model_dir
    from tests.fake_sglang import Action, FakeSGLang
    cfg = small_config(shared, 3)
    cfg.data.synthetic_image_size = "112"
    cfg.eval.every = 0
    cfg.train.max_staleness, cfg.loss.kl_coef = 1, 0.0
    cfg.engine.backend, cfg.engine.sglang_colocated = "sglang", True
    with pytest.raises(ValueError, match="colocated"):
        train_main.train(cfg, str(tmp_path / "refused"))
    cfg.engine.sglang_colocated = False
    tok = load_processor(prepare_model_dir(cfg)).tokenizer
    reply = tok.encode('<tool_call>\n{"name": "calc_score", "arguments": {"answer": "A"}}\n'
                       '</tool_call>', add_special_tokens=False)
    with FakeSGLang(image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                    tokens_per_image=16, responder=lambda body: Action(ids=reply)) as fake:
        with cfg.unlocked():
            cfg.engine.sglang_urls = fake.url
        train_main.train(cfg, str(tmp_path / "run"))
        synced = fake.bodies("/update_weights_from_disk")
        generated = len(fake.bodies("/generate"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [b["weight_version"] for b in synced] == ["1", "2", "3"]
    assert generated == 3 * 2 * 3
    assert [r["train/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]


def test_a_step_line_reads_plainly():
    from common.train import step_line
    m = {"train/reward_mean": 0.4123, "train/accuracy": 0.381, "train/tool_call_rate": 0.98,
         "eval/greedy_accuracy": 0.5, "train/loss": 1.0}
    assert step_line(12, 200, m, 9.06, 1685.2) == (
        "step 12/200 reward 0.412 acc 0.381 tools 0.980 eval 0.500 9.1 s eta 28m05s")
    assert step_line(1, 1, {}, 0.0, 0.0) == "step 1/1 0.0 s eta 0m00s"

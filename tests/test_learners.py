"""Both learners through the `common.learner.Learner` protocol, as the shared loop uses them:
the first step's loss is the numpy reference, and a step after save/restore equals the step of
an uninterrupted learner (saved while the saving learner went on to its next step)."""

from pathlib import Path

import ml_collections
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from common import checkpoints
from common.batching import pack
from common.grpo import LossConfig, policy_loss
from common.learner import Deferred, SingleProcess
from tests.jax_learner_setup import train_config
from tests.test_jax_model import sequences
from tests.tiny_models import ImageOnlyProcessor, qwen3_vl

LOSS = LossConfig(tis_cap=2.0, agg="seq-mean-token-mean")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_setup(qwen3_vl, tmp_path_factory.mktemp("tiny"))


def tiny_setup(build, path):
    """A tiny checkpoint directory `path` of the model `build` gives, its processor,
    micro-batches and their log-probs under transformers (the reference forward)."""
    from geo3k_torch.model import packed_inputs, token_logprobs

    model, patch = build(seed=0)
    model.save_pretrained(path)
    processor = ImageOnlyProcessor(patch)
    seqs = sequences(processor, np.random.default_rng(0), 6)
    batches = pack(seqs, max(max(map(len, seqs)), sum(map(len, seqs)) // 3))
    with torch.no_grad():
        logp = [token_logprobs(model, packed_inputs(b, processor, model.config),
                               torch.from_numpy(np.flatnonzero(b.loss_mask))).numpy()
                for b in batches]
    return dict(path=str(path), processor=processor, batches=batches, logp=logp,
                n_tokens=float(sum(s.loss_mask.sum() for s in seqs)), n_seqs=float(len(seqs)))


def torch_learner(tiny, train_cfg=None, loss=LOSS):
    from geo3k_torch.learner import Learner
    from geo3k_torch.model import load_model
    return Learner(load_model(tiny["path"]), tiny["processor"], loss,
                   train_cfg or train_config(), 1.0, model_dir=tiny["path"])


def jax_learner(tiny, train_cfg=None):
    import jax
    from geo3k_jax.learner.learner import Learner
    from geo3k_jax.models.model import split_params
    from geo3k_jax.models.weights import load_model
    jax.config.update("jax_default_matmul_precision", "highest")
    model, config = load_model(tiny["path"])
    merge, params = split_params(model)
    return Learner(merge, params, LOSS, train_cfg or train_config(), 1.0,
                   processor=tiny["processor"], config=config, row_len=512,
                   model_dir=tiny["path"])


# The JAX learner compiles its step (seconds on CPU): slow.
LEARNERS = pytest.mark.parametrize("make_learner", [
    torch_learner, pytest.param(jax_learner, marks=pytest.mark.slow)], ids=["torch", "jax"])


def step(learner, tiny) -> dict:
    return learner.train_step(tiny["batches"], tiny["n_tokens"], tiny["n_seqs"])


@LEARNERS
def test_first_step_loss_is_the_numpy_reference(make_learner, tiny):
    b = tiny["batches"]
    mask = np.concatenate([x.loss_mask for x in b]) > 0
    logp = np.zeros(mask.shape, np.float32)
    logp[mask] = np.concatenate(tiny["logp"])
    seq_ids = np.concatenate([x.seq_ids + 1000 * i for i, x in enumerate(b)])
    expected, metrics = policy_loss(
        logp, logp, np.concatenate([x.advantages for x in b]), mask.astype(np.float32), LOSS,
        rollout_logp=np.concatenate([x.rollout_logprobs for x in b]), seq_ids=seq_ids,
        n_tokens=tiny["n_tokens"], n_seqs=tiny["n_seqs"])
    m = step(make_learner(tiny), tiny)
    if make_learner is jax_learner:  # returned while still running: device scalars, read below
        assert isinstance(m, Deferred) and not isinstance(m.pending()["loss"], float)
    assert m["loss"] == pytest.approx(expected, abs=1e-6)
    assert m["tis_mean"] == pytest.approx(metrics["tis_mean"], rel=1e-5)
    assert m["skipped"] == 0.0 and m["grad_norm"] > 0
    # one update: clip_frac and approx_kl compare the policy with the behaviour (rollout)
    # log-probs, which differ here; against the current policy they were 0 by construction
    rollout = np.concatenate([x.rollout_logprobs for x in b])
    _, behaviour = policy_loss(
        logp, logp, np.concatenate([x.advantages for x in b]), mask.astype(np.float32), LOSS,
        rollout_logp=rollout, seq_ids=seq_ids, n_tokens=tiny["n_tokens"],
        n_seqs=tiny["n_seqs"], diag_logp=rollout)
    assert behaviour["approx_kl"] > 1e-3 and behaviour["clip_frac"] > 0
    assert m["approx_kl"] == pytest.approx(behaviour["approx_kl"], rel=1e-4)
    assert m["clip_frac"] == pytest.approx(behaviour["clip_frac"], abs=1e-6)


@pytest.mark.slow
@LEARNERS
def test_resumed_step_equals_uninterrupted(make_learner, tiny, tmp_path):
    assert_resume_is_exact(make_learner, tiny, tmp_path)


def assert_resume_is_exact(make_learner, tiny, tmp_path):
    """Two steps equal one step, a checkpoint (DCP state and HF export) and a restored step."""
    comm = SingleProcess()
    straight = make_learner(tiny)
    for _ in range(2):
        step(straight, tiny)
    straight.export_hf(tmp_path / "straight")

    first = make_learner(tiny)
    step(first, tiny)
    finish = checkpoints.start(tmp_path / "ckpt", 1, first, {"note": "x"}, comm)
    assert checkpoints.latest(tmp_path / "ckpt") is None  # not in place before `finish`
    step(first, tiny)  # while the state may still be written (the JAX step donates its buffers)
    saved = finish()
    assert checkpoints.latest(tmp_path / "ckpt") == saved
    assert checkpoints.load_loop_state(saved) == {"step": 1, "note": "x"}
    resumed = make_learner(tiny)  # fresh weights and optimizer, then restored
    resumed.restore(saved)
    step(resumed, tiny)
    resumed.export_hf(tmp_path / "resumed")

    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    w0 = load_file(str(saved / "model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) == 0.0
    assert max(float(np.abs(a[k] - w0[k]).max()) for k in a) > 0  # the second step moved them


@pytest.fixture(scope="module")
def gcs():
    from tests.fake_gcs import fake_gcs
    with fake_gcs() as bucket:
        yield bucket


@pytest.mark.slow
def test_a_jax_checkpoint_round_trips_through_an_object_store(tiny, gcs, tmp_path):
    """checkpoints.start / finish / latest / prune and the JAX learner's save / restore with a
    gs:// root (a GCS server on localhost: tests/fake_gcs.py): the resumed step equals the
    uninterrupted one exactly, and nothing is written to a local path."""
    from common import storage
    from geo3k_jax.learner.learner import SHAPES_FILE, STATE_DIR

    comm, root = SingleProcess(), f"gs://{gcs}/run/checkpoints"
    straight = jax_learner(tiny)
    for _ in range(2):
        step(straight, tiny)
    first = jax_learner(tiny)
    step(first, tiny)
    finish = checkpoints.start(root, 1, first, {"note": "x"}, comm)
    assert checkpoints.latest(root) is None  # written in place, but not published yet
    step(first, tiny)  # while orbax may still be writing (the step donates its buffers)
    saved = finish()
    assert str(saved) == f"{root}/step_1" and checkpoints.latest(root) == saved
    assert checkpoints.load_loop_state(saved) == {"step": 1, "note": "x"}
    assert {"model.safetensors", "config.json", STATE_DIR, SHAPES_FILE,
            checkpoints.LOOP_STATE} <= {p.name for p in saved.iterdir()}
    resumed = jax_learner(tiny)
    resumed.restore(saved)
    step(resumed, tiny)
    for k, v in straight.params.items():
        np.testing.assert_array_equal(np.asarray(resumed.params[k]), np.asarray(v), err_msg=k)
    # the export on GCS is the saved learner's model, as transformers reads it
    export = load_file(str(_download(saved / "model.safetensors", tmp_path)))
    assert export.keys() == load_file(str(tiny["path"] + "/model.safetensors")).keys()

    checkpoints.save(root, 2, resumed, {}, comm)
    # a checkpoint being written (newer, no loop state yet) stays; an older one that never
    # finished goes (an object store has no empty directories: each holds a file)
    for name in ("step_0", "step_3"):
        (storage.path(root) / name / "config.json").write_text("{}")
    checkpoints.prune(root, 1)
    assert sorted(p.name for p in storage.path(root).iterdir()) == ["step_2", "step_3"]
    assert checkpoints.latest(root).name == "step_2"
    assert not any(Path(".").glob("gs:*")) and not list(tmp_path.glob("gs:*"))


def _download(remote, local_dir):
    out = local_dir / remote.name
    out.write_bytes(remote.read_bytes())
    return out


def test_only_a_learner_that_writes_to_object_stores_gets_one(tiny, tmp_path):
    cfg = ml_collections.ConfigDict({"checkpoint": {"dir": ""}})
    learner = torch_learner(tiny)
    assert checkpoints.root(cfg, tmp_path, learner) == tmp_path / "checkpoints"
    cfg.checkpoint.dir = "gs://bucket/run"
    with pytest.raises(ValueError, match="object stores need the JAX learner"):
        checkpoints.root(cfg, tmp_path, learner)


@LEARNERS
def test_several_updates_per_rollout_use_the_behaviour_policy(make_learner, tiny):
    """Four updates on one rollout: after the first, the ratio to the behaviour log-probs
    leaves 1 and clipping acts, and each update's loss is the numpy reference on the learner's
    current log-probs against the behaviour ones."""
    import dataclasses

    learner = make_learner(tiny, train_config(lr=0.05, lr_schedule="constant",
                                              warmup_steps=0))
    batches = tiny["batches"]
    old = learner.logprobs(batches)
    mask = [b.loss_mask > 0 for b in batches]
    for o, b, m in zip(old, tiny["logp"], mask):  # the current policy: transformers' log-probs
        np.testing.assert_allclose(o[m], b, atol=1e-5)
    batches = [dataclasses.replace(b, old_logprobs=o) for b, o in zip(batches, old)]
    for i, b in enumerate(batches):
        now = learner.logprobs([b])[0]
        n_tokens, n_seqs = float(b.loss_mask.sum()), float(len(b.seq_index))
        want, ref = policy_loss(now, b.old_logprobs, b.advantages, b.loss_mask, LOSS,
                                rollout_logp=b.rollout_logprobs, seq_ids=b.seq_ids,
                                n_tokens=n_tokens, n_seqs=n_seqs)
        got = learner.train_step([b], n_tokens, n_seqs)
        assert got["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6), i
        assert got["clip_frac"] == pytest.approx(ref["clip_frac"], abs=1e-6), i
        if i == 0:  # the behaviour policy itself: ratio 1
            assert got["clip_frac"] == 0.0 and abs(got["approx_kl"]) < 1e-6
    assert got["clip_frac"] > 0 and got["approx_kl"] > 1e-4  # later updates: off-policy


@pytest.mark.slow
@LEARNERS
def test_the_schedule_spans_every_optimizer_step_of_the_run(make_learner, tiny):
    """2 rollouts x 3 updates (common.step.update, as the loop trains), linear decay to 0: the
    LR falls over all 6 optimizer steps, 1, 5/6, ... 1/6 of lr. Before, the horizon was
    train.steps = 2 optimizer steps: 1, 1/2, then 0 from the first rollout's third update on
    (means 0.5 and 0 where they are 5/6 and 1/3)."""
    from common.step import update

    lr = 1e-3
    learner = make_learner(tiny, train_config(lr=lr, lr_schedule="linear", warmup_steps=0,
                                              steps=2, min_lr_ratio=0.0, updates_per_rollout=3))
    minis = [list(m) for m in np.array_split(np.array(tiny["batches"], object), 3)]
    assert all(minis)
    got = [update(learner, minis)["lr"] for _ in range(2)]
    assert got == pytest.approx([lr * (1 + 5 / 6 + 4 / 6) / 3, lr * (3 / 6 + 2 / 6 + 1 / 6) / 3])
    # warmup counts rollouts too: 1 rollout of warmup is 3 optimizer steps
    learner = make_learner(tiny, train_config(lr=lr, lr_schedule="constant", warmup_steps=1,
                                              steps=2, updates_per_rollout=3))
    assert update(learner, minis)["lr"] == pytest.approx(lr * (1 / 3 + 2 / 3 + 1) / 3)


@pytest.mark.parametrize("make_learner", [torch_learner], ids=["torch"])
def test_one_update_per_rollout_is_the_plain_step(make_learner, tiny):
    """common.step.update with one mini-batch is train_step itself, bit for bit."""
    from common.step import update

    a, b = make_learner(tiny), make_learner(tiny)
    ma = update(a, [tiny["batches"]])
    mb = step(b, tiny)
    assert ma == mb
    for (k, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), k


@LEARNERS
def test_a_frozen_vision_tower_is_not_trained(make_learner, tiny):
    """train.freeze_vision: after a step (with weight decay) every vision tower parameter is
    as loaded, and the language model's moved."""
    from common.learner import is_vision
    from safetensors.numpy import load_file as load_numpy

    learner = make_learner(tiny, train_config(lr=0.05, freeze_vision=True))
    step(learner, tiny)
    before = load_numpy(str(Path(tiny["path"]) / "model.safetensors"))
    after = params_of(learner)
    vision = [k for k in before if is_vision(k)]
    assert vision and len(vision) < len(before)
    for k in vision:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    assert all(not np.array_equal(after[k], before[k]) for k in before
               if not is_vision(k) and "norm" not in k)


def params_of(learner) -> dict:
    """The learner's parameters as numpy arrays under transformers' names."""
    if hasattr(learner, "model"):
        return {k: v.detach().numpy() for k, v in learner.model.state_dict().items()}
    from geo3k_jax.core.stacking import to_hf
    return {k: np.asarray(v) for k, v in to_hf(learner.params).items()}

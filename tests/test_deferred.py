"""Metrics a learner is still computing (`common.learner.Deferred`), and the loop reading them
only after the work it can do beside a background update."""

import json

import pytest

from common.learner import Deferred


class Lazy:
    """A scalar that records when it is read, as a device scalar waits when float() reads it."""

    def __init__(self, value: float, log: list):
        self.value, self.log = value, log

    def __float__(self) -> float:
        self.log.append(self.value)
        return self.value


def test_values_are_read_once_and_only_when_asked():
    log = []
    inner = Deferred({"loss": Lazy(0.5, log)}, {"compiles": 3.0})
    seen = []
    outer = Deferred(inner, {"time_train": 1.0}, {"loss_copy": Lazy(0.25, log)},
                     then=lambda m, waited: seen.append((dict(m), waited)))
    assert log == []  # building from a Deferred reads nothing
    assert outer["loss"] == 0.5 and sorted(log) == [0.25, 0.5]
    assert outer.settle() == {"loss": 0.5, "compiles": 3.0, "time_train": 1.0, "loss_copy": 0.25}
    assert len(log) == 2 and len(seen) == 1  # settled once, `then` called once
    assert seen[0][0]["loss"] == 0.5 and seen[0][1] == outer.waited >= 0.0
    assert {"a": 1.0} | outer == {"a": 1.0, **outer.settle()}  # a merge reads it, as a dict
    assert outer | {"loss": 2.0} == {**outer.settle(), "loss": 2.0}
    assert inner.pending()["loss"].value == 0.5  # the inner one was never read itself


def test_then_adds_derived_values():
    def finish(m, waited):
        m["time_train"] += waited
        m["per_s"] = 10.0 / m["time_train"]
    d = Deferred({"time_train": 2.0}, then=finish)
    assert d["per_s"] == pytest.approx(10.0 / d["time_train"]) and set(d) == {"time_train",
                                                                             "per_s"}


def test_an_unreadable_value_fails_when_read():
    d = Deferred({"loss": "not a number"})
    with pytest.raises(ValueError):
        d.settle()


@pytest.mark.slow
def test_the_loop_reads_the_learners_metrics_after_dumping_the_step(tmp_path):
    """While a background update runs, the loop writes the step's rollouts and the curve first;
    only then does it read (wait for) the learner's metrics. With a learner that computes in
    line this changes nothing."""
    from common import train as loop
    from geo3k_torch import main as torch_main
    from tests.test_train_loop import small_config

    cfg = small_config(tmp_path / "shared", 2)
    cfg.eval.every = 0
    run = torch_main.build(cfg, str(tmp_path / "run"))
    reads = []

    class Background:
        """The torch learner, its metrics handed back unread, as a JAX learner's are."""

        def __init__(self, learner):
            self.learner = learner

        def train_step(self, *args):
            metrics = self.learner.train_step(*args)
            step = len(reads) + 1
            dump = tmp_path / "run" / "rollouts" / f"step_{step}.jsonl"
            curve = tmp_path / "run" / "curve.png"

            class Watched:
                def __float__(self):
                    reads.append((step, dump.exists(), curve.exists() or step == 1))
                    return metrics["loss"]
            return Deferred(metrics, {"loss": Watched()})

        def __getattr__(self, name):
            return getattr(self.learner, name)

    run.learner = Background(run.learner)
    loop.train(cfg, str(tmp_path / "run"), run)
    assert reads == [(1, True, True), (2, True, True)]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/time_train"] > 0 and r["train/train_tokens_per_s"] > 0 for r in rows)

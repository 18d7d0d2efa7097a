"""A user's reward from their own module (`reward.fn="pkg.module:function"`), through the rollout."""

import json
import sys
import textwrap

import pytest

from common.reward import RewardConfig, load_reward_fn
from common.rollout import RolloutConfig, rollout
from configs import to_dataclass
from configs.cpu import get_config
from tests.conftest import Reply, ScriptedEngine, make_prompt


def call(answer):
    return '<tool_call>{"name": "calc_score", "arguments": {"answer": ' + json.dumps(answer) + '}}</tool_call>'


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `my_rewards` on sys.path, as a user's own package would be."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent('''
        from common.reward import EpisodeScore

        def shorter_is_better(texts, infos, answer, cfg, choices, env_cfg):
            # 1 / (number of turns) when some turn was scored correct, else 0
            ok = any(i.get("tool_score") == 1.0 for i in infos)
            return 1.0 / len(texts) if ok else 0.0

        def always_right(texts, infos, answer, cfg, choices, env_cfg):
            return EpisodeScore(reward=0.25, correct=True, correct_turn=1)

        def says_no(texts, infos, answer, cfg, choices, env_cfg):
            return "no"

        def nan(texts, infos, answer, cfg, choices, env_cfg):
            return float("nan")

        not_a_function = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    load_reward_fn.cache_clear()
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)
    load_reward_fn.cache_clear()


def two_episodes(renderer, reward_cfg):
    """Episode 0 solves on turn 2 (after a wrong call), episode 1 answers wrong then stops."""
    engine = ScriptedEngine({"0-0": [Reply(call("10")), Reply(call("12"))],
                             "0-1": [Reply("\\boxed{3}")]})
    cfg = RolloutConfig(n_samples=2, max_response_tokens=1000, max_context_tokens=2000)
    return rollout([make_prompt(answer="12")], engine, renderer, cfg, reward_config=reward_cfg)


def test_builtin_reward_is_binary(renderer):
    t0, t1 = two_episodes(renderer, RewardConfig())
    assert (t0.reward, t0.correct, t0.correct_turn) == (1.0, True, 2)
    assert (t1.reward, t1.correct) == (0.0, False)


def test_user_reward_number_replaces_reward_keeps_correctness(renderer, user_module):
    t0, t1 = two_episodes(renderer, RewardConfig(fn=f"{user_module}:shorter_is_better"))
    assert t0.reward == 0.5  # solved on turn 2 of 2: the user's 1/2, not the built-in 1.0
    assert (t0.correct, t0.correct_turn) == (True, 2)  # accuracy stays the grader's
    assert (t1.reward, t1.correct) == (0.0, False)


def test_user_reward_episode_score_is_taken_whole(renderer, user_module):
    t0, t1 = two_episodes(renderer, RewardConfig(fn=f"{user_module}:always_right"))
    assert [(t.reward, t.correct, t.correct_turn) for t in (t0, t1)] == [(0.25, True, 1)] * 2


def test_config_names_the_plugin(user_module):
    cfg = get_config()
    cfg.reward.fn = f"{user_module}:shorter_is_better"
    assert to_dataclass(RewardConfig, cfg.reward).fn == "my_rewards:shorter_is_better"


@pytest.mark.parametrize("spec,match", [
    ("my_rewards", "must read 'package.module:function'"),
    ("my_rewards:", "must read"),
    (":f", "must read"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("my_rewards:missing", "has no function 'missing'"),
    ("my_rewards:not_a_function", "has no function 'not_a_function'"),
])
def test_bad_names_stop_before_any_rollout(user_module, spec, match):
    with pytest.raises(ValueError, match=match):
        RewardConfig(fn=spec)


@pytest.mark.parametrize("name,err,match", [("says_no", TypeError, "returned str"),
                                             ("nan", ValueError, "non-finite")])
def test_bad_return_values_are_named(renderer, user_module, name, err, match):
    with pytest.raises(err, match=match):
        two_episodes(renderer, RewardConfig(fn=f"{user_module}:{name}"))

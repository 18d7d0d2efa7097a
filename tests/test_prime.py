"""geo3k_torch.prime: the tiny checkpoint's format priming plays the environment with random
letters, and what it trains on is what a rollout of the same turns produces."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from common.chat import ChatRenderer
from common.data import row_to_prompt
from common.engine import STOP, Completion
from common.env import EnvConfig, Geo3kEnv
from common.prompts import prompt_style
from common.rollout import RolloutConfig, rollout
from common.sft import sft_example
from common.synthetic import generate
from geo3k_torch.prime import format_target, primer_messages


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from geo3k_torch.tiny import build_tiny_checkpoint
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _prompt(style="tool", seed=3):
    system, _ = prompt_style(style)
    row = generate(1, seed=seed, image_size="112", families=("polygon_sides",))[0]
    return row_to_prompt(row, uid="p0", system=system)


def test_primer_plays_the_environment_with_uniform_letters():
    prompt = _prompt()
    rng = np.random.default_rng(0)
    turns, letters = collections.Counter(), collections.Counter()
    for _ in range(600):
        messages = primer_messages(prompt, rng, EnvConfig(max_turns=3))
        assert messages[:len(prompt.messages)] == prompt.messages
        played = messages[len(prompt.messages):]
        replies = played[::2]
        assert all(m["role"] == "assistant" for m in replies)
        turns[len(replies)] += 1
        letters[replies[-1]["content"]] += 1
        # between the calls: the environment's own feedback to each of them, all wrong (a later
        # turn of a rollout follows wrong ones)
        env = Geo3kEnv(prompt.answer, EnvConfig(max_turns=3), choices=prompt.choices)
        for reply, feedback in zip(replies, played[1::2]):
            observation, done, info = env.step(reply["content"])
            assert not done and info["reason"] in ("wrong", "repeated")
            assert feedback == Geo3kEnv.format_observation(observation)
    # the trained (last) turn is turn 1, 2 or 3, its letter uniform: the priming says nothing
    # about the answer (a solving call that ended it early made it the answer 270 times in 600)
    assert set(turns) == {1, 2, 3} and min(turns.values()) > 150
    assert set(letters) == {format_target(x) for x in "ABCD"}
    assert all(110 < n < 190 for n in letters.values()), letters


def test_primer_answers_by_value_or_refuses():
    prompt = _prompt()
    rng = np.random.default_rng(0)
    values = {primer_messages(prompt, rng, EnvConfig(), "value")[-1]["content"]
              for _ in range(100)}
    assert values == {format_target(c) for c in prompt.choices}
    with pytest.raises(ValueError, match="tiny_prime_answer='number'"):
        primer_messages(prompt, rng, EnvConfig(), "number")


def test_primer_retries_only_choices_not_yet_given():
    from geo3k_torch.prime import wrong_choices

    prompt = _prompt()
    (solution,) = set(range(len(prompt.choices))) - set(wrong_choices(prompt, EnvConfig()))
    rng = np.random.default_rng(0)
    by_turn = collections.defaultdict(collections.Counter)
    for _ in range(900):
        messages = primer_messages(prompt, rng, EnvConfig(max_turns=3), retry="new")
        replies = [m["content"] for m in messages[len(prompt.messages)::2]]
        assert len(set(replies)) == len(replies)  # no call repeats an earlier one
        env = Geo3kEnv(prompt.answer, EnvConfig(max_turns=3), choices=prompt.choices)
        for reply in replies[:-1]:
            assert env.step(reply)[2]["reason"] == "wrong"
        # the trained call is uniform over what is left: the right letter 1 in (5 - turn)
        by_turn[len(replies)][replies[-1] == format_target("ABCD"[solution])] += 1
    assert set(by_turn) == {1, 2, 3}
    for turn, counts in by_turn.items():
        share = counts[True] / sum(counts.values())
        assert abs(share - 1 / (5 - turn)) < 0.07, (turn, counts)
    with pytest.raises(ValueError, match="tiny_prime_retry='never'"):
        primer_messages(prompt, rng, EnvConfig(), retry="never")


def test_primer_retries_a_new_choice_after_repeated_ones():
    """"new_after_repeats": the earlier calls are wrong and may repeat (the context then holds
    the environment's "repeated" feedback, as rollouts do); the trained call is one of the
    choices no earlier call gave, uniformly: right 1 in (number of choices left)."""
    from geo3k_torch.prime import wrong_choices

    prompt = _prompt()
    (solution,) = set(range(len(prompt.choices))) - set(wrong_choices(prompt, EnvConfig()))
    rng = np.random.default_rng(0)
    right = collections.defaultdict(collections.Counter)
    second = collections.Counter()  # the reason for turn 2 of the episodes of three turns
    for _ in range(1500):
        messages = primer_messages(prompt, rng, EnvConfig(max_turns=3),
                                   retry="new_after_repeats")
        replies = [m["content"] for m in messages[len(prompt.messages)::2]]
        assert replies[-1] not in replies[:-1]
        env = Geo3kEnv(prompt.answer, EnvConfig(max_turns=3), choices=prompt.choices)
        reasons = [env.step(reply)[2]["reason"] for reply in replies[:-1]]
        assert set(reasons) <= {"wrong", "repeated"} and reasons[:1] in ([], ["wrong"])
        if len(replies) == 3:
            second[reasons[1]] += 1
        left = len(prompt.choices) - len(set(replies[:-1]))
        right[left][replies[-1] == format_target("ABCD"[solution])] += 1
    # turn 2 repeats turn 1 as often as two independent draws from the 3 wrong choices: 1 in 3
    assert abs(second["repeated"] / sum(second.values()) - 1 / 3) < 0.07, second
    assert set(right) == {2, 3, 4}
    for left, counts in right.items():
        share = counts[True] / sum(counts.values())
        assert abs(share - 1 / left) < 0.07, (left, counts)


def test_primer_retries_the_next_choice_not_yet_given_cyclically():
    """"cyclic": a first call is uniform over the choices; a later one, after wrong earlier
    calls that may repeat, is the choice after the last call's in the listed order, cyclically,
    skipping those given: every such call follows from the earlier ones."""
    prompt = _prompt()
    targets = [format_target(x) for x in "ABCD"]
    rng = np.random.default_rng(0)
    firsts, later, trained = collections.Counter(), collections.Counter(), set()
    for _ in range(1200):
        messages = primer_messages(prompt, rng, EnvConfig(max_turns=3), retry="cyclic")
        replies = [m["content"] for m in messages[len(prompt.messages)::2]]
        if len(replies) == 1:
            firsts[replies[0]] += 1
            continue
        given = {targets.index(r) for r in replies[:-1]}
        last = targets.index(replies[-2])
        expected = next((last + j) % 4 for j in range(1, 4) if (last + j) % 4 not in given)
        assert replies[-1] == targets[expected], replies
        later[len(given)] += 1
        trained.add(expected)
    assert set(firsts) == set(targets)
    assert min(firsts.values()) > 0.2 * sum(firsts.values())  # about a quarter each
    assert set(later) == {1, 2}  # contexts with one or two distinct earlier calls
    # every choice but the one after the right one (reached only from the right one, never given)
    assert len(trained) == 3


def test_primer_trains_second_turns_only_when_asked():
    prompt = _prompt()
    rng = np.random.default_rng(0)
    turns = collections.Counter()
    for _ in range(300):
        messages = primer_messages(prompt, rng, EnvConfig(max_turns=3), "letter", retry="cyclic",
                                   later=True)
        turns[sum(m["role"] == "assistant" for m in messages)] += 1
    assert set(turns) == {2}  # a first call, its feedback, the trained second call
    one_turn = EnvConfig(max_turns=1)  # no later turn to train: the first
    assert sum(m["role"] == "assistant" for m in primer_messages(
        prompt, rng, one_turn, later=True)) == 1


def test_priming_refuses_negative_step_counts():
    from geo3k_torch.prime import prime_format

    with pytest.raises(ValueError, match="tiny_prime_later_steps=-1"):
        prime_format("never/read", [_prompt()], 10, later_steps=-1)


class ScriptEngine:
    """Answers each session from a script of texts, tokenized by the real tokenizer."""

    def __init__(self, tokenizer, stop, script):
        self.tok, self.stop, self.script = tokenizer, stop, list(script)

    def generate(self, requests):
        out = []
        for _ in requests:
            ids = self.tok.encode(self.script.pop(0), add_special_tokens=False) + [self.stop]
            out.append(Completion(ids, [-0.5] * len(ids), STOP))
        return out


@pytest.mark.parametrize("style", ["tool", "brief"])
def test_a_primed_later_turn_is_the_rollouts_own_tokens(tiny, style):
    """The priming's sequence for a turn-3 call equals, token for token, what a rollout
    writing the same calls holds, and trains that turn alone."""
    from common.processor import load_processor
    renderer = ChatRenderer(load_processor(tiny), tools=prompt_style(style)[1])
    prompt = _prompt(style)
    rng = np.random.default_rng(1)
    messages = next(m for m in iter(lambda: primer_messages(prompt, rng, EnvConfig()), None)
                    if len(m) == len(prompt.messages) + 5)
    seq = sft_example(renderer, messages, prompt.images)
    replies = [m["content"] for m in messages[len(prompt.messages)::2]]
    engine = ScriptEngine(renderer.tokenizer, renderer.turn_end_id, replies)
    traj, = rollout([prompt], engine, renderer, RolloutConfig(n_samples=1))
    assert len(traj.turns) == 3
    assert seq.token_ids.tolist() == traj.token_ids.tolist()
    last = renderer.tokenizer.encode(replies[-1], add_special_tokens=False)
    assert seq.token_ids[seq.loss_mask == 1].tolist() == last + [renderer.turn_end_id]


def test_the_brief_style_leaves_the_schema_out(tiny):
    from common.processor import load_processor
    processor = load_processor(tiny)
    texts = {}
    for style in ("tool", "brief"):
        renderer = ChatRenderer(processor, tools=prompt_style(style)[1])
        prompt = _prompt(style)
        texts[style] = renderer.decode(renderer.prompt_ids(prompt.messages, prompt.images))
    assert "<tools>" in texts["tool"] and "<tools>" not in texts["brief"]
    assert prompt_style("brief")[0] in texts["brief"]
    assert len(texts["brief"]) < len(texts["tool"]) / 2


def test_the_cpu_default_has_room_for_every_turn(tiny):
    """A primed policy answering wrong every turn gets all of the quick CPU run's turns on its
    longest prompt: the token budget fits max_turns calls and the feedback between them (at 96
    response tokens the episode was cut after turn 2, so "with feedback, 3 turns" and its 0.75
    elimination line measured a 2-turn run)."""
    from common.processor import load_processor
    from common.rollout import RolloutConfig
    from configs import cpu, to_dataclass
    from geo3k_torch.prime import wrong_choices

    cfg = cpu.get_config()
    system, tools = prompt_style(cfg.data.prompt_style)
    renderer = ChatRenderer(load_processor(tiny), tools=tools)
    families = tuple(cfg.data.synthetic_families.split(","))
    prompts = [row_to_prompt(row, uid=f"p{i}", system=system) for i, row in enumerate(
        generate(24, seed=5, image_size=cfg.data.synthetic_image_size, families=families))]
    prompt = max(prompts, key=lambda p: len(renderer.prompt_ids(p.messages, p.images)))
    env = to_dataclass(EnvConfig, cfg.env)
    wrong = chr(ord("A") + wrong_choices(prompt, env)[0])
    engine = ScriptEngine(renderer.tokenizer, renderer.turn_end_id,
                          [format_target(wrong)] * env.max_turns)
    rollout_cfg = dataclasses.replace(to_dataclass(RolloutConfig, cfg.rollout), n_samples=1)
    traj, = rollout([prompt], engine, renderer, rollout_cfg, env)
    assert len(traj.turns) == env.max_turns and traj.status == "completed"

"""`train.micro_batch_tokens = "auto"`: the chooser (`common.micro_batch.choose`) on numbers, the
torch learner's activation measurement (`geo3k_torch.memory`) on the tiny Qwen3-VL on CPU, the
resolution in the entry point's order, and the config field taking "auto" or a number from the
command line."""

import pytest

from common.micro_batch import AUTO, Cost, choose, largest, require_fixed, setting

GIB = 1 << 30
KIB = 1 << 10


# ---------------------------------------------------------------- the chooser, on numbers

# Qwen3-VL-2B-like costs: none keeps every activation, selective the matmul outputs, full only
# each layer's input (numbers of the right order, not measured).
COSTS = [Cost("none", 1 * GIB, 3000 * KIB), Cost("selective", 1 * GIB, 1300 * KIB),
         Cost("full", 1 * GIB, 250 * KIB)]


def test_largest_fits_the_budget_in_steps_of_1024():
    c = Cost("full", 1 * GIB, 250 * KIB)
    n = largest(c, 20 * GIB)
    assert n % 1024 == 0 and c.fixed + n * c.per_token <= 20 * GIB
    assert c.fixed + (n + 1024) * c.per_token > 20 * GIB  # the next step does not fit
    assert n == 78848  # (20 - 1) GiB / 250 KiB = 79,691.8 tokens: 77 x 1024


def test_the_fastest_mode_reaching_the_target_wins():
    # 45 GiB x 0.9 = 40.5 GiB, less 1 GiB fixed: none 13,312 tokens, selective 31,744, full
    # 164,864 -> selective misses 32k, full is chosen; with a 16k target selective wins (a
    # chooser that took the largest size would pick full there; one that ignored the margin
    # would give selective 35,840 tokens and pick it for 32k)
    got = choose(COSTS, 45 * GIB, 0.1, 32768, 8192)
    assert (got.mode, got.tokens) == ("full", 164864)
    got = choose(COSTS, 45 * GIB, 0.1, 16384, 8192)
    assert (got.mode, got.tokens) == ("selective", 31744)
    assert "selective" in got.reason and "31744" in got.reason and "45.0 GiB" in got.reason
    assert "none 3000.0 KiB/token" in got.reason


def test_without_a_mode_at_the_target_the_largest_size_wins():
    got = choose(COSTS, 12 * GIB, 0.1, 1 << 20, 8192)  # none 3,072, selective 7,168, full 40,960
    assert (got.mode, got.tokens) == ("full", 40960) and "no mode reaches" in got.reason
    got = choose(COSTS[:2], 30 * GIB, 0.0, 1 << 20, 8192)  # none 9,216, selective 22,528
    assert (got.mode, got.tokens) == ("selective", 22528)


def test_sizes_hold_one_episode_or_the_choice_is_refused():
    # 4 GiB x 0.9 - 1 GiB = 2.6 GiB: full holds 10,240 tokens, selective 2,048, none 0
    got = choose(COSTS, 4 * GIB, 0.1, 32768, 5000)  # an episode of 5,000 tokens: 5,120 at least
    assert (got.mode, got.tokens) == ("full", 10240)
    with pytest.raises(ValueError, match="no checkpointing mode holds one episode"):
        choose(COSTS, 4 * GIB, 0.1, 32768, 12000)
    # an unmeasurable mode (its probe ran out of memory) never fits
    assert choose([Cost("none", 0, float("inf")), COSTS[2]], 45 * GIB, 0.1, 8192, 8192).mode \
        == "full"


def test_the_setting_is_a_positive_int_or_auto():
    assert setting(AUTO) == AUTO and setting(16384) == 16384
    for bad in ("abc", 0, -5, 1.5, True, "16384"):
        with pytest.raises(ValueError, match="positive number of tokens or 'auto'"):
            setting(bad)
    assert require_fixed(4096, "x") == 4096
    with pytest.raises(ValueError, match="the JAX learner takes a number"):
        require_fixed(AUTO, "the JAX learner")


# ---------------------------------------------------------------- the config field

def parse(overrides: list[str]):
    """configs/base.py with `overrides`, parsed as absl parses an entry point's command line."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["prog", "--config=configs/base.py"] + overrides
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", "configs/base.py", flag_values=fv,
                                    lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("16384", 16384)])
def test_the_command_line_sets_auto_or_a_number(value, want):
    from common.config_help import check
    from common.prepare import check_config

    arg = f"--config.train.micro_batch_tokens={value}"
    assert not check(["prog", "--config=configs/h100.py", arg], "configs/base.py")
    got = parse([arg]).train.micro_batch_tokens
    assert got == want and type(got) is type(want)
    check_config(parse([arg]), 1)  # both pass the start-up checks


@pytest.mark.parametrize("value", ["abc", "1.5", "0", "true"])
def test_anything_else_stops_at_the_start_up_checks(value):
    from common.prepare import check_config

    cfg = parse([f"--config.train.micro_batch_tokens={value}"])
    refused = r"micro_batch_tokens.*(must be >= 1 \(or 'auto'\)|a positive number of tokens or 'auto')"
    with pytest.raises(ValueError, match=refused):
        check_config(cfg, 1)


def test_the_gpu_recipes_use_auto_and_their_cpu_shrinks_a_number():
    from configs import h100, h100_areal, h100_moe, h100_single_turn

    for module in (h100, h100_areal, h100_single_turn, h100_moe):
        assert module.get_config().train.micro_batch_tokens == AUTO
    for module in (h100_areal, h100_single_turn, h100_moe):  # the CPU shrink: cpu.py's number
        assert module.get_config("cpu").train.micro_batch_tokens == 2048

"""common.data: both public layouts (parquet, `save_to_disk`), the chat messages built from
`<image>` placeholders, image decoding, and every kind of bad row (raised or skipped and counted)."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common.data import (BAD_CHOICES, BAD_IMAGE, DUPLICATE_UID, EMPTY_PROBLEM, IMAGE_COUNT,
                         MISSING_ANSWER, NO_IMAGE, DataError, build_messages, load_split,
                         row_to_prompt)
from common.prompts import SYSTEM_PROMPT


def png(w: int, h: int, color=(255, 0, 0), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def fake_png_header(w: int, h: int) -> bytes:
    """A PNG that claims w x h pixels but carries no pixel data (a decompression-bomb probe)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def img(data: bytes, path=None) -> dict:
    return {"bytes": data, "path": path}


def write_parquet(path, rows: list[dict], schema: pa.Schema | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def user(p):
    return p.messages[1]["content"]


def test_parquet_rows_become_chat_prompts(tmp_path):
    f = write_parquet(tmp_path / "train-00000-of-00001.parquet", [
        {"problem": "In the figure <image> find x given <image>.", "answer": " 12 ",
         "images": [img(png(30, 20)), img(png(10, 12, 128, "L"), "ignored.png")],
         "choices": ["3", "4", "12", "5"], "extra": 1},
        {"problem": "<image>Find y.", "answer": "5\\sqrt{2}", "images": [img(png(8, 9))],
         "choices": None, "extra": 2},
    ])
    split = load_split(f)
    assert len(split) == 2 and not split.skipped
    p0, p1 = split[0], split[1]
    assert p0.messages == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": [
            {"type": "text", "text": "In the figure"}, {"type": "image"},
            {"type": "text", "text": "find x given"}, {"type": "image"},
            {"type": "text", "text": ".\nChoices: A. 3  B. 4  C. 12  D. 5"}]}]
    assert [im.size for im in p0.images] == [(30, 20), (10, 12)]
    assert [im.mode for im in p0.images] == ["RGB", "RGB"]
    assert p0.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert p0.images[1].getpixel((0, 0)) == (128, 128, 128)
    assert (p0.answer, p0.choices, p0.uid) == ("12", ["3", "4", "12", "5"], "train-0")
    assert p0.source == f"{f}:0" and p1.source == f"{f}:1"
    assert user(p1) == [{"type": "image"}, {"type": "text", "text": "Find y."}]
    assert (p1.answer, p1.choices, p1.uid) == ("5\\sqrt{2}", None, "train-1")
    assert p1.problem == "<image>Find y."


def test_no_placeholder_puts_images_first_and_choices_can_be_hidden():
    msgs = build_messages("Find x.", 1, ["1", "2"])
    assert msgs[1]["content"] == [{"type": "image"},
                                  {"type": "text", "text": "Find x.\nChoices: A. 1  B. 2"}]
    p = row_to_prompt({"problem": "Find x.", "answer": "3", "images": [Image.new("RGB", (4, 5))],
                       "choices": ["3", "4"]}, uid="u", show_choices=False)
    assert user(p) == [{"type": "image"}, {"type": "text", "text": "Find x."}]
    assert p.choices is None  # not shown: not there for the environment either
    assert build_messages("A<image>", 1, ["7"])[1]["content"] == [
        {"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "Choices: A. 7"}]


def test_directory_of_shards_selects_the_split(tmp_path):
    d = tmp_path / "geo3k"
    row = lambda a: {"problem": "<image>Find x.", "answer": a, "images": [img(png(4, 4))]}
    write_parquet(d / "data" / "train-00001-of-00002.parquet", [row("3"), row("4")])
    write_parquet(d / "data" / "train-00000-of-00002.parquet", [row("1"), row("2")])
    write_parquet(d / "data" / "test-00000-of-00001.parquet", [row("9")])
    write_parquet(d / "trainer-notes.parquet", [row("0")])  # "trainer" is not split "train"
    train = load_split(d, split="train")
    assert [p.answer for p in train] == ["1", "2", "3", "4"]
    assert [p.uid for p in train] == ["train-0", "train-1", "train-2", "train-3"]
    assert train[2].source.endswith("train-00001-of-00002.parquet:0")
    test = load_split(d, split="test")
    assert [(p.uid, p.answer) for p in test] == [("test-0", "9")]
    # the parquet-converter layout: a folder per split
    write_parquet(tmp_path / "conv" / "default" / "validation" / "0000.parquet", [row("5")])
    assert [p.answer for p in load_split(tmp_path / "conv", split="validation")] == ["5"]


def test_image_file_paths_resolve_against_the_data_file(tmp_path):
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (6, 7), (0, 255, 0)).save(tmp_path / "imgs" / "a.png")
    Image.new("RGB", (3, 2)).save(tmp_path / "b.png")
    f = write_parquet(tmp_path / "train.parquet", [
        {"problem": "<image><image>x", "answer": "1",
         "images": ["imgs/a.png", str(tmp_path / "b.png")]}])
    p = load_split(f)[0]
    assert [im.size for im in p.images] == [(6, 7), (3, 2)]
    assert p.images[0].getpixel((0, 0)) == (0, 255, 0)
    g = write_parquet(tmp_path / "sub" / "train.parquet", [
        {"problem": "<image>x", "answer": "1", "images": [img(None, "../imgs/a.png")]}])
    assert load_split(g)[0].images[0].size == (6, 7)


def test_numeric_answers_and_id_column(tmp_path):
    f = write_parquet(tmp_path / "t.parquet", [
        {"id": 17, "problem": "<image>x", "answer": 70.0, "images": [img(png(2, 2))],
         "choices": [1.0, 2.5]},
        {"id": 18, "problem": "<image>x", "answer": 12.5, "images": [img(png(2, 2))],
         "choices": [3.0, 4.0]}])
    ps = load_split(f, split="test")
    assert [(p.uid, p.answer, p.choices) for p in ps] == [("17", "70", ["1", "2.5"]),
                                                          ("18", "12.5", ["3", "4"])]
    g = write_parquet(tmp_path / "u.parquet", [
        {"problem": "<image>x", "answer": 7, "images": [img(png(2, 2))]}])
    assert load_split(g)[0].answer == "7"


def test_saved_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    feats = datasets.Features({"problem": datasets.Value("string"),
                               "answer": datasets.Value("string"),
                               "images": datasets.List(datasets.Image()),
                               "choices": datasets.List(datasets.Value("string"))})
    ds = datasets.Dataset.from_dict({
        "problem": ["<image>Find x.", "Compare <image> and <image>"],
        "answer": ["8\\sqrt{3}", "\\frac{5}{2}"],
        "images": [[Image.new("RGB", (11, 13), (0, 0, 255))],
                   [Image.new("L", (5, 6)), Image.new("RGBA", (7, 8), (0, 0, 0, 0))]],
        "choices": [["1", "2", "3", "8\\sqrt{3}"], ["a", "b", "c", "\\frac{5}{2}"]]},
        features=feats)
    ds.save_to_disk(str(tmp_path / "one"))
    one = load_split(tmp_path / "one", split="train")
    assert [p.answer for p in one] == ["8\\sqrt{3}", "\\frac{5}{2}"]
    assert one[0].images[0].size == (11, 13) and one[0].images[0].getpixel((0, 0)) == (0, 0, 255)
    assert [im.size for im in one[1].images] == [(5, 6), (7, 8)]
    assert one[1].images[1].getpixel((0, 0)) == (255, 255, 255)  # transparent -> white
    assert user(one[1]) == [{"type": "text", "text": "Compare"}, {"type": "image"},
                            {"type": "text", "text": "and"}, {"type": "image"},
                            {"type": "text", "text": "Choices: A. a  B. b  C. c  D. \\frac{5}{2}"}]
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    test = load_split(tmp_path / "dd", split="test")
    assert [(p.uid, p.answer) for p in test] == [("test-0", "\\frac{5}{2}")]
    assert str(tmp_path / "dd" / "test") in test[0].source
    with pytest.raises(DataError, match="no split 'validation'.*'train', 'test'"):
        load_split(tmp_path / "dd", split="validation")
    # a singular `image` column
    single = datasets.Dataset.from_dict(
        {"problem": ["Find x."], "answer": ["4"], "image": [Image.new("RGB", (9, 9))]},
        features=datasets.Features({"problem": datasets.Value("string"),
                                    "answer": datasets.Value("string"),
                                    "image": datasets.Image()}))
    single.save_to_disk(str(tmp_path / "single"))
    p = load_split(tmp_path / "single")[0]
    assert p.images[0].size == (9, 9) and user(p)[0] == {"type": "image"}


GOOD = {"problem": "<image>Find x.", "answer": "3", "images": [img(png(4, 4))],
        "choices": ["1", "2", "3", "4"]}
BAD = [
    (MISSING_ANSWER, {"answer": None}),
    (MISSING_ANSWER, {"answer": "  "}),
    (EMPTY_PROBLEM, {"problem": " <image> "}),
    (EMPTY_PROBLEM, {"problem": None}),
    (NO_IMAGE, {"images": []}),
    (IMAGE_COUNT, {"problem": "<image>x<image>"}),
    (BAD_IMAGE, {"images": [img(b"not a png")]}),
    (BAD_IMAGE, {"images": [img(png(4, 4)[:40])]}),  # truncated
    (BAD_IMAGE, {"images": [img(None, "missing.png")]}),
    (BAD_IMAGE, {"images": [img(fake_png_header(8000, 8000))]}),  # over our pixel cap
    (BAD_IMAGE, {"images": [img(fake_png_header(20000, 20000))]}),  # over PIL's bomb limit
    (BAD_CHOICES, {"choices": ["1", ""]}),
]
SCHEMA = pa.schema([("problem", pa.string()), ("answer", pa.string()),
                    ("images", pa.list_(pa.struct([("bytes", pa.binary()),
                                                   ("path", pa.string())]))),
                    ("choices", pa.list_(pa.string()))])


@pytest.mark.parametrize("reason,change", BAD, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD)])
def test_each_bad_row_raises_naming_file_and_row(tmp_path, reason, change):
    f = write_parquet(tmp_path / "train-x.parquet", [GOOD, {**GOOD, **change}], SCHEMA)
    with pytest.raises(DataError) as e:
        load_split(f)
    assert e.value.reason == reason
    assert str(f) in str(e.value) and "row 1" in str(e.value) and reason in str(e.value)


def test_skip_bad_counts_each_reason_and_keeps_good_rows(tmp_path):
    rows = [GOOD] + [{**GOOD, **change} for _, change in BAD] + [{**GOOD, "answer": "9"}]
    f = write_parquet(tmp_path / "train.parquet", rows, SCHEMA)
    split = load_split(f, skip_bad=True)
    assert [(p.uid, p.answer) for p in split] == [("train-0", "3"), (f"train-{len(BAD) + 1}", "9")]
    expected = {}
    for r, _ in BAD:
        expected[r] = expected.get(r, 0) + 1
    assert dict(split.skipped) == expected


def test_pixel_cap_is_configurable(tmp_path):
    f = write_parquet(tmp_path / "t.parquet", [GOOD], SCHEMA)
    assert load_split(f, max_image_pixels=16)[0].images[0].size == (4, 4)
    with pytest.raises(DataError, match="over the 15 cap"):
        load_split(f, max_image_pixels=15)


def test_duplicate_ids(tmp_path):
    rows = [{**GOOD, "id": "a"}, {**GOOD, "id": "b"}, {**GOOD, "id": "a"}]
    f = write_parquet(tmp_path / "t.parquet", rows)
    with pytest.raises(DataError, match="row 2: duplicate_uid"):
        load_split(f)
    split = load_split(f, skip_bad=True)
    assert [p.uid for p in split] == ["a", "b"] and split.skipped == {DUPLICATE_UID: 1}


def test_source_level_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="nowhere.*no such file"):
        load_split(tmp_path / "nowhere")
    write_parquet(tmp_path / "d" / "train.parquet", [GOOD], SCHEMA)
    with pytest.raises(DataError, match=r"d: no parquet file for split 'test'"):
        load_split(tmp_path / "d", split="test")
    f = write_parquet(tmp_path / "e" / "train.parquet", [{"problem": "<image>x", "images": []}])
    for skip in (False, True):  # a missing column is never a row to skip
        with pytest.raises(DataError, match=r"train.parquet: missing column\(s\) \['answer'\]"):
            load_split(f, skip_bad=skip)
    g = write_parquet(tmp_path / "g" / "train.parquet", [{**GOOD, "answer": None}], SCHEMA)
    with pytest.raises(DataError, match="no usable row.*missing_answer"):
        load_split(g, skip_bad=True)
    (tmp_path / "h.parquet").write_bytes(b"garbage")
    with pytest.raises(DataError, match="h.parquet: not a readable parquet file"):
        load_split(tmp_path / "h.parquet")


@pytest.mark.parametrize("shown,solved", [(True, True), (False, False)])
def test_hidden_choices_give_a_blind_letter_nothing(renderer, shown, solved):
    """Through the rollout: the label is choice A; a model that answers "A" solves it only when
    the choices were in its prompt (before, hidden choices still resolved the letter)."""
    from common.env import EnvConfig
    from common.rollout import RolloutConfig, rollout
    from tests.conftest import Reply, ScriptedEngine

    p = row_to_prompt({"problem": "<image>Find x.", "answer": "3", "choices": ["3", "4"],
                       "images": [Image.new("RGB", (4, 5))]}, uid="u", show_choices=shown)
    answer = '<tool_call>{"name": "calc_score", "arguments": {"answer": "A"}}</tool_call>'
    traj, = rollout([p], ScriptedEngine({"0-0": [Reply(answer)]}), renderer,
                    RolloutConfig(n_samples=1), EnvConfig(max_turns=1))
    assert traj.correct is solved and traj.reward == float(solved)


def test_shares_partition_the_split_and_decode_only_their_rows(tmp_path, monkeypatch):
    """`shard=(k, n)`: the rows k modulo n, counted over files as uids are; together the shares
    are the split; a share decodes only its own images, yet every row's uid is checked."""
    from common import data

    rows = [{**GOOD, "answer": str(i)} for i in range(7)]
    write_parquet(tmp_path / "train-00000-of-00002.parquet", rows[:4], SCHEMA)
    write_parquet(tmp_path / "train-00001-of-00002.parquet", rows[4:], SCHEMA)
    whole = load_split(tmp_path)
    assert whole.rows == list(range(7)) and whole.shard == (0, 1)
    decoded = []
    convert = data._convert
    monkeypatch.setattr(data, "_convert", lambda row, uid, *a: decoded.append(uid) or
                        convert(row, uid, *a))
    for n in (2, 3):
        shares = [load_split(tmp_path, shard=(k, n)) for k in range(n)]
        for k, share in enumerate(shares):
            assert share.rows == list(range(k, 7, n))
            assert [p.uid for p in share] == [f"train-{r}" for r in share.rows]
            assert [p.answer for p in share] == [str(r) for r in share.rows]
        assert sorted(decoded) == sorted(p.uid for p in whole)  # each row once, by its share
        decoded.clear()
    with pytest.raises(ValueError, match="0 <= k < n"):
        load_split(tmp_path, shard=(2, 2))
    # a duplicate uid is an error whichever share it falls in; a bad image only in its own
    dup = [{**GOOD, "id": "a"}, {**GOOD, "id": "b"}, {**GOOD, "id": "a"}]
    f = write_parquet(tmp_path / "dup.parquet", dup)
    with pytest.raises(DataError, match="row 2: duplicate_uid"):
        load_split(f, shard=(1, 2))  # row 2 is share 0's
    bad = write_parquet(tmp_path / "bad.parquet", [GOOD, {**GOOD, "images": [img(b"x")]}],
                        SCHEMA)
    assert load_split(bad, shard=(0, 2)).rows == [0]
    with pytest.raises(DataError, match="row 1: bad_image"):
        load_split(bad, shard=(1, 2))
    one = write_parquet(tmp_path / "one.parquet", [GOOD], SCHEMA)
    with pytest.raises(DataError, match="no usable row in share 1 of 3 \\(1 rows\\)"):
        load_split(one, shard=(1, 3))


class FakeComm:
    """Process `rank` of `world`; `others_failed` of the other processes could not read."""

    def __init__(self, rank, world=2, others_failed=0, events=None):
        self.rank, self.world, self.others_failed = rank, world, others_failed
        self.events = [] if events is None else events

    def barrier(self):
        self.events.append("barrier")

    def gather(self, obj):
        """Only (uid, content key) pairs of the test share may cross processes (the overlap
        check; every process holds the whole train split)."""
        assert all(isinstance(u, str) and len(k) == 64 for u, k in obj), "the data crossed"
        self.events.append(("gather", len(obj)))
        return [obj, []] if self.rank == 0 else [[], obj]

    def sum_scalars(self, values):
        return {k: v + self.others_failed for k, v in values.items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_each_process_reads_the_train_split_and_its_test_share_after_process_0_wrote_them(
        rank, tmp_path):
    from common import prepare
    from configs import cpu

    cfg = cpu.get_config()
    cfg.data.synthetic_dir = str(tmp_path / "synthetic")
    cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 6, 3
    comm = FakeComm(rank)
    if rank == 1:  # process 0 wrote it before the barrier
        prepare.write_synthetic(cfg)
    train, test = prepare.load_data(cfg, comm)
    assert comm.events == ["barrier", ("gather", len(range(rank, 3, 2)))]  # its test keys
    assert train.shard == (0, 1) and test.shard == (rank, 2)
    assert train.rows == list(range(6)) and test.rows == list(range(rank, 3, 2))


def test_the_synthetic_set_is_the_same_for_every_run_seed_and_other_settings_are_refused(
        tmp_path):
    """Runs of seeds 3 and 4, in either order, read the same problems; a folder of other
    settings (or of none recorded) stops the run and keeps its files."""
    from common import prepare
    from configs import cpu

    def config(folder, seed=0, **data):
        cfg = cpu.get_config()
        cfg.seed = seed
        cfg.data.synthetic_dir = str(tmp_path / folder)
        cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 4, 2
        cfg.data.update(data)
        return cfg

    def files(folder):
        return {p.name: p.read_bytes() for p in sorted((tmp_path / folder).glob("*.parquet"))}

    prepare.write_synthetic(config("a", seed=3))
    prepare.write_synthetic(config("b", seed=4))
    assert len(files("a")) == 2 and files("a") == files("b")
    assert prepare.write_synthetic(config("a", seed=4)) == str(tmp_path / "a")
    before = {**files("a"), "record": (tmp_path / "a" / prepare.SYNTHETIC_RECORD).read_bytes()}
    for key, value in (("synthetic_seed", 1), ("synthetic_train_size", 5),
                       ("synthetic_test_size", 3), ("synthetic_image_size", "56"),
                       ("synthetic_families", "polygon_sides")):
        with pytest.raises(DataError, match="but this config asks for") as e:
            prepare.write_synthetic(config("a", **{key: value}))
        assert "data.synthetic_dir=" in str(e.value) and "data.path=" in str(e.value)
    prepare.write_synthetic(config("c", synthetic_seed=1))
    assert files("c") != files("a")
    (tmp_path / "a" / prepare.SYNTHETIC_RECORD).write_text("{not json")
    with pytest.raises(DataError, match="synthetic.json: unreadable"):
        prepare.write_synthetic(config("a"))
    (tmp_path / "a" / prepare.SYNTHETIC_RECORD).unlink()
    with pytest.raises(DataError, match="no record of its settings"):
        prepare.write_synthetic(config("a"))
    assert {**files("a"), "record": before["record"]} == before


def test_a_missing_split_is_generated_beside_a_recorded_one(tmp_path):
    """A bigger test split in a new run: the train split is kept, the test split written."""
    from common import prepare
    from configs import cpu

    cfg = cpu.get_config()
    cfg.data.synthetic_dir = str(tmp_path)
    cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 4, 2
    prepare.write_synthetic(cfg)
    train = (tmp_path / "train-00000-of-00001.parquet").read_bytes()
    (tmp_path / "test-00000-of-00001.parquet").unlink()
    cfg.data.synthetic_test_size = 3
    prepare.write_synthetic(cfg)
    assert (tmp_path / "train-00000-of-00001.parquet").read_bytes() == train
    assert len(load_split(tmp_path, split="test").prompts) == 3


def test_the_build_lock_lets_one_holder_in_at_a_time(tmp_path):
    import threading
    import time
    from common.prepare import build_lock

    order = []

    def hold(name):
        with build_lock(tmp_path / "target"):
            order.append(f"{name} in")
            time.sleep(0.2)
            order.append(f"{name} out")

    threads = [threading.Thread(target=hold, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert order == ["a in", "a out", "b in", "b out"]
    assert not (tmp_path / "target").exists()


def test_a_process_that_cannot_read_its_share_stops_every_process(tmp_path):
    from common import prepare
    from configs import cpu

    cfg = cpu.get_config()  # test row 1, process 1's, cannot be read
    cfg.data.path = _splits(tmp_path, [dict(GOOD, id="te0", images=[img(png(4, 4, (9, 9, 9)))]),
                                       dict(GOOD, id="te1", images=[img(b"x")])])
    with pytest.raises(DataError, match="row 1: bad_image"):  # its own error
        prepare.load_data(cfg, FakeComm(1))
    with pytest.raises(DataError, match="1 of the 2 processes could not read their share"):
        prepare.load_data(cfg, FakeComm(0, others_failed=1))  # not left waiting for it


def _splits(tmp_path, test_rows):
    """A folder with a train split of 3 problems (red, green, blue 4x4 figures) and a test
    split of `test_rows`."""
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    train = [dict(GOOD, id=f"tr{i}", images=[img(png(4, 4, c))]) for i, c in enumerate(colours)]
    write_parquet(tmp_path / "d" / "train-00000-of-00001.parquet", train)
    write_parquet(tmp_path / "d" / "test-00000-of-00001.parquet", test_rows)
    return str(tmp_path / "d")


@pytest.mark.parametrize("mode", ["refuse", "drop"])
def test_a_test_problem_that_repeats_a_train_one_is_refused_or_dropped(tmp_path, mode):
    """The same text over the same pixels is the same problem, whatever its uid or PNG bytes:
    refused with both uids named, or (data.overlap=drop) left out of the test split and
    counted; another text over the same figure is another problem."""
    from common import prepare
    from configs import cpu

    same = Image.new("RGB", (4, 4), (0, 255, 0))
    buf = io.BytesIO()
    same.save(buf, format="PNG", compress_level=0)  # other bytes, the same pixels as tr1
    test = [dict(GOOD, id="te0", images=[img(buf.getvalue())]),
            dict(GOOD, id="te1", images=[img(png(4, 4, (9, 9, 9)))]),
            dict(GOOD, id="te2", problem="<image>Find y.", images=[img(png(4, 4, (255, 0, 0)))])]
    cfg = cpu.get_config()
    cfg.data.path, cfg.data.overlap = _splits(tmp_path, test), mode
    if mode == "refuse":
        with pytest.raises(DataError, match=r"1 'test' problem\(s\) repeat 'train' ones .*: "
                                            r"te0 = tr1\. .*data.overlap=drop"):
            prepare.prepare_data(cfg)
        return
    train, kept = prepare.prepare_data(cfg)
    assert [p.uid for p in kept.prompts] == ["te1", "te2"] and kept.rows == [1, 2]
    assert kept.skipped["overlap"] == 1 and len(train) == 3


def test_the_synthetic_test_split_never_repeats_a_train_problem(tmp_path):
    """right_angle at 32 px repeats figures often (9 of 100 plain test draws are train
    figures); the generated test split is drawn apart from the train split (and says so in its
    record), and it loads past the overlap check."""
    from common import prepare
    from common.synthetic import generate, row_key, split_keys
    from configs import cpu

    cfg = cpu.get_config()
    cfg.data.synthetic_dir = str(tmp_path / "s")
    cfg.data.synthetic_families, cfg.data.synthetic_image_size = "right_angle", "32"
    cfg.data.synthetic_train_size, cfg.data.synthetic_test_size = 200, 100
    path = Path(prepare.write_synthetic(cfg))
    train_keys = split_keys(path / "train-00000-of-00001.parquet")
    test_keys = split_keys(path / "test-00000-of-00001.parquet")
    assert len(train_keys) == 200 and len(test_keys) == 100 and not train_keys & test_keys
    plain = [row_key(r) for r in generate(100, cfg.data.synthetic_seed + prepare.TEST_SEED_OFFSET,
                                          "32", ("right_angle",))]
    assert len(set(plain) & train_keys) == 9  # drawn without the exclusion
    record = json.loads((path / "synthetic.json").read_text())
    assert record["test"]["distinct_from"] == ["train"] and record["train"]["distinct_from"] == []
    train, test = prepare.prepare_data(cfg)
    assert len(train) == 200 and len(test) == 100 and not test.skipped

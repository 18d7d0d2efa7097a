"""common.synthetic: deterministic files in the public schema, answers that follow from the numbers
drawn (re-derived from the `meta` column), numbers only in the image, four distinct choices."""

from __future__ import annotations

import collections
import io
import json
import re

import pyarrow.parquet as pq
import pytest
from PIL import Image

from common.data import load_split
from common.synthetic import (FAMILIES, GEOMETRY, PERCEPTION, fmt_num, fmt_sqrt, generate, main,
                              parse_image_size, problem_kind, write_split)

ROWS = generate(120, seed=3, image_size="64,160")


def square_of(answer: str) -> int:
    """'5\\sqrt{2}' -> 50, '\\sqrt{41}' -> 41, '7' -> 49."""
    m = re.fullmatch(r"(\d*)\\sqrt\{(\d+)\}|(\d+)", answer)
    assert m, answer
    if m.group(3):
        return int(m.group(3)) ** 2
    return int(m.group(1) or 1) ** 2 * int(m.group(2))


def expected_answer(meta: dict) -> str:
    """The answer re-derived from the numbers drawn, family by family."""
    fam, g = meta["family"], meta["given"]
    if fam == "triangle_angles":
        assert sum(meta["angles"]) == 180 and sorted(g) == sorted(
            a for k, a in enumerate(meta["angles"]) if k != meta["unknown"])
        return str(180 - sum(g))
    if fam == "parallel_lines":
        theta = meta["theta"]
        measure = lambda pos: theta if pos[1] in ("UR", "LL") else 180 - theta
        assert g == [measure(meta["given_pos"])] and meta["given_pos"] != meta["unknown_pos"]
        return str(measure(meta["unknown_pos"]))
    if fam == "circle_angles":
        c = meta["central"]
        if meta["variant"] == "central_given":
            assert g == [c]
            return fmt_num(c / 2)
        assert g == [c // 2] and c % 2 == 0
        return str(c)
    if fam == "right_triangle":
        leg, other, hyp = meta["leg"] ** 2, meta["other_sq"], meta["hyp_sq"]
        assert leg + other == hyp
        if meta["ask"] == "hypotenuse":
            assert [v * v for v in g] == [leg, other]
            return fmt_sqrt(hyp)
        assert [v * v for v in g] == [leg, hyp]
        return fmt_sqrt(other)
    if fam == "isosceles":
        return fmt_num((180 - g[0]) / 2) if meta["variant"] == "apex_given" else str(180 - 2 * g[0])
    if fam == "rectangle_area":
        a, b = meta["sides"]
        assert g == [a, b]
        return fmt_num(a * b)
    # perception: nothing given as a number, the answer is what the figure shows
    if fam == "polygon_sides":
        return str(meta["sides"])
    if fam == "right_angle":  # exactly one right angle; the others at least 25 degrees off
        angles = meta["angles"]
        assert angles.count(90) == 1 and all(abs(a - 90) >= 25 for a in angles if a != 90)
        return str(angles.index(90) + 1)
    if fam == "longest_segment":  # the longest is clearly so: the others at most 0.7 of it
        n = meta["lengths"]
        assert sorted(n)[-2] <= 0.7 * max(n)
        return "abcd"[n.index(max(n))]
    raise AssertionError(fam)


def test_number_formats():
    assert [fmt_sqrt(n) for n in (50, 41, 25, 12, 2)] == [
        "5\\sqrt{2}", "\\sqrt{41}", "5", "2\\sqrt{3}", "\\sqrt{2}"]
    assert [fmt_num(v) for v in (70.0, 12.5, 3, 144.25)] == ["70", "12.5", "3", "144.2"]
    assert parse_image_size(224) == (224, 224) == parse_image_size("224")
    assert parse_image_size("112,224") == (112, 224) == parse_image_size((112, 224))
    for bad in ("224,112", "8", "1,2,3"):
        with pytest.raises(ValueError):
            parse_image_size(bad)


def test_deterministic_and_prefix_stable(tmp_path):
    a = write_split(tmp_path / "a", "train", 12, seed=7, image_size="56,112")
    b = write_split(tmp_path / "b", "train", 12, seed=7, image_size="56,112")
    assert a.name == "train-00000-of-00001.parquet"
    assert a.read_bytes() == b.read_bytes()
    assert generate(5, 7, "56,112") == pq.read_table(a).to_pylist()[:5]
    assert generate(3, 8) != generate(3, 7)
    assert not list(tmp_path.glob("**/*.tmp"))


def test_answers_follow_from_the_drawn_numbers():
    seen = set()
    for row in ROWS:
        meta = json.loads(row["meta"])
        seen.add(meta["family"])
        assert row["answer"] == expected_answer(meta), meta
    assert seen == set(FAMILIES)
    answers = [r["answer"] for r in ROWS]
    assert any("\\sqrt" in a for a in answers) and any("." in a for a in answers)


def test_text_never_holds_the_given_numbers_and_choices_are_sound():
    for row in ROWS:
        meta = json.loads(row["meta"])
        text = row["problem"]
        assert text.startswith("<image>") and text.count("<image>") == 1
        numbers = re.findall(r"\d+(?:\.\d+)?", text)
        assert not {fmt_num(g) for g in meta["given"]} & set(numbers), (text, meta)
        assert row["answer"] not in numbers
        choices = row["choices"]
        assert len(choices) == 4 and len(set(choices)) == 4 and row["answer"] in choices
        assert all(c and not c.startswith("-") for c in choices)
    geometry = [r for r in ROWS if json.loads(r["meta"])["family"] in GEOMETRY]
    positions = {r["choices"].index(r["answer"]) for r in geometry}
    assert positions == {0, 1, 2, 3}  # shuffled


def test_perception_problems_name_their_kind_and_keep_their_choices_in_order():
    rows = generate(60, seed=5, image_size=112, families=PERCEPTION)
    order = {"polygon_sides": ["3", "4", "5", "6"], "right_angle": ["1", "2", "3", "4"],
             "longest_segment": ["a", "b", "c", "d"]}
    answers = collections.defaultdict(set)
    for row in rows:
        fam = json.loads(row["meta"])["family"]
        assert problem_kind(row["problem"]) == fam and row["choices"] == order[fam]
        answers[fam].add(row["answer"])
    assert all(answers[f] == set(order[f]) for f in PERCEPTION)  # every choice is an answer
    assert problem_kind("<image>Find x.") == "geometry"


def test_images_are_pngs_of_the_requested_sizes():
    sizes = set()
    for row in ROWS:
        (item,) = row["images"]
        im = Image.open(io.BytesIO(item["bytes"]))
        assert im.format == "PNG" and item["path"] is None
        assert list(im.size) == json.loads(row["meta"])["size"]
        assert all(64 <= s <= 160 for s in im.size)
        assert im.convert("L").getextrema()[0] < 100  # something dark was drawn
        sizes.add(im.size)
    assert len(sizes) > 10
    for fam in FAMILIES:  # tiny sizes still draw every family
        row = generate(1, 0, image_size=56, families=[fam])[0]
        assert Image.open(io.BytesIO(row["images"][0]["bytes"])).size == (56, 56)


def test_loads_through_common_data(tmp_path):
    path = write_split(tmp_path, "test", 10, seed=1, image_size=112)
    split = load_split(tmp_path, split="test")
    rows = pq.read_table(path).to_pylist()
    assert len(split) == 10 and not split.skipped
    for p, row in zip(split, rows):
        assert p.answer == row["answer"] and p.choices == row["choices"]
        assert p.images[0].size == (112, 112) and p.images[0].mode == "RGB"
        content = p.messages[1]["content"]
        assert content[0] == {"type": "image"} and len(content) == 2
        assert content[1]["text"].startswith(row["problem"][len("<image>"):] + "\nChoices: A. ")
    datasets = pytest.importorskip("datasets")
    feats = datasets.Features.from_arrow_schema(pq.read_schema(path))
    assert isinstance(feats["images"].feature, datasets.Image)


def test_cli(tmp_path, capsys):
    main(["--out", str(tmp_path), "--n", "4", "--seed", "2", "--split", "validation",
          "--image-size", "56,84", "--families", "triangle_angles,circle_angles"])
    assert "wrote 4 problems" in capsys.readouterr().out
    rows = pq.read_table(tmp_path / "validation-00000-of-00001.parquet").to_pylist()
    assert {json.loads(r["meta"])["family"] for r in rows} <= {"triangle_angles", "circle_angles"}
    with pytest.raises(ValueError, match="unknown families"):
        generate(1, 0, families=["hexagon"])


def test_a_repeated_figure_is_drawn_again_and_excluded_keys_never_appear():
    """right_angle at 56 px: the plain draws repeat problem 70 at index 85. `generate` draws
    index 85 again (attempt 1, recorded in meta) and leaves every other row as drawn; given
    another set's keys as `exclude`, none of them comes back."""
    from common.synthetic import make_problem, row_key

    fam = ("right_angle",)
    plain = [make_problem(3, i, "56", fam) for i in range(100)]
    assert row_key(plain[85]) == row_key(plain[70])
    rows = generate(100, 3, "56", fam)
    keys = [row_key(r) for r in rows]
    assert len(set(keys)) == 100
    assert [i for i in range(100) if rows[i] != plain[i]] == [85]
    assert json.loads(rows[85]["meta"])["attempt"] == 1
    assert rows[85] == make_problem(3, 85, "56", fam, attempt=1)
    other = generate(100, 4, "56", fam, exclude=keys)
    assert not {row_key(r) for r in other} & set(keys)


def test_a_problem_that_cannot_be_drawn_distinct_is_an_error():
    """With one draw allowed per index, excluding the seed's own first problem leaves index 0
    nothing to draw: the error says what to change (never an endless loop)."""
    import common.synthetic as synthetic

    first = synthetic.row_key(generate(1, 3, "56", ("right_angle",))[0])
    old, synthetic.MAX_ATTEMPTS = synthetic.MAX_ATTEMPTS, 1
    try:
        with pytest.raises(ValueError, match="ask for fewer problems, more families or larger"):
            generate(1, 3, "56", ("right_angle",), exclude=[first])
    finally:
        synthetic.MAX_ATTEMPTS = old

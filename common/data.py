"""Geometry3K from local files in the public Hugging Face layouts, as chat prompts with images.

    from common.data import load_split
    train = load_split("/data/geo3k", split="train")          # Geo3kSplit
    p = train[0]   # Prompt(uid, messages, images, answer, choices, source, problem)

Sources `load_split` accepts (nothing is downloaded):
  * a parquet file (`train-00000-of-00001.parquet`): read as it is, whatever `split` says;
  * a directory holding parquet files, searched recursively: the files of split `s` are those
    whose name is `s`, or starts with `s-`, `s_` or `s.` (`data/train-00000-of-00001.parquet`),
    or that lie in a folder named `s` (`default/train/0000.parquet`); read in sorted path order;
  * a `datasets.save_to_disk` directory: a `Dataset` (`state.json` + `dataset_info.json`) is read
    whatever `split` says, a `DatasetDict` (`dataset_dict.json`) gives its `split`.
Parquet is read in record batches; a saved dataset is read as Arrow batches, so images are
decoded one row at a time and nothing bigger than a batch is materialized besides the prompts.

Columns (unknown columns are ignored, e.g. the synthetic set's `meta`):
  * `problem` (str): the text, with one `<image>` placeholder per image. If it has no placeholder
    at all, every image of the row goes before the text (some public copies have no placeholder
    and one image).
  * `answer` (str): numbers in a non-string column become `str(v)`, integral floats without
    `.0` (`70.0` -> "70").
  * `images`: a list whose items are `{"bytes": ..., "path": ...}` dicts (bytes win, else the
    path), raw bytes, file paths (relative ones resolve against the data file's directory, or the
    saved dataset's), or PIL images (rows given to `row_to_prompt` directly). A singular `image`
    column holding one such item is accepted when there is no `images` column.
  * `choices` (list of str, optional): appended to the last user text as
    "Choices: A. 3  B. 4  C. 5  D. 6" (`show_choices=False` leaves them out of the text and
    out of the `Prompt`: the problem is then free-form, and a letter answer is just a letter).
  * `id` (optional): used as the uid; otherwise the uid is f"{split}-{row}", `row` counting every
    row of the split across files (skipped rows included), so uids do not move when rows are
    skipped.

A row becomes a `Prompt` whose `messages` are `[system, user]` in the Hugging Face multimodal chat
format: the user content is text parts and `{"type": "image"}` parts exactly where the `<image>`
placeholders stood (text pieces stripped, empty ones dropped), `images` the decoded RGB images in
the same order (transparent images are flattened onto white). A bad row (reasons: `BAD_REASONS`)
raises `DataError` naming the file, the row and the fault, or with `skip_bad=True` is skipped and
counted in `Geo3kSplit.skipped`. A missing required column is an error of the whole file and
raises even with `skip_bad`; so does a split with no usable row, and a missing path. Images above
`max_image_pixels` (decompression bombs) make a bad row, as do undecodable ones.

Several processes read a split in shares: `load_split(..., shard=(k, n))` keeps the rows whose
row number (counted as for uids) is k modulo n, and decodes and checks only those; every row's
uid is still checked for duplicates.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

from PIL import Image

from common.prompts import SYSTEM_PROMPT

PLACEHOLDER = "<image>"
MAX_IMAGE_PIXELS = 40_000_000  # Geometry3K diagrams are far smaller; beyond this a row is bad
BATCH_ROWS = 64

# Why a row is bad: the keys of `Geo3kSplit.skipped`.
MISSING_ANSWER = "missing_answer"
EMPTY_PROBLEM = "empty_problem"
NO_IMAGE = "no_image"
BAD_IMAGE = "bad_image"
IMAGE_COUNT = "image_count_mismatch"
BAD_CHOICES = "bad_choices"
DUPLICATE_UID = "duplicate_uid"
BAD_REASONS = (MISSING_ANSWER, EMPTY_PROBLEM, NO_IMAGE, BAD_IMAGE, IMAGE_COUNT, BAD_CHOICES,
               DUPLICATE_UID)


class DataError(ValueError):
    """A data file or one of its rows cannot be used. `reason` is one of `BAD_REASONS` for a bad
    row, "file" for a fault of the whole source."""

    def __init__(self, message: str, reason: str = "file"):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class Prompt:
    """One problem, ready for a chat template: see the module docstring for `messages`."""

    uid: str
    messages: list[dict]
    images: list[Image.Image]
    answer: str
    choices: list[str] | None
    source: str  # "file:row"
    problem: str = ""  # the raw problem text, placeholders included


@dataclasses.dataclass
class Geo3kSplit:
    """The prompts of one split and how many rows were skipped, per reason."""

    prompts: list[Prompt]
    skipped: collections.Counter
    path: str = ""
    split: str = ""
    rows: list[int] = dataclasses.field(default_factory=list)  # each prompt's row number
    shard: tuple[int, int] = (0, 1)  # (k, n): the rows k modulo n

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# ---- one row -> Prompt ---------------------------------------------------------------------------

def decode_image(item: Any, base_dir: str | os.PathLike = ".",
                 max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """An RGB PIL image, fully loaded, from any image item the module docstring lists.

    Raises ValueError (with a short reason) for anything that is not a decodable image of at
    most `max_pixels` pixels.
    """
    if isinstance(item, Image.Image):
        im = item
    else:
        if isinstance(item, dict):
            data, path = item.get("bytes"), item.get("path")
            item = data if data else path
        if isinstance(item, (bytes, bytearray, memoryview)):
            src: Any = io.BytesIO(bytes(item))
        elif isinstance(item, (str, os.PathLike)) and str(item):
            src = Path(base_dir, item)  # an absolute `item` ignores base_dir
            if not src.is_file():
                raise ValueError(f"image file {str(src)!r} not found")
        else:
            raise ValueError(f"no image data in a {type(item).__name__}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                im = Image.open(src)
                w, h = im.size
                if w * h > max_pixels:
                    raise ValueError(f"image of {w}x{h} pixels is over the {max_pixels} cap")
                im.load()
        except ValueError:
            raise
        except Exception as e:  # untrusted bytes: whatever the decoder raises means "bad image"
            raise ValueError(f"cannot decode image: {type(e).__name__}: {e}") from None
    if im.width * im.height > max_pixels or im.width < 1 or im.height < 1:
        raise ValueError(f"image of {im.width}x{im.height} pixels is out of bounds")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        # Transparent diagrams often have black (0, 0, 0, 0) backgrounds: flatten onto white, or
        # the black lines would vanish into a black background.
        rgba = im.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
    else:
        out = im.convert("RGB") if im.mode != "RGB" else im.copy()  # detached from any file
    if im is not item:
        im.close()
    return out


def _answer_text(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v).strip()


def _image_items(row: dict) -> list:
    items = row["images"] if "images" in row else row.get("image")
    if items is None:
        return []
    if isinstance(items, (list, tuple)):
        return list(items)
    return [items]  # a singular image column


def format_choices(choices: list[str]) -> str:
    """'Choices: A. 3  B. 4  C. 5  D. 6' (letters A, B, ... in the given order)."""
    return "Choices: " + "  ".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(choices))


def build_messages(problem: str, n_images: int, choices: list[str] | None = None,
                   system: str = SYSTEM_PROMPT) -> list[dict]:
    """[system, user] chat messages: image parts where `<image>` stood (or all first if the
    problem has no placeholder), then text; choices are appended to the last text."""
    pieces = problem.split(PLACEHOLDER)
    if len(pieces) == 1:
        pieces = [""] * n_images + pieces  # no placeholder: the images precede the text
    content: list[dict] = []
    for k, piece in enumerate(pieces):
        if k:
            content.append({"type": "image"})
        piece = piece.strip()
        if piece:
            content.append({"type": "text", "text": piece})
    if choices:
        tail = format_choices(choices)
        if content and content[-1]["type"] == "text":
            content[-1] = {"type": "text", "text": content[-1]["text"] + "\n" + tail}
        else:
            content.append({"type": "text", "text": tail})
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def _convert(row: dict, uid: str, source: str, base_dir: str | os.PathLike, show_choices: bool,
             max_pixels: int, system: str = SYSTEM_PROMPT) -> Prompt:
    problem = row.get("problem")
    problem = "" if problem is None else str(problem)
    if not problem.replace(PLACEHOLDER, "").strip():
        raise _BadRow(EMPTY_PROBLEM, "the problem text is empty")
    answer = _answer_text(row.get("answer"))
    if not answer:
        raise _BadRow(MISSING_ANSWER, "the answer is missing or empty")
    items = _image_items(row)
    if not items:
        raise _BadRow(NO_IMAGE, "the row has no image")
    n_slots = problem.count(PLACEHOLDER)
    if n_slots and n_slots != len(items):
        raise _BadRow(IMAGE_COUNT, f"{n_slots} <image> placeholders but {len(items)} images")
    images = []
    for k, item in enumerate(items):
        try:
            images.append(decode_image(item, base_dir, max_pixels))
        except ValueError as e:
            raise _BadRow(BAD_IMAGE, f"image {k}: {e}") from None
    choices = row.get("choices")
    if choices is not None:
        if not isinstance(choices, (list, tuple)) or not all(
                c is not None and str(c).strip() for c in choices):
            raise _BadRow(BAD_CHOICES, f"choices must be a list of non-empty strings: {choices!r}")
        choices = [_answer_text(c) for c in choices] or None
    if not show_choices:  # the model never saw them: no letter may stand for one (`common.env`)
        choices = None
    messages = build_messages(problem, len(images), choices, system)
    return Prompt(uid, messages, images, answer, choices, source, problem)


def row_to_prompt(row: dict, uid: str, source: str = "", base_dir: str | os.PathLike = ".",
                  show_choices: bool = True, max_image_pixels: int = MAX_IMAGE_PIXELS,
                  system: str = SYSTEM_PROMPT) -> Prompt:
    """One row (a dict of the columns above) as a `Prompt`; raises `DataError` if it is bad."""
    try:
        return _convert(row, uid, source, base_dir, show_choices, max_image_pixels, system)
    except _BadRow as e:
        raise DataError(f"{source or uid}: {e.reason}: {e.detail}", e.reason) from None


# ---- sources -> batches of rows ----------------------------------------------------------------

def _split_files(root: Path, split: str) -> list[Path]:
    def matches(p: Path) -> bool:
        name = p.name[:-len(".parquet")]
        rel_dirs = p.relative_to(root).parts[:-1]
        return (name == split or name.startswith((f"{split}-", f"{split}_", f"{split}."))
                or split in rel_dirs)
    return sorted(p for p in root.rglob("*.parquet") if p.is_file() and matches(p))


def _parquet_batches(path: Path) -> Iterator[list[dict]]:
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    columns = _check_columns(f.schema_arrow.names, path)
    for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=columns):
        yield batch.to_pylist()


def _check_columns(names: list[str], where: Any) -> list[str]:
    """The columns to read (unknown ones are never decoded); raises if a required one is
    missing."""
    missing = [c for c in ("problem", "answer") if c not in names]
    if "images" not in names and "image" not in names:
        missing.append("images")
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}; found {list(names)}")
    image = "images" if "images" in names else "image"
    return [c for c in names if c in ("problem", "answer", "choices", "id", image)]


def _saved_dataset(path: Path, split: str) -> tuple[Any, Path]:
    import datasets
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} in this DatasetDict; it has {list(ds)}")
        return ds[split], path / split
    return ds, path


def _sources(path: Path, split: str) -> Iterator[tuple[str, Path, Iterator[list[dict]]]]:
    """(label for messages, base dir for relative image paths, batches of row dicts)."""
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_file():
        yield str(path), path.parent, _parquet_batches(path)
        return
    if any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        ds, base = _saved_dataset(path, split)
        ds = ds.select_columns(_check_columns(ds.column_names, base))
        batches = (t.to_pylist() for t in ds.with_format("arrow").iter(batch_size=BATCH_ROWS))
        yield str(base), base, batches
        return
    files = _split_files(path, split)
    if not files:
        raise DataError(f"{path}: no parquet file for split {split!r} (looked for {split}*.parquet"
                        f" and {split}/*.parquet, recursively)")
    for f in files:
        yield str(f), f.parent, _parquet_batches(f)


def load_split(path: str | os.PathLike, split: str = "train", skip_bad: bool = False,
               show_choices: bool = True,
               max_image_pixels: int = MAX_IMAGE_PIXELS,
               system: str = SYSTEM_PROMPT, shard: tuple[int, int] = (0, 1)) -> Geo3kSplit:
    """The prompts of `split` from `path` (a parquet file, a directory of them, or a
    `save_to_disk` directory), each starting with the `system` message: all of them, or with
    `shard=(k, n)` those of the rows k modulo n. Bad rows raise `DataError`, or are counted
    when `skip_bad`."""
    k, n = shard
    if not (isinstance(k, int) and isinstance(n, int) and 0 <= k < n):
        raise ValueError(f"shard={shard}: needs (k, n) with 0 <= k < n")
    path = Path(path)
    prompts: list[Prompt] = []
    rows: list[int] = []
    skipped: collections.Counter = collections.Counter()
    seen: set[str] = set()
    index = 0
    for label, base, batches in _sources(path, split):
        local = 0
        for row in (r for batch in batches for r in batch):
            uid = str(row["id"]) if row.get("id") is not None else f"{split}-{index}"
            source = f"{label}:{local}"
            mine, index, local = index % n == k, index + 1, local + 1
            try:
                if uid in seen:
                    raise _BadRow(DUPLICATE_UID, f"uid {uid!r} already used")
                seen.add(uid)
                if not mine:
                    continue
                prompt = _convert(row, uid, source, base, show_choices, max_image_pixels, system)
            except _BadRow as e:
                if not skip_bad:
                    raise DataError(f"{label}: row {local - 1}: {e.reason}: {e.detail}",
                                    e.reason) from None
                skipped[e.reason] += 1
                continue
            prompts.append(prompt)
            rows.append(index - 1)
    if not prompts:
        share = f" in share {k} of {n} ({index} rows)" if n > 1 else ""
        raise DataError(f"{path}: split {split!r} has no usable row{share} (skipped: "
                        f"{dict(skipped)})")
    return Geo3kSplit(prompts, skipped, str(path), split, rows, (k, n))

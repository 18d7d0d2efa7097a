"""The published Qwen-VL models' configs (Hugging Face config.json, no weights), by short name.

`model_shapes("qwen3_vl_2b")` is the parsed JSON; `write_config_dir(name, d)` writes it as
`d/config.json`, which `transformers.AutoConfig.from_pretrained(d)` reads. Where each figure came
from: README.md beside this file.
"""

import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
NAMES = ("qwen3_vl_2b", "qwen3_vl_8b", "qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen3_vl_30b_a3b",
         "qwen3_vl_235b_a22b")


def model_shapes(name: str) -> dict:
    """The config.json of published model `name` (one of NAMES) as a dict."""
    if name not in NAMES:
        raise ValueError(f"unknown model shapes {name!r}: choose one of {', '.join(NAMES)} "
                         f"(files in {HERE})")
    return json.loads((HERE / f"{name}.json").read_text())


def write_config_dir(name: str, directory) -> pathlib.Path:
    """Write `name`'s config as `directory/config.json` (created if missing); returns the dir."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model_shapes(name), indent=2) + "\n")
    return d

"""The command line's config checks and help, answered before an entry point imports torch or jax.

`preflight(argv, default)` reads only the `--config` arguments of `argv` (`--config=<file>` and the
`--config.<key>=<value>` overrides ml_collections' `config_flags` turns into flags) and

* with `--help`, `--helpshort`, `-?`, `-h` or `--helpfull` prints the entry point's docstring, its
  flags and every config field with its value in the chosen config file (the entry point's
  default without `--config`) and a one-line meaning, the comment beside or above the field in
  configs/base.py, then exits 0;
* with a key the config lacks (`--config.train.lr_typo=1`, `--config.trian.lr=1`), a value its
  field cannot take (`--config.train.lr=abc`) or an override before `--config`, writes one line
  to stderr (the key, the nearest existing keys or the expected type) and exits 2, absl's
  status for a usage error;
* otherwise returns, and absl parses the command line as before.

Imports absl and ml_collections only (and the config file, which imports `common`'s light
modules), so the answer comes in about a second.
"""

from __future__ import annotations

import ast
import difflib
import io
import os
import re
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Callable, Iterable

BASE = Path(__file__).resolve().parent.parent / "configs" / "base.py"
HELP_ARGS = {"--help": "short", "-help": "short", "--helpshort": "short", "-helpshort": "short",
             "-?": "short", "-h": "short", "--helpfull": "full", "-helpfull": "full"}
USAGE_ERROR = 2  # absl's exit status for a bad command line
_CONFIG = re.compile(r"^--?config(?:=(.*))?$", re.S)  # as config_flags finds it
_OVERRIDE = re.compile(r"^--?(no)?config\.([^=]*)(?:=(.*))?$", re.S)


# ---------------------------------------------------------------- the meanings, from base.py

def field_notes(path: Path | str = BASE) -> dict[str, str]:
    """One line per config key assigned in `path` (`c.section.field = value  # meaning`): the
    comment beside the assignment, else the comment block just above it (no blank line
    between), whitespace collapsed. Keys in file order; {} where the file cannot be read."""
    try:
        source = Path(path).read_text()
        tree = ast.parse(source)
        comments = {}  # line -> (text, whole line)
        lines = source.splitlines()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start
                whole = not lines[row - 1][:col].strip()
                comments[row] = (tok.string.lstrip("#").strip(), whole)
    except (OSError, SyntaxError, ValueError, tokenize.TokenError):
        return {}
    found = []  # (line, key, meaning)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        key = _dotted_target(node.targets[0])
        if key is None:
            continue
        end = node.end_lineno or node.lineno
        beside = [comments[r][0] for r in range(node.lineno, end + 1)
                  if r in comments and not comments[r][1]]
        above, row = [], node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        found.append((node.lineno, key, " ".join(" ".join(beside or above).split())))
    return {key: text for _, key, text in sorted(found)}


def _dotted_target(target) -> str | None:
    """"a.b" for the target `c.a.b` (any root name), None for anything else."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.insert(0, target.attr)
        target = target.value
    return ".".join(parts) if parts and isinstance(target, ast.Name) else None


# ---------------------------------------------------------------- the config and its keys

def flatten(cfg, prefix: str = "") -> dict[str, object]:
    """Every dotted key of a ConfigDict (sections too, before their fields) -> its value."""
    import ml_collections
    out = {}
    for name, value in cfg.items():
        key = prefix + str(name)
        out[key] = value
        if isinstance(value, ml_collections.ConfigDict):
            out.update(flatten(value, key + "."))
    return out


def nearest(key: str, keys: Iterable[str], n: int = 3) -> list[str]:
    """The existing keys closest to a misspelled `key`: the same field name in other sections
    if there is one (`trian.lr`, `lr` -> `train.lr`), else the closest spellings of the key,
    else of its last part among its section's fields (`train.lrate` -> `train.lr`)."""
    keys = list(keys)
    leaf = key.rsplit(".", 1)[-1]
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    same_leaf = [k for k in keys if k != key and k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return sorted(same_leaf, key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())[:n]
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.6)
    if close:
        return close
    fields = [k[len(section):] for k in keys
              if k.startswith(section) and "." not in k[len(section):]]
    close = [section + f for f in difflib.get_close_matches(leaf, fields, n=n, cutoff=0.5)]
    if close or not section:
        return close
    top = key.split(".", 1)[0]  # a misspelled section, then an unknown field: the section
    return difflib.get_close_matches(top, [k for k in keys if "." not in k], n=n, cutoff=0.6)


def load(path: str):
    """The ConfigDict `--config=<path>` gives (ml_collections' own loader, `path:arg` included),
    or None where it cannot be loaded."""
    from ml_collections import ConfigDict
    from ml_collections.config_flags import config_flags
    config = config_flags.ConfigFileFlagParser(name="config", lock_config=True).parse(path)
    return config if isinstance(config, ConfigDict) else None


# ---------------------------------------------------------------- the command line

def _config_arg(argv: list[str]) -> tuple[int, str | None]:
    """(index, value) of the last `--config` argument before `--`; (-1, None) if none."""
    found = (-1, None)
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            break
        m = _CONFIG.match(arg)
        if m:
            value = m.group(1) if m.group(1) is not None else (
                argv[i + 1] if i + 1 < len(argv) else None)
            found = (i, value)
    return found


def _overrides(argv: list[str], types: Callable[[str], type | None]):
    """(index, key, value, argument) of each `--config.<key>` argument before `--`, the value
    taken as absl does: after `=`, else "true"/"false" for a boolean (`--noconfig.<key>`), else
    the next argument."""
    out, i = [], 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        m = _OVERRIDE.match(arg)
        if m:
            negated, key, value = m.group(1), m.group(2), m.group(3)
            if value is None:
                if negated or types(key) is bool:
                    value = "false" if negated else "true"
                elif i + 1 < len(argv):
                    value = argv[i + 1]
                    i += 1
            out.append((i, key, value, arg))
        i += 1
    return out


def _type_of(cfg, key: str):
    """The type ml_collections gives the field `key` (None: no such field)."""
    from ml_collections.config_flags import config_path
    try:
        return config_path.get_type(key, cfg)
    except Exception:  # KeyError, AttributeError, IndexError, ValueError, ...
        return None


def check(argv: list[str], default: str) -> str | None:
    """The one-line complaint about `argv`'s `--config` arguments, or None (no complaint, or
    one absl reports better itself, such as a config file that fails to load)."""
    from absl import flags
    try:  # --flagfile=...: its arguments in its place, as config_flags reads them
        argv = flags.FLAGS.read_flags_from_files(list(argv), force_gnu=False)
    except Exception:  # absl reports a bad flag file itself
        return None
    index, path = _config_arg(argv)
    path = path if index > 0 else default
    if path is None:
        return None
    if not os.path.exists(path.split(":", 1)[0]):
        return (f"--config={path}: no such config file (relative to {os.getcwd()})"
                if index > 0 else None)
    try:
        cfg = load(path)
    except Exception:  # absl's parse shows the traceback a broken file deserves
        return None
    if cfg is None:
        return None
    from ml_collections import ConfigDict
    keys = flatten(cfg)
    overrides = _overrides(argv, lambda key: _type_of(cfg, key))
    for i, key, value, arg in overrides:
        if index > 0 and i < index:
            return f"{arg} comes before --config={path}: give --config first"
        if key not in keys and _type_of(cfg, key) is None:
            leaves = [k for k, v in keys.items() if not isinstance(v, ConfigDict)]
            near = nearest(key, leaves) or nearest(key, keys)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            return f"--config.{key}: {path} has no key {key}{hint}"
    return _check_values(argv[0] if argv else "", path, cfg, overrides)


def _check_values(argv0: str, path: str, cfg, overrides) -> str | None:
    """Parse each override's value with the flag ml_collections defines for its field (on a
    private FlagValues: nothing global changes); the first refused names its expected type."""
    from absl import flags
    from ml_collections.config_flags import config_flags
    if not overrides:
        return None
    fv = flags.FlagValues()
    args = [argv0, f"--config={path}"] + [arg for _, _, _, arg in overrides]
    try:
        config_flags.DEFINE_config_file("config", path, flag_values=fv, lock_config=True,
                                        sys_argv=args)
        fv([argv0, f"--config={path}"])
    except Exception:  # absl reports what it cannot parse
        return None
    for _, key, value, _ in overrides:
        name = f"config.{key}"
        if name not in fv or isinstance(fv[name], flags.MultiFlag) or value is None:
            continue
        try:
            fv[name].parse(value)
        except Exception:  # IllegalFlagValueError, TypeError, ...
            kind = _type_of(cfg, key)
            kind = getattr(kind, "__name__", str(kind))
            article = "an" if kind[:1] in "aeiou" else "a"
            try:
                now = f" ({path} sets {_show(_get(cfg, key))})"
            except Exception:  # an indexed key (`a.b[0]`)
                now = ""
            return f"--config.{key}={value}: {key} takes {article} {kind}{now}"
    return None


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


# ---------------------------------------------------------------- help

def _show(value, width: int = 32) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def config_listing(cfg, path: str, base_cfg=None, notes: dict[str, str] | None = None,
                   width: int = 132) -> str:
    """Every field of `cfg`: `key = value`, the configs/base.py value where the file changes
    it, and its one-line meaning; sections in base.py's order, each under its own note."""
    import ml_collections
    notes = field_notes() if notes is None else notes
    keys = flatten(cfg)
    base = flatten(base_cfg) if base_cfg is not None else {}
    order = {k: i for i, k in enumerate(notes)}

    def rank(key):  # base.py's order: the key's line, else that of the dict it sits in
        parts, line = key.split("."), len(order)
        for n in range(len(parts), 1, -1):
            if ".".join(parts[:n]) in order:
                line = order[".".join(parts[:n])]
                break
        return order.get(parts[0], len(order)), parts[0], line, key

    leaves = [k for k, v in keys.items() if not isinstance(v, ml_collections.ConfigDict)]
    leaves.sort(key=rank)
    lines = [f"config fields ({path}; set one with --config.<key>=<value>; "
             "[base: ...] where configs/base.py differs):"]
    section = None
    for key in leaves:
        top = key.split(".")[0] if "." in key else ""
        if top != section:
            section = top
            if top:
                head = f"  {top}:"
                if notes.get(top):
                    head += "  " + _fit(notes[top], len(head), width)
                lines.append(head)
        text = f"    {key} = {_show(keys[key])}"
        if key in base and _differs(base[key], keys[key]):
            text += f" [base: {_show(base[key], 20)}]"
        note = _note(key, notes)
        if note:
            text = f"{text:<52}  "
            text += _fit(note, len(text), width)
        lines.append(text)
    return "\n".join(lines)


def _fit(text: str, used: int, width: int) -> str:
    """`text` shortened at a word to end by column `width` (at least 40 characters of it)."""
    return textwrap.shorten(text, max(40, width - used), placeholder=" ...")


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:
        return True


def _note(key: str, notes: dict[str, str]) -> str:
    """The key's own meaning, else that of the dict it sits in (`jax.mesh.data`: `jax.mesh`'s),
    never a top-level section's."""
    while key:
        if notes.get(key):
            return notes[key]
        key = key.rsplit(".", 1)[0] if key.count(".") > 1 else ""
    return ""


def help_text(argv: list[str], default: str, kind: str,
              define_flags: Callable[[object], None]) -> str:
    """The docstring of `__main__`, the entry point's flags (`define_flags(flag_values)`; with
    kind "full", absl's own flags too) and the config listing."""
    from absl import flags
    main = sys.modules.get("__main__")
    doc = (getattr(main, "__doc__", None)
           or f"\nUSAGE: {argv[0] if argv else 'python'} [flags]\n").rstrip("\n") + "\n"
    fv = flags.FlagValues()
    define_flags(fv)
    parts = [doc, "flags:" + fv.get_help(include_special_flags=False)]
    if kind == "full":
        from absl import app  # defines absl.logging's flags
        parts.append(flags.FLAGS.get_help())
    index, path = _config_arg(argv)
    path = path if index > 0 else default
    try:
        cfg = load(path) if path and os.path.exists(path.split(":", 1)[0]) else None
    except Exception as e:
        cfg, path = None, f"{path} ({type(e).__name__}: {e})"
    if cfg is None:
        parts.append(f"\nconfig fields: cannot load --config={path}")
    else:
        try:
            base_cfg = load(str(BASE))
        except Exception:
            base_cfg = None
        parts.append("\n" + config_listing(cfg, path, base_cfg))
    return "\n".join(parts) + "\n"


def wants_help(argv: list[str]) -> str | None:
    """"short" or "full" where `argv` asks for help (before any `--`), else None."""
    for arg in argv[1:]:
        if arg == "--":
            return None
        if arg in HELP_ARGS:
            return HELP_ARGS[arg]
    return None


def preflight(argv: list[str], default: str,
              define_flags: Callable[[object], None] | None = None) -> None:
    """Answer help (where `define_flags` is given: it defines the entry point's flags on the
    FlagValues it is passed) and refuse a bad `--config` argument, both before the caller goes
    on to import its framework; return where there is nothing to say."""
    kind = wants_help(argv)
    if kind and define_flags is not None:
        try:
            sys.stdout.write(help_text(argv, default, kind, define_flags))
            sys.stdout.flush()
        except BrokenPipeError:  # `--help | head`
            pass
        sys.exit(0)
    if kind:
        return  # absl prints the help of an entry point that defines its own flags
    error = check(argv, default)
    if error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(USAGE_ERROR)

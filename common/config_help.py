"""The command line's config checks and help, answered before an entry point imports torch or jax.

`preflight(argv, default)` reads only the `--config` arguments of `argv` (`--config=<file>` and the
`--config.<key>=<value>` overrides ml_collections' `config_flags` turns into flags) and

* with `--help`, `--helpshort`, `-?`, `-h` or `--helpfull` prints the entry point's docstring, its
  flags and every config field with its value in the chosen config file (the entry point's
  default without `--config`) and its meaning, the comment beside or above the field in
  configs/base.py, wrapped to the terminal's width, then exits 0;
* with a key the config lacks (`--config.train.lr_typo=1`, `--config.trian.lr=1`), a value its
  field cannot take (`--config.train.lr=abc`) or an override before `--config`, writes one line
  to stderr (the key, the nearest existing keys or the expected type) and exits 2, absl's
  status for a usage error;
* with values out of their ranges (`common.config_rules`: `--config.train.lr=-1`, `nan`, a
  GRPO run's `--config.rollout.n_samples=1`), one line each, and exits 2;
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
import shutil
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


def override_keys(argv: list[str], cfg) -> list[str]:
    """The keys of `argv`'s `--config.<key>` overrides, in order (`cfg`: the config they apply
    to, whose boolean fields may go without a value)."""
    return [key for _, key, _, _ in _overrides(argv, lambda key: _type_of(cfg, key))]


def config_file_given(argv: list[str]) -> bool:
    """Whether `argv` names a config file (`--config=<file>`), rather than take the default."""
    return _config_arg(argv)[0] > 0


def _type_of(cfg, key: str):
    """The type ml_collections gives the field `key` (None: no such field)."""
    from ml_collections.config_flags import config_path
    try:
        return config_path.get_type(key, cfg)
    except Exception:  # KeyError, AttributeError, IndexError, ValueError, ...
        return None


def check(argv: list[str], default: str, grpo: bool = False) -> list[str]:
    """The complaints about `argv`'s `--config` arguments, one line each: the first unknown key
    or value its field cannot take alone, else every field of the resolved config (the file
    and its overrides) outside its range (`common.config_rules`; with `grpo` also what the GRPO
    loop needs). Empty where there is nothing to say, or where absl says it better itself (a
    config file that fails to load)."""
    from absl import flags
    try:  # --flagfile=...: its arguments in its place, as config_flags reads them
        argv = flags.FLAGS.read_flags_from_files(list(argv), force_gnu=False)
    except Exception:  # absl reports a bad flag file itself
        return []
    index, path = _config_arg(argv)
    path = path if index > 0 else default
    if path is None:
        return []
    if not os.path.exists(path.split(":", 1)[0]):
        return ([f"--config={path}: no such config file (relative to {os.getcwd()})"]
                if index > 0 else [])
    try:
        cfg = load(path)
    except Exception:  # absl's parse shows the traceback a broken file deserves
        return []
    if cfg is None:
        return []
    from ml_collections import ConfigDict
    keys = flatten(cfg)
    overrides = _overrides(argv, lambda key: _type_of(cfg, key))
    for i, key, value, arg in overrides:
        if index > 0 and i < index:
            return [f"{arg} comes before --config={path}: give --config first"]
        if key not in keys and _type_of(cfg, key) is None:
            leaves = [k for k, v in keys.items() if not isinstance(v, ConfigDict)]
            near = nearest(key, leaves) or nearest(key, keys)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            return [f"--config.{key}: {path} has no key {key}{hint}"]
    error, resolved = _check_values(argv[0] if argv else "", path, cfg, overrides)
    if error:
        return [error]
    from common.config_rules import problems
    return problems(resolved, grpo) if resolved is not None else []


def _check_values(argv0: str, path: str, cfg, overrides) -> tuple[str | None, object]:
    """Parse each override's value with the flag ml_collections defines for its field (on a
    private FlagValues: nothing global changes). Returns (the first refusal, naming the type
    its field expects, or None; the config with every override applied, or None where absl
    reports the command line itself)."""
    from absl import flags
    from ml_collections.config_flags import config_flags
    if not overrides:
        return None, cfg
    fv = flags.FlagValues()
    args = [argv0, f"--config={path}"] + [arg for _, _, _, arg in overrides]
    try:
        config_flags.DEFINE_config_file("config", path, flag_values=fv, lock_config=True,
                                        sys_argv=args)
        fv([argv0, f"--config={path}"])
    except Exception:  # absl reports what it cannot parse
        return None, None
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
            return f"--config.{key}={value}: {key} takes {article} {kind}{now}", None
    return None, fv["config"].value


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


# ---------------------------------------------------------------- help

def _show(value, width: int = 32) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def width() -> int:
    """The terminal's width in columns (`COLUMNS`, else the terminal of stdout, else 80)."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def _wrap(text: str, first: str, indent: int, cols: int) -> list[str]:
    """`first` followed by `text`, wrapped at `cols` columns, later lines indented `indent`;
    a word longer than a line is kept whole, never cut."""
    return textwrap.wrap(text, cols, initial_indent=first, subsequent_indent=" " * indent,
                         break_long_words=False, break_on_hyphens=False) or [first]


NOTE_COLUMN = 54  # where a field's meaning starts beside it, on a terminal wide enough
NOTE_MIN = 40  # the fewest columns a meaning gets beside its field; fewer: below it


def config_listing(cfg, path: str, base_cfg=None, notes: dict[str, str] | None = None,
                   cols: int | None = None) -> str:
    """Every field of `cfg`: `key = value`, the configs/base.py value where the file changes
    it, and its meaning (the comment of configs/base.py), wrapped at `cols` columns (the
    terminal's): beside the field where it leaves the meaning 40 columns, else below it.
    Sections in base.py's order, each under its own note."""
    import ml_collections
    notes = field_notes() if notes is None else notes
    cols = width() if cols is None else cols
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
    lines = _wrap(f"({path}; set one with --config.<key>=<value>; [base: ...] where "
                  "configs/base.py differs):", "config fields ", 2, cols)
    section = None
    for key in leaves:
        top = key.split(".")[0] if "." in key else ""
        if top != section:
            section = top
            if top:
                lines += _wrap(notes.get(top, ""), f"  {top}:" + "  " * bool(notes.get(top)),
                               6, cols)
        text = f"    {key} = {_show(keys[key])}"
        if key in base and _differs(base[key], keys[key]):
            text += f" [base: {_show(base[key], 20)}]"
        note = _note(key, notes)
        column = max(len(text) + 2, NOTE_COLUMN)
        if note and column + NOTE_MIN <= cols:
            lines += _wrap(note, f"{text:<{column}}", column, cols)
            continue
        lines += _wrap(text.strip(), "    ", 8, cols)
        if note:
            lines += _wrap(note, " " * 8, 8, cols)
    return "\n".join(lines)


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


def flag_listing(fv, cols: int | None = None) -> str:
    """The flags defined on `fv`, one paragraph each (`--name: help (default: value)`),
    wrapped at `cols` columns (the terminal's)."""
    cols = width() if cols is None else cols
    seen, lines = set(), ["flags:"]
    for flags in fv.flags_by_module_dict().values():
        for flag in flags:
            if flag.name in seen:
                continue
            seen.add(flag.name)
            name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
            default = f" (default: {flag.default_as_str})" if flag.default_as_str else ""
            lines += _wrap(f"{flag.help}{default}", f"  {name}: ", 6, cols)
    return "\n".join(lines)


def docstring(doc: str, cols: int | None = None) -> str:
    """`doc` with each paragraph of plain lines wrapped at `cols` columns (the terminal's);
    a paragraph with an indented line (a command, a list) is kept as written."""
    cols = width() if cols is None else cols
    out = []
    for block in textwrap.dedent(doc).strip("\n").split("\n\n"):
        lines = block.splitlines()
        if any(line[:1].isspace() for line in lines):
            out.append(block)
        else:
            out.append("\n".join(_wrap(" ".join(lines), "", 0, cols)))
    return "\n\n".join(out) + "\n"


def help_text(argv: list[str], default: str, kind: str,
              define_flags: Callable[[object], None]) -> str:
    """The docstring of `__main__`, the entry point's flags (`define_flags(flag_values)`; with
    kind "full", absl's own flags too) and, where it defines `--config`, the config listing."""
    from absl import flags
    main = sys.modules.get("__main__")
    doc = docstring(getattr(main, "__doc__", None)
                    or f"USAGE: {argv[0] if argv else 'python'} [flags]") + "\n"
    fv = flags.FlagValues()
    define_flags(fv)
    parts = [doc, flag_listing(fv)]
    if kind == "full":
        from absl import app  # defines absl.logging's flags
        parts.append(flags.FLAGS.get_help())
    if "config" not in fv:
        return "\n".join(parts) + "\n"
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
              define_flags: Callable[[object], None] | None = None,
              grpo: bool = False) -> None:
    """Answer help (where `define_flags` is given: it defines the entry point's flags on the
    FlagValues it is passed) and refuse a bad `--config` argument or a config out of its
    ranges (`check`; `grpo`: an entry point that trains with GRPO), both before the caller
    goes on to import its framework; return where there is nothing to say."""
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
    errors = check(argv, default, grpo)
    if errors:
        sys.stderr.write("".join(f"error: {e}\n" for e in errors))
        sys.exit(USAGE_ERROR)

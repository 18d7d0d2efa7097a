"""Traced programs kept on disk between runs: a warm run does not trace its big functions again.

JAX's persistent compilation cache (`geo3k_jax.compiler.use_compilation_cache`) saves XLA's
compile, but a run still traces each function in Python and lowers it, only to find the cache
entry: on the CPU default the gradient's and the prefill's traces and lowerings took 3.3 s of
a 55 s run (docs/benchmarks.md). `ProgramStore.jit` is `jax.jit` whose lowered program, per
call signature, is exported (`jax.export`: StableHLO with its shardings, a format made to be
stored) into a directory; a later run deserializes it, and lowering the call of an exported
program is cheap. The compile itself still comes from the compilation cache.

An exported program holds everything the traced function read, the values it closed over
included, so its key is everything that decides it:

  - the code: the bytes of every module of `geo3k_jax` and `common`;
  - the libraries (jax, jaxlib, flax, optax, numpy versions), JAX's configuration, XLA_FLAGS,
    the devices;
  - its owner's settings (`context`: for the learner its loss, optimizer and model config and
    model structure, for the engine its model config and structure, ...);
  - the call: the function's name, its arguments' tree, shapes, dtypes and shardings, its
    static arguments.

Any change is a new key: a miss traces and exports (then keeps the file) as jit would trace.
A file that cannot be read (truncated, written by another version) is exported anew and
replaced; files are written whole (a temporary file, then renamed); a folder that cannot be
written is warned about once per program, and the run goes on as without a store. One process
only:
`geo3k_jax.train` gives a multi-host run no store.

Loading a stored program still costs its first call a read of the compilation cache (XLA's
executable: 0.2-0.3 s for the CPU default's gradient). The store also keeps notes (`note`,
`notes`: small JSON records under the code's and environment's key, such as the slice shapes a
learner has met) from which a later run knows what it will call, and `prepare` does a call's
loading without running it, in any thread: the learner loads its gradients in the background
while the first rollouts run (`geo3k_jax.learner.Learner.warm_up`). `prepare` only loads what
is stored: it never traces.

    store = ProgramStore("data/jax_cache/programs")
    grad = store.jit(f, "grad", context=describe(settings), donate_argnums=0)
    grad(params, batch, nucleus=True)   # as jax.jit(f): static arguments by keyword
    grad.prepare(abstract_params, batch, nucleus=True)  # load and compile, do not run
    store.loaded, store.exported        # programs read from disk / traced in this process
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Callable

import jax

PACKAGES = ("geo3k_jax", "common")  # the code whose bytes are part of every key
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy")


@functools.cache
def code_fingerprint() -> str:
    """`fingerprint` of this checkout's PACKAGES (read once a process)."""
    return fingerprint(Path(__file__).resolve().parent.parent, PACKAGES)


def fingerprint(root: Path, packages) -> str:
    """sha256 over the path and bytes of every .py file of `packages` under `root`."""
    h = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> str:
    """Everything outside the code that changes a traced program: library versions, JAX's
    configuration, XLA_FLAGS, the devices."""
    versions = {name: _version(name) for name in LIBRARIES}
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    return repr((sys.version, versions, config, os.environ.get("XLA_FLAGS", ""), devices))


def describe(obj) -> str:
    """repr(obj) without memory addresses (`<function silu at 0x7f..>` -> `<function silu>`):
    a model's structure (an nnx GraphDef) names its functions, whose addresses change from
    run to run."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(obj))


def call_key(args: tuple, static: dict) -> tuple:
    """A hashable signature of a call, quick to take: the arguments' tree, each leaf's abstract
    value (shape, dtype, weak type), its sharding when it is placed (`sharding`), and the
    static arguments."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple((jax.typeof(x), sharding(x)) for x in leaves),
            tuple(sorted(static.items())))


def sharding(x):
    """The sharding of a placed jax.Array, or of a `jax.ShapeDtypeStruct` that stands for one
    (`_Stored.prepare`); None for host values."""
    return x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None


def placement(x) -> str:
    """Where the pieces of a placed jax.Array (or its `jax.ShapeDtypeStruct`) live: each
    device's index into it (`NamedSharding`s that differ in spelling only, as P() and P(None)
    or an axis of one device, are one placement); "-" for host values."""
    placed = sharding(x)
    if placed is None:
        return "-"
    pieces = placed.devices_indices_map(x.shape)
    return repr(sorted((device.id, str(index)) for device, index in pieces.items()))


_STORABLE: set[type] = set()  # NamedTuple types registered with jax.export by this process


def register_namedtuples(tree) -> None:
    """Make the NamedTuple nodes of `tree` storable (`jax.export` serializes only the tree
    nodes registered with it; an optimizer state is optax's NamedTuples), once a type, under
    its module and name. Call it before the first program that takes or returns such a tree,
    in every run: loading needs the registration as much as storing."""
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields") and type(tree) not in _STORABLE:
        kind = type(tree)
        jax.export.register_namedtuple_serialization(
            kind, serialized_name=f"{kind.__module__}.{kind.__qualname__}")
        _STORABLE.add(kind)
    children = tree.values() if isinstance(tree, dict) else \
        tree if isinstance(tree, (tuple, list)) else ()
    for child in children:
        register_namedtuples(child)


class ProgramStore:
    """A directory of exported programs (module docstring). loaded: programs this process read
    from it; exported: programs it traced and wrote."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # the run goes on, tracing as without a store
            logging.warning("program store: cannot use %s (%s); programs are not kept",
                            self.dir, e)
        self.loaded = 0
        self.exported = 0
        self._base = None  # code_fingerprint() + environment(), at the first miss in memory

    def jit(self, fn: Callable, name: str, context: str = "", *, static_argnames=(),
            donate_argnums=(), compiler_options=None, **shardings) -> Callable:
        """`jax.jit(fn, ...)` whose programs come from the store: call it as the jitted
        function, with the static arguments by keyword. name: the file name's prefix;
        context: what `fn` reads besides its arguments (`describe` of the owner's settings)."""
        return _Stored(self, fn, name, context, static_argnames, donate_argnums,
                       compiler_options, shardings)

    def file(self, name: str, context: str, args: tuple, static: dict) -> Path:
        """Where the program of this call lives: its tree, abstract values and placements
        (`placement`), static arguments, name and context, with the code and environment."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        text = repr((self._key_base(), name, context, str(tree),
                     [f"{jax.typeof(x)}@{placement(x)}" for x in leaves],
                     repr(sorted(static.items()))))
        return self.dir / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:40]}.exported"

    def _key_base(self) -> str:
        if self._base is None:  # once: it reads every module of PACKAGES
            self._base = code_fingerprint() + environment()
        return self._base

    def _notes_file(self, kind: str, context: str) -> Path:
        text = repr((self._key_base(), kind, context))
        return self.dir / f"notes-{kind}-{hashlib.sha256(text.encode()).hexdigest()[:40]}.json"

    def notes(self, kind: str, context: str = "") -> list:
        """The records `note` kept under `kind` and `context` (in the order first noted), for
        this code and environment; [] when there are none or the file is unreadable."""
        try:
            records = json.loads(self._notes_file(kind, context).read_text())
        except (OSError, ValueError):
            return []
        return records if isinstance(records, list) else []

    def note(self, kind: str, context: str, record) -> None:
        """Keep the JSON value `record` under `kind` and `context` (once: a record kept before
        is not added again). A folder that cannot be written loses the note, not the run."""
        records = self.notes(kind, context)
        if record in records:
            return
        path = self._notes_file(kind, context)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(records + [record]))
            os.replace(tmp, path)
        except OSError as e:
            logging.warning("program store: cannot write %s (%s)", path.name, e)

    def program(self, jitted, path: Path, args: tuple, static: dict):
        """The `jax.export.Exported` of jitted(*args, **static) kept at `path` (`file`): read
        when stored, else traced and stored."""
        if path.exists():
            try:
                exported = jax.export.deserialize(bytearray(path.read_bytes()))
                self.loaded += 1
                return exported
            except Exception as e:  # noqa: BLE001  a damaged or foreign file: export it anew
                logging.warning("program store: %s unreadable (%s: %s); tracing it anew",
                                path.name, type(e).__name__, e)
        exported = jax.export.export(jitted)(*args, **static)
        self.exported += 1
        blob = exported.serialize()  # ValueError: a tree export cannot store
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(blob)
            os.replace(tmp, path)
        except OSError as e:  # a full disk, a read-only folder: this run is not slowed
            logging.warning("program store: cannot write %s (%s)", path.name, e)
        return exported


class _Stored:
    """`ProgramStore.jit`'s function: per call signature, the stored program's call, jitted
    with the function's donations, compiler options and shardings."""

    def __init__(self, store, fn, name, context, static_argnames, donate_argnums,
                 compiler_options, shardings):
        self.store, self.name, self.context = store, name, context
        self.donate, self.options, self.shardings = donate_argnums, compiler_options, shardings
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnums=donate_argnums,
                              compiler_options=compiler_options, **shardings)
        self._calls = {}  # call_key -> the jitted call of its program
        self._programs = {}  # file -> that call: signatures that differ in spelling share it
        self._lock = threading.Lock()  # guards _loading; a signature is loaded by one thread
        self._loading = {}  # call_key -> Event set when the thread loading it is done

    def __call__(self, *args, **static):
        key = call_key(args, static)
        call = self._calls.get(key) or self._load(key, args, static, compile_now=False)
        return call(*args)

    def prepare(self, *args, **static) -> bool:
        """Load and compile the stored program of this call signature without running it
        (arguments may be `jax.ShapeDtypeStruct`s with their shardings), so that the call
        itself only runs. Only what the store holds: returns False, doing nothing, when the
        program is not stored (tracing it is left to the call)."""
        key = call_key(args, static)
        if key in self._calls:
            return True
        if not self.store.file(self.name, self.context, args, static).exists():
            return False
        return self._load(key, args, static, compile_now=True) is not None

    def _load(self, key, args: tuple, static: dict, compile_now: bool):
        """The call of signature `key`, loaded (or traced and stored) by this thread, or by
        the thread already loading it (waited for). None only when `prepare`'s loading failed
        in this thread (the caller's own call then loads it as usual)."""
        with self._lock:
            waiting = self._loading.get(key)
            if waiting is None and key not in self._calls:
                self._loading[key] = threading.Event()
        if waiting is not None:
            waiting.wait()
            return self._calls.get(key) or self._load(key, args, static, compile_now)
        if key in self._calls:
            return self._calls[key]
        try:
            path = self.store.file(self.name, self.context, args, static)
            call = self._programs.get(path)
            if call is None:
                exported = self.store.program(self.jitted, path, args, static)
                # the function's own shardings, not the arguments' spellings of them: a call
                # whose arguments place their pieces alike (the first parameters, an update's
                # outputs, a warm-up's descriptions) then compiles one executable, one XLA
                # cache entry, and its outputs are spelled as its next call's inputs
                call = self._programs[path] = jax.jit(
                    exported.call, donate_argnums=self.donate, compiler_options=self.options,
                    **self.shardings)
            if compile_now:  # fills jit's caches for this signature: the call only runs
                call.lower(*args).compile()
            self._calls[key] = call
            return call
        except Exception as e:  # noqa: BLE001
            if not compile_now:
                raise
            logging.warning("program store: preparing %s failed (%s: %s); its call loads it",
                            self.name, type(e).__name__, e)
            return None
        finally:
            with self._lock:
                self._loading.pop(key).set()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"

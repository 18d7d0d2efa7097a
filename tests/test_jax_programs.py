"""geo3k_jax.programs: a stored program computes what jax.jit computes, a later store on the same
directory loads it without tracing, and whatever decides a program is part of its key."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geo3k_jax.programs import ProgramStore, describe, environment, fingerprint

X = np.arange(6, dtype=np.float32).reshape(2, 3)
Y = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)


def counting():
    """(f, traces): f(x, y, *, scale) appends to traces each time it is traced."""
    traces = []

    def f(x, y, *, scale):
        traces.append(1)
        return {"sum": (x * scale + jnp.sin(y)).sum(), "gram": x @ y.T}

    return f, traces


def same(a, b) -> bool:
    return all(np.array_equal(np.asarray(p), np.asarray(q))
               for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_stored_program_is_loaded_not_traced_and_computes_the_same(tmp_path):
    want = jax.jit(counting()[0], static_argnames="scale")(X, Y, scale=2.0)
    f, traces = counting()
    first = ProgramStore(tmp_path)
    got = first.jit(f, "f", static_argnames="scale")(X, Y, scale=2.0)
    assert same(got, want) and len(traces) == 1 and (first.exported, first.loaded) == (1, 0)

    f, traces = counting()  # another run: a new store, a new function
    later = ProgramStore(tmp_path)
    fn = later.jit(f, "f", static_argnames="scale")
    assert same(fn(X, Y, scale=2.0), want) and same(fn(X, Y, scale=2.0), want)
    assert not traces and (later.exported, later.loaded) == (0, 1)


@pytest.mark.parametrize("change", ["static", "shape", "dtype", "weak type", "context", "name"])
def test_anything_that_decides_the_program_is_another_program(tmp_path, change):
    f, traces = counting()
    ProgramStore(tmp_path).jit(f, "f", "settings", static_argnames="scale")(X, Y, scale=2.0)
    args, static, name, context = (X, Y), {"scale": 2.0}, "f", "settings"
    if change == "static":
        static = {"scale": 3.0}
    elif change == "shape":
        args = (X[:1], Y[:1])
    elif change == "dtype":
        args = (X.astype(np.float16), Y)
    elif change == "weak type":
        args = (X, jnp.asarray(Y))  # a placed array is another input, as for jax.jit
        static = {"scale": 2.0}
    elif change == "context":
        context = "other settings"
    else:
        name = "g"
    store = ProgramStore(tmp_path)
    got = store.jit(f, name, context, static_argnames="scale")(*args, **static)
    want = jax.jit(f, static_argnames="scale")(*args, **static)
    assert same(got, want)
    assert (store.exported, store.loaded) == (1, 0)
    assert len(list(tmp_path.glob("*.exported"))) == 2


def test_a_damaged_file_is_traced_again_and_replaced(tmp_path, caplog):
    f, traces = counting()
    ProgramStore(tmp_path).jit(f, "f", static_argnames="scale")(X, Y, scale=2.0)
    (path,) = tmp_path.glob("*.exported")
    path.write_bytes(path.read_bytes()[:50])  # cut short (a full disk, a partial copy)
    store = ProgramStore(tmp_path)
    with caplog.at_level(logging.WARNING):
        got = store.jit(f, "f", static_argnames="scale")(X, Y, scale=2.0)
    assert "unreadable" in caplog.text and store.exported == 1
    assert same(got, jax.jit(f, static_argnames="scale")(X, Y, scale=2.0))
    store = ProgramStore(tmp_path)
    store.jit(f, "f", static_argnames="scale")(X, Y, scale=2.0)
    assert store.loaded == 1
    assert not list(tmp_path.glob(".*tmp"))  # written whole, then renamed


def test_a_loaded_program_donates_as_the_function_does(tmp_path):
    f = lambda x, y: (x + y, y * 2)  # noqa: E731
    ProgramStore(tmp_path).jit(f, "f", donate_argnums=0)(jnp.asarray(X), jnp.asarray(Y))
    store = ProgramStore(tmp_path)
    x, y = jnp.asarray(X), jnp.asarray(Y)
    out = store.jit(f, "f", donate_argnums=0)(x, y)
    assert store.loaded == 1 and x.is_deleted() and not y.is_deleted()
    assert np.array_equal(np.asarray(out[0]), X + Y)


def test_code_environment_and_structure_are_keyed(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    before = fingerprint(tmp_path, ("pkg",))
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    edited = fingerprint(tmp_path, ("pkg",))
    (tmp_path / "pkg" / "b.py").write_text("")
    assert len({before, edited, fingerprint(tmp_path, ("pkg",))}) == 3

    env = environment()
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "bfloat16" if precision != "bfloat16"
                      else "highest")
    try:
        assert environment() != env
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    assert environment() == env

    text = describe({"act": jax.nn.silu, "f": lambda: 0})  # a model names its functions:
    assert "0x" not in text and "silu" in text            # by name, never by address


def test_a_store_that_cannot_write_warns_and_computes(tmp_path, caplog):
    blocker = tmp_path / "taken"
    blocker.write_text("a file where the folder should be")
    f, traces = counting()
    with caplog.at_level(logging.WARNING):
        store = ProgramStore(blocker)
        got = store.jit(f, "f", static_argnames="scale")(X, Y, scale=2.0)
    assert "cannot use" in caplog.text and "cannot write" in caplog.text
    assert same(got, jax.jit(counting()[0], static_argnames="scale")(X, Y, scale=2.0))
    assert blocker.read_text().startswith("a file")


def test_shardings_spelled_differently_share_one_program(tmp_path):
    """P() and P(None, None) place an array the same way (as the learner's first parameters
    and its update's outputs may): one program, traced once."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    f, traces = counting()
    store = ProgramStore(tmp_path)
    fn = store.jit(f, "f", static_argnames="scale")
    for spec in (P(), P(None, None), P("data")):
        x = jax.device_put(X, NamedSharding(mesh, spec))
        assert same(fn(x, Y, scale=2.0), jax.jit(counting()[0], static_argnames="scale")(
            X, Y, scale=2.0))
    assert store.exported == 1 and len(list(tmp_path.glob("*.exported"))) == 1


def compile_events():
    """A list that collects the names of JAX's compile events (traces, lowerings, XLA compiles
    or compilation-cache reads) from now on."""
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if "/compile/" in name else None)
    return events


def placed(x):
    """x committed to the first device, and its description (what `prepare` takes)."""
    x = jax.device_put(x, jax.devices()[0])
    return x, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def test_a_prepared_call_only_runs(tmp_path):
    """`prepare` loads and compiles a stored program from a description of the arguments; the
    call itself then neither loads, traces, lowers nor compiles."""
    f, _ = counting()
    x, like = placed(X)
    want = ProgramStore(tmp_path).jit(f, "f", static_argnames="scale")(x, Y, scale=2.0)
    f, traces = counting()
    store = ProgramStore(tmp_path)
    fn = store.jit(f, "f", static_argnames="scale")
    events = compile_events()
    assert fn.prepare(like, Y, scale=2.0) and store.loaded == 1 and events
    events.clear()
    assert same(fn(x, Y, scale=2.0), want)
    assert not events and not traces and (store.loaded, store.exported) == (1, 0)


def test_prepare_loads_only_what_is_stored(tmp_path):
    f, traces = counting()
    store = ProgramStore(tmp_path)
    fn = store.jit(f, "f", static_argnames="scale")
    assert not fn.prepare(placed(X)[1], Y, scale=2.0)
    assert not traces and (store.loaded, store.exported) == (0, 0)
    assert not list(tmp_path.glob("*.exported"))


def test_a_call_waits_for_the_thread_preparing_its_signature(tmp_path, monkeypatch):
    """A call whose program another thread is loading waits for that load: one load."""
    import threading
    f, _ = counting()
    x, like = placed(X)
    want = ProgramStore(tmp_path).jit(f, "f", static_argnames="scale")(x, Y, scale=2.0)
    store = ProgramStore(tmp_path)
    inside, release, reads = threading.Event(), threading.Event(), []
    program = store.program

    def slow_program(*args):  # the preparing thread holds the load until the call waits
        reads.append(threading.current_thread().name)
        inside.set()
        release.wait(10)
        return program(*args)

    monkeypatch.setattr(store, "program", slow_program)
    fn = store.jit(counting()[0], "f", static_argnames="scale")
    thread = threading.Thread(target=fn.prepare, args=(like, Y), kwargs={"scale": 2.0},
                              name="preparing")
    thread.start()
    assert inside.wait(10)
    threading.Timer(0.2, release.set).start()
    assert same(fn(x, Y, scale=2.0), want)
    thread.join()
    assert reads == ["preparing"] and store.loaded == 1


def test_notes_are_kept_once_per_kind_and_context(tmp_path):
    store = ProgramStore(tmp_path)
    assert store.notes("slices", "a") == []
    for record in ({"n": 1}, {"n": 2}, {"n": 1}):
        store.note("slices", "a", record)
    store.note("slices", "b", {"n": 3})
    later = ProgramStore(tmp_path)
    assert later.notes("slices", "a") == [{"n": 1}, {"n": 2}]
    assert later.notes("slices", "b") == [{"n": 3}] and later.notes("other", "a") == []
    for path in tmp_path.glob("notes-*"):
        path.write_text("{not json")
    assert later.notes("slices", "a") == []  # unreadable: no notes, no error


def test_a_stored_call_keeps_the_functions_shardings_whatever_the_arguments_spelling(tmp_path):
    """A stored function that names its shardings (the learner's gradient and update) runs its
    program with those, not with the arguments' spelling of the same placement, and its outputs
    are spelled as it names them. Before, an update's outputs came back spelled otherwise
    (a row-parallel weight's ("fsdp", "tensor") as ("tensor", "fsdp") on one device), the
    gradients called with them lowered to other text than the warm-up's, and the CPU default's
    first warm run compiled three of its four gradients again (new XLA cache entries)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    sh = NamedSharding(mesh, P())
    f = lambda x, y: {"sum": (2 * x + jnp.sin(y)).sum(), "gram": x @ y.T}  # noqa: E731
    kw = dict(in_shardings=(sh, sh), out_shardings=sh)
    want = ProgramStore(tmp_path).jit(f, "f", **kw)(jax.device_put(X, sh), jax.device_put(Y, sh))
    store = ProgramStore(tmp_path)
    fn = store.jit(f, "f", **kw)
    other = NamedSharding(mesh, P(None, None))
    out = fn(jax.device_put(X, other), jax.device_put(Y, other))
    assert same(out, want) and (store.loaded, store.exported) == (1, 0)
    assert [leaf.sharding.spec for leaf in jax.tree.leaves(out)] == [P(), P()]

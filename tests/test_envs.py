"""The knobs' parsers and the checks built on them: every refusal names the variable, its value and
what the knob takes, in words of its own (never Python's "invalid literal for int()"); an alias is
named as one; ``check`` and ``describe`` report what is set and wrong."""

from __future__ import annotations

import types
import typing

import pytest

from ple_um import _testing, envs
from ple_um.errors import KnobError

GARBAGE = ("abc", "", " ", "-1", "0", "1e400", "nan", "inf", "99999999999999999999999", "1.5", "auto,")


EVERY = {**envs.KNOBS, **_testing.HOOKS}  # the test hooks refuse a value as the knobs do


@pytest.mark.parametrize("name", sorted(EVERY))
def test_every_refusal_names_the_knob_its_value_and_what_it_takes(monkeypatch, name):
    knob = EVERY[name]
    for text in GARBAGE:
        monkeypatch.setenv(name, text)
        why = knob.problem()
        if why is None:
            continue  # a value this knob takes
        assert why.startswith(f"environment variable {name}={text!r}: expected "), why
        assert f"got {text!r}" in why or "got an empty value" in why, why
        for python_words in ("invalid literal", "could not convert", "base 10", "Traceback", "float()"):
            assert python_words not in why, why
        with pytest.raises(KnobError, match="environment variable"):
            knob.value()


def test_an_alias_is_named_with_the_knob_it_stands_for(monkeypatch):
    monkeypatch.setenv("VLLM_PLE_MMAP_WORKERS", "0")
    assert envs.KNOBS["PLE_UM_CPU_THREADS"].problem() == (
        "environment variable VLLM_PLE_MMAP_WORKERS='0' (an alias of PLE_UM_CPU_THREADS): expected a whole "
        "number from 1 to 1024, got '0'"
    )


@pytest.mark.parametrize(
    "name,text,value",
    [
        ("PLE_UM_BULK_ROWS", "auto", "auto"),
        ("PLE_UM_BULK_ROWS", " AUTO ", "auto"),
        ("PLE_UM_BULK_ROWS", "0", 0),
        ("PLE_UM_BULK_ROWS", "4096", 4096),
        ("PLE_UM_FIRST_READ_TIMEOUT", "0.5", 0.5),
        ("PLE_UM_FIRST_READ_TIMEOUT", "86400", 86400.0),
        ("PLE_UM_PREWARM", "Yes", True),
        ("PLE_UM_PREWARM", "off", False),
        ("PLE_UM_ROW_CACHE", " Auto ", "auto"),
        ("PLE_UM_ROW_CACHE", "0", 0),
        ("PLE_UM_ROW_CACHE", "4096", 4096),
        ("PLE_UM_ROW_CACHE", "512MiB", 512 << 20),
        ("PLE_UM_ROW_CACHE", "4GiB", 4 << 30),
        ("PLE_UM_ROW_CACHE_FRACTION", "0", 0.0),
        ("PLE_UM_ROW_CACHE_FRACTION", "0.25", 0.25),
        ("PLE_UM_ROW_CACHE_FRACTION", "1", 1.0),
        ("PLE_UM_ROW_CACHE_POLICY", "LRU", "lru"),
        ("PLE_UM_ROW_CACHE_POLICY", "clock", "clock"),
        ("PLE_UM_FILE_READS", "uring", "uring"),
        ("PLE_UM_FILE_READS", " Threads", "threads"),
        ("PLE_UM_FILE_READS", "mmap", "mmap"),
        ("PLE_UM_DIRECT_READS", "On", "on"),
        ("PLE_UM_DIRECT_READS", "off", "off"),
        ("PLE_UM_READ_DEPTH", "1", 1),
        ("PLE_UM_READ_DEPTH", "256", 256),
    ],
)
def test_values_taken(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert envs.KNOBS[name].value() == value and envs.KNOBS[name].problem() is None


@pytest.mark.parametrize(
    "name,text,expected",
    [
        ("PLE_UM_BULK_ROWS", "abc", "auto or a whole number of rows from 0 (never) to 2147483648"),
        ("PLE_UM_BULK_ROWS", "-1", "auto or a whole number of rows from 0 (never) to 2147483648"),
        ("PLE_UM_BULK_ROWS", str(1 << 40), "auto or a whole number of rows from 0 (never) to 2147483648"),
        ("PLE_UM_FIRST_READ_TIMEOUT", "abc", "a number of seconds above 0, at most 86400"),
        ("PLE_UM_FIRST_READ_TIMEOUT", "0", "a number of seconds above 0, at most 86400"),
        ("PLE_UM_FIRST_READ_TIMEOUT", "inf", "a number of seconds above 0, at most 86400"),
        ("PLE_UM_PREWARM", "maybe", "a boolean (1/0, true/false, yes/no, on/off)"),
        ("PLE_UM_ROW_CACHE", "abc", "auto or a byte count (0, 512MiB, 4GiB)"),
        ("PLE_UM_ROW_CACHE", "-1", "auto or a byte count (0, 512MiB, 4GiB)"),
        ("PLE_UM_ROW_CACHE", "-1GiB", "auto or a byte count (0, 512MiB, 4GiB)"),
        ("PLE_UM_ROW_CACHE", "4GB,", "auto or a byte count (0, 512MiB, 4GiB)"),
        ("PLE_UM_ROW_CACHE", "inf", "auto or a byte count (0, 512MiB, 4GiB)"),
        ("PLE_UM_ROW_CACHE", "", "auto or a byte count (0, 512MiB, 4GiB)"),
        ("PLE_UM_ROW_CACHE", "1e30", "auto or a byte count (0, 512MiB, 4GiB)"),
        ("PLE_UM_PIN_BUDGET", "1e30", "a byte count of at most 8 EiB (2**63 - 1 bytes)"),
        ("PLE_UM_ROW_CACHE_FRACTION", "1.5", "a fraction from 0 to 1"),
        ("PLE_UM_ROW_CACHE_FRACTION", "nan", "a fraction from 0 to 1"),
        ("PLE_UM_ROW_CACHE_FRACTION", "half", "a fraction from 0 to 1"),
        ("PLE_UM_ROW_CACHE_POLICY", "lfu", "one of tinylfu, lru, clock"),
        ("PLE_UM_FILE_READS", "io_uring", "one of auto, uring, threads, mmap"),
        ("PLE_UM_DIRECT_READS", "yes", "one of auto, on, off"),
        ("PLE_UM_READ_DEPTH", "0", "a whole number from 1 to 256"),
        ("PLE_UM_READ_DEPTH", "257", "a whole number from 1 to 256"),
        ("PLE_UM_READ_DEPTH", "8.5", "a whole number from 1 to 256"),
        ("PLE_UM_READ_DEPTH", "deep", "a whole number from 1 to 256"),
    ],
)
def test_values_refused(monkeypatch, name, text, expected):
    monkeypatch.setenv(name, text)
    assert (
        envs.KNOBS[name].problem()
        == f"environment variable {name}={text!r}: expected {expected}, got {text!r}"
    )


def _invalid() -> list[str]:
    """Why each knob's value is not taken, as ``describe`` (``ple-um knobs``) says it."""
    return [row["invalid"] for row in envs.describe() if row["invalid"] is not None]


def test_check_and_describe(monkeypatch):
    envs.check()
    assert _invalid() == []
    monkeypatch.setenv("PLE_UM_MODE", "bogus")
    monkeypatch.setenv("PLE_UM_STATS_SEC", "soon")
    with pytest.raises(KnobError, match="PLE_UM_MODE='bogus'"):
        envs.check()
    envs.check(skip=("PLE_UM_MODE", "PLE_UM_STATS_SEC"))
    envs.check(only=("PLE_UM_CPU_THREADS",))
    with pytest.raises(KnobError, match="PLE_UM_STATS_SEC='soon'"):
        envs.check(only=("PLE_UM_STATS_SEC",))
    assert [p.split("=")[0] for p in _invalid()] == [
        "environment variable PLE_UM_MODE",
        "environment variable PLE_UM_STATS_SEC",
    ]
    rows = {r["name"]: r for r in envs.describe()}
    assert rows["PLE_UM_MODE"]["set"] == "PLE_UM_MODE=bogus"
    assert rows["PLE_UM_MODE"]["invalid"] == envs.KNOBS["PLE_UM_MODE"].problem()
    assert rows["PLE_UM_PREWARM"]["set"] is None and rows["PLE_UM_PREWARM"]["invalid"] is None


def test_the_test_hooks_are_no_knobs(monkeypatch):
    """A test hook is set by the test suite only: ``describe`` (``ple-um knobs``) and ``check`` know
    nothing of it, and no knob shares its name."""
    monkeypatch.setenv("PLE_UM_FIRST_READ_FAULT", "melt")
    assert not set(_testing.HOOKS) & set(envs.KNOBS)
    assert not set(_testing.HOOKS) & {r["name"] for r in envs.describe()}
    envs.check()
    assert _testing.HOOKS["PLE_UM_FIRST_READ_FAULT"].problem() is not None


def _of(value, hint) -> bool:
    """Whether ``value`` is of the type ``hint`` (the kinds envs.py's annotations use), exactly: a
    bool is no int, an int no float."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_of(value, a) for a in args)
    if origin is tuple:
        return type(value) is tuple and all(_of(x, args[0]) for x in value)
    return value is None if hint is type(None) else type(value) is hint


# The words the choice knobs take, and texts of the other kinds: each knob takes some of them.
WORDS = ("ats", "registered", "cpu", "device", "random", "normal", "none", "fits", "spills", "tinylfu")
WORDS += ("lru", "clock", "uring", "threads", "mmap", "auto", "on", "off")
TEXTS = (*GARBAGE, *WORDS, "1", "0.5", "64", "4GiB", "ats,registered")


@pytest.mark.parametrize("name", sorted(envs.KNOBS))
def test_every_knob_is_typed_and_its_values_are_of_its_type(monkeypatch, tmp_path, name):
    """envs.py annotates every knob (a type checker sees ``envs.PLE_UM_MODE`` as its Literal), and the
    default and every value the knob takes, of texts of every kind, are of that type."""
    hints = typing.get_type_hints(envs)
    assert name in hints, f"{name} has no annotation in ple_um/envs.py"
    knob = envs.KNOBS[name]
    for var in (name, *knob.aliases):
        monkeypatch.delenv(var, raising=False)
    values = [getattr(envs, name)]
    for text in (*TEXTS, str(tmp_path / "folder")):
        monkeypatch.setenv(name, text)
        if knob.problem() is None:
            values.append(getattr(envs, name))
    allowed = typing.get_args(hints[name])
    for text in (a for a in allowed if isinstance(a, str)):
        monkeypatch.setenv(name, text)
        values.append(getattr(envs, name))
    assert len(values) > 1, f"no text tried is taken by {name}"
    bad = [value for value in values if not _of(value, hints[name])]
    assert not bad, f"{name}: {bad} not of {hints[name]}"


def test_only_knobs_are_annotated_as_knobs():
    hints = {name for name in typing.get_type_hints(envs) if name.startswith("PLE_UM")}
    assert hints == set(envs.KNOBS)


@pytest.mark.parametrize("var", ["PLE_UM_DIR", "VLLM_PLE_MMAP_DIR"])
def test_an_empty_checkpoint_directory_is_said_to_be_empty(monkeypatch, tmp_path, var):
    """PLE_UM_DIR (or its alias) set to an empty string is taken as unset, and the error says that
    it is empty, naming the variable set, not that it is unset."""
    from ple_um.errors import CheckpointError
    from ple_um.served import table_directory

    monkeypatch.delenv("PLE_UM_DIR", raising=False)
    monkeypatch.delenv("VLLM_PLE_MMAP_DIR", raising=False)
    monkeypatch.setenv(var, "")
    with pytest.raises(CheckpointError, match=f"Tried: {var}: set but empty; no model folder") as info:
        table_directory(lambda tried: tried.append("no model folder"))
    assert "unset" not in str(info.value)
    assert table_directory(lambda tried: str(tmp_path)) == str(tmp_path.resolve())
    monkeypatch.delenv(var)
    with pytest.raises(CheckpointError, match=r"Tried: PLE_UM_DIR \(alias VLLM_PLE_MMAP_DIR\): unset;"):
        table_directory(lambda tried: tried.append("no model folder"))

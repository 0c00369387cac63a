"""The verbs about this machine and its settings: `ple-um probe` (the device's capabilities and the
mode an open would choose) and `ple-um knobs` (every environment knob, with any invalid value
marked and why)."""

from __future__ import annotations

import argparse

from ple_um.cli import arguments as a
from ple_um.cli.output import EXIT_INVALID, EXIT_OK, EXIT_USAGE, CliError, emit, emit_json
from ple_um.units import format_bytes

PROBE = """\
Read the device's capabilities and say which access mode an open would choose here, and why not
each other mode. With DIR, also make the chosen mode's first read of that table as an open makes
it (from the cached verdict, or in a child process), and say which path would serve its
decode-sized lookups now (the kernel or the host path: whether its rows fit in memory)."""

KNOBS = """\
List every environment knob ple-um reads: its default, its aliases (the seeds' VLLM_PLE_MMAP_*
names) and its current setting. A value the knob does not take is marked INVALID with the reason,
and the command exits 2."""


def add_parsers(sub) -> None:
    help = "the device's capabilities and the mode auto would choose"
    pr = a.add_verb(sub, "probe", probe, help, PROBE, knobs=None)
    a.add_dir(
        pr,
        "checkpoint dir: make the chosen mode's first read of its table as an open does (from the "
        "cached verdict, or in a child process)",
        optional=True,
    )
    pr.add_argument("--recheck", action="store_true", help="with DIR: run the first-read child again")
    a.add_device(pr)
    help = "every environment knob: default, alias, current setting"
    a.add_verb(sub, "knobs", knobs, help, KNOBS, knobs=())


def probe(args: argparse.Namespace) -> int:
    import ple_um
    from ple_um.errors import ModeUnavailableError

    if args.recheck and args.dir is None:
        raise CliError("--recheck needs DIR: the check reads the table's own files", EXIT_USAGE)
    if args.dir is not None:
        a.one_layer(args.dir, args.layer)
        a.resolved(args.device)  # the first read runs on it
    elif args.layer is not None:
        raise CliError("--layer needs DIR: it picks a layer of that checkpoint", EXIT_USAGE)
    try:
        report = ple_um.probe(args.device, path=args.dir, layer=args.layer, recheck=args.recheck)
    except ModeUnavailableError as exc:
        if not exc.reason.startswith("FirstReadRejected"):
            raise  # a mode forced where the machine cannot run it: bad input, exit 2 (main)
        raise CliError(str(exc), EXIT_INVALID) from None  # the forced mode's first read failed here
    serving = None
    if args.dir is not None:  # what an open would serve decode-sized lookups with, and why
        from ple_um.checkpoint import read_layout
        from ple_um.lookup import fit

        layout = read_layout(args.dir, args.layer)
        serving = fit.at_open(layout, report.mode, cuda=bool(report.capabilities.get("cuda")))
    if args.json:
        said = {"serving": {**serving.as_dict(0), "counted": fit.AT_OPEN_COUNTS}} if serving else {}
        emit_json({**report.as_dict(), **said})
        return EXIT_OK
    emit(report.describe())
    if serving is not None:
        touch = ", a page touch before each kernel" if serving.touch else ""
        emit(f"decode lookups: {serving.path}{touch} ({serving.why})", f"  counted: {fit.AT_OPEN_COUNTS}")
    emit("capabilities:", *(f"  {key}: {value}" for key, value in report.capabilities.items()))
    if report.pin_budget is not None:
        emit(f"pin budget: {format_bytes(report.pin_budget)}")
    return EXIT_OK


def knobs(args: argparse.Namespace) -> int:
    from ple_um import envs

    rows = envs.describe()
    bad = [r["name"] for r in rows if r["invalid"]]
    summary = f"{len(bad)} knob{'s are' if len(bad) > 1 else ' is'} set to a value it does not take: "
    summary += ", ".join(bad)
    if args.json and bad:  # the error's object carries the knobs
        raise CliError(summary, EXIT_USAGE, knobs=rows)
    if args.json:
        emit_json({"knobs": rows})
        return EXIT_OK
    for r in rows:
        aliases = f" (alias {', '.join(r['aliases'])})" if r["aliases"] else ""
        now = f"; set: {r['set']}" if r["set"] else ""
        mark = f"\n    INVALID: {r['invalid']}" if r["invalid"] else ""
        emit(f"{r['name']}{aliases} = {r['default']!r}{now}{mark}\n    {r['doc']}")
    if bad:
        raise CliError(f"{summary} (marked INVALID above)", EXIT_USAGE)
    return EXIT_OK

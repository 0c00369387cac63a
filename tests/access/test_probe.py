"""ple_um.access.probe: which access mode a machine allows, and why every other mode was not chosen.

Machines are injected as DeviceCapabilities (what read_capabilities would report on them); the
decision logic is the real one.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers.machines import ATS, DISCRETE, HMM

import ple_um
from ple_um.access import memory
from ple_um.access.capabilities import (
    DeviceCapabilities,
    read_capabilities,
    resolve_device,
    triton_interpreter,
)
from ple_um.access.probe import (
    ALL_MODES,
    ATS_DIRECT_READ,
    HMM_DIRECT_READ,
    INTERPRETER_DIRECT_READ,
    comes_first,
    decide,
    direct_read,
    pin_budget,
    reason_if_unsatisfied,
    requested_mode,
)
from ple_um.cli import arguments
from ple_um.errors import ModeUnavailableError
from ple_um.opening import probe

GiB = 1 << 30

NO_REGISTER = DeviceCapabilities(cuda=True, device="cuda:0", name="no register")
NO_READ_ONLY = DeviceCapabilities(
    cuda=True, device="cuda:0", name="no read-only register", host_register_supported=True
)
NO_CUDA = DeviceCapabilities(cuda=False, device="cpu", name="cpu")
INTERPRETER = DeviceCapabilities(cuda=False, device="cpu", name="cpu", host_is_device=True)

MACHINES = {
    "ats": ATS,
    "hmm": HMM,
    "discrete": DISCRETE,
    "no-register": NO_REGISTER,
    "no-read-only": NO_READ_ONLY,
    "no-cuda": NO_CUDA,
    "interpreter": INTERPRETER,
}


def assert_reasons_complete(report) -> None:
    """Every mode but the chosen one carries a non-empty reason; the chosen one none."""
    assert set(report.reasons) == set(ALL_MODES) - {report.mode}
    assert all(isinstance(why, str) and why.strip() for why in report.reasons.values())


def test_ats_system_chooses_ats():
    report = decide(ATS, table_bytes=60 * GiB, budget=100 * GiB)
    assert report.mode == "ats"
    assert_reasons_complete(report)
    assert report.reasons["registered"] == "ats comes first"
    assert report.reasons["cpu"] == "ats comes first"
    assert "explicit only" in report.reasons["device"]
    assert report.capabilities == ATS.as_dict()
    assert report.pin_budget == 100 * GiB


def test_discrete_gpu_chooses_registered_and_says_why_not_ats():
    report = decide(DISCRETE, table_bytes=50 * GiB, budget=100 * GiB)
    assert report.mode == "registered"
    assert_reasons_complete(report)
    assert "PageableMemoryAccessUsesHostPageTables" in report.reasons["ats"]
    assert "PageableMemoryAccess (HMM)" in report.reasons["ats"]
    assert report.reasons["cpu"] == "registered comes first"
    assert report.direct_read is None and "direct read: none" in report.describe()


def test_the_direct_read_is_named_hardware_coherent_hmm_or_none():
    assert direct_read(ATS) == ATS_DIRECT_READ == "hardware coherent (ATS)"
    assert direct_read(HMM) == HMM_DIRECT_READ == "HMM"
    assert direct_read(DISCRETE) is None and direct_read(NO_CUDA) is None
    assert direct_read(INTERPRETER) == INTERPRETER_DIRECT_READ
    # A device with host page tables is hardware coherent, whatever else it reports.
    assert direct_read(dataclasses.replace(ATS, pageable_memory_access=False)) == ATS_DIRECT_READ
    for caps, named in ((ATS, "hardware coherent (ATS)"), (HMM, "HMM")):
        report = decide(caps, mode="ats", table_bytes=GiB, budget=100 * GiB)
        assert report.mode == "ats" and report.direct_read == named
        assert f"direct read: {named}" in report.describe()
        assert report.as_dict()["direct_read"] == named


def test_hmm_prefers_registered_while_the_table_fits_the_pin_budget():
    # HMM: a direct read faults each page in through the driver on first touch; registration maps
    # every page at open. So registered first, the direct read (mode ats) for what does not fit.
    report = decide(HMM, table_bytes=50 * GiB, budget=100 * GiB)
    assert report.mode == "registered"
    assert_reasons_complete(report)
    assert report.reasons["ats"].startswith("registered comes first on HMM")
    assert "pin budget" in report.reasons["ats"]
    assert report.reasons["cpu"] == "registered comes first"
    # Over the budget: the direct read instead of the cpu mode.
    report = decide(HMM, table_bytes=60 * GiB, budget=30 * GiB)
    assert report.mode == "ats" and report.direct_read == "HMM"
    assert "PLE_UM_PIN_BUDGET" in report.reasons["registered"]
    assert report.reasons["cpu"] == "ats comes first"
    # Registration failing (its self-test, or cudaHostRegister) also leads to the direct read.
    report = decide(HMM, exclude={"registered": "RegistrationError: x"}, table_bytes=GiB, budget=100 * GiB)
    assert report.mode == "ats"
    # ...and the direct read failing too (its first read in a child, its self-test) to cpu.
    report = decide(HMM, exclude={"registered": "RegistrationError: x", "ats": "FirstReadRejected: y"})
    assert report.mode == "cpu" and report.reasons["ats"] == "FirstReadRejected: y"
    # On a hardware-coherent system the direct read stays first.
    assert decide(ATS, table_bytes=50 * GiB, budget=100 * GiB).mode == "ats"


def test_no_cuda_chooses_cpu():
    report = decide(NO_CUDA, table_bytes=GiB, budget=GiB)
    assert report.mode == "cpu"
    assert_reasons_complete(report)
    assert report.reasons == {m: "no CUDA device" for m in ("ats", "registered", "device")}


def test_interpreter_host_counts_as_a_device():
    report = decide(INTERPRETER)
    assert report.mode == "ats"
    assert_reasons_complete(report)
    assert report.reasons["registered"] == "no CUDA device"  # registration needs real CUDA
    assert decide(INTERPRETER, mode="device").mode == "device"


@pytest.mark.parametrize(
    ("caps", "needle"),
    [(NO_REGISTER, "HostRegisterSupported = 0"), (NO_READ_ONLY, "ReadOnlyHostRegisterSupported = 0")],
    ids=["register-unsupported", "read-only-unsupported"],
)
def test_registration_unsupported_falls_back_to_cpu(caps, needle):
    report = decide(caps, table_bytes=GiB, budget=100 * GiB)
    assert report.mode == "cpu"
    assert_reasons_complete(report)
    assert needle in report.reasons["registered"]
    assert "PageableMemoryAccessUsesHostPageTables" in report.reasons["ats"]
    with pytest.raises(ModeUnavailableError, match=needle):
        decide(caps, mode="registered", table_bytes=GiB, budget=100 * GiB)


def test_table_over_the_pin_budget_falls_back_to_cpu():
    report = decide(DISCRETE, table_bytes=60 * GiB, budget=30 * GiB)
    assert report.mode == "cpu"
    assert_reasons_complete(report)
    why = report.reasons["registered"]
    assert "PLE_UM_PIN_BUDGET" in why and "60.00 GiB" in why and "30.00 GiB" in why
    # At the budget exactly it fits; without a size or a budget nothing is checked.
    assert decide(DISCRETE, table_bytes=30 * GiB, budget=30 * GiB).mode == "registered"
    assert decide(DISCRETE, table_bytes=None, budget=1).mode == "registered"
    assert decide(DISCRETE, table_bytes=60 * GiB, budget=None).mode == "registered"
    # The budget does not concern the ats mode, which pins nothing.
    assert decide(ATS, table_bytes=60 * GiB, budget=1).mode == "ats"


@pytest.mark.parametrize(
    ("caps", "mode", "needle"),
    [
        (NO_CUDA, "ats", "no CUDA device"),
        (NO_CUDA, "registered", "no CUDA device"),
        (NO_CUDA, "device", "no CUDA device"),
        (DISCRETE, "ats", "PageableMemoryAccessUsesHostPageTables"),
        (NO_READ_ONLY, "registered", "ReadOnlyHostRegisterSupported"),
        (INTERPRETER, "registered", "no CUDA device"),
    ],
)
def test_forced_mode_that_cannot_work_raises(caps, mode, needle):
    with pytest.raises(ModeUnavailableError, match=needle) as info:
        decide(caps, mode=mode, table_bytes=GiB, budget=100 * GiB)
    assert info.value.mode == mode and needle in info.value.reason
    assert isinstance(info.value, ple_um.PleUmError)


def test_forced_registered_over_budget_raises():
    with pytest.raises(ModeUnavailableError, match="PLE_UM_PIN_BUDGET"):
        decide(DISCRETE, mode="registered", table_bytes=2 * GiB, budget=GiB)


@pytest.mark.parametrize("name", list(MACHINES))
@pytest.mark.parametrize("mode", ["auto", *ALL_MODES])
def test_every_decision_explains_every_other_mode(name, mode):
    caps = MACHINES[name]
    try:
        report = decide(caps, mode=mode, table_bytes=GiB, budget=100 * GiB)
    except ModeUnavailableError as exc:
        assert exc.mode == mode and exc.reason
        return
    assert_reasons_complete(report)
    for m, why in report.reasons.items():
        gate = reason_if_unsatisfied(m, caps, GiB, 100 * GiB)
        if mode != "auto":
            assert report.mode == mode
            assert why == (gate or f"{mode} was asked for")
        elif gate is None and m == "device":
            assert why == "explicit only: it copies the whole table into GPU memory"
        else:
            assert why == (gate or comes_first(report.mode, m, caps))
    assert f"mode: {report.mode}" in report.describe()
    for m, why in report.reasons.items():
        assert f"not {m}: {why}" in report.describe()
    assert report.as_dict()["mode"] == report.mode and report.as_dict()["reasons"] == report.reasons


def test_cpu_can_always_be_forced():
    for caps in MACHINES.values():
        report = decide(caps, mode="cpu", table_bytes=GiB, budget=1)
        assert report.mode == "cpu"
        assert_reasons_complete(report)


def test_excluded_mode_falls_through_to_the_next():
    failed = "self-test: 3 of 64 sample rows differ from the file (first: row 7)"
    report = decide(ATS, exclude={"ats": failed}, table_bytes=GiB, budget=100 * GiB)
    assert report.mode == "registered"
    assert report.reasons["ats"] == failed
    assert_reasons_complete(report)
    report = decide(ATS, exclude={"ats": failed, "registered": "RegistrationError: x"})
    assert report.mode == "cpu"
    assert report.reasons["registered"] == "RegistrationError: x"
    # An excluded mode that was forced is unavailable, with the exclusion as its reason.
    with pytest.raises(ModeUnavailableError, match="self-test"):
        decide(ATS, mode="ats", exclude={"ats": failed})


def test_unknown_mode_is_a_value_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown access mode 'gpu'"):
        requested_mode("gpu")
    with pytest.raises(ValueError, match="unknown access mode"):
        probe("cpu", mode="fast")
    monkeypatch.setenv("PLE_UM_MODE", "fast")
    with pytest.raises(ValueError, match="PLE_UM_MODE"):
        requested_mode("auto")


def test_decide_rejects_an_unknown_mode():
    # It once returned a ProbeReport whose mode was the unknown name.
    with pytest.raises(ValueError, match="unknown access mode 'bogus'"):
        decide(ATS, mode="bogus")


def test_mode_knob_forces_a_mode(monkeypatch):
    monkeypatch.setenv("PLE_UM_MODE", "cpu")
    assert requested_mode("auto") == "cpu"
    assert requested_mode("ats") == "ats"  # an explicit argument wins over the knob
    assert probe("cpu").mode == "cpu"
    monkeypatch.setenv("PLE_UM_MODE", "registered")
    with pytest.raises(ModeUnavailableError, match="no CUDA device"):
        probe("cpu")


def test_a_mode_is_named_in_any_case_everywhere(make_checkpoint, monkeypatch):
    """``mode=`` (open_table, probe), ``PLE_UM_MODE`` and the bench's ``--modes`` take a mode's name in
    any case, and give it lower case; an unknown name is refused as it was written."""
    assert requested_mode("CPU") == "cpu" and requested_mode("Ats") == "ats"
    assert probe("cpu", mode="Cpu").mode == "cpu"
    layout = make_checkpoint()
    with ple_um.open_table(layout.directory, mode="CPU", device="cpu") as table:
        assert table.mode == "cpu" and table.report.mode == "cpu"
    monkeypatch.setenv("PLE_UM_MODE", "CPU")
    assert requested_mode("AUTO") == "cpu"
    with ple_um.open_table(layout.directory, device="cpu") as table:
        assert table.mode == "cpu"
    assert arguments.modes("CPU,Ats") == ("cpu", "ats")
    with pytest.raises(ValueError, match="unknown access mode 'GPU'"):
        requested_mode("GPU")


@pytest.mark.skipif(not triton_interpreter(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_probe_of_this_host(monkeypatch):
    caps = read_capabilities("cpu")
    assert (caps.cuda, caps.device, caps.host_is_device) == (False, "cpu", True)
    report = probe("cpu")
    assert report.mode == "ats" and report.capabilities["host_is_device"] is True
    assert_reasons_complete(report)
    monkeypatch.delenv("TRITON_INTERPRET")  # a plain CPU-only host
    report = probe("cpu")
    assert report.mode == "cpu" and report.capabilities["host_is_device"] is False
    assert_reasons_complete(report)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_a_device_this_machine_lacks_is_reported_not_raised():
    """read_capabilities never raises: a device it cannot use comes back as no CUDA device, with
    why in .errors; resolve_device (which open_table uses) raises ValueError saying the same."""
    for device, why in (
        ("cuda", "device 'cuda': no CUDA device here (torch.cuda.is_available() is False)"),
        ("cuda:3", "device 'cuda:3': no CUDA device here"),
        (0, "device 'cuda:0': no CUDA device here"),
        ("bogus", "'bogus' is not a device: expected cpu, cuda or cuda:N"),
        ("cuda:x", "'cuda:x' is not a device"),
    ):
        caps = read_capabilities(device)
        assert (caps.cuda, caps.device) == (False, str(device))
        assert len(caps.errors) == 1 and caps.errors[0].startswith(why)
        with pytest.raises(ValueError, match=re.escape(why)):
            resolve_device(device)
        report = decide(caps)
        assert report.mode == "cpu" and report.reasons["registered"] == "no CUDA device"


def test_pin_budget_knobs(monkeypatch):
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "3GiB")
    assert pin_budget() == 3 * GiB
    monkeypatch.setenv("PLE_UM_PIN_BUDGET", "512m")
    assert pin_budget() == 512 << 20
    monkeypatch.delenv("PLE_UM_PIN_BUDGET")
    monkeypatch.setenv("PLE_UM_PIN_FRACTION", "0")
    assert pin_budget() == 0
    monkeypatch.setenv("PLE_UM_PIN_FRACTION", "0.25")
    assert pin_budget() > 0  # the real MemAvailable
    # The one reading of MemAvailable, access.memory's, is what the budget takes a fraction of.
    monkeypatch.setattr(memory, "mem_available", lambda: 8 * GiB)
    assert pin_budget() == 2 * GiB and memory.available() <= 8 * GiB
    assert probe("cpu", table_bytes=GiB).pin_budget == pin_budget()

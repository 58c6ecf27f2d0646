"""The embedded Ray of `ladder submit` stays on this machine (README.md, "Network").

A small ladder runs through `python -m ladder.cli submit` (a fresh interpreter, so Ray starts as it does for
a user) while the test watches every process that submit starts: from the process table (psutil), every
listening or bound socket must be on loopback and every connection must go to loopback; under strace
(when it can run here) every bind, connect and addressed send of every thread must be to loopback too.
That includes the probe README.md names: Ray's dashboard process asks the cloud metadata service which
cloud it runs on (Ray 2.60 has no setting that stops it; ladder sends it to a closed loopback proxy), so
any sign of it leaving the machine fails the test.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]

# What Ray 2.60's dashboard process sends off the machine at start-up, whatever the settings
# (dashboard/modules/usage_stats: get_cluster_config_to_report -> get_cloud_from_metadata_requests):
# HTTP GETs to the link-local metadata address and a DNS lookup of metadata.google.internal.
DASHBOARD = "ray/dashboard/dashboard.py"
METADATA_ADDRESS = ("169.254.169.254", 80)

FUNCTION_LADDER = '''
import os, time
from ladder import FunctionStep, ResourceSpec

RELEASE = {release!r}


def hold(ctx, name):
    """Stays running (so its worker can be audited) until the test has looked, at most two minutes."""
    open(os.path.join(os.path.dirname(RELEASE), "started-" + name), "w").close()
    deadline = time.time() + 120
    while not os.path.exists(RELEASE) and time.time() < deadline:
        time.sleep(0.2)
    return {{"value": 1}}


def add(ctx):
    return {{"value": sum(dep.result["value"] for dep in ctx.deps.values())}}


HALF = ResourceSpec(cpus=0.5)  # both held at once even on a one-core machine
left = FunctionStep(name="left", fn=hold, config={{"name": "left"}}, resources=HALF)
right = FunctionStep(name="right", fn=hold, config={{"name": "right"}}, resources=HALF)
both = FunctionStep(name="both", fn=add, deps=("left", "right"))
'''


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def nameservers() -> set[str]:
    try:
        lines = Path("/etc/resolv.conf").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[1] for line in lines if line.startswith("nameserver") and len(line.split()) > 1}


def is_residue(label: str, ip: str, port: int) -> bool:
    """The dashboard's cloud probe (README.md, "Network"): the metadata address, or DNS for its name."""
    return DASHBOARD in label and ((ip, port) == METADATA_ADDRESS or (port == 53 and ip in nameservers()))


# ------------------------------------------------------------------------------------ process table


@dataclass
class TableAudit:
    """What psutil saw, over all polls, in the processes under the submitter."""

    labels: dict[int, str] = field(default_factory=dict)  # pid -> its command line, as last seen
    seen: set[str] = field(default_factory=set)  # every command line seen (a Ray worker renames itself)
    listening: set[tuple[str, str, int]] = field(default_factory=set)  # (process, ip, port)
    bad_listening: set[tuple[str, str, int, str]] = field(default_factory=set)
    bad_remote: set[tuple[str, str, int]] = field(default_factory=set)
    residue: set[tuple[str, str, int]] = field(default_factory=set)

    def poll(self, root: psutil.Process) -> None:
        try:
            processes = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        for process in processes:
            try:
                label = self.labels[process.pid] = " ".join(process.cmdline())[:300] or process.name()
                self.seen.add(label)
                connections = process.net_connections(kind="inet")
            except psutil.Error:
                continue
            for conn in connections:
                if conn.status == psutil.CONN_LISTEN or (conn.type.name == "SOCK_DGRAM" and conn.laddr and not conn.raddr):
                    self.listening.add((label, conn.laddr.ip, conn.laddr.port))
                    if not is_loopback(conn.laddr.ip):
                        self.bad_listening.add((label, conn.laddr.ip, conn.laddr.port, conn.status))
                if conn.raddr and not is_loopback(conn.raddr.ip):
                    target = (label, conn.raddr.ip, conn.raddr.port)
                    (self.residue if is_residue(*target) else self.bad_remote).add(target)


# ------------------------------------------------------------------------------------ strace


STRACE_CALLS = "bind,connect,sendto,sendmsg,sendmmsg,execve,clone,clone3,fork,vfork"
_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>(.*)|(\w+)\((.*))$")
_INET = re.compile(r'sa_family=AF_INET, sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)')
_INET6 = re.compile(r'sa_family=AF_INET6, sin6_port=htons\((\d+)\),.*?inet_pton\(AF_INET6, "([^"]+)"')
_RESULT = re.compile(r"\)\s+=\s+(-?\d+)")


def strace_usable() -> str | None:
    """None when strace can trace a child here, else why not."""
    if shutil.which("strace") is None:
        return "strace is not installed (Debian: apt-get install strace)"
    probe = subprocess.run(["strace", "-f", "-qq", "-e", "trace=none", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"strace cannot trace here: {probe.stderr.strip()[:200]}"


def strace_calls(path: Path) -> list[tuple[int, str, str]]:
    """(tid, syscall, whole text) per call, an <unfinished ...> call joined with its resumption."""
    calls, pending = [], {}
    for line in path.read_text(errors="replace").splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        tid = int(match.group(1))
        if match.group(2):  # "<... name resumed> rest"
            name, head = pending.pop(tid, (match.group(2), ""))
            calls.append((tid, name, head + match.group(3)))
        elif match.group(5).endswith("<unfinished ...>"):
            pending[tid] = (match.group(4), match.group(5).removesuffix("<unfinished ...>"))
        else:
            calls.append((tid, match.group(4), match.group(5)))
    calls.extend((tid, name, head) for tid, (name, head) in pending.items())
    return calls


def strace_findings(path: Path) -> tuple[list[tuple[str, str, str, int]], list[tuple[str, str, int]], set[str]]:
    """(violations as (process, syscall, ip, port), residue, every traced process's label) from an `strace -f` log."""
    calls = strace_calls(path)
    spawned: dict[int, tuple[int, bool]] = {}  # child tid -> (the tid that cloned it, is it a thread)
    execs: list[tuple[int, str]] = []
    for tid, name, text in calls:  # first pass: who cloned whom, what ran
        results = _RESULT.findall(text)
        if name in ("clone", "clone3", "fork", "vfork") and results and int(results[-1]) > 0:
            spawned[int(results[-1])] = (tid, "CLONE_THREAD" in text)
        elif name == "execve" and results and results[-1] == "0":
            execs.append((tid, text[:400]))

    def tgid(tid: int) -> int:
        seen = set()
        while tid in spawned and spawned[tid][1] and tid not in seen:
            seen.add(tid)
            tid = spawned[tid][0]
        return tid

    argv = {tgid(tid): text for tid, text in execs}

    def label(process: int) -> str:
        seen = set()
        while process not in argv and process in spawned and process not in seen:
            seen.add(process)
            process = tgid(spawned[process][0])
        return argv.get(process, f"pid {process}")

    violations, residue = [], []
    for tid, name, text in calls:
        if name not in ("bind", "connect", "sendto", "sendmsg", "sendmmsg"):
            continue
        for pattern in (_INET, _INET6):
            for port, ip in pattern.findall(text):
                who = label(tgid(tid))
                if is_loopback(ip):
                    continue
                if name != "bind" and is_residue(who, ip, int(port)):
                    residue.append((who, ip, int(port)))
                else:
                    violations.append((who, name, ip, int(port)))
    return violations, residue, {label(tgid(t)) for t, _, _ in calls}


# ------------------------------------------------------------------------------------ the audit


@dataclass
class Audit:
    returncode: int
    output: str
    table: TableAudit
    strace: tuple[list, list, set] | None
    strace_skip: str | None


def audited_submit(experiment: Path, root: Path, work: Path, *, release: Path | None = None, timeout: float = 600) -> Audit:
    """`ladder submit` under the audit; with `release`, the file is created once the held steps have been seen."""
    skip = strace_usable()
    trace = work / "strace.log"
    argv = [sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--root", str(root)]
    if skip is None:
        argv = ["strace", "-f", "-qq", "-s", "200", "-e", "signal=none", "-e", f"trace={STRACE_CALLS}", "-o", str(trace), *argv]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(work / "submit.log", "w+")
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    table, root_process = TableAudit(), psutil.Process(process.pid)
    deadline, polls_after_start = time.time() + timeout, 0
    try:
        while process.poll() is None and time.time() < deadline:
            table.poll(root_process)
            if release is not None and not release.exists():
                started = len(list(release.parent.glob("started-*")))
                polls_after_start += started == 2
                if polls_after_start >= 6:  # both held workers up, and the agents had a few seconds to bind
                    release.touch()
            time.sleep(0.5)
        process.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log.seek(0)
    output = log.read()
    log.close()
    findings = strace_findings(trace) if skip is None else None
    return Audit(process.returncode, output, table, findings, skip)


def check_ran(audit: Audit, must_see: tuple[str, ...]) -> None:
    assert audit.returncode == 0, audit.output[-4000:]
    labels = " | ".join(sorted(audit.table.seen))
    for name in must_see:  # the audit saw the processes that matter, so it cannot pass by seeing nothing
        assert name in labels, f"no process matching {name!r} was audited: {labels[:3000]}"
    assert audit.table.listening, "no listening socket was seen at all"


def check_table(audit: Audit) -> None:
    assert not audit.table.bad_listening, f"sockets listening beyond loopback: {sorted(audit.table.bad_listening)}"
    assert not audit.table.bad_remote, f"connections beyond loopback: {sorted(audit.table.bad_remote)}"
    assert not audit.table.residue, f"the dashboard's cloud probe left the machine: {sorted(audit.table.residue)}"


def check_strace(audit: Audit) -> None:
    if audit.strace is None:
        pytest.skip(f"the strace audit needs strace: {audit.strace_skip}")
    violations, residue, traced = audit.strace
    assert any("gcs_server" in t for t in traced) and any("raylet" in t for t in traced), "strace did not follow Ray's processes"
    assert not violations, "binds/connects/sends beyond loopback (process, call, ip:port):\n" + "\n".join(
        f"  {who[:160]} {call} {ip}:{port}" for who, call, ip, port in sorted(set(violations)))
    assert not residue, "the dashboard's cloud probe left the machine (process, ip, port):\n" + "\n".join(
        f"  {who[:160]} {ip}:{port}" for who, ip, port in sorted(set(residue)))


# ------------------------------------------------------------------------------------ a ladder of function steps


@pytest.fixture(scope="module")
def ladder_audit(tmp_path_factory) -> Audit:
    work = tmp_path_factory.mktemp("loopback")
    release = work / "hold" / "release"
    release.parent.mkdir()
    experiment = work / "loopback_exp.py"
    experiment.write_text(FUNCTION_LADDER.format(release=str(release)))
    audit = audited_submit(experiment, work / "root", work, release=release, timeout=300)
    assert release.exists(), f"the held steps never both started: {audit.output[-3000:]}"
    result = json.loads(next((work / "root" / "runs").glob("both-*/result.json")).read_text())
    assert result == {"value": 2}
    check_ran(audit, must_see=("gcs_server", "raylet", DASHBOARD, "ray::ladder:left", "ray::ladder:right"))
    return audit


def test_every_process_of_an_embedded_ladder_listens_and_connects_only_on_loopback(ladder_audit):
    check_table(ladder_audit)


def test_no_thread_of_an_embedded_ladder_binds_connects_or_sends_beyond_loopback(ladder_audit):
    check_strace(ladder_audit)


# ------------------------------------------------------------------------------------ a gang


@pytest.fixture(scope="module")
def gang_audit(tmp_path_factory) -> Audit:
    """A 2-process gang: Ray gives rank 0 the node IP 127.0.0.1, so jax.distributed's coordinator (and the
    port probe before it) are on loopback, and so are gloo's collectives (they bind the address of this
    machine's hostname)."""
    from tests.test_ladder_gang import EXPERIMENT

    work = tmp_path_factory.mktemp("loopback-gang")
    experiment = work / "gang_exp.py"
    text = EXPERIMENT.format(num_steps=3, mesh={"data": 4, "expert": 2}, experts=4, hang_timeout=None)
    experiment.write_text(text.replace('one = TrainStep(name="one-process", spec=spec(1))\n', ""))
    audit = audited_submit(experiment, work / "root", work, timeout=900)
    check_ran(audit, must_see=("gcs_server", "raylet", "ladder.gang_worker"))
    run_dir = next((work / "root" / "runs").glob("two-process-*"))
    attempts = [json.loads(line) for line in (run_dir / "gang" / "attempts.jsonl").read_text().splitlines()]
    assert attempts[-1]["outcome"] == "done", attempts
    for attempt in attempts:  # a restart (a slow machine under strace) must land on loopback too
        assert attempt["nodes"] == ["127.0.0.1", "127.0.0.1"] and attempt["coordinator"].startswith("127.0.0.1:"), attempt
    return audit


@pytest.mark.slow
def test_a_gang_under_the_embedded_ray_listens_and_connects_only_on_loopback(gang_audit):
    check_table(gang_audit)


@pytest.mark.slow
def test_no_thread_of_a_gang_binds_connects_or_sends_beyond_loopback(gang_audit):
    check_strace(gang_audit)

"""Deaths with causes: the kernel's OOM killer told apart from a plain SIGKILL, a diverged loss and an
untrained LoRA stopped with the step named.

The OOM test makes a real process really run out of memory under a memory cgroup limit this test sets
(cgroup v2 where the machine has its memory controller there, else cgroup v1), watched by the
supervisor's own ``watch_ranks``; the plain SIGKILL test is the same process in the same kind of cgroup,
killed by a person. The file-format tests feed the readers the kernel's real formats. The training
tests run the real process tree (supervisor + DeepSpeed CPU ranks) on inputs that really diverge or
really leave the LoRA at zero.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from pipetrainer.tests.helpers import make_spec
from pipetrainer.training.process.deaths import (
    HOST_MEMORY,
    DeathWatch,
    killed_in_log,
    memory_cgroup_file,
    oom_kills,
    parse_kmsg_record,
)
from pipetrainer.training.process.events import EventWriter, read_all
from pipetrainer.training.process.rank import EXIT_FAILED
from pipetrainer.training.process.supervisor import watch_ranks
from pipetrainer.training.spec.options import OptimizerSpec

# ---- the kernel's formats ----------------------------------------------------------------------
V2_EVENTS = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n"
V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
GLOBAL_OOM = ("Out of memory: Killed process 4242 (python3) total-vm:2097152kB, anon-rss:1048576kB, "
              "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:2100kB oom_score_adj:0")
CGROUP_OOM = ("Memory cgroup out of memory: Killed process 4242 (python3) total-vm:262144kB, "
              "anon-rss:131072kB, file-rss:4096kB, shmem-rss:0kB, UID:0 pgtables:400kB oom_score_adj:0")


def test_the_oom_kill_counter_is_read_from_both_cgroup_versions():
    assert oom_kills(V2_EVENTS) == 2
    assert oom_kills(V1_OOM_CONTROL) == 3
    assert oom_kills("oom_kill_disable 0\nunder_oom 0\n") is None  # kernels before 4.13 have no counter


def test_the_kernel_log_names_the_victim_by_pid():
    assert killed_in_log(4242, ["some other line", GLOBAL_OOM]) == GLOBAL_OOM
    assert killed_in_log(4242, [CGROUP_OOM]) == CGROUP_OOM
    assert killed_in_log(424, [GLOBAL_OOM, CGROUP_OOM]) is None  # another pid
    assert killed_in_log(4242, ["Killed process 4242 (python3) by a watchdog"]) is None  # not the OOM killer
    assert parse_kmsg_record("3,1207,5418223,-;" + CGROUP_OOM + "\n") == (1207, CGROUP_OOM)
    assert parse_kmsg_record(" SUBSYSTEM=memory\n") is None  # a continuation line


def test_the_memory_cgroup_file_of_a_v2_process(tmp_path):
    cgroup = tmp_path / "user.slice" / "comfy.scope"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.events").write_text(V2_EVENTS)
    mountinfo = f"30 25 0:26 / {tmp_path} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    assert memory_cgroup_file("0::/user.slice/comfy.scope\n", mountinfo) == cgroup / "memory.events"
    assert memory_cgroup_file("0::/elsewhere\n", mountinfo) is None


def test_the_memory_cgroup_file_of_a_v1_process(tmp_path):
    cgroup = tmp_path / "docker" / "abc"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.oom_control").write_text(V1_OOM_CONTROL)
    mountinfo = (f"35 31 0:32 / {tmp_path} rw,relatime - cgroup cgroup rw,memory\n"
                 f"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    proc_cgroup = "9:name=systemd:/\n4:memory:/docker/abc\n0::/\n"
    assert memory_cgroup_file(proc_cgroup, mountinfo) == cgroup / "memory.oom_control"


def test_this_machine_s_own_files_are_found_and_read():
    """The real /proc/self/cgroup and mountinfo lead to a counter file the readers parse (when the
    machine has a memory cgroup at all)."""
    path = memory_cgroup_file(Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text())
    if path is None:
        pytest.skip("no memory cgroup for this process on this machine")
    assert oom_kills(path.read_text()) is not None, path


def test_only_a_sigkill_can_be_an_oom_kill():
    watch = DeathWatch.start([os.getpid()])
    assert watch.cause(os.getpid(), -signal.SIGTERM) is None
    assert watch.cause(os.getpid(), 1) is None
    assert watch.cause(os.getpid(), -signal.SIGKILL) is None  # nothing happened to this process


# ---- a real OOM kill under a limit, and a real plain SIGKILL -----------------------------------
class MemoryCgroup:
    """A child memory cgroup of this process's own, with a limit (v2 if its memory controller is there)."""

    def __init__(self, limit_bytes: int):
        proc_cgroup = Path("/proc/self/cgroup").read_text()
        counter = memory_cgroup_file(proc_cgroup, Path("/proc/self/mountinfo").read_text())
        if counter is None:
            raise PermissionError("no memory cgroup for this process")
        self.version = 2 if counter.name == "memory.events" else 1
        self.path = counter.parent / f"pipetrainer-test-{uuid.uuid4().hex[:8]}"
        if self.version == 2:  # children get a memory.max only where the parent delegates the controller
            try:
                (counter.parent / "cgroup.subtree_control").write_text("+memory")
            except OSError:
                pass  # already enabled, or not allowed here: the writes below tell
        self.path.mkdir()  # PermissionError / OSError where the machine does not allow it
        try:
            if self.version == 2:
                (self.path / "memory.max").write_text(str(limit_bytes))
                swap = self.path / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    memsw.write_text(str(limit_bytes))
        except OSError:
            self.remove()
            raise

    def join(self) -> None:
        """Move the calling process here (used as a Popen preexec_fn, so the child starts inside)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def remove(self) -> None:
        deadline = time.monotonic() + 10
        while self.path.exists() and time.monotonic() < deadline:
            try:
                self.path.rmdir()
            except OSError:
                time.sleep(0.1)


@pytest.fixture
def limited_cgroup():
    try:
        cgroup = MemoryCgroup(limit_bytes=96 * 2**20)
    except OSError as exc:
        pytest.skip(f"this machine does not let the test create a memory cgroup ({exc}); the readers are "
                    "tested on the kernel's file formats above")
    yield cgroup
    cgroup.remove()


_HOG = """
import os, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.02)
chunks = []
while True:
    chunks.append(bytearray(b"\\x01") * (8 * 2**20))  # written, so resident
"""
_SLEEPER = "import time; time.sleep(120)"


def _start_rank(run_dir: Path, rank: int, program: str, *args: str, cgroup: MemoryCgroup | None = None):
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"rank{rank}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-c", program, *args], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=cgroup.join if cgroup else None)


def _failed(run_dir: Path) -> dict:
    [failed] = [e for e in read_all(run_dir) if e["type"] == "failed"]
    return failed


def test_a_rank_that_runs_out_of_memory_is_reported_as_host_memory_exhausted(limited_cgroup, tmp_path):
    go = tmp_path / "go"
    hog = _start_rank(tmp_path, 0, _HOG, str(go), cgroup=limited_cgroup)
    peer = _start_rank(tmp_path, 1, _SLEEPER)
    try:
        by_log = DeathWatch.start([hog.pid])
        by_counter = DeathWatch.start([hog.pid], kmsg=tmp_path / "no-kernel-log")  # the cgroup counter alone
        threading.Timer(0.5, go.touch).start()  # after watch_ranks took its own snapshot
        code = watch_ranks([hog, peer], tmp_path, EventWriter(tmp_path, source="supervisor"))
    finally:
        for p in (hog, peer):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert code == EXIT_FAILED and hog.returncode == -signal.SIGKILL
    failed = _failed(tmp_path)
    print(f"\ncgroup v{limited_cgroup.version}: {failed['cause_text']}")
    assert failed["rank"] == 0 and failed["exit_code"] == -signal.SIGKILL and failed["cause"] == HOST_MEMORY
    assert "host memory ran out" in failed["cause_text"] and "Lower batch_size" in failed["cause_text"]
    counter_death = by_counter.cause(hog.pid, hog.returncode)
    assert counter_death is not None and counter_death.cause == HOST_MEMORY, "the cgroup counter alone tells"
    assert "oom_kill 0 -> 1" in counter_death.evidence
    log_death = by_log.cause(hog.pid, hog.returncode)
    if by_log._kmsg_seq is not None:  # the kernel log is readable here: it names the pid too
        assert log_death is not None and f"Killed process {hog.pid} " in log_death.evidence


def test_a_plain_sigkill_is_not_reported_as_out_of_memory(limited_cgroup, tmp_path):
    victim = _start_rank(tmp_path, 0, _SLEEPER, cgroup=limited_cgroup)  # same cgroup, same limit
    peer = _start_rank(tmp_path, 1, _SLEEPER)
    threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL)).start()
    try:
        code = watch_ranks([victim, peer], tmp_path, EventWriter(tmp_path, source="supervisor"))
    finally:
        for p in (victim, peer):
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = _failed(tmp_path)
    assert code == EXIT_FAILED and failed["rank"] == 0 and failed["exit_code"] == -signal.SIGKILL
    assert failed["cause"] is None and failed["cause_text"] is None


def test_a_rank_killed_by_a_signal_is_the_origin_even_when_its_peer_reported_first(tmp_path):
    """The OOM-killed rank writes no error; its peer's 'connection closed' error must not take the blame."""
    events = EventWriter(tmp_path, source="rank1")
    victim = _start_rank(tmp_path, 0, _SLEEPER)
    peer = _start_rank(tmp_path, 1, "import sys, time; time.sleep(0.6); sys.exit(1)")
    events.emit("error", rank=1, message="RuntimeError: Connection closed by peer")
    time.sleep(0.3)
    os.kill(victim.pid, signal.SIGKILL)
    peer.wait(10)  # both are dead before the watch looks
    code = watch_ranks([victim, peer], tmp_path, EventWriter(tmp_path, source="supervisor"))
    assert code == EXIT_FAILED and _failed(tmp_path)["rank"] == 0


# ---- a diverged loss and an untrained LoRA, in real runs ---------------------------------------
def _run_through_the_node_launcher(spec):
    from pipetrainer.nodes.run import run_process

    handle = run_process.launch(spec)
    code = run_process.follow(handle, lambda e: None, lambda: False)
    return code, handle, run_process.failure_message(handle)


@pytest.mark.slow
def test_a_diverging_loss_stops_every_rank_at_the_step_it_happened(fixture_paths, comfy_root, demo_cache, tmp_path):
    """A learning rate of 1e30 is accepted by the spec and overflows the LoRA: two pipeline stages stop
    together with the step named (the loss reaches every stage by DeepSpeed's broadcast)."""
    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=20,
                     pipeline_stages=2, gradient_checkpointing=False, optimizer=OptimizerSpec(lr=1e30, weight_decay=0.0))
    code, handle, message = _run_through_the_node_launcher(spec)
    events = read_all(spec.run_dir)
    steps = [e["step"] for e in events if e["type"] == "step"]
    errors = [e for e in events if e["type"] == "error"]
    print(f"\n{message.splitlines()[1]}")
    assert code != 0 and steps and steps[-1] < 20
    bad_step = steps[-1] + 1
    assert {e["rank"] for e in errors} == {0, 1}, errors  # both stages raised, none was left waiting
    assert all(f"at step {bad_step}:" in e["message"] and "TrainingDiverged" in e["message"] for e in errors)
    assert "ranks 0, 1: TrainingDiverged: The loss is " in message and "Lower the learning rate" in message
    assert not Path(spec.lora_output).exists()


def test_a_lora_that_never_moved_is_an_error_naming_the_step(fixture_paths, comfy_root, demo_cache, tmp_path):
    """A learning rate of 1e-50 rounds every fp32 update to 0: lora_B stays exactly 0 and nothing is saved."""
    spec = make_spec(fixture_paths.mmdit, demo_cache.items, tmp_path / "run", comfy_root, steps=2,
                     gradient_checkpointing=False, optimizer=OptimizerSpec(lr=1e-50, weight_decay=0.0))
    code, handle, message = _run_through_the_node_launcher(spec)
    assert code != 0
    assert "LoraUntrained: The LoRA is still untrained at step 2" in message, message
    assert "raise the learning rate" in message
    assert not Path(spec.lora_output).exists()

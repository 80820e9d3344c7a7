import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lagom_tune.errors import UserError
from lagom_tune.knobs import Settings
from lagom_tune.runtime.launch import (
    SITE_DIR, LaunchLayout, check_fit, check_threads, launcher_layout, plan_environment,
)

from conftest import BIN, ROOT, cli
from test_plan import BASE


def launcher_world_size(cmd, env):
    layout = launcher_layout(cmd, env)
    return layout.world_size if layout is not None else None


@pytest.mark.parametrize("cmd, world", [
    (["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--nproc-per-node", "9"], 2),
    (["torchrun", "--nproc_per_node=4", "--nnodes=2", "train.py"], 8),
    (["torchrun", "--nnodes", "2:2", "--nproc-per-node", "3", "t.py"], 6),
    ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "t.py"], 2),
    (["torchrun", "--nproc-per-node", "gpu", "t.py"], None),
    (["python", "train.py"], None),
])
def test_world_size_from_the_launcher(cmd, world):
    assert launcher_world_size(cmd, {}) == world


def test_world_size_from_the_environment():
    assert launcher_world_size(["python", "t.py"], {"WORLD_SIZE": "4"}) == 4
    # torchrun's own defaults from the environment (Kubeflow's PyTorchJob), and flags it has that take no value
    assert launcher_world_size(["torchrun", "--standalone", "t.py"], {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "3"}) == 6
    assert launcher_world_size(["torchrun", "--no-python", "--nproc-per-node", "2", "t.py"], {}) == 2
    assert launcher_world_size(["torchrun", "--nproc-per-node", "2", "--no-such-flag", "t.py"], {}) is None
    assert launcher_world_size(["python", "-m", "torch.distributed.launch", "--use-env", "--nproc-per-node", "2", "t.py"], {}) == 2
    assert launcher_layout(["python", "t.py"], {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == LaunchLayout(4, 2)


def test_threads_that_oversubscribe_the_node_are_refused():
    check_threads(2, 2, cores=4)
    with pytest.raises(UserError, match="2 threads per rank x 2 ranks on this node but this process may run on 2 cores"):
        check_threads(2, 2, cores=2)
    import dataclasses, os
    cores = os.cpu_count() or 1
    fits = dataclasses.replace(BASE, settings=Settings({"threads": cores}, {}))
    check_fit(fits, ["python", "t.py"], {})  # one rank: all cores
    with pytest.raises(UserError, match="ranks on this node"):
        check_fit(fits, ["torchrun", "--nproc-per-node", "2", "t.py"], {})


def test_mismatches_are_refused_with_the_reason():
    with pytest.raises(UserError, match="world size 2, the command starts 4"):
        check_fit(BASE, ["torchrun", "--nproc-per-node", "4", "t.py"], {})
    import dataclasses
    greedy = dataclasses.replace(BASE, settings=Settings({"threads": 4096}, {}))
    with pytest.raises(UserError, match="threads per rank"):
        check_fit(greedy, ["python", "t.py"], {})
    with pytest.raises(UserError, match="simulated"):
        check_fit(dataclasses.replace(BASE, simulated=True), ["python", "t.py"], {})


def test_a_plan_for_other_nodes_is_refused():
    """The world size alone was compared: a one-node plan ran on two nodes, where its rules (matched
    by node count too) reach no communicator, silently."""
    import dataclasses
    two = dataclasses.replace(BASE, world_size=4, nodes=2)
    with pytest.raises(UserError, match=r"4 ranks on 2 node\(s\), the command starts 4 ranks on each of 1 node"):
        check_fit(two, ["torchrun", "--nproc-per-node", "4", "t.py"], {})
    with pytest.raises(UserError, match=r"on 1 node\(s\), the command starts 2 ranks on each of 2 node"):
        check_fit(dataclasses.replace(BASE, world_size=4), ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "t.py"], {})
    assert "world size 4 matches on 2 node(s)" in check_fit(two, ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "t.py"], {})
    assert check_fit(two, ["python", "t.py"], {"WORLD_SIZE": "4"}) == ["world size 4 matches"]  # nodes not known: not refused
    # elastic: one or two nodes join (a one-node plan was refused as two nodes, a two-node one matched)
    for plan in (BASE, two):
        notes = check_fit(plan, ["torchrun", "--nnodes", "1:2", "--nproc-per-node", str(plan.world_size // plan.nodes), "t.py"], {})
        assert notes and "world size not known from the command (elastic --nnodes" in notes[0], notes


def test_each_node_of_a_multi_node_plan_records_its_own_ranks(tmp_path):
    """Each node runs `apply` and sees only its own ranks: on a shared file system every node wrote
    applied.json beside the plan, and the last one's ranks were all that stayed."""
    import dataclasses
    import socket

    from lagom_tune.runtime.launch import default_applied_path

    plan = tmp_path / "p.yaml"
    assert default_applied_path(BASE, plan) == tmp_path / "applied.json"
    two = dataclasses.replace(BASE, world_size=4, nodes=2)
    assert default_applied_path(two, plan) == tmp_path / f"applied.{socket.gethostname()}.json"


def test_environment_puts_the_shim_first(tmp_path):
    env = plan_environment(BASE, tmp_path / "p.yaml", "/tmp/x", {"PYTHONPATH": "/already"})
    assert env["PYTHONPATH"].split(":") == [str(SITE_DIR), "/already"]
    # an empty entry is the working folder: it was dropped, and the script's own modules with it
    env = plan_environment(BASE, tmp_path / "p.yaml", "/tmp/x", {"PYTHONPATH": "/already:"})
    assert env["PYTHONPATH"].split(":") == [str(SITE_DIR), "/already", ""]
    assert plan_environment(BASE, tmp_path / "p.yaml", "/tmp/x", {"PYTHONPATH": ""})["PYTHONPATH"] == str(SITE_DIR)
    assert env["OMP_NUM_THREADS"] == "1"
    assert (SITE_DIR / "sitecustomize.py").is_file()


def test_a_plan_that_keeps_the_defaults_leaves_nccl_alone(tmp_path):
    """`search` writes a plan that keeps the defaults with nothing set; such a plan pinned the
    defaults as the model knows them (ring, simple, 16 channels, 512 threads) on every call."""
    import dataclasses
    from lagom_tune.runtime.launch import prepare_tuner
    kept = dataclasses.replace(BASE, backend="nccl", settings=Settings(), rules=())
    assert prepare_tuner(kept, tmp_path) is None
    assert set(plan_environment(kept, tmp_path / "p.yaml", None, {})) == {"LAGOM_TUNE_PLAN", "PYTHONPATH"}
    from lagom_tune.runtime.launch import deployment_warnings
    assert deployment_warnings(dataclasses.replace(kept, search={"kept_default": "why"}), {}, {}, None) == []
    old = dataclasses.replace(BASE, search={"kept_default": "why"})  # written before: the defaults pinned
    assert any("pins them as the model knew them" in w for w in deployment_warnings(old, {}, {}, None))


def test_a_command_not_after_dashes_is_refused(tmp_path):
    """Without `--` the command ran, and its own options were taken as apply's: `echo --dry-run`
    made a dry run, a script's `--applied X` moved apply's record, `--help` printed apply's help."""
    plan = BASE.save(tmp_path / "p.yaml")
    for cmd in (["echo", "--dry-run"], [sys.executable, "-c", "print('ran')", "--applied", str(tmp_path / "a.json")]):
        r = cli("apply", plan, *cmd)
        assert r.returncode == 2 and "put the command after `--`" in r.stderr and "ran" not in r.stdout, (r.stdout, r.stderr)
    assert not (tmp_path / "a.json").exists()
    r = cli("apply", plan, "--applied", "--", "echo", "hi")  # the "--" was --applied's path
    assert r.returncode == 2 and "--applied took it as its path" in r.stderr, r.stderr
    r = cli("apply", "--", plan, "echo", "hi")  # the plan after "--": was told "got 'echo' before it"
    assert r.returncode == 2 and "put the plan before `--`" in r.stderr, r.stderr
    # a wrapped launcher hides the world size: the run says so (only --dry-run did)
    r = cli("apply", plan, "--", "env", "FOO=1", sys.executable, "-c", "print('ran')", check=True)
    assert r.stdout == "ran\n" and "check: world size not known from the command; the plan expects 2" in r.stderr, r.stdout  # the command's stdout is its own


def test_print_env_refuses_a_simulated_plan():
    r = cli("apply", ROOT / "plans" / "sim-h100-nvlink-mpt-7b-tp8-dp2.yaml", "--print-env")
    assert r.returncode == 2 and r.stdout == "" and "simulated cluster" in r.stderr and "Traceback" not in r.stderr


def test_dry_run_prints_what_it_would_set(tmp_path):
    plan = BASE.save(tmp_path / "p.yaml")
    r = cli("apply", plan, "--dry-run", "--", "torchrun", "--nproc-per-node", "2", "x.py", check=True)
    assert "OMP_NUM_THREADS=1" in r.stdout and "bucket_cap_mb = 8" in r.stdout and "world size 2 matches" in r.stdout
    r = cli("apply", plan, "--dry-run", "--", "torchrun", "--nproc-per-node", "4", "x.py")
    assert r.returncode == 2 and "world size 2, the command starts 4" in r.stderr  # shown, then refused
    r = cli("apply", plan, "--print-env", check=True)
    assert r.stdout.startswith("export ")
    assert "LAGOM_TUNE_APPLIED_DIR" not in r.stdout and "<" not in r.stdout  # once a literal '<temporary folder>'
    evaluated = subprocess.run(["bash", "-c", r.stdout + '\necho "$LAGOM_TUNE_PLAN"'], capture_output=True, text=True, cwd=tmp_path)
    assert evaluated.stdout.strip() == str(plan.resolve()) and not list(tmp_path.glob("<*"))
    for extra, said in ((["--", sys.executable, "-c", "print('ran')"], "takes no command"), (["--dry-run"], "takes no --dry-run")):
        r = cli("apply", plan, "--print-env", *extra)  # the command was silently not run (exit 0)
        assert r.returncode == 2 and said in r.stderr and "ran" not in r.stdout and r.stdout == "", (r.stdout, r.stderr)


def run_under_plan(plan_obj, script: str, tmp_path):
    """`lagom-tune apply` a plan to a 2-rank torchrun script; returns the result and each rank's report."""
    plan = plan_obj.save(tmp_path / "p.yaml")
    out = tmp_path / "report"
    r = cli("apply", plan, "--", BIN / "torchrun", "--standalone", "--nproc-per-node", "2",
            ROOT / "tests" / "scripts" / script, out)
    assert r.returncode == 0, r.stderr
    return r, [json.loads(out.with_name(f"report.rank{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_plain_ddp_script_runs_with_the_plan_in_effect(tmp_path):
    r, reports = run_under_plan(BASE, "plain_ddp.py", tmp_path)
    for seen in reports:
        assert seen["bucket_bytes_cap"] == 8 * 1024 * 1024  # the plan's DDP setting, inside the script's DDP
        assert seen["threads"] == 1
    applied = json.loads((tmp_path / "applied.json").read_text())
    assert set(applied["ranks"]) == {"0", "1"}
    for rank in applied["ranks"].values():
        assert {(r["setting"], r["applied"]) for r in rank["records"]} == {("threads", True), ("bucket_cap_mb", True)}
    assert "[lagom-tune rank 0] applied bucket_cap_mb=8" in r.stderr and "[lagom-tune rank 1] applied" not in r.stderr
    assert "2 rank(s) reported" in r.stderr and "LAGOM_TUNE_LOG=all logs every rank's" in r.stderr


def test_the_commands_exit_code_passes_through(tmp_path):
    plan = BASE.save(tmp_path / "p.yaml")
    r = cli("apply", plan, "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert r.returncode == 3
    assert "[lagom-tune] no rank reported" in r.stderr  # the prefix is text, not markup
    r = cli("apply", plan, "--", sys.executable, "-c", "import sys; sys.exit(130)")
    assert r.returncode == 130 and "interrupted" not in r.stderr, r.stderr  # the command's 130, not a Ctrl-C to lagom-tune
    r = cli("apply", plan, "--", "no-such-program-xyz")
    assert r.returncode == 2 and r.stderr.strip() == "lagom-tune: error: command not found: no-such-program-xyz", r.stderr
    r = cli("apply", plan, "--", tmp_path)  # it is there: "command not found" named the wrong problem
    assert r.returncode == 2 and r.stderr.strip() == f"lagom-tune: error: command is a directory, not a program: {tmp_path}", r.stderr
    # an executable file the system cannot start ended in "internal error: OSError: Exec format error",
    # and one whose #! interpreter is missing was "command not found" though it is there
    for name, text, said in (("noshebang", "echo hi\n", "not a program this system can start (a script needs a #! line)"),
                             ("badshebang", "#!/nonexistent/python\n", "the interpreter its #! line names (or a binary's dynamic loader) is not found")):
        script = tmp_path / name
        script.write_text(text)
        script.chmod(0o755)
        r = cli("apply", plan, "--", script)
        assert r.returncode == 2 and f"cannot run {script}: {said}" in r.stderr and "internal error" not in r.stderr, r.stderr
    r = cli("apply", plan, "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == 128 + 9, r.returncode  # as a shell says it (was 247: -9 passed to sys.exit)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="apply adopts a killed command's orphans through Linux's prctl")
def test_what_a_command_killed_from_outside_left_running_is_ended(tmp_path):
    """torchrun SIGKILLed from outside (the OOM killer) left its workers training, reparented to init,
    though apply's exit said the command had ended (an audit, 2026-12-04): apply now adopts them
    and ends them."""
    plan, pid_file = BASE.save(tmp_path / "p.yaml"), tmp_path / "worker.pid"
    script = (f"import os, pathlib, signal, subprocess, sys; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"pathlib.Path({str(pid_file)!r}).write_text(str(w.pid)); os.kill(os.getpid(), signal.SIGKILL)")
    r = cli("apply", plan, "--", sys.executable, "-c", script)
    assert r.returncode == 128 + 9, (r.returncode, r.stderr)
    worker = int(pid_file.read_text())
    stat = Path(f"/proc/{worker}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the worker outlived apply"
    assert "ended the 1 process(es) it left running" in " ".join(r.stderr.split()), r.stderr


def apply_started(tmp_path, before: str, after: str, **popen) -> subprocess.Popen:
    """`lagom-tune apply` of a gloo plan to `python -c "{before}; <touch a marker>; {after}"`,
    returned once the command has touched the marker (it runs, its signal handlers set)."""
    import time

    marker = tmp_path / "started"
    script = f"import pathlib, signal, sys, time; {before}; pathlib.Path({str(marker)!r}).touch(); {after}"
    proc = subprocess.Popen([str(BIN / "lagom-tune"), "apply", str(BASE.save(tmp_path / "p.yaml")), "--", sys.executable, "-c", script],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    deadline = time.time() + 60
    while not marker.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal mask from /proc")
def test_the_command_starts_with_sigint_unblocked(tmp_path):
    """apply blocks SIGINT from before it starts the command (one sent in between is read with
    its sender, not lost); the command must not inherit the block, or Ctrl-C would never reach it."""
    out = tmp_path / "sigblk"
    script = (f"import pathlib; pathlib.Path({str(out)!r}).write_text("
              "next(l for l in open('/proc/self/status') if l.startswith('SigBlk:')).split()[1])")
    r = subprocess.run([str(BIN / "lagom-tune"), "apply", str(BASE.save(tmp_path / "p.yaml")), "--", sys.executable, "-c", script],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not int(out.read_text(), 16) & (1 << (signal.SIGINT - 1)), out.read_text()


def test_a_stop_signal_to_apply_reaches_the_command(tmp_path):
    """SIGTERM to apply alone (a scheduler's stop) ended apply and left the command running."""
    import signal
    import time

    proc = apply_started(tmp_path, "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))", "time.sleep(60)")
    started = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 7 and time.time() - started < 20, proc.returncode  # the command's own exit, promptly


def test_sigint_sent_to_apply_alone_reaches_the_command(tmp_path):
    """`kill -INT` of apply's pid (a script's send_signal) was not passed on: the command ran on
    until apply killed it 30 s later (exit 137)."""
    import signal
    import time

    proc = apply_started(tmp_path, "signal.signal(signal.SIGINT, lambda *a: sys.exit(5))", "time.sleep(60)")
    started = time.time()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 5 and time.time() - started < 20, proc.returncode


def test_a_second_stop_signal_does_not_leave_the_command_behind(tmp_path):
    """A second SIGTERM (or SIGINT) while apply waited for its command after the first ended apply
    at once, the command still running with no parent to report its exit."""
    import signal
    import time

    proc = apply_started(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)",
                         "time.sleep(4); sys.exit(3)")
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
        proc.send_signal(sig)
        time.sleep(0.3)
    assert proc.poll() is None  # still waiting for its command
    proc.communicate(timeout=60)
    assert proc.returncode == 3, proc.returncode  # the command's own exit, once it ended


def test_a_second_sigint_sent_to_apply_reaches_the_command_too(tmp_path):
    """A second `kill -INT` while apply waited for its command was taken as a terminal's Ctrl-C
    (which the command gets itself) and not passed on."""
    import signal
    import time

    proc = apply_started(tmp_path, "got = []; signal.signal(signal.SIGINT, lambda *a: got.append(1))",
                         "time.sleep(3); sys.exit(10 + len(got))")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 12, proc.returncode


def test_a_command_killed_after_the_grace_goes_with_every_process_it_started(tmp_path):
    """After the grace only the command itself was killed: torchrun's workers, which outlive it,
    ran on."""
    import os
    import time

    from lagom_tune.runtime.launch import _descendants, _kill_tree

    tree = subprocess.Popen(["sh", "-c", "sleep 60 & sh -c 'sleep 60 & wait' & wait"])
    deadline = time.time() + 10
    while len(_descendants(tree.pid)) < 3 and time.time() < deadline:  # sleep, sh and its sleep
        time.sleep(0.05)
    below = _descendants(tree.pid)
    assert len(below) >= 3, below
    _kill_tree(tree)
    assert tree.wait(timeout=10) == -9
    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]
              for p in below if os.path.exists(f"/proc/{p}")) and time.time() < deadline:
        time.sleep(0.05)
    alive = [p for p in below if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]]
    assert not alive, alive


def test_the_grace_ends_in_killing_the_whole_tree(monkeypatch):
    """What apply does once a stopped command outlives STOP_GRACE_S: the tree, not the command alone."""
    import signal
    import time

    from lagom_tune.errors import Interrupted
    from lagom_tune.runtime import launch

    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    tree = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & sleep 60 & wait"])
    deadline = time.time() + 10
    while len(launch._descendants(tree.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    below = launch._descendants(tree.pid)
    assert len(below) == 2, below
    started = time.time()
    assert launch._wait_grace(tree, Interrupted(signal.SIGTERM)) == -9 and time.time() - started < 10
    for pid in below:  # gone, or a zombie until init reaps it
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]:
            assert time.time() < deadline, pid
            time.sleep(0.05)


def test_an_ignored_sigint_stays_ignored(tmp_path):
    """A job started with & from a script ignores SIGINT, and so does its command: apply acted on
    it anyway, and killed the command 30 s later."""
    import time

    script = "import sys, time; print('ready', flush=True); time.sleep(3); sys.exit(5)"
    cmd = f"trap '' INT; exec {BIN / 'lagom-tune'} apply {BASE.save(tmp_path / 'p.yaml')} -- {sys.executable} -c \"{script}\""
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "ready" in proc.stdout.readline()
    proc.send_signal(__import__("signal").SIGINT)
    started = time.time()
    proc.communicate(timeout=60)
    assert proc.returncode == 5 and time.time() - started < 20, proc.returncode


def test_ctrl_c_reaches_the_command_once(tmp_path):
    """Ctrl-C on a terminal signals apply and the command alike (one process group): apply must not
    send it a second time (a second SIGINT cuts short torchrun's own shut-down)."""
    import fcntl
    import os
    import termios

    master, slave = os.openpty()

    def own_terminal():  # a session of its own, whose controlling terminal is the pty
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    proc = apply_started(tmp_path, "got = []; signal.signal(signal.SIGINT, lambda *a: got.append(1))",
                         "time.sleep(3); time.sleep(1); sys.exit(10 + len(got))", stdin=slave, preexec_fn=own_terminal)
    os.write(master, b"\x03")  # the terminal's interrupt character: SIGINT to its foreground process group
    proc.communicate(timeout=60)
    os.close(master), os.close(slave)
    assert proc.returncode == 11, proc.returncode  # the command counted one SIGINT, and its exit passed through


@pytest.mark.slow
def test_chunking_is_applied_to_ddp_and_to_direct_all_reduce(tmp_path):
    import dataclasses

    plan_obj = dataclasses.replace(BASE, groups={"dp": 2}, settings=Settings({"threads": 1}, {"dp": {"chunk_bytes": 1 << 20}}))
    _, reports = run_under_plan(plan_obj, "plain_allreduce.py", tmp_path)
    for seen in reports:
        assert "chunked_allreduce_hook" in seen["comm_hook"]  # the DDP model runs the plan's hook
        assert seen["grads_equal"] and seen["all_reduce_ok"]  # and the results are still right
    applied = json.loads((tmp_path / "applied.json").read_text())
    settings = {r["setting"] for r in applied["ranks"]["0"]["records"] if r["applied"]}
    assert {"chunk_bytes", "chunk_bytes[all_reduce]", "threads"} <= settings


@pytest.mark.slow
def test_ddp_over_a_mesh_dimension_own_hooks_and_sparse_gradients(tmp_path):
    """Three scripts a chunked all-reduce plan broke or misjudged: DDP(device_mesh=...) was judged
    by the world's group (its role was "tp", its cap not applied); a script registering its own
    comm hook after DDP(...) died ("can only be called once"); a model with sparse gradients died
    in the hook ("Could not run 'aten::view' ... SparseCPU")."""
    import dataclasses

    plan_obj = dataclasses.replace(BASE, groups={"dp": 1, "tp": 2},
                                   settings=Settings({"threads": 1}, {"dp": {"bucket_cap_mb": 8, "chunk_bytes": 1 << 20}}))
    _, reports = run_under_plan(plan_obj, "ddp_hooks_and_meshes.py", tmp_path)
    for seen in reports:
        assert seen["caps"] == [8 * 1024 * 1024] * 3  # the mesh's dp dimension is the plan's dp role
        own, sparse, plain = seen["hooks"]
        assert "fp16_compress_hook" in own and "chunked" not in sparse and "chunked_allreduce_hook" in plain
    applied = json.loads((tmp_path / "applied.json").read_text())
    chunks = [(r["applied"], r["how"]) for r in applied["ranks"]["0"]["records"] if r["setting"] == "chunk_bytes"]
    assert [a for a, _ in chunks] == [False, False, True], chunks
    assert "registers its own DDP comm hook" in chunks[0][1] and "sparse gradients" in chunks[1][1]


def test_ddp_settings_reach_only_a_ddp_model_of_their_role(tmp_path):
    """A DDP model over a group of no role of the plan (here one rank) got the data-parallel
    role's bucket cap and was recorded as applied."""
    import dataclasses

    plan_obj = dataclasses.replace(BASE, groups={"dp": 2})
    _, reports = run_under_plan(plan_obj, "ddp_two_groups.py", tmp_path)
    for seen in reports:
        assert seen == {"world": 8 * 1024 * 1024, "own": 25 * 1024 * 1024}  # the plan's cap, DDP's default
    applied = json.loads((tmp_path / "applied.json").read_text())
    caps = [(r["applied"], r["how"]) for r in applied["ranks"]["0"]["records"] if r["setting"] == "bucket_cap_mb"]
    assert caps[0][0] and not caps[1][0] and "has 1 ranks; the plan's dp has 2" in caps[1][1], caps


def test_ddp_settings_of_another_role_are_reported_not_applied(tmp_path, monkeypatch):
    """A gloo plan's DDP knobs on a role other than DDP's were never applied, and nothing said so."""
    import dataclasses

    from lagom_tune.runtime.shim import Shim, rank_reports

    monkeypatch.setenv("RANK", "0")
    plan = dataclasses.replace(BASE, groups={"dp": 2, "dp_shard": 1},
                               settings=Settings({}, {"dp": {"bucket_cap_mb": 8}, "dp_shard": {"bucket_cap_mb": 4, "chunk_bytes": 1 << 20}}))
    shim = Shim(plan, "p.yaml", str(tmp_path))
    shim.at_exit()
    records = {r["setting"]: r for r in rank_reports(tmp_path)["0"]["records"]}
    assert not records["bucket_cap_mb[dp_shard]"]["applied"] and not records["chunk_bytes[dp_shard]"]["applied"]
    assert "no way to set it on dp_shard's communicators" in records["bucket_cap_mb[dp_shard]"]["how"]
    assert not records["bucket_cap_mb"]["applied"]  # no DDP model was built in this process
    # a rank's helper (a DataLoader worker, a subprocess) inherits RANK: at exit it said "NOT applied
    # bucket_cap_mb (no DistributedDataParallel model was built in this process)" after the rank applied it
    helper_dir = tmp_path / "helper"
    helper_dir.mkdir()
    monkeypatch.setenv("LAGOM_TUNE_RANK_PID", "1")  # the rank's, not this process's
    helper = Shim(plan, "p.yaml", str(helper_dir))
    helper.at_exit()
    assert not any(r["setting"] == "bucket_cap_mb" for r in rank_reports(helper_dir)["0"]["records"])


def test_a_rank_that_cannot_write_its_record_trains_on(tmp_path, monkeypatch, capsys):
    """A full disk, or a folder the ranks may not write, raised UserError inside `import torch`:
    every rank of the user's training died."""
    from lagom_tune.runtime.shim import Shim

    monkeypatch.setenv("RANK", "0")
    (tmp_path / "file").write_text("")
    shim = Shim(BASE, "p.yaml", str(tmp_path / "file" / "applied"))  # a folder under a file: not writable
    shim.record("threads", 1, True, "torch.set_num_threads")
    shim.record("bucket_cap_mb", 8, True, "DistributedDataParallel(bucket_cap_mb=...)")
    shim.at_exit()
    err = capsys.readouterr().err
    assert err.count("not recorded for applied.json") == 1 and "the training goes on" in err
    assert "[lagom-tune rank 0] applied bucket_cap_mb=8" in err  # its log lines still go on


def test_rank_0_logs_what_it_applied_every_rank_what_it_could_not(tmp_path, monkeypatch, capsys):
    """16 ranks logging every setting and communicator in every run of a trial buried the
    training's own output: the others log only what they could not apply, unless asked; every
    rank's whole record still reaches applied.json."""
    from lagom_tune.runtime.shim import LOG_ENV, Shim, rank_reports

    def logged(rank: str, log: str | None) -> str:
        monkeypatch.setenv("RANK", rank)
        if log:
            monkeypatch.setenv(LOG_ENV, log)
        else:
            monkeypatch.delenv(LOG_ENV, raising=False)
        shim = Shim(BASE, "p.yaml", str(tmp_path / rank))
        shim.record("threads", 1, True, "torch.set_num_threads")
        shim.record("bucket_cap_mb", 8, False, "no DistributedDataParallel model was built in this process")
        shim.amend("threads", "a later note")
        return capsys.readouterr().err

    assert "rank 0] applied threads=1" in logged("0", None) and "rank 0] NOT applied bucket_cap_mb" in logged("0", None)
    quiet = logged("1", None)
    assert "applied threads" not in quiet.replace("NOT applied", "") and "rank 1] NOT applied bucket_cap_mb=8" in quiet, quiet
    assert {r["setting"] for r in rank_reports(tmp_path / "1")["1"]["records"]} == {"threads", "bucket_cap_mb"}
    assert "rank 1] applied threads=1" in logged("1", "all")
    quiet = logged("0", "failures")  # a trial's plan runs after the first
    assert "applied threads" not in quiet.replace("NOT applied", "") and "rank 0] NOT applied bucket_cap_mb=8" in quiet, quiet


def test_a_command_that_fails_before_any_rank_keeps_the_last_applied_record(tmp_path):
    plan = BASE.save(tmp_path / "p.yaml")
    record = tmp_path / "applied.json"
    record.write_text('{"ranks": {"0": {"rank": "0", "records": []}}}')
    r = cli("apply", plan, "--applied", record, "--", "false")  # no Python rank ever starts
    assert r.returncode == 1 and "keeps the last run's record" in r.stderr
    assert record.read_text() == '{"ranks": {"0": {"rank": "0", "records": []}}}'


def test_the_applied_record_replaces_nothing_but_an_applied_record(tmp_path):
    """`--applied train.py` overwrote the training script with JSON, `--applied RUN/meta.yaml` a
    profile's record (an auditor's runs)."""
    plan = BASE.save(tmp_path / "p.yaml")
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    r = cli("apply", plan, "--applied", script, "--", sys.executable, script)
    assert r.returncode == 2 and "which this command reads" in r.stderr and script.read_text() == "print('training')\n"
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    r = cli("apply", plan, "--applied", notes, "--", "true")
    assert r.returncode == 2 and "is not a --applied record lagom-tune wrote" in r.stderr and notes.read_text() == "my notes\n"


@pytest.mark.parametrize("world", ["0", "²", "-2", "abc"])
def test_a_world_size_that_is_no_count_of_ranks_leaves_the_layout_unknown(world):
    """WORLD_SIZE=0 divided by zero and WORLD_SIZE=² (a digit to str.isdigit, not to int) raised:
    apply ended with "internal error" and exit 1."""
    assert launcher_layout(["python", "train.py"], {"WORLD_SIZE": world}) is None
    assert launcher_layout(["python", "train.py"], {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": world}).nodes_known is False


def test_a_full_disk_at_the_record_keeps_the_commands_exit_code(tmp_path, monkeypatch):
    """ENOSPC writing applied.json after a run that succeeded ended apply with "internal error:
    OSError" and exit 1."""
    import errno

    from lagom_tune.runtime import launch

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(launch, "rank_reports", lambda folder: {"0": {"rank": "0", "records": []}})
    monkeypatch.setattr(launch, "atomic_write_text", full)
    result = launch.apply(BASE, BASE.save(tmp_path / "p.yaml"), ["true"])
    assert result.exit_code == 0 and result.unwritten == f"cannot write {tmp_path / 'applied.json'}: No space left on device"


def test_a_record_that_cannot_be_written_is_refused_before_the_command_runs(tmp_path):
    plan = BASE.save(tmp_path / "p.yaml")
    marker = tmp_path / "ran"
    r = cli("apply", plan, "--applied", "/proc/applied.json", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert r.returncode == 2 and "cannot write --applied record /proc/applied.json" in r.stderr
    assert not marker.exists()  # a long job is never run only to fail at the end
    r = cli("apply", plan, "--applied", tmp_path / "new" / "applied.json", "--", "true")
    assert r.returncode == 0 and "nothing written to" in r.stderr
    # the record's folder replaced by a file during the run: the command's exit code still comes back
    gone = tmp_path / "gone"
    gone.mkdir()
    r = cli("apply", plan, "--applied", gone / "applied.json", "--", "sh", "-c",
            f"RANK=0 {sys.executable} -c 'import torch' && rm -r {gone} && touch {gone} && exit 5")
    assert r.returncode == 5 and "1 rank(s) reported" in r.stderr and "not recorded: cannot write" in r.stderr, (r.stdout, r.stderr)

"""lagom-tune's NCCL tuner plugin, on CPU: built with `cc`, loaded with dlopen (ctypes) and driven
the way NCCL drives it, with fake cost tables, for every rule of the plans in plans/."""

import ctypes
import json
import dataclasses
import os
import random
import shutil
import subprocess
import sys
import textwrap
from ctypes import CFUNCTYPE, POINTER, Structure, c_char_p, c_float, c_int, c_size_t, c_uint64, c_ulong, c_void_p
from pathlib import Path

import pytest

from lagom_tune.errors import UserError
from lagom_tune.knobs import Settings
from lagom_tune.plan.schema import CollectiveRule, Plan, load_plan
from lagom_tune.backends.nccl_tuner import RULES_ENV
from lagom_tune.runtime.nccl import TunerRules, communicator_nodes, tuner_rules
from lagom_tune.backends.tuner_build import LIBRARY_NAME, cache_root, ensure_plugin, find_compiler

from conftest import ROOT, RULES_PLAN, cli

sys.path.insert(0, str(ROOT / "bench"))
from nccl_tuner_versions import tuner_versions_named  # noqa: E402  (the table bench/results/nccl_tuner_versions.md shows)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs the system C compiler `cc`")

# NCCL's numbering (nccl_common.h, plugin/nccl_tuner.h): the cost table is float[NUM_ALGOS][NUM_PROTOS].
FUNC = {"broadcast": 0, "reduce": 1, "all_gather": 2, "reduce_scatter": 3, "all_reduce": 4}
ALGO = {"tree": 0, "ring": 1}
PROTO = {"ll": 0, "ll128": 1, "simple": 2}
NUM_ALGOS, NUM_PROTOS = 7, 3
IGNORE = -1.0
LOG_WARN, LOG_INFO, TUNING = 2, 3, 0x40
UNTOUCHED = -7  # what *nChannels holds before the call: a rule that sets nothing leaves it

LOGGER = CFUNCTYPE(None, c_int, c_ulong, c_char_p, c_int, c_char_p, c_char_p)  # the plugin logs with fmt "%s"
TABLE_CALL = CFUNCTYPE(c_int, c_void_p, c_int, c_size_t, c_int, c_void_p, c_int, c_int, c_int, POINTER(c_int))
V3_CALL = CFUNCTYPE(c_int, c_void_p, c_int, c_size_t, c_int, c_void_p, c_int, c_int, POINTER(c_int))
DIRECT_CALL = CFUNCTYPE(c_int, c_void_p, c_int, c_size_t, c_int, c_int, c_int, POINTER(c_int), POINTER(c_int), POINTER(c_int))
OLD_INIT = CFUNCTYPE(c_int, c_size_t, c_size_t, LOGGER, POINTER(c_void_p))
NEW_INIT = CFUNCTYPE(c_int, POINTER(c_void_p), c_uint64, c_size_t, c_size_t, LOGGER, c_void_p, c_void_p)
FINALIZE = CFUNCTYPE(c_int, c_void_p)


class V2(Structure):
    _fields_ = [("name", c_char_p), ("init", OLD_INIT), ("getCollInfo", DIRECT_CALL), ("destroy", FINALIZE)]


class V3(Structure):
    _fields_ = [("name", c_char_p), ("init", OLD_INIT), ("getCollInfo", V3_CALL), ("destroy", FINALIZE)]


class V4(Structure):
    _fields_ = [("name", c_char_p), ("init", OLD_INIT), ("getCollInfo", TABLE_CALL), ("destroy", FINALIZE)]


class V5(Structure):
    _fields_ = [("name", c_char_p), ("init", NEW_INIT), ("getCollInfo", TABLE_CALL), ("finalize", FINALIZE)]


class V6(Structure):
    _fields_ = V5._fields_ + [("getChunkSize", c_void_p)]


STRUCTS = {2: V2, 3: V3, 4: V4, 5: V5, 6: V6, 7: V6}
TABLE_VERSIONS = (3, 4, 5, 6, 7)


@pytest.fixture(scope="session")
def library(tmp_path_factory) -> Path:
    build = ensure_plugin(cache=tmp_path_factory.mktemp("cache"))
    assert build.ok and build.built, build.reason
    return build.path


class Tuner:
    """One tuner API version of the loaded plugin, called as NCCL calls it."""

    def __init__(self, lib: ctypes.CDLL, version: int):
        self.version = version
        self.api = STRUCTS[version].in_dll(lib, f"ncclTunerPlugin_v{version}")
        self.logs: list[tuple[int, int, str]] = []
        self.logger = LOGGER(lambda level, flags, file, line, fmt, msg: self.logs.append((level, flags, msg.decode())))

    def init(self, n_ranks: int, n_nodes: int) -> c_void_p:
        ctx = c_void_p()
        if self.version >= 5:
            rc = self.api.init(ctypes.byref(ctx), 0x1234, n_ranks, n_nodes, self.logger, None, None)
        else:
            rc = self.api.init(n_ranks, n_nodes, self.logger, ctypes.byref(ctx))
        assert rc == 0
        return ctx

    def finalize(self, ctx) -> None:
        assert (self.api.finalize if self.version >= 5 else self.api.destroy)(ctx) == 0

    def call(self, ctx, func: int, n_bytes: int, table: list[float]) -> tuple[list[float], int]:
        """getCollInfo with a cost table; returns the table after the call and *nChannels."""
        arr = (c_float * len(table))(*table)
        nch = c_int(UNTOUCHED)
        args = (ctx, func, n_bytes, 1, ctypes.cast(arr, c_void_p), NUM_ALGOS, NUM_PROTOS)
        rc = self.api.getCollInfo(*args, ctypes.byref(nch)) if self.version == 3 else \
            self.api.getCollInfo(*args, 0, ctypes.byref(nch))
        assert rc == 0
        return list(arr), nch.value

    def call_direct(self, ctx, func: int, n_bytes: int, coll_net=0, nvls=0) -> tuple[int, int, int]:
        """v2's getCollInfo: returns (algorithm, protocol, nChannels) as the plugin left them."""
        algo, proto, nch = c_int(-1), c_int(-1), c_int(UNTOUCHED)
        assert self.api.getCollInfo(ctx, func, n_bytes, coll_net, nvls, 1, ctypes.byref(algo), ctypes.byref(proto),
                                    ctypes.byref(nch)) == 0
        return algo.value, proto.value, nch.value


@pytest.fixture(scope="session")
def lib(library) -> ctypes.CDLL:
    return ctypes.CDLL(str(library))


def fake_table(rng: random.Random) -> list[float]:
    """NCCL-like times (all positive, so the plugin's 0.0 is the unique minimum)."""
    return [rng.uniform(1.0, 100.0) for _ in range(NUM_ALGOS * NUM_PROTOS)]


def cheapest(table: list[float]) -> tuple[int, int]:
    """The (algo, proto) NCCL picks from a cost table: the smallest available time."""
    i = min((i for i, t in enumerate(table) if t >= 0), key=lambda i: table[i])
    return divmod(i, NUM_PROTOS)


def use_rules(monkeypatch, tmp_path: Path, rules: TunerRules) -> Path:
    path = tmp_path / "plan.rules"
    path.write_text(rules.text())
    monkeypatch.setenv(RULES_ENV, str(path))
    return path


# -- the plans ---------------------------------------------------------------------------------

IN_TEST_PLAN = Plan(
    backend="nccl", world_size=16, nodes=2, hardware={"gpu": "NVIDIA H100 80GB HBM3"}, groups={"dp": 16, "tp": 8},
    settings=Settings({"threads": 256}),
    rules=(CollectiveRule("all_gather", "dp", 1 << 20, 1 << 28, {"algo": "ring", "proto": "simple", "channels": 2}),
           CollectiveRule("reduce_scatter", "dp", 1 << 20, 1 << 28, {"algo": "ring", "proto": "ll128", "channels": 4}),
           CollectiveRule("all_reduce", "tp", 1, 1 << 26, {"algo": "tree", "proto": "ll", "channels": 8}),
           CollectiveRule("all_reduce", "tp", 1 << 26, 1 << 30, {"channels": 16}),
           CollectiveRule("broadcast", "*", 0, 4096, {"algo": "ring", "proto": "simple"}),
           CollectiveRule("all_to_all", "dp", 0, 1 << 30, {"channels": 4})),
)
PLANS = {p.name: load_plan(p) for p in sorted((ROOT / "plans").glob("*.yaml"))}
PLANS["in-test"] = IN_TEST_PLAN
PLANS["with-rules"] = load_plan(RULES_PLAN)
NCCL_PLANS = {name: plan for name, plan in PLANS.items() if plan.backend in ("nccl", "sim") and plan.rules}


def test_the_repository_has_nccl_plans_with_rules():
    """Committed plans with rules, and the kept one (the H100 plan now keeps NCCL's NVLS)."""
    assert [n for n in NCCL_PLANS if n.startswith("sim-")] and "with-rules" in NCCL_PLANS


def expected(plan: Plan, op: str, n_ranks: int, n_nodes: int, n_bytes: int) -> CollectiveRule | None:
    """The plan's first rule for this call, read straight from the plan (what the plugin must apply)."""
    for r in plan.rules:
        ranks = plan.groups.get(r.group)
        nodes = communicator_nodes(plan, ranks)
        if (r.op == op and r.min_bytes <= n_bytes <= r.max_bytes and ranks in (None, n_ranks)
                and nodes in (None, n_nodes)):
            return r
    return None


def calls_for(plan: Plan):
    """Every (op, nRanks, nNodes, nBytes) worth checking: each rule's edges, middle and just outside,
    on each communicator the plan names (both node counts when the plan leaves it open)."""
    comms = {(ranks, nodes) for ranks in {*plan.groups.values(), plan.world_size}
             for nodes in ({communicator_nodes(plan, ranks)} - {None} or {1, plan.nodes})}
    for r in plan.rules:
        if r.op not in FUNC:
            continue
        sizes = {r.min_bytes, r.max_bytes, (r.min_bytes + r.max_bytes) // 2, r.max_bytes + 1}
        if r.min_bytes > 0:
            sizes.add(r.min_bytes - 1)
        for ranks, nodes in sorted(comms):
            for n in sorted(sizes):
                yield r.op, ranks, nodes, n


@pytest.mark.parametrize("version", TABLE_VERSIONS)
@pytest.mark.parametrize("name", sorted(NCCL_PLANS))
def test_every_rule_of_every_plan_is_chosen_inside_its_range_and_nothing_outside(lib, version, name, tmp_path, monkeypatch):
    plan = NCCL_PLANS[name]
    use_rules(monkeypatch, tmp_path, tuner_rules(plan))
    tuner, rng, checked = Tuner(lib, version), random.Random(name), 0
    contexts = {}
    for op, ranks, nodes, n_bytes in calls_for(plan):
        if (ranks, nodes) not in contexts:  # NCCL: one tuner context per communicator
            contexts[ranks, nodes] = tuner.init(ranks, nodes)
        ctx = contexts[ranks, nodes]
        table = fake_table(rng)
        after, nch = tuner.call(ctx, FUNC[op], n_bytes, table)
        want = expected(plan, op, ranks, nodes, n_bytes)
        where = f"{op} {n_bytes} B on nRanks={ranks} nNodes={nodes}"
        if want is None:
            assert after == pytest.approx(table) and nch == UNTOUCHED, where
            continue
        if "algo" in want.set and "proto" in want.set:
            assert cheapest(after) == (ALGO[want.set["algo"]], PROTO[want.set["proto"]]), where
            assert [a for a, b in zip(after, table) if a != pytest.approx(b)] == [0.0], where  # one entry lowered
        elif "algo" not in want.set and "proto" not in want.set:
            assert after == pytest.approx(table), where
        assert nch == want.set.get("channels", UNTOUCHED), where
        checked += 1
    for ctx in contexts.values():
        tuner.finalize(ctx)
    assert checked >= len([r for r in plan.rules if r.op in FUNC])


def test_a_communicator_no_rule_names_is_left_alone(lib, tmp_path, monkeypatch):
    use_rules(monkeypatch, tmp_path, tuner_rules(IN_TEST_PLAN))
    tuner = Tuner(lib, 5)
    ctx = tuner.init(3, 1)
    table = fake_table(random.Random(0))
    for op, func in FUNC.items():
        if op == "broadcast":
            continue  # the plan's broadcast rule is for any communicator
        assert tuner.call(ctx, func, 1 << 20, table) == (pytest.approx(table), UNTOUCHED)
    tuner.finalize(ctx)


@pytest.mark.parametrize("version", TABLE_VERSIONS)
def test_an_unavailable_algorithm_is_never_forced(lib, version, tmp_path, monkeypatch):
    use_rules(monkeypatch, tmp_path, tuner_rules(IN_TEST_PLAN))
    tuner = Tuner(lib, version)
    ctx = tuner.init(8, 1)
    table = fake_table(random.Random(1))
    table[ALGO["tree"] * NUM_PROTOS + PROTO["ll"]] = IGNORE  # NCCL has no tree/LL for this call
    after, nch = tuner.call(ctx, FUNC["all_reduce"], 4096, table)
    assert after == pytest.approx(table) and nch == 8  # the table untouched; channels still set
    assert any("skipped" in msg for _, _, msg in tuner.logs), tuner.logs
    tuner.finalize(ctx)


def test_a_rule_naming_only_an_algorithm_gets_its_cheapest_available_protocol(lib, tmp_path, monkeypatch):
    plan = Plan(backend="nccl", world_size=8, hardware={}, settings=Settings({}), groups={"tp": 8},
                rules=(CollectiveRule("all_reduce", "tp", 0, 1 << 30, {"algo": "ring"}),))
    use_rules(monkeypatch, tmp_path, tuner_rules(plan))
    tuner = Tuner(lib, 5)
    ctx = tuner.init(8, 1)
    table = [50.0] * (NUM_ALGOS * NUM_PROTOS)
    table[ALGO["ring"] * NUM_PROTOS + PROTO["ll"]] = IGNORE
    table[ALGO["ring"] * NUM_PROTOS + PROTO["simple"]] = 20.0
    table[ALGO["tree"] * NUM_PROTOS + PROTO["simple"]] = 10.0  # NCCL's own pick
    after, nch = tuner.call(ctx, FUNC["all_reduce"], 1 << 20, table)
    assert cheapest(after) == (ALGO["ring"], PROTO["simple"]) and nch == UNTOUCHED
    tuner.finalize(ctx)


def test_each_rule_is_logged_once_through_nccls_logger(lib, tmp_path, monkeypatch):
    rules_file = use_rules(monkeypatch, tmp_path, tuner_rules(IN_TEST_PLAN))
    tuner = Tuner(lib, 6)
    ctx = tuner.init(16, 2)
    for _ in range(5):
        tuner.call(ctx, FUNC["all_gather"], 1 << 22, fake_table(random.Random(2)))
    tuner.finalize(ctx)
    msgs = [msg for level, flags, msg in tuner.logs if level == LOG_INFO and flags == TUNING]
    assert any(f"from {rules_file} apply to this communicator (nRanks 16, nNodes 2)" in m for m in msgs), msgs
    applied = [m for m in msgs if "applied" in m]
    assert len(applied) == 1 and "allgather 1048576..268435456 B, ring/simple, 2 channels" in applied[0], msgs
    tuner = Tuner(lib, 6)  # a rule that leaves channels to NCCL says "*", as the rules file does (it said "-1 channels")
    ctx = tuner.init(8, 1)
    tuner.call(ctx, FUNC["broadcast"], 1024, fake_table(random.Random(2)))
    tuner.finalize(ctx)
    said = [msg for level, flags, msg in tuner.logs if level == LOG_INFO and "broadcast 0..4096 B" in msg]
    assert said and all("ring/simple, * channels" in m for m in said), tuner.logs


def test_tuner_api_v2_returns_algorithm_and_protocol(lib, tmp_path, monkeypatch):
    use_rules(monkeypatch, tmp_path, tuner_rules(IN_TEST_PLAN))
    tuner = Tuner(lib, 2)
    ctx = tuner.init(16, 2)
    assert tuner.call_direct(ctx, FUNC["all_gather"], 1 << 20) == (ALGO["ring"], PROTO["simple"], 2)
    # NCCL 2.19-2.21 run what a v1/v2 tuner returns unchecked: LL128 where NCCL turned it off (unsafe
    # there) was forced; only Simple is now, and a rule for another protocol still sets its channels
    assert tuner.call_direct(ctx, FUNC["reduce_scatter"], 1 << 20) == (-1, -1, 4)
    assert tuner.call_direct(ctx, FUNC["reduce_scatter"], 1 << 29) == (-1, -1, UNTOUCHED)
    tuner.finalize(ctx)
    ctx = tuner.init(8, 1)
    assert tuner.call_direct(ctx, FUNC["all_reduce"], 1 << 20) == (-1, -1, 8)
    assert tuner.call_direct(ctx, FUNC["all_reduce"], 1 << 27) == (-1, -1, 16)
    tuner.finalize(ctx)
    assert any("rule at line" in m and "ll128" in m and "skipped" in m for _, _, m in tuner.logs), tuner.logs
    # the user's NCCL_PROTO/NCCL_ALGO exclude what the plugin cannot see: nothing forced, channels set
    monkeypatch.setenv("NCCL_PROTO", "^LL128")
    ctx = tuner.init(16, 2)
    assert tuner.call_direct(ctx, FUNC["all_gather"], 1 << 20) == (-1, -1, 2)
    tuner.finalize(ctx)


def test_tuner_api_v1_has_one_context_per_process(lib, tmp_path, monkeypatch):
    use_rules(monkeypatch, tmp_path, tuner_rules(IN_TEST_PLAN))
    v1_init = CFUNCTYPE(c_int, c_size_t, c_size_t, LOGGER)
    v1_call = CFUNCTYPE(c_int, c_int, c_size_t, c_int, c_int, c_int, POINTER(c_int), POINTER(c_int), POINTER(c_int))

    class V1(Structure):
        _fields_ = [("name", c_char_p), ("init", v1_init), ("getCollInfo", v1_call), ("destroy", CFUNCTYPE(c_int))]

    v1 = V1.in_dll(lib, "ncclTunerPlugin_v1")
    assert v1.name == b"lagom-tune"
    logger = LOGGER(lambda *a: None)
    assert v1.init(16, 2, logger) == 0
    algo, proto, nch = c_int(-1), c_int(-1), c_int(UNTOUCHED)
    assert v1.getCollInfo(FUNC["all_gather"], 1 << 20, 0, 0, 1, ctypes.byref(algo), ctypes.byref(proto), ctypes.byref(nch)) == 0
    assert (algo.value, proto.value, nch.value) == (ALGO["ring"], PROTO["simple"], 2)
    assert v1.destroy() == 0

    # NCCL 2.19 and 2.20 init once per communicator, with no context to tell their calls apart: each init
    # replaced the last, and the last communicator's rules then reached every communicator
    said = []
    logger = LOGGER(lambda level, flags, file, line, fmt, msg: said.append(msg))
    for ranks, nodes in ((16, 2), (8, 1), (16, 2)):  # world, tp, dp
        assert v1.init(ranks, nodes, logger) == 0

    def call(func, nbytes):
        algo, proto, nch = c_int(-1), c_int(-1), c_int(UNTOUCHED)
        v1.getCollInfo(FUNC[func], nbytes, 0, 0, 1, ctypes.byref(algo), ctypes.byref(proto), ctypes.byref(nch))
        return algo.value, proto.value, nch.value

    assert call("all_gather", 1 << 20) == (-1, -1, UNTOUCHED)  # dp's rule: this call may come from tp
    assert call("broadcast", 1024) == (ALGO["ring"], PROTO["simple"], UNTOUCHED)  # a rule for any communicator stays
    assert any(b"cannot tell this process's communicators apart; 2 rule(s) for particular communicators are not applied, 1 for any" in m for m in said), said
    # NCCL destroys as each communicator is freed: the others live on, still indistinguishable
    assert v1.destroy() == 0 and v1.init(8, 1, logger) == 0
    assert call("all_reduce", 1 << 20) == (-1, -1, UNTOUCHED)  # tp's rule, which the live world communicator would take
    assert call("broadcast", 1024) == (ALGO["ring"], PROTO["simple"], UNTOUCHED)
    for _ in range(3):
        assert v1.destroy() == 0
    assert v1.init(8, 1, logger) == 0  # all gone: a process of one communicator again
    assert call("all_reduce", 1 << 20) == (-1, -1, 8)  # tp's rule: its channels (tree/LL is not forced on v1)
    assert v1.destroy() == 0


# -- bad rules never break NCCL ------------------------------------------------------------------

BAD_RULES = {
    "no header": "allreduce 8 * 0 10 ring simple 4\n",
    "wrong version": "lagom-tune-tuner-rules 2\n",
    "empty": "",
    "seven fields": "lagom-tune-tuner-rules 1\nallreduce 8 * 0 10 ring simple\n",
    "nine fields": "lagom-tune-tuner-rules 1\nallreduce 8 * 0 10 ring simple 4 x\n",
    "unknown collective": "lagom-tune-tuner-rules 1\nalltoall 8 * 0 10 ring simple 4\n",
    "unknown algorithm": "lagom-tune-tuner-rules 1\nallreduce 8 * 0 10 fast simple 4\n",
    "negative size": "lagom-tune-tuner-rules 1\nallreduce 8 * -1 10 ring simple 4\n",
    "overflow": "lagom-tune-tuner-rules 1\nallreduce 8 * 0 99999999999999999999999 ring simple 4\n",
    "min above max": "lagom-tune-tuner-rules 1\nallreduce 8 * 10 0 ring simple 4\n",
    "zero channels": "lagom-tune-tuner-rules 1\nallreduce 8 * 0 10 ring simple 0\n",
    "sets nothing": "lagom-tune-tuner-rules 1\nallreduce 8 * 0 10 * * *\n",
    "long line": "lagom-tune-tuner-rules 1\n" + "#" * 5000 + "\n",
    "NUL byte": "lagom-tune-tuner-rules 1\nallreduce 8 * 0 10 ring\0 simple 4\n",
}


@pytest.mark.parametrize("case", sorted(BAD_RULES))
def test_malformed_rules_are_refused_with_the_line(lib, case, tmp_path, monkeypatch):
    text = BAD_RULES[case].encode()
    err = ctypes.create_string_buffer(256)
    assert lib.lagom_tuner_check_text(text, c_size_t(len(text)), err, c_size_t(256)) == -1
    assert err.value.startswith(b"line "), err.value
    # In NCCL: init still succeeds (NCCL would fail the communicator otherwise), says why in a
    # WARN, and the plugin then leaves every collective to NCCL.
    path = tmp_path / "bad.rules"
    path.write_bytes(text)
    monkeypatch.setenv(RULES_ENV, str(path))
    tuner = Tuner(lib, 5)
    ctx = tuner.init(8, 1)
    table = fake_table(random.Random(3))
    assert tuner.call(ctx, FUNC["all_reduce"], 5, table) == (pytest.approx(table), UNTOUCHED)
    tuner.finalize(ctx)
    assert any(level == LOG_WARN and "is not usable (line" in msg for level, _, msg in tuner.logs), tuner.logs
    # on every subsystem, as NCCL's WARNs are: with NCCL_DEBUG_SUBSYS's default (no TUNING) it was dropped
    assert {flags for level, flags, _ in tuner.logs if level == LOG_WARN} == {ctypes.c_ulong(-1).value}


def test_a_missing_rules_file_or_variable_keeps_nccls_choices(lib, tmp_path, monkeypatch):
    for value in (str(tmp_path / "nope.rules"), None):
        if value:
            monkeypatch.setenv(RULES_ENV, value)
        else:
            monkeypatch.delenv(RULES_ENV, raising=False)
        tuner = Tuner(lib, 7)
        ctx = tuner.init(8, 1)
        table = fake_table(random.Random(4))
        assert tuner.call(ctx, FUNC["all_reduce"], 5, table) == (pytest.approx(table), UNTOUCHED)
        tuner.finalize(ctx)
        assert tuner.logs
        if value:  # said why, without a "line 0"
            assert any("cannot open the rules file: No such file or directory" in m and "line 0" not in m
                       for _, _, m in tuner.logs), tuner.logs


def test_the_rules_apply_writes_parse_in_the_plugin(lib):
    for plan in NCCL_PLANS.values():
        text = tuner_rules(plan).text().encode()
        err = ctypes.create_string_buffer(256)
        assert lib.lagom_tuner_check_text(text, c_size_t(len(text)), err, c_size_t(256)) == len(tuner_rules(plan).rules), err.value


FUZZ = textwrap.dedent("""
    import ctypes, os, random, sys, tempfile
    from hypothesis import given, settings, strategies as st, HealthCheck

    lib = ctypes.CDLL(sys.argv[1])
    err = ctypes.create_string_buffer(128)
    words = st.sampled_from(["lagom-tune-tuner-rules", "1", "2", "*", "allreduce", "allgather", "broadcast", "ring",
                             "tree", "pat", "ll", "ll128", "simple", "0", "-1", "4", "64", "1024", "1025",
                             "18446744073709551616", "9223372036854775807", "#", "", "\\t", "\\r", "\\0", "x" * 300])
    lines = st.lists(st.lists(words, max_size=10).map(" ".join), max_size=12).map(
        lambda ls: "\\n".join(["lagom-tune-tuner-rules 1"] + ls).encode())

    def check(data):
        n = lib.lagom_tuner_check_text(data, ctypes.c_size_t(len(data)), err, ctypes.c_size_t(len(err)))
        assert n >= -1
        if n == -1:
            assert err.value.startswith(b"line ")

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=3000) | lines)
    def fuzz(data):
        check(data)

    fuzz()
    # the file path as NCCL's init reads it, with random truncations of a valid file
    good = open(sys.argv[2], "rb").read()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r")
        for i in range(300):
            cut = good[: rng.randrange(len(good) + 1)]
            data = bytes(b ^ (rng.randrange(256) if rng.random() < 0.02 else 0) for b in cut)
            open(path, "wb").write(data)
            assert lib.lagom_tuner_check_file(path.encode(), err, ctypes.c_size_t(len(err))) >= -1
    print("fuzz ok")
""")


def test_fuzzed_rules_never_crash_the_parser(library, tmp_path):
    """Run in a child process: a crash there fails this test instead of killing pytest."""
    good = tmp_path / "good.rules"
    good.write_text(tuner_rules(IN_TEST_PLAN).text())
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ)
    r = subprocess.run([sys.executable, script, library, good], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "fuzz ok" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])


# -- build and CLI ----------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_the_library_exports_every_tuner_api_version(library):
    out = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {f"ncclTunerPlugin_v{v}" for v in range(1, 8)} <= exported
    assert not {"plugin_init", "parse_rules"} & exported  # everything else stays hidden


def installed_nccl() -> list[Path]:
    """The NCCL libraries this Python would load with torch: a CUDA build's ``nvidia/nccl`` wheel
    or one bundled in ``torch/lib`` (none beside a CPU build).

    Returns:
        Their resolved paths, sorted.
    """
    found = {p.resolve() for entry in sys.path if entry and Path(entry).is_dir()
             for sub in ("nvidia/nccl/lib", "torch/lib") for p in Path(entry).glob(f"{sub}/libnccl.so*")}
    return sorted(found)


@pytest.mark.skipif(not installed_nccl(), reason="needs an NCCL library (a CUDA build of torch brings one)")
def test_the_installed_nccl_finds_the_newest_tuner_api_it_knows(library):
    """NCCL looks for the newest tuner API it knows first, then older ones: the plugin must define
    that newest one (a new NCCL release with a new version fails here on a CUDA machine; it would
    still load an older version, without what the new one adds). The releases from 2.19 to 2.32.6:
    bench/results/nccl_tuner_versions.md."""
    exported = tuner_versions_named(Path(library).read_bytes())
    for nccl in installed_nccl():
        asked = tuner_versions_named(nccl.read_bytes())
        assert asked, f"{nccl} names no ncclTunerPlugin_vN: not an NCCL with tuner plugins (2.19 and later)?"
        assert max(asked) in exported, f"{nccl} asks for v{max(asked)} first; the plugin defines v{min(exported)}-v{max(exported)}"


def test_a_build_is_reused_and_keyed_by_the_source(tmp_path):
    first = ensure_plugin(cache=tmp_path)
    again = ensure_plugin(cache=tmp_path)
    assert first.built and not again.built and again.path == first.path and first.path.name == LIBRARY_NAME
    assert not list(first.path.parent.glob(".*.tmp"))  # nothing half-written left behind


def test_dry_run_names_the_built_plugin(tmp_path):
    r = cli("apply", RULES_PLAN, "--dry-run", "--", "true",
            env={"XDG_CACHE_HOME": str(tmp_path)}, check=True)
    plugin = next(tmp_path.glob(f"lagom-tune/nccl-tuner-*/{LIBRARY_NAME}"))
    rules = next(tmp_path.glob("lagom-tune/tuner-rules/*.rules"))
    out = r.stdout
    assert f"export NCCL_TUNER_PLUGIN={plugin}" in out and f"{RULES_ENV}={rules}" in out
    assert "allreduce 8 * 16777216 16777216 tree ll128 64" in out and "rules that need the plugin" in out
    assert rules.read_text() == tuner_rules(PLANS["with-rules"]).text()


def test_without_a_compiler_apply_says_so_and_falls_back_to_cta_bounds(tmp_path):
    plan = IN_TEST_PLAN.save(tmp_path / "p.yaml")
    r = cli("apply", plan, "--dry-run", env={"XDG_CACHE_HOME": str(tmp_path), "CC": "/nonexistent/cc"}, check=True)
    out = " ".join(r.stdout.split())  # rich may wrap long lines
    assert "no C compiler found (CC=/nonexistent/cc is not a command on PATH)" in out  # said "`cc`, or set CC": it was set
    assert "falling back to per-communicator CTA bounds" in out
    assert "NCCL_TUNER_PLUGIN" not in r.stdout.split("ProcessGroupNCCL")[0]  # not exported
    assert "not deployed without the plugin: all_reduce on tp (8 ranks) 1..67108864 B: algo=tree, proto=ll, channels=8" in out
    # all-to-all's channels still cap dp through its CTA bounds: said, not "not deployable" beside them
    assert "not deployable as a rule: all_to_all on dp" in out and "its channels reach NCCL only as dp's CTA bounds (2..4)" in out
    assert "config.min_ctas=2, config.max_ctas=4" in out  # the fallback still reaches every communicator
    r = cli("apply", plan, "--print-env", env={"XDG_CACHE_HOME": str(tmp_path), "CC": "/nonexistent/cc"}, check=True)
    assert r.stdout.startswith("export ") and "NCCL_TUNER_PLUGIN" not in r.stdout and "no C compiler" in r.stderr


def test_the_users_own_nccl_variables_the_plan_replaces_or_that_narrow_its_rules_are_named(tmp_path):
    """The plan's NCCL_NTHREADS replaced the user's, and a user's NCCL_ALGO (with which NCCL offers
    the plugin nothing else, so its rules are skipped) passed, both without a word."""
    plan = IN_TEST_PLAN.save(tmp_path / "p.yaml")
    env = {"XDG_CACHE_HOME": str(tmp_path), "NCCL_NTHREADS": "128", "NCCL_ALGO": "Tree", "NCCL_PROTO": "", "NCCL_NET_PLUGIN": "ofi"}
    r = cli("apply", plan, "--print-env", env=env, check=True)
    assert "NCCL_NTHREADS=128 from your environment is replaced by the plan's 256" in r.stderr, r.stderr
    # NCCL takes a net plugin's own tuner only when NCCL_TUNER_PLUGIN fails: the plan silently replaced it
    assert "NCCL_NET_PLUGIN=ofi: a tuner that net plugin ships (aws-ofi-nccl's) is replaced by lagom-tune's" in r.stderr
    assert "NCCL_ALGO=Tree from your environment narrows NCCL's choices" in r.stderr and "NCCL_PROTO" not in r.stderr
    assert r.stdout.startswith("export ") and "NCCL_TUNER_PLUGIN" in r.stdout
    # variables that override the CTA bounds were named only by each rank at run time, not by --print-env or --dry-run
    r = cli("apply", plan, "--dry-run", env={**env, "NCCL_MAX_CTAS": "32"}, check=True)
    assert "NCCL_MAX_CTAS=32 from your environment overrides every communicator's CTA bounds" in " ".join(r.stdout.split())
    # an earlier plan's plugin, left in the environment by `eval "$(apply --print-env)"`, under a plan that sets nothing
    kept = dataclasses.replace(IN_TEST_PLAN, settings=Settings(), rules=()).save(tmp_path / "kept.yaml")
    r = cli("apply", kept, "--print-env", env={**env, "NCCL_TUNER_PLUGIN": "/old/libnccl-tuner.so"}, check=True)
    assert "NCCL_TUNER_PLUGIN=/old/libnccl-tuner.so from your environment stays in effect" in r.stderr, r.stderr
    assert "NCCL_NTHREADS=128 from your environment stays in effect" in r.stderr, r.stderr


def test_the_cache_is_absolute_and_a_garbled_cc_is_a_user_error(tmp_path):
    """A relative XDG_CACHE_HOME exported relative plugin and rules paths (every rank resolved them
    from its own folder); CC with an unclosed quote ended apply with an internal error."""
    assert cache_root({"XDG_CACHE_HOME": "relcache"}) == Path.home() / ".cache" / "lagom-tune"
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "lagom-tune"
    with pytest.raises(UserError, match="is not a command line"):
        find_compiler({"CC": 'cc -DFOO="'})
    r = cli("apply", IN_TEST_PLAN.save(tmp_path / "p.yaml"), "--dry-run", env={"XDG_CACHE_HOME": str(tmp_path), "CC": 'cc -DFOO="'})
    assert r.returncode == 2 and "is not a command line" in r.stderr and "internal error" not in r.stderr, r.stderr


def test_rules_the_plugin_would_refuse_are_refused_before_the_run(tmp_path):
    """A rule's max_bytes beyond int64 passed every check, then the plugin refused the whole rules
    file when NCCL loaded it: the run went on with none of the plan's rules."""
    import dataclasses

    from lagom_tune.errors import UserError
    from lagom_tune.runtime.launch import prepare_tuner

    plan = PLANS["with-rules"]
    assert prepare_tuner(plan, cache=tmp_path).deployed
    huge = dataclasses.replace(plan, rules=(dataclasses.replace(plan.rules[0], max_bytes=10 ** 23),) + plan.rules[1:])
    with pytest.raises(UserError, match=r"would refuse the plan's rules and NCCL would use none of them: line \d+: bad maxBytes"):
        prepare_tuner(huge, cache=tmp_path)


def test_a_library_that_cannot_be_loaded_is_never_cached(tmp_path):
    """A CC that wrote no real library (a wrapper, an ASan build that aborts on load) was renamed
    into the cache: every later apply ended in an internal error (OSError: file too short)."""
    fake = tmp_path / "fakecc"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && echo garbage > "$2"; shift; done\n')
    fake.chmod(0o755)
    build = ensure_plugin(cache=tmp_path, env={"CC": str(fake), "PATH": os.environ["PATH"]})
    assert not build.ok and "cannot be loaded" in build.reason and "file too short" in build.reason, build.reason
    assert not list(tmp_path.glob(f"nccl-tuner-*/{LIBRARY_NAME}")) and not list(tmp_path.glob("nccl-tuner-*/.*.tmp"))


def test_a_cached_library_that_cannot_be_loaded_falls_back_to_cta_bounds(tmp_path):
    from lagom_tune.runtime.launch import prepare_tuner

    plan = PLANS["with-rules"]
    built = prepare_tuner(plan, cache=tmp_path)
    assert built.deployed
    built.plugin.path.write_text("garbage")  # left by a version that cached whatever CC wrote
    again = prepare_tuner(plan, cache=tmp_path)
    assert not again.deployed and "cannot load the NCCL tuner plugin" in again.plugin.reason and again.env() == {}


def test_a_read_only_cache_takes_a_prebuilt_plugin_and_the_rules_go_to_a_temporary_folder(tmp_path, monkeypatch):
    """The rules file was written before the plugin was looked for: a shared cache holding a
    prebuilt plugin, read-only to the job, stopped apply (exit 2) instead of being used."""
    import tempfile

    from lagom_tune.runtime.launch import prepare_tuner

    plan = PLANS["with-rules"]
    ensure_plugin(cache=tmp_path / "shared")
    (tmp_path / "shared" / "tuner-rules").write_text("")  # its rules folder cannot be made (as read-only)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    d = prepare_tuner(plan, cache=tmp_path / "shared")
    assert d.deployed and d.rules_file.is_relative_to(tmp_path / "tmp") and d.rules_file.read_text() == tuner_rules(plan).text()
    d.rules_file.unlink()
    d.rules_file.parent.parent.chmod(0o777)  # a folder others may write: they could choose the rules NCCL applies
    with pytest.raises(UserError, match="is not a folder of this user's alone"):
        prepare_tuner(plan, cache=tmp_path / "shared")


def test_a_failed_build_names_its_reason_and_leaves_no_folder(tmp_path):
    """A full disk was reported as collect2's "ld returned 1 exit status" (the linker's own line,
    "final link failed: No space left on device", came before it), and each failed build left an
    empty nccl-tuner-* folder in the cache."""
    from lagom_tune.backends.tuner_build import compile_error

    linker = ("/usr/bin/ld: final link failed: No space left on device\n"
              "collect2: error: ld returned 1 exit status\n")
    assert compile_error(linker) == "/usr/bin/ld: final link failed: No space left on device"
    assert compile_error("x.c:3:1: error: expected ';'\nx.c:9:1: error: more\n") == "x.c:3:1: error: expected ';'"
    assert compile_error("something odd\n") == "something odd" and compile_error("") == ""
    build = ensure_plugin(cache=tmp_path, env={"CC": "false", "PATH": os.environ["PATH"]})
    assert not build.ok and "could not build" in build.reason
    assert not list(tmp_path.glob("nccl-tuner-*")), list(tmp_path.iterdir())


# -- what reached NCCL: the plugin's counts, read by the shim at a rank's exit ---------------------


def _counts_delta(after, before):
    from lagom_tune.backends.nccl_tuner import TunerCounts

    return TunerCounts(tuple(a - b for a, b in zip(after.applied, before.applied)),
                       tuple(a - b for a, b in zip(after.skipped, before.skipped)),
                       {k: after.unmatched[k] - before.unmatched[k] for k in after.unmatched})


def _drive(lib, rules: TunerRules) -> None:
    """NCCL's calls on the plan's dp communicator (16 ranks, 2 nodes): two all-gathers its first rule
    applies to, a reduce-scatter whose LL128 NCCL did not offer, and an all-gather no rule matches."""
    tuner = Tuner(lib, 5)
    ctx = tuner.init(16, 2)
    table = fake_table(random.Random(5))
    no_ll128 = list(table)
    no_ll128[ALGO["ring"] * NUM_PROTOS + PROTO["ll128"]] = IGNORE
    tuner.call(ctx, FUNC["all_gather"], 1 << 20, table)
    tuner.call(ctx, FUNC["all_gather"], 1 << 21, table)
    tuner.call(ctx, FUNC["reduce_scatter"], 1 << 20, no_ll128)
    tuner.call(ctx, FUNC["all_gather"], 100, table)
    tuner.finalize(ctx)


def test_the_plugin_counts_what_reached_nccl_per_rule(lib, library, tmp_path, monkeypatch):
    """Per rule, the calls it was applied to and those whose algorithm/protocol NCCL did not offer;
    per collective, the calls no rule matched. The counts outlive NCCL's handle: the shim holds
    the library (destroy_process_group makes NCCL unload its plugin)."""
    from lagom_tune.backends.nccl_tuner import hold_tuner, read_tuner_counts

    rules = tuner_rules(IN_TEST_PLAN)
    use_rules(monkeypatch, tmp_path, rules)
    held = hold_tuner(str(library))
    ctx = Tuner(lib, 5).init(16, 2)  # the plugin reads the rules file: the counts are this plan's
    before = read_tuner_counts(held, len(rules.rules))
    _drive(lib, rules)
    delta = _counts_delta(read_tuner_counts(held, len(rules.rules)), before)
    assert delta.applied == (2, 0, 0, 0, 0) and delta.skipped == (0, 1, 0, 0, 0)
    assert delta.unmatched == {"broadcast": 0, "reduce": 0, "allgather": 1, "reducescatter": 0, "allreduce": 0}
    assert read_tuner_counts(held, len(rules.rules) + 1) is None  # counts of another rules file are not this plan's
    assert hold_tuner(str(tmp_path / "missing.so")) is None
    Tuner(lib, 5).finalize(ctx)


def test_rules_that_did_not_reach_nccl_are_recorded_by_name():
    from lagom_tune.backends.nccl_tuner import TunerCounts
    from lagom_tune.runtime.nccl import rule_reach

    rules = tuner_rules(IN_TEST_PLAN)
    records = rule_reach(rules, TunerCounts((2, 0, 0, 5, 1), (0, 1, 0, 0, 0), {"allgather": 1, "allreduce": 0}))
    summary, *per_rule = records
    assert summary[:3] == ("collective_rules_reached", "8 of 9 matched calls", False)
    assert "9 matched a rule, 8 got all of it; 1 matched none" in summary[3]
    by_setting = {r[0]: r for r in per_rule}
    assert set(by_setting) == {"rule[reduce_scatter dp 1048576..268435456 B]", "rule[all_reduce tp 1..67108864 B]"}
    skipped = by_setting["rule[reduce_scatter dp 1048576..268435456 B]"]
    assert skipped[1:3] == ("ring ll128 4", False) and "skipped on 1 of 1 calls" in skipped[3]
    assert "no NCCL call matched it" in by_setting["rule[all_reduce tp 1..67108864 B]"][3]
    (summary,) = rule_reach(rules, TunerCounts((2, 1, 3, 5, 1), (0,) * 5, {}))
    assert summary[2] is True


def test_a_rule_no_call_matched_says_what_sizes_nccl_was_called_with():
    """A torchtitan job reduces bf16 training's gradients in fp32: a plan profiled with the bf16
    default holds its reduce-scatter rule to half the bytes NCCL is called with. The record said
    only "no NCCL call matched it"; it now lists the op's sizes NCCL's tuner saw in the process and
    names the dtype when one is the rule's size times 2 or 4 (or over), for a gradient reduction."""
    from lagom_tune.backends.nccl_tuner import NcclChoice, TunerCounts, size_bucket
    from lagom_tune.runtime.nccl import TunerRule, rule_reach

    bf16 = 157_352_960  # Phi-2's layer in bf16: the reduce-scatter the plan was profiled with
    rule = lambda op: TunerRule(op, "dp_shard", 8, 1, bf16, bf16, "ring", "simple", 4)
    rules = TunerRules((rule("reduce_scatter"), rule("all_gather"), rule("all_reduce")), ())
    seen = lambda op, n, calls: NcclChoice(op, False, *size_bucket(n), "ring", "simple", calls)
    choices = (seen("reduce_scatter", 2 * bf16, 32), seen("all_gather", 3 * bf16 // 4, 64))
    records = {r[0].split()[0]: r[3] for r in rule_reach(rules, TunerCounts((0, 0, 0), (0, 0, 0), {}, choices))[1:]}
    lo, hi = size_bucket(2 * bf16)
    assert f"NCCL's tuner saw reduce_scatter calls of {lo}..{hi} B x32" in records["rule[reduce_scatter"]
    assert "in another dtype" in records["rule[reduce_scatter"] and "--reduce-dtype" in records["rule[reduce_scatter"]
    # an all-gather is no gradient reduction: its sizes are listed, no dtype is blamed
    assert "all_gather calls of" in records["rule[all_gather"] and "dtype" not in records["rule[all_gather"]
    assert "saw no all_reduce call at all" in records["rule[all_reduce"]
    # a same-size call in another bucket than x2/x4 names no dtype; without cost tables nothing is added
    off = rule_reach(rules, TunerCounts((0, 0, 0), (0, 0, 0), {}, (seen("reduce_scatter", 8 * bf16 + 1, 1),)))[1][3]
    assert "reduce_scatter calls of" in off and "dtype" not in off
    assert rule_reach(rules, TunerCounts((0, 0, 0), (0, 0, 0), {}))[1][3].endswith("a role this rank is not in)")


def test_a_ranks_record_says_which_rules_reached_nccl(lib, library, tmp_path, monkeypatch):
    """At exit the shim reads the plugin NCCL ran in its process and records each rule NCCL's calls
    did not get (here the reduce-scatter's LL128, which NCCL did not offer)."""
    from lagom_tune.backends.nccl_tuner import PLUGIN_ENV, TUNER_ALGOS, TUNER_PROTOS
    from lagom_tune.runtime.shim import Shim

    rules = tuner_rules(IN_TEST_PLAN)
    use_rules(monkeypatch, tmp_path, rules)
    monkeypatch.setenv(PLUGIN_ENV, str(library))
    monkeypatch.setenv("RANK", "0")
    shim = Shim(IN_TEST_PLAN, str(tmp_path / "p.yaml"), str(tmp_path))
    shim.on_torch_nccl(None)
    assert shim.tuner is not None
    _drive(lib, rules)
    shim.at_exit()
    records = {r["setting"]: r for r in json.loads(next(tmp_path.glob("rank-0.*.json")).read_text())["records"]}
    assert records["collective_rules"]["applied"] and not records["collective_rules_reached"]["applied"]
    skipped = records["rule[reduce_scatter dp 1048576..268435456 B]"]
    assert not skipped["applied"] and "NCCL did not offer it" in skipped["how"]
    algo, proto = cheapest(fake_table(random.Random(5)))  # NCCL's own choice for _drive's 100 B all-gather
    own = f"all_gather 64..127 B across nodes: {TUNER_ALGOS[algo]}/{TUNER_PROTOS[proto]} x"  # nvls_tree/ll128
    assert any(line.startswith(own) for line in records["nccl_defaults_as_modelled"]["value"]), records["nccl_defaults_as_modelled"]


# -- NCCL's own choice, from each cost table as NCCL handed it over ---------------------------------


def _choices(lib) -> dict[tuple, int]:
    from lagom_tune.backends.nccl_tuner import read_nccl_choices

    return {(c.op, c.across_nodes, c.min_bytes, c.max_bytes, c.algo, c.proto): c.calls for c in read_nccl_choices(lib)}


def _entry(algo: int, proto: int) -> int:
    return algo * NUM_PROTOS + proto


def test_the_plugin_counts_nccl_s_own_choice_before_any_rule(lib, tmp_path, monkeypatch):
    """NCCL runs its cost table's first strictly cheapest available entry, in algorithm-then-protocol
    order; the plugin counts that entry per span, collective and power-of-two size before a rule
    lowers another (so a plan's run still shows what NCCL's defaults would have run)."""
    use_rules(monkeypatch, tmp_path, tuner_rules(IN_TEST_PLAN))  # all-gathers of 1 MiB and up forced to ring/simple
    table = [50.0] * (NUM_ALGOS * NUM_PROTOS)
    table[_entry(ALGO["ring"], PROTO["ll128"])] = 10.0
    table[_entry(ALGO["tree"], PROTO["ll"])] = 5.0
    table[_entry(ALGO["tree"], PROTO["ll"])] = IGNORE  # not available: never NCCL's choice
    table[_entry(6, PROTO["simple"])] = float("nan")
    tie = [50.0] * (NUM_ALGOS * NUM_PROTOS)
    tie[_entry(ALGO["ring"], PROTO["ll"])] = tie[_entry(ALGO["tree"], PROTO["simple"])] = 3.0  # tree comes first
    before = _choices(lib)
    for version in TABLE_VERSIONS:
        tuner = Tuner(lib, version)
        across, within = tuner.init(16, 2), tuner.init(8, 1)
        after_rule, _ = tuner.call(across, FUNC["all_gather"], 3 << 20, table)
        assert after_rule[_entry(ALGO["ring"], PROTO["simple"])] == 0.0  # the rule still applied
        tuner.call(within, FUNC["all_reduce"], 1000, tie)
        tuner.call(within, FUNC["broadcast"], 0, tie)
        tuner.finalize(across)
        tuner.finalize(within)
    direct = Tuner(lib, 2)  # no cost table: nothing to count
    ctx = direct.init(16, 2)
    direct.call_direct(ctx, FUNC["all_gather"], 3 << 20)
    direct.finalize(ctx)
    after = _choices(lib)
    delta = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    n = len(TABLE_VERSIONS)
    assert delta == {("all_gather", True, 2 << 20, (4 << 20) - 1, "ring", "ll128"): n,
                     ("all_reduce", False, 512, 1023, "tree", "simple"): n,
                     ("broadcast", False, 0, 1, "tree", "simple"): n}


def test_the_defaults_a_plan_assumed_are_held_against_nccl_s_own_choice():
    """Where NCCL's own choice is not the algorithm/protocol the plan's predictions of the defaults
    assumed, the rank's record says for which calls, and that the predicted speed-up rests on it."""
    from lagom_tune.backends.nccl_tuner import NcclChoice
    from lagom_tune.runtime.nccl import defaults_record

    hopper = dataclasses.replace(IN_TEST_PLAN, hardware={"gpu": "NVIDIA H100 80GB HBM3", "nvls": True, "ll128": True})
    as_modelled = (NcclChoice("all_reduce", False, 1 << 26, (1 << 27) - 1, "nvls", "simple", 4),
                   NcclChoice("all_gather", True, 1 << 26, (1 << 27) - 1, "ring", "simple", 3),
                   NcclChoice("reduce", False, 1 << 10, (1 << 11) - 1, "ring", "ll", 9))  # no op of ours: not compared
    setting, value, held, how = defaults_record(hopper, as_modelled)
    assert setting == "nccl_defaults_as_modelled" and held and "each of 16 calls" in how
    assert value[0] == "all_reduce 67108864..134217727 B within a node: nvls/simple x4"
    other = as_modelled + (NcclChoice("all_gather", False, 1 << 20, (1 << 21) - 1, "ring", "ll128", 2),)
    _, _, held, how = defaults_record(hopper, other)
    assert not held and "all_gather 1048576..2097151 B within a node: ring/ll128 x2, modelled ring/simple" in how
    assert "nvls" not in how.split("for ")[1].split(".")[0]  # the all-reduce agreed
    no_nvls = dataclasses.replace(hopper, hardware={**hopper.hardware, "nvls": False})
    _, _, held, how = defaults_record(no_nvls, as_modelled)
    assert not held and "nvls/simple x4, modelled ring/simple" in how
    assert defaults_record(hopper, ()) is None
    # a plan whose profile saw NCCL choose LL128 for that all-gather assumed it: nothing differs
    seen = dataclasses.replace(hopper, backend_defaults=(CollectiveRule("all_gather", "tp", 1536 << 10, 1536 << 10,
                                                                        {"algo": "ring", "proto": "ll128"}),))
    assert defaults_record(seen, other)[2]
    # ... and one that saw it choose LL there holds LL128 as the difference
    ll = dataclasses.replace(seen, backend_defaults=(dataclasses.replace(seen.backend_defaults[0], set={"algo": "ring", "proto": "ll"}),))
    _, _, held, how = defaults_record(ll, other)
    assert not held and "ring/ll128 x2, modelled ring/ll" in how

"""NCCL's log as the observing worker reads it: each communicator's channels, thresholds and
threads, and the channels NCCL then runs one collective on (``topoGetAlgoInfo``'s rule)."""

import os

from lagom_tune.backends.nccl_log import CommChannels, LogReader, communicators, log_path

# NCCL 2.28's set-up of two communicators, as a rank 0 logs them with NCCL_DEBUG=INFO and
# NCCL_DEBUG_SUBSYS=INIT,TUNING (tuning.cc prints its table three algorithms to a row; only a
# communicator's rank 0 prints it): an 8-GPU one with NVLS, then a 2-rank one whose rank 0 is
# another process (no table here).
LOG = """\
gpu01:4242:4300 [0] NCCL INFO Channel 00/24 :    0   1   2   3   4   5   6   7
gpu01:4242:4300 [0] NCCL INFO   Algorithm   |                 Tree              |                 Ring              |
gpu01:4242:4300 [0] NCCL INFO   Protocol    |             LL |          LL128 |         Simple |             LL |
gpu01:4242:4300 [0] NCCL INFO  Max NThreads |            512 |            640 |            512 |            512 |            640 |            256 |            512 |            640 |            512 |
gpu01:4242:4300 [0] NCCL INFO     Broadcast |     6.2/   0.0 |    13.3/   0.0 |    14.1/   0.0 |     6.2/  32.0 |
gpu01:4242:4300 [0] NCCL INFO  Max NThreads |            512 |            640 |            512 |            512 |            640 |            544 |              0 |              0 |            512 |
gpu01:4242:4300 [0] NCCL INFO  Max NThreads |            512 |            640 |            512 |
gpu01:4242:4300 [0] NCCL INFO threadThresholds 8/8/64 | 64/8/64 | 512 | 512
gpu01:4242:4300 [0] NCCL INFO 24 coll channels, 24 collnet channels, 16 nvls channels, 32 p2p channels, 32 p2p channels per peer
gpu01:4242:4311 [0] NCCL INFO threadThresholds 8/8/64 | 16/8/64 | 512 | 512
gpu01:4242:4311 [0] NCCL INFO 4 coll channels, 4 collnet channels, 0 nvls channels, 4 p2p channels, 2 p2p channels per peer
"""


def test_each_communicators_set_up_is_read_with_its_own_thresholds_and_threads():
    node, pair = communicators(LOG)
    assert (node.coll, node.nvls, pair.coll, pair.nvls) == (24, 16, 4, 0)
    assert node.thresholds[("ring", "ll")] == 64 and node.thresholds[("tree", "simple")] == 64 and pair.thresholds[("ring", "ll")] == 16
    assert node.threads[("ring", "simple")] == 256 and node.threads[("ring", "ll128")] == 640 and node.threads[("pat", "simple")] == 512
    assert node.threads[("nvls", "simple")] == 544  # the second row: CollNetChain, NVLS, NVLS-tree
    assert pair.threads == {}  # not this process's table: NCCL's defaults then
    assert communicators("gpu01:1:2 [0] NCCL INFO Bootstrap : Using eth0\n") == []
    # an NCCL before the NVLS count (2.12-2.16): coll channels alone
    (old,) = communicators("h:1:2 [0] NCCL INFO 8 coll channels, 8 p2p channels, 2 p2p channels per peer\n")
    assert (old.coll, old.nvls) == (8, 0)


def test_the_channels_nccl_runs_a_collective_on_follow_its_rule():
    """A ring or tree drops a channel while the collective is smaller than channels x threads x
    threshold bytes; NVLS runs the communicator's NVLS channels; CollNet is not followed."""
    node, pair = communicators(LOG)
    per = 256 * 64  # the node's ring Simple: 256 threads (its table) x 64 B
    assert node.channels_for("ring", "simple", 1 << 30) == 24
    assert node.channels_for("ring", "simple", 24 * per) == 24  # not smaller: all of them
    assert node.channels_for("ring", "simple", 24 * per - 1) == 23
    assert node.channels_for("ring", "simple", 4 * per) == 4
    assert node.channels_for("ring", "simple", 100) == 1  # never fewer than one
    assert node.channels_for("ring", "ll", 100_000) == 3  # LL: 512 threads x 64 B (8 B x 8 ranks)
    assert node.channels_for("nvls", "simple", 1 << 20) == 16 and pair.channels_for("nvls", "simple", 1 << 20) is None
    assert node.channels_for("collnet_direct", "simple", 1 << 30) is None
    assert pair.channels_for("ring", "simple", 3 * 512 * 64) == 3  # NCCL's default 512 threads where no table was logged
    assert CommChannels(32).channels_for("tree", "ll128", 2 * 640 * 8) == 2  # NCCL's default thresholds too


def test_the_log_is_read_in_stretches_from_the_file_nccl_names(tmp_path):
    pattern = str(tmp_path / "nccl.%p.log")
    path = log_path(pattern)
    assert path == tmp_path / f"nccl.{os.getpid()}.log"
    reader = LogReader(path)
    assert reader.new_text() == ""  # NCCL has not written it yet
    path.write_text(LOG)
    assert [c.coll for c in communicators(reader.new_text())] == [24, 4]
    assert reader.new_text() == ""
    with path.open("a") as f:
        f.write("h:1:2 [0] NCCL INFO 2 coll channels, 2 collnet channels, 0 nvls channels, 2 p2p channels, 1 p2p channels per peer\n")
    assert [c.coll for c in communicators(reader.new_text())] == [2]


def test_nccls_warnings_are_found_for_a_failing_workers_error():
    from lagom_tune.backends.nccl_log import warnings

    text = LOG + "".join(f"gpu01:4242:4300 [0] NCCL WARN Cuda failure {i} 'out of memory'\n" for i in range(5))
    assert warnings(text) == ["Cuda failure 2 'out of memory'", "Cuda failure 3 'out of memory'", "Cuda failure 4 'out of memory'"]
    assert warnings(LOG) == []

"""NCCL's log as the observing worker reads it: what NCCL ran each collective call with."""

import os

from lagom_tune.backends.nccl_log import LogReader, NcclCall, calls, last_call, log_path, warnings

# A communicator's rank 0 under NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=TUNING (NCCL 2.28's enqueue.cc
# line; a later one adds the CGA cluster size, an earlier one the communicator): the barrier's
# all-reduce of 4 bytes, then an all-gather of 32 KiB a rank.
LOG = """\
gpu01:4242:4300 [0] NCCL INFO   Algorithm   |                 Tree              |                 Ring              |
gpu01:4242:4300 [0] NCCL INFO  Max NThreads |            512 |            640 |            512 |            512 |            640 |            256 |
gpu01:4242:4242 [0] NCCL INFO AllReduce: 4 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0}
gpu01:4242:4242 [0] NCCL INFO AllGather: 32768 Bytes -> Algo RING proto LL128 channel{Lo..Hi}={0..23} cgaClusterSize 1
gpu01:4242:4242 [0] NCCL INFO ReduceScatter: 1048576 Bytes -> Algo PAT proto SIMPLE channel{Lo..Hi}={2..5} comm 0x55a7a339db50
"""


def test_each_call_is_read_with_the_algorithm_protocol_and_channels_nccl_ran():
    assert calls(LOG) == [NcclCall("all_reduce", 4, "tree", "ll", 1), NcclCall("all_gather", 32768, "ring", "ll128", 24),
                          NcclCall("reduce_scatter", 1048576, "pat", "simple", 4)]
    assert last_call(LOG, "all_gather") == NcclCall("all_gather", 32768, "ring", "ll128", 24)
    assert last_call(LOG + LOG.splitlines()[2] + "\n", "all_reduce").channels == 1  # the latest of its op
    assert last_call(LOG, "broadcast") is None
    assert calls("gpu01:1:2 [0] NCCL INFO Bootstrap : Using eth0\n") == []  # a rank that is no communicator's rank 0
    assert calls("h:1:2 [0] NCCL INFO Send: 8 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={3..1}\n") == []  # no channels


def test_nccls_warnings_are_found_for_a_failing_workers_error():
    text = LOG + "".join(f"gpu01:4242:4300 [0] NCCL WARN Cuda failure {i} 'out of memory'\n" for i in range(5))
    assert warnings(text) == ["Cuda failure 2 'out of memory'", "Cuda failure 3 'out of memory'", "Cuda failure 4 'out of memory'"]
    assert warnings(LOG) == []


def test_the_log_is_read_in_stretches_from_the_file_nccl_names(tmp_path):
    pattern = str(tmp_path / "nccl.%p.log")
    path = log_path(pattern)
    assert path == tmp_path / f"nccl.{os.getpid()}.log"
    reader = LogReader(path)
    assert reader.new_text() == ""  # NCCL has not written it yet
    path.write_text(LOG)
    assert len(calls(reader.new_text())) == 3
    assert reader.new_text() == ""
    with path.open("a") as f:
        f.write("h:1:2 [0] NCCL INFO Broadcast: 64 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}\n")
    assert calls(reader.new_text()) == [NcclCall("broadcast", 64, "ring", "ll", 2)]

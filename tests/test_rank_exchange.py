"""The nccl backend's ranks exchange Python objects through the job's store, never a gloo group."""

import datetime
import threading

import torch.distributed as dist

from lagom_tune.backends.rank_exchange import RankExchange


def run_ranks(world, body):
    """``body(exchange)`` on ``world`` threads, one exchange each, sharing one real TCPStore."""
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    results, errors = {}, []

    def rank(r):
        try:
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timeout)
            results[r] = body(RankExchange(dist.PrefixStore("job/", client), r, world))
        except BaseException as e:  # noqa: BLE001  (reported below, with the rank)
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == world, errors
    return server, results


def test_every_rank_gets_every_value_in_rank_order_call_after_call():
    def body(x):
        return [x.all_gather({"rank": x.rank, "call": n, "rows": list(range(n))}) for n in range(40)]

    _, results = run_ranks(3, body)
    for r, calls in results.items():
        for n, got in enumerate(calls):
            assert got == [{"rank": s, "call": n, "rows": list(range(n))} for s in range(3)], (r, n)


def test_share_gives_rank_0s_value_and_the_store_keeps_two_calls_at_most():
    """A profile gathers every point's rows: the store must not keep them all."""
    def body(x):
        shared = [x.share(f"token-{n}" if x.rank == 0 else f"ignored-{x.rank}") for n in range(30)]
        x.barrier()
        return shared

    server, results = run_ranks(4, body)
    assert all(shared == [f"token-{n}" for n in range(30)] for shared in results.values())
    # 31 calls of 4 ranks' keys (124 kept without the deletions), less the ones deleted
    assert server.num_keys() <= 2 * 4, server.num_keys()

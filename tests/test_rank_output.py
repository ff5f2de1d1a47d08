"""A rank's output reaches the pod before its result, with one poll of every rank's pipes per
batch of answers (``ktlite_server.rankoutput``), not one per answer. Real rank processes."""

from __future__ import annotations

import asyncio
import os
import sys

import cloudpickle

from ktlite_server.rankgather import Arrivals
from ktlite_server.rankoutput import pipes
from ktlite_server.ranks import RankProcess
from ktlite_wire import codec, rankchannel

LONG = 60.0


def shout(tag: str) -> str:
    rank = os.environ.get("KTLITE_TEST_RANK", "?")
    print(f"{tag} from rank {rank}, stdout")
    os.write(2, f"{tag} from rank {rank}, stderr by the fd\n".encode())  # as C code writes
    return tag


def test_every_answer_comes_after_its_ranks_lines_with_at_most_one_poll_a_batch() -> None:
    async def main() -> tuple[list[str], list[tuple[int, int, int]], list[str]]:
        lines: list[str] = []
        ranks = [
            RankProcess(
                i,
                {**os.environ, "KTLITE_TEST_RANK": str(i)},
                lambda r, stream, line: lines.append(line),
            )
            for i in range(4)
        ]
        seen: list[tuple[int, int, int]] = []  # (rank, its lines seen at its answer, drains)
        try:
            await asyncio.gather(*(r.start(LONG) for r in ranks))
            cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank can't import it
            try:
                bundle = cloudpickle.dumps(shout)
            finally:
                cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
            for r in ranks:
                assert (await r.load(rankchannel.Load(env={}, bundle=bundle), LONG)).ok
            args = codec.dumps((None, ("hello",), {}))
            calls = [(r, rankchannel.Call("c1", args, size=len(args))) for r in ranks]
            arrivals = Arrivals("c1", calls)
            batches, before = 0, pipes().drains
            values = []
            while arrivals.left:
                batch = await asyncio.wait_for(arrivals.next(), LONG)
                batches += 1
                for reply in batch:
                    r = reply.rank
                    result = r.check(reply.msg.id, reply.result())
                    values.append(codec.loads(bytearray(result.inline or b"")))
                    mine = [ln for ln in lines if ln.startswith(f"hello from rank {r.local_rank},")]
                    seen.append((r.local_rank, len(mine), pipes().drains - before))
            return values, seen, [str(batches)]
        finally:
            for r in ranks:
                r.kill()
            await asyncio.gather(*(r.wait_dead(LONG) for r in ranks))
            await asyncio.sleep(0)

    values, seen, (batches,) = asyncio.run(main())
    assert values == ["hello"] * 4
    assert all(n == 2 for _, n, _ in seen), f"an answer came before its rank's lines: {seen}"
    # at most one poll a batch (a batch whose bytes were read before a drain ran needs none)
    assert 1 <= seen[-1][2] <= int(batches), f"{seen[-1][2]} polls for {batches} batches of answers"

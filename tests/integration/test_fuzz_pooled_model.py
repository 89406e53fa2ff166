"""The pooled fuzz model's allowed answers, on streams whose races are known.

fuzz_pooled must allow exactly what the summing threads may do: the inline
answer always, the answers a late landing gives where one is possible
(a resend to a chunk still being summed, answered only when it lands, so
the stream reads on), and nothing else: no wrong sum, no reply after the
status, no result dropped that was complete before the end. No daemon here.
"""

import grpc
import numpy as np
import pytest
from fuzz_model import StreamModel, mismatches, play, stream_events
from fuzz_pooled import pooled_outcomes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

pytestmark = pytest.mark.timeout(30)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
ONE_RANK = dict(job="j", world_size=1, key="b", op=pb.REDUCE_OP_SUM)


def f16(*values):
    return np.array(values, "<f2").tobytes()


def shard(**fields):
    return pb.Shard(**{**ONE_RANK, "dtype": pb.DTYPE_FLOAT16, "data": f16(1, 2), **fields})


def answers(messages, inband):
    return [(o.code, [r.shard.error_code for r in o.replies])
            for o in pooled_outcomes(stream_events(messages), inband)]


# Found by the fuzz (gRPC, out-of-band errors): a complete chunk, a resend that
# disagrees, a good resend, an invalid shard.
RACE = [shard(), shard(dtype=pb.DTYPE_BFLOAT16), shard(), shard(rank=1)]


def test_a_disagreeing_resend_while_summed_lets_the_stream_read_on():
    got = sorted(answers(RACE, inband=False), key=lambda a: len(a[1]))
    # Landed first: the resend's error ends the stream (the inline answer).
    # Landed late: the stream read on; the result twice, then the invalid shard's end.
    assert got == [(INVALID, [0]), (INVALID, [0, 0])]
    inline = play(StreamModel(False), stream_events(RACE))
    assert (inline.code, len(inline.replies)) == (INVALID, 1)


def test_in_band_the_race_changes_nothing():
    assert answers(RACE, inband=True) == [(INVALID, [0, INVALID.value[0], 0])]


def test_a_stream_without_resends_has_the_inline_answer_only():
    messages = [shard(key="a"), shard(key="b", world_size=2), shard(key="b", rank=1,
                world_size=2), shard(key="c", world_size=2)]
    inline = play(StreamModel(True), stream_events(messages))
    allowed = pooled_outcomes(stream_events(messages), True)
    assert len(allowed) == 1
    assert [(r.shard.key, r.shard.error_code, r.data) for r in allowed[0].replies] == [
        (r.shard.key, r.shard.error_code, r.data) for r in inline.replies]
    assert allowed[0].code == grpc.StatusCode.OK


def test_an_error_end_never_drops_a_result_complete_before_it():
    # The result of "a" may still be summed at the invalid shard: it goes out first.
    assert answers([shard(key="a"), shard(rank=1)], inband=False) == [(INVALID, [0])]


def _reply(key, data, **fields):
    return pb.Shard(**{**ONE_RANK, "key": key, "dtype": pb.DTYPE_FLOAT16, "data": data,
                       **fields}).SerializeToString()


def test_wrong_sums_and_replies_past_the_status_are_refused():
    allowed = pooled_outcomes(stream_events(RACE), inband=False)

    def accepted(replies, code=INVALID):
        return any(mismatches(o, code, replies, False) == [] for o in allowed)

    right = _reply("b", f16(1, 2))
    assert accepted([right]) and accepted([right, right])
    assert not accepted([_reply("b", f16(1, 3))])  # a wrong sum
    assert not accepted([right, right, right])  # a reply the stream never earned
    assert not accepted([])  # the result complete before the end, dropped
    assert not accepted([right], grpc.StatusCode.OK)


def test_a_resend_to_a_round_older_than_the_cached_one_opens_it_anew():
    """Found by the fuzz (CI): the daemon keeps one result per chunk, its
    latest round's (ReductionTable._cache_result); once round 1 completed, a
    resend to round 0 opens round 0 anew, and with one rank it completes with
    the resent values. Pooled, round 1 may still be summed when the resend
    comes: then round 0's result is still the cached one."""
    messages = [shard(data=f16(1)), shard(data=f16(2)), shard(round=1, data=f16(3)),
                shard(data=f16(4))]
    inline = play(StreamModel(False), stream_events(messages))
    assert [bytes(r.data) for r in inline.replies] == [f16(1), f16(1), f16(3), f16(4)]
    pooled = {tuple(sorted(bytes(r.data) for r in o.replies))
              for o in pooled_outcomes(stream_events(messages), False)}
    assert pooled == {tuple(sorted([f16(1), f16(1), f16(3), f16(4)])),
                      tuple(sorted([f16(1), f16(1), f16(3), f16(1)]))}

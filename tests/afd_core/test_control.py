import pytest

from afd_core.connectors.protocol.control import (
    MAGIC,
    MAX_MICROBATCHES,
    MESSAGE_LEN,
    ControlError,
    ControlFlag,
    ControlMessage,
    Expectation,
    decode,
    is_heartbeat,
)

EXP = Expectation(sender_rank=1, hidden_size=64, dtype="float32", max_tokens=256)


def msg(**kw):
    base = dict(sender_rank=1, step=7, tokens=(5, 3), hidden_size=64, dtype="float32")
    return ControlMessage(**(base | kw))


@pytest.mark.parametrize(
    "m",
    [
        msg(),
        msg(tokens=(0,)),
        msg(tokens=(256,) * MAX_MICROBATCHES),
        msg(flags=ControlFlag.WARMUP | ControlFlag.CAPTURE, tokens=(1,)),
        msg(senders=0b101),  # DP ranks 0 and 2 of its server send this step
    ],
)
def test_round_trip(m):
    words = m.encode()
    assert len(words) == MESSAGE_LEN and words[0] == MAGIC
    assert decode(words, EXP) == m


def test_shutdown_round_trip():
    m = msg(tokens=(), flags=ControlFlag.SHUTDOWN)
    out = decode(m.encode(), EXP)
    assert out.is_shutdown and out.tokens == ()


def test_heartbeat_round_trip():
    m = msg(tokens=(), flags=ControlFlag.HEARTBEAT)
    words = m.encode()
    assert is_heartbeat(words) and not is_heartbeat(msg().encode())
    out = decode(words, EXP)
    assert out.is_heartbeat and not out.is_shutdown and out.tokens == ()


def corrupt(index, value):
    words = msg().encode()
    words[index] = value
    return words


@pytest.mark.parametrize(
    "words,match",
    [
        (corrupt(0, 0x1234), "bad magic 0x1234"),
        (corrupt(1, 1), "protocol version 1, this rank speaks 5"),
        (corrupt(2, 0), "says it comes from attention rank 0"),
        (corrupt(4, 128), "unknown flags 0x80"),
        (corrupt(4, 64), "a <ControlFlag.HEARTBEAT: 64> message carries rows"),
        (corrupt(5, 0), "num_microbatches=0; allowed 1..4"),
        (corrupt(5, 9), "num_microbatches=9"),
        (corrupt(6, 128), "hidden_size=128, but this FFN rank's model has hidden_size=64"),
        (corrupt(7, 2), "dtype='bfloat16', but this FFN rank runs 'float32'"),
        (corrupt(7, 99), "dtype=99"),
        (corrupt(8, -1), "senders=-1; allowed a non-negative bit mask"),
        (corrupt(9, -1), "negative token count"),
        (corrupt(9, 257), "257 tokens in one micro-batch exceed the 256 that rank announced"),
        (corrupt(12, 4), "non-zero padding"),
        (msg().encode()[:-1], f"{MESSAGE_LEN - 1} words, expected {MESSAGE_LEN}"),
    ],
)
def test_malformed(words, match):
    with pytest.raises(ControlError, match=match) as e:
        decode(words, EXP)
    assert "attention rank 1" in str(e.value)


@pytest.mark.parametrize(
    "m,match",
    [
        (msg(tokens=()), "0 micro-batches"),
        (msg(tokens=(1,) * 5), "5 micro-batches"),
        (msg(tokens=(-1,)), "negative"),
        (msg(dtype="int8"), "dtype 'int8' cannot be sent"),
        (msg(senders=-2), "senders=-2"),
    ],
)
def test_encode_rejects(m, match):
    with pytest.raises(ControlError, match=match):
        m.encode()

"""The named random streams (comlrl.engine.streams): one tag each, and the seed keys the streams
were released with, so that every run draws what it drew before the table existed."""

import numpy as np

from comlrl.engine.streams import Stream, stream_key, stream_rng


def test_every_stream_has_its_own_tag():
    assert len({int(s) for s in Stream}) == len(Stream)


def test_the_keys_are_those_released():
    seed = 42
    assert stream_key(seed, Stream.DATA_ORDER, 3) == [42, 3]                         # engine: data order
    assert stream_key(seed, Stream.BUFFER_ORDER, 3, 5) == [42, 7, 3, 5]              # actor-critic
    assert stream_key(seed, Stream.PREFERENCE_PAIRS, 1, 9) == [42, 11, 1, 9]         # MADPO, iterative
    assert stream_key(seed, Stream.PAIR_ORDER, 1, 3) == [42, 13, 1, 3]               # MADPO
    assert stream_key(seed, Stream.REWARD_MODEL_ORDER, 1, 3) == [42, 17, 1, 3]       # MARLHF
    assert stream_key(seed, Stream.REPLAY, 4) == [42, 19, 4]                         # iterative replay
    assert stream_key(seed, Stream.UPDATE_ORDER, 6) == [42, 6, 0x4A50]               # MAHAGRPO


def test_a_stream_draws_what_its_key_seeds():
    for stream in Stream:
        got = stream_rng(5, stream, 2, 3).permutation(10)
        assert np.array_equal(got, np.random.default_rng(stream_key(5, stream, 2, 3)).permutation(10))

"""The named random streams of a run, on one derivation.

Every draw a trainer makes outside sampling comes from a numpy generator seeded by the run's
``seed``, the stream's tag and the counters that place the draw (epoch, step, prompt, ...), never
from global state: a resumed run redraws exactly what the uninterrupted one drew. The tags are
those the streams were first released with, so checkpoints and results stay bit-identical; two
streams never share a tag (before this table, 11 was written out in two files for one stream).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["Stream", "stream_rng", "stream_key"]


class Stream(IntEnum):
    """A stream's tag (its number in the seed key)."""

    DATA_ORDER = 0               # the engine: the dataset's order in an epoch (key: seed, epoch; no tag)
    BUFFER_ORDER = 7             # actor-critic: a buffer's prompts before they are cut into optimizer steps
    PREFERENCE_PAIRS = 11        # MADPO / iterative: which pairs of a prompt's candidates are trained on
    PAIR_ORDER = 13              # MADPO: the order of a pair set's pairs in an epoch
    REWARD_MODEL_ORDER = 17      # MARLHF: the order of the reward model's training pairs in an epoch
    REPLAY = 19                  # iterative preference: which replayed pairs a round draws
    UPDATE_ORDER = 0x4A50        # MAHAGRPO: the agents' order in an optimizer step (key: seed, step, tag)


def stream_key(seed: int, stream: Stream, *parts: int) -> list[int]:
    """The seed key of ``stream`` at ``parts``: ``[seed, tag, *parts]``, except the two streams
    released with another layout (kept so that their draws stay those of earlier runs):
    ``DATA_ORDER`` ``[seed, *parts]`` and ``UPDATE_ORDER`` ``[seed, *parts, tag]``."""
    stream = Stream(stream)
    if stream is Stream.DATA_ORDER:
        return [seed, *parts]
    if stream is Stream.UPDATE_ORDER:
        return [seed, *parts, int(stream)]
    return [seed, int(stream), *parts]


def stream_rng(seed: int, stream: Stream, *parts: int) -> np.random.Generator:
    """A generator of ``stream`` at ``parts`` (see :func:`stream_key`)."""
    return np.random.default_rng(stream_key(seed, stream, *parts))

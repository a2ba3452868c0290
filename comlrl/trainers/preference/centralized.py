"""Centralised collaboration: ONE policy writes every role's part in one completion.

An adapter builds the joint prompt from the roles' own prompts and splits a joint completion back
into one output per role, so that the task's reward (and metrics) see the roles separately while
the policy learns from the joint text. :class:`TaggedCentralizedComparatorAdapter` asks for
``<agent_i> ... </agent_i>`` sections; any object with the same two methods can replace it.
(Defined in :mod:`comlrl.engine.roles`, shared by every family; CoMLRL's import path.)
"""

from ...engine.roles import (CentralizedComparatorAdapter, CentralizedComparatorParseError,
                             TaggedCentralizedComparatorAdapter)

__all__ = ["CentralizedComparatorParseError", "CentralizedComparatorAdapter", "TaggedCentralizedComparatorAdapter"]

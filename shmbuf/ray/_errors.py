"""The errors of ``shmbuf.ray``, and the one rule for which Ray errors mean a lost shard."""
from __future__ import annotations

import ray.exceptions as rex

from shmbuf import ShmbufError

# A shard is lost when its actor is dead or unreachable, its node is dead, or it
# did not answer within the caller's timeout (a node that is being declared dead
# answers nothing for the health-check period first).
_LOSS = (rex.RayActorError, rex.NodeDiedError, rex.LocalRayletDiedError,
         rex.ObjectLostError, rex.GetTimeoutError)


class ShardLostError(ShmbufError, ConnectionError):
    """A shard (or every shard) is gone: its node or actor died, or it stopped answering."""


class ShardedBufferNotFoundError(ShmbufError, LookupError):
    """``connect(name)`` found no live shard of that name in that namespace."""


def is_loss(exc: BaseException) -> bool:
    """True if ``exc`` from a call to a shard means the shard is gone (not a bad argument)."""
    return isinstance(exc, _LOSS) and not isinstance(exc, rex.RayTaskError)

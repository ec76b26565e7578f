"""GEMINI's durable tier: promoted captures as standard ``torch.distributed.checkpoint`` directories.

- :mod:`.tier` -- :class:`DurableTier`: the promotions of a job, verified before use, newest first; the entry point.
- :mod:`.sidecar` -- what a promotion's SHA-256 sidecar must contain, and its MAC.
- :mod:`.held_files` -- a promotion's files opened once, hashed and loaded through the same descriptors.
- :mod:`.keys` -- the DCP key of every tensor of a capture (shards, replicated state, a rank's own state).
- :mod:`.codecs` -- the protocol and registry of partition codecs (an adapter's per-parameter storage).
- :mod:`.promote` / :mod:`.load` -- the collective promotion and load.
"""

from gemscout.gemini.durable.sidecar import SIDECAR
from gemscout.gemini.durable.tier import DurableTier

__all__ = ["SIDECAR", "DurableTier"]

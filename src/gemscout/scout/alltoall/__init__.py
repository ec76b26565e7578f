"""SCOUT for expert-parallel dispatch: record every AllToAll's split metadata, replay a bounded set, verify the bytes.

A Mixture-of-Experts layer moves tokens to the rank that holds their expert with ``all_to_all_single`` and uneven
splits, and back again. A link or a rank that corrupts those bytes changes training silently, and the replay of
dense recipes never exercises that path. So, during the step, :class:`AllToAllCheck` records the metadata of each
AllToAll the dispatch module issues (group, dtype, row shape, input and output split sizes) — the user installs it
once on the module (:meth:`AllToAllCheck.install`), nothing is called per step — and at a due step it replays, on
every rank of each EP group, a bounded representative set of AllToAlls with deterministic payloads:

* ``recorded`` — the largest recorded call, with its own uneven splits;
* ``balanced`` — every rank sends the same number of rows to every rank;
* ``cyclic`` — every rank sends all its rows to the next rank (a cyclic permutation: one link each, zero splits).

Every sender digests each chunk before sending; every receiver digests what it got and regenerates what it should
have got. One JSON all-gather of those digests, and every rank of the group judges all pairs with the same pure
function (:func:`judge`): a chunk whose sender digest differs from the regenerated one names the sender
(scope ``rank``); a chunk that arrived different from what its sender digested names the (sender, receiver) pair
(scope ``peer_group``: either end, or the link between them). The replay runs at fixed, agreed shapes, so every rank
runs the same collectives in the same order whatever it found locally. Metadata and digests travel on the check's own
gloo twin of each group; only the replayed AllToAlls use the recorded group (and its device: CUDA under NCCL).

How recording works: while the installed module's forward runs on the thread that called it,
``torch.distributed.all_to_all_single`` is wrapped so each call is noted and then passed through unchanged. Code that
bound the function before (``from torch.distributed import all_to_all_single``) is not seen; call it through the
module. Backward AllToAlls (the reverse of the forward ones) are not recorded.
"""

from gemscout.scout.alltoall.check import AllToAllCheck, Installed, SendHook
from gemscout.scout.alltoall.config import AllToAllConfig
from gemscout.scout.alltoall.plan import CASES, judge, payload, plan_cases, reports_for
from gemscout.scout.alltoall.records import AllToAllRecord, AllToAllResult

__all__ = [
    "CASES",
    "AllToAllCheck",
    "AllToAllConfig",
    "AllToAllRecord",
    "AllToAllResult",
    "Installed",
    "SendHook",
    "judge",
    "payload",
    "plan_cases",
    "reports_for",
]

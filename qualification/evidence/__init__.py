"""Evidence bundles: seal a run's payload into a signed, revision-bound in-toto manifest, and verify one.

The engine calls :func:`seal_bundle` with a :class:`SealInput`; people and CI call ``validation-evidence verify``
(:func:`verify_bundle`). See docs/evidence.md for the layout, the checks and the exit codes.
"""

from qualification.evidence.facts import (
    BackedClaim,
    Boundaries,
    CampaignRef,
    CommandRecord,
    Scope,
    SealInput,
    Summary,
    Topology,
    UnbackedClaim,
)
from qualification.evidence.freshness import Freshness, FreshnessReport
from qualification.evidence.seal import SealedBundle, seal_bundle, sign_bundle
from qualification.evidence.sign import (
    KeySigner,
    NoneSigner,
    Signer,
    SigstoreSigner,
    generate_key,
    make_signer,
)
from qualification.evidence.verify import TrustPolicy, VerificationResult, verify_bundle

__all__ = [
    "BackedClaim",
    "Boundaries",
    "CampaignRef",
    "CommandRecord",
    "Freshness",
    "FreshnessReport",
    "KeySigner",
    "NoneSigner",
    "Scope",
    "SealInput",
    "SealedBundle",
    "Signer",
    "SigstoreSigner",
    "Summary",
    "Topology",
    "TrustPolicy",
    "UnbackedClaim",
    "VerificationResult",
    "generate_key",
    "make_signer",
    "seal_bundle",
    "sign_bundle",
    "verify_bundle",
]

"""Signing a manifest, and checking the signature over one.

Three signers behind one interface (:class:`Signer`): ``none`` (digests only), ``key`` (a DSSE v1 envelope made with a
local ECDSA P-256 key: offline, what tests use) and ``sigstore`` (keyless; needs an OIDC token and the network, so CI
only). Every signer signs the exact bytes of ``manifest.json``; the verifier then requires ``manifest.json`` to equal
the signed payload byte for byte, and works from those bytes only.

``sigstore`` is an optional extra (``pip install 'gemscout[sigstore]'``), imported only when asked for.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from qualification.errors import QualificationError, SignatureInvalid, UsageError
from qualification.evidence.manifest import DSSE_NAME, PAYLOAD_TYPE, SIGSTORE_NAME

GITHUB_OIDC_ISSUER = "https://token.actions.githubusercontent.com"
_INSTALL_HINT = "install the extra: pip install 'gemscout[sigstore]'"


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``.

    Lengths are byte counts in ASCII decimal; signing this (not the bare body) binds the payload type to the bytes.
    """
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(type_bytes), type_bytes, len(body), body)


def keyid(public_key: ec.EllipticCurvePublicKey) -> str:
    """Hex SHA-256 of the key's SubjectPublicKeyInfo DER. A hint for messages only: DSSE keyids are unauthenticated."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


class Signer(ABC):
    """Turns manifest bytes into the contents of the signature file ``envelope_name`` (None: no file)."""

    mode: ClassVar[str]
    envelope_name: ClassVar[str | None]

    def sign(self, manifest: bytes) -> bytes | None:
        """Sign ``manifest`` exactly as given. Raises :class:`UsageError` for an empty manifest."""
        if not manifest:
            raise UsageError("refusing to sign an empty manifest")
        return self._do_sign(manifest)

    @abstractmethod
    def _do_sign(self, manifest: bytes) -> bytes | None: ...


class NoneSigner(Signer):
    """No signature: integrity rests on the digests alone, and whoever hands you the bundle."""

    mode = "none"
    envelope_name = None

    def _do_sign(self, manifest: bytes) -> bytes | None:
        return None


class KeySigner(Signer):
    """DSSE v1 envelope over the manifest, signed with a local ECDSA P-256 key (signature DER, SHA-256)."""

    mode = "key"
    envelope_name = DSSE_NAME

    def __init__(self, private_key: ec.EllipticCurvePrivateKey) -> None:
        if not isinstance(private_key.curve, ec.SECP256R1):
            raise UsageError(f"signing key must be ECDSA P-256, got {private_key.curve.name}")
        self._key = private_key

    def _do_sign(self, manifest: bytes) -> bytes | None:
        signature = self._key.sign(pae(PAYLOAD_TYPE, manifest), ec.ECDSA(hashes.SHA256()))
        envelope = {
            "payload": base64.b64encode(manifest).decode("ascii"),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [
                {
                    "keyid": keyid(self._key.public_key()),
                    "sig": base64.b64encode(signature).decode(),
                }
            ],
        }
        return (json.dumps(envelope, sort_keys=True, indent=2) + "\n").encode("utf-8")


class SigstoreSigner(Signer):
    """Keyless signing through Sigstore (Fulcio certificate + Rekor entry) as a DSSE bundle.

    ``identity_token`` is a raw OIDC token; without one, the ambient CI credential is used (GitHub Actions with
    ``permissions: id-token: write``). Blocks on the Sigstore services. Raises :class:`UsageError` when the extra is
    missing or no token is found, :class:`QualificationError` when the services refuse.
    """

    mode = "sigstore"
    envelope_name = SIGSTORE_NAME

    def __init__(self, *, identity_token: str | None = None, staging: bool = False) -> None:
        self._identity_token = identity_token
        self._staging = staging

    def _do_sign(self, manifest: bytes) -> bytes | None:
        try:
            from sigstore.dsse import Statement
            from sigstore.errors import Error as SigstoreError
            from sigstore.models import ClientTrustConfig
            from sigstore.oidc import IdentityToken, detect_credential
            from sigstore.sign import SigningContext
        except ImportError as exc:
            raise UsageError(
                f"sigstore signing needs the sigstore package; {_INSTALL_HINT}"
            ) from exc
        try:
            token = self._identity_token or detect_credential()
            if not token:
                raise UsageError(
                    "sigstore signing needs an OIDC token: run in CI with id-token: write"
                )
            trust = ClientTrustConfig.staging() if self._staging else ClientTrustConfig.production()
            context = SigningContext.from_trust_config(trust)
            with context.signer(IdentityToken(token)) as signer:
                bundle = signer.sign_dsse(Statement(manifest))
        except (SigstoreError, OSError) as exc:
            raise QualificationError(f"sigstore signing failed: {exc}") from exc
        return str(bundle.to_json()).encode("utf-8")


def make_signer(mode: str, *, key: Path | None = None, identity_token: str | None = None) -> Signer:
    """The signer for ``mode`` (``none``, ``key`` with ``key``, or ``sigstore``). Raises :class:`UsageError`."""
    if mode == "none":
        return NoneSigner()
    if mode == "key":
        if key is None:
            raise UsageError(
                "--sign key needs --key PATH (make one with: validation-evidence keygen PATH)"
            )
        return KeySigner(load_private_key(key))
    if mode == "sigstore":
        # Checked here, before any cell runs: hours of cells must not end in "the extra is not installed".
        if importlib.util.find_spec("sigstore") is None:
            raise UsageError(
                f"--sign sigstore needs the sigstore package, which is not installed; {_INSTALL_HINT}"
            )
        return SigstoreSigner(identity_token=identity_token)
    raise UsageError(f"unknown signing mode {mode!r}; choose none, key or sigstore")


def generate_key(path: Path) -> tuple[Path, Path]:
    """Write a new P-256 private key to ``path`` (PEM, mode 0600) and its public key to ``path`` + ``.pub``.

    Refuses to overwrite either file (:class:`UsageError`): losing a signing key is not undoable.
    """
    public_path = path.with_name(path.name + ".pub")
    for target in (path, public_path):
        if target.exists():
            raise UsageError(f"{target} already exists; refusing to overwrite a key")
    private_key = ec.generate_private_key(ec.SECP256R1())
    private_pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
        )  # never world-readable, not even briefly
        with os.fdopen(fd, "wb") as handle:
            handle.write(private_pem)
        public_path.write_bytes(public_pem)
    except OSError as exc:
        raise UsageError(f"cannot write key {exc.filename or path}: {exc.strerror}") from exc
    return path, public_path


def load_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The unencrypted PEM P-256 private key at ``path``. Raises :class:`UsageError` naming the file."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise UsageError(f"cannot read signing key {path}: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise UsageError(f"{path} is not an ECDSA P-256 private key")
    return key


def load_public_key(path: Path) -> ec.EllipticCurvePublicKey:
    """The PEM P-256 public key at ``path``. Raises :class:`UsageError` naming the file."""
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read public key {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise UsageError(f"{path} is not a PEM public key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise UsageError(f"{path} is not an ECDSA P-256 public key")
    return key


def _b64decode(text: Any, what: str) -> bytes:
    # DSSE requires verifiers to accept both the standard and the URL-safe alphabet, padded or not.
    if not isinstance(text, str):
        raise SignatureInvalid(f"signature: {DSSE_NAME} {what} is not a base64 string")
    normalized = text.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(normalized + "=" * (-len(normalized) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SignatureInvalid(f"signature: {DSSE_NAME} {what} is not valid base64") from exc


def verify_dsse(envelope_bytes: bytes, public_key: ec.EllipticCurvePublicKey) -> bytes:
    """Check the DSSE envelope against ``public_key`` and return the signed payload bytes (use only these).

    Raises :class:`SignatureInvalid` for a malformed envelope, a wrong payload type, a signature made by another key,
    or a signature that does not verify (payload or signature altered).
    """
    try:
        envelope = json.loads(envelope_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SignatureInvalid(f"signature: {DSSE_NAME} is not JSON: {exc}") from exc
    except (
        RecursionError
    ) as exc:  # a parser stack exhausted by nesting is a malformed envelope, not a crash
        raise SignatureInvalid(
            f"signature: {DSSE_NAME} is nested too deeply to be a DSSE envelope"
        ) from exc
    signatures = envelope.get("signatures") if isinstance(envelope, dict) else None
    if (
        not isinstance(signatures, list)
        or not signatures
        or not all(isinstance(s, dict) for s in signatures)
    ):
        raise SignatureInvalid(f"signature: {DSSE_NAME} is not a DSSE envelope (no signatures)")
    if envelope.get("payloadType") != PAYLOAD_TYPE:
        raise SignatureInvalid(
            f"signature: payloadType is {envelope.get('payloadType')!r}, expected {PAYLOAD_TYPE!r}"
        )
    payload = _b64decode(envelope.get("payload"), "payload")
    message = pae(PAYLOAD_TYPE, payload)
    for entry in signatures:
        try:
            public_key.verify(
                _b64decode(entry.get("sig"), "sig"), message, ec.ECDSA(hashes.SHA256())
            )
        except (InvalidSignature, SignatureInvalid):
            continue
        return payload
    # The keyid only chooses the message; the decision above was made on the signature alone.
    expected_id = keyid(public_key)
    claimed_ids = {
        e.get("keyid") for e in signatures if isinstance(e.get("keyid"), str) and e.get("keyid")
    }
    if claimed_ids and expected_id not in claimed_ids:
        claimed = ", ".join(sorted(str(k)[:16] for k in claimed_ids))
        raise SignatureInvalid(
            f"signature: made by another key ({claimed}…), not the given public key ({expected_id[:16]}…)"
        )
    raise SignatureInvalid(
        "signature: DSSE signature does not verify with the given public key (envelope altered)"
    )


def verify_sigstore(
    bundle_bytes: bytes, *, trusted_root: Path, identity: str, issuer: str, expected_commit: str
) -> bytes:
    """Check a Sigstore DSSE bundle offline against the pinned ``trusted_root`` and return the signed payload.

    The policy requires the certificate's identity (SAN) and issuer to match exactly, and its SourceRepositoryDigest
    to equal ``expected_commit``: a claim the workflow cannot forge, unlike anything in the predicate. Raises
    :class:`UsageError` when the extra is missing or the trusted root unreadable, :class:`SignatureInvalid` otherwise.
    """
    try:
        from sigstore.errors import Error as SigstoreError
        from sigstore.models import Bundle, TrustedRoot
        from sigstore.verify import Verifier
        from sigstore.verify.policy import AllOf, Identity, OIDCSourceRepositoryDigest
    except ImportError as exc:
        raise UsageError(
            f"{SIGSTORE_NAME} needs the sigstore package to verify; {_INSTALL_HINT}"
        ) from exc
    try:
        root = TrustedRoot.from_file(str(trusted_root))
    except (OSError, ValueError, SigstoreError) as exc:
        raise UsageError(f"cannot load trusted root {trusted_root}: {exc}") from exc
    try:
        bundle = Bundle.from_json(bundle_bytes)
        policy = AllOf(
            [
                Identity(identity=identity, issuer=issuer),
                OIDCSourceRepositoryDigest(expected_commit),
            ]
        )
        payload_type, payload = Verifier(trusted_root=root).verify_dsse(bundle, policy)
    except (SigstoreError, ValueError) as exc:
        raise SignatureInvalid(f"signature: {SIGSTORE_NAME} does not verify: {exc}") from exc
    if payload_type != PAYLOAD_TYPE:
        raise SignatureInvalid(
            f"signature: payloadType is {payload_type!r}, expected {PAYLOAD_TYPE!r}"
        )
    return bytes(payload)

"""Signing: DSSE exactly per spec, every signer against one contract, and signatures checked before anything else."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import stat
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from evidence_support import make_facts, make_payload, make_repo, rewrite_manifest

from qualification.errors import EXIT_SIGNATURE, QualificationError, SignatureInvalid, UsageError
from qualification.evidence import (
    KeySigner,
    NoneSigner,
    Signer,
    SigstoreSigner,
    seal_bundle,
    sign_bundle,
    verify_bundle,
)
from qualification.evidence.manifest import DSSE_NAME, MANIFEST_NAME, PAYLOAD_TYPE, SIGSTORE_NAME
from qualification.evidence.sign import (
    generate_key,
    keyid,
    load_private_key,
    make_signer,
    pae,
    verify_dsse,
    verify_sigstore,
)
from qualification.evidence.verify import TrustPolicy

pytestmark = pytest.mark.timeout(60)
HAVE_SIGSTORE = importlib.util.find_spec("sigstore") is not None


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return generate_key(tmp_path / "signing.pem")


@pytest.fixture
def signed(tmp_path: Path, keys: tuple[Path, Path]) -> tuple[Path, str, Path]:
    """A key-signed bundle at the head of main: (bundle, commit, public key)."""
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo, signer=KeySigner(load_private_key(keys[0])))
    return bundle, commit, keys[1]


def _rejects(bundle: Path, commit: str, trust: TrustPolicy) -> SignatureInvalid:
    with pytest.raises(SignatureInvalid) as caught:
        verify_bundle(bundle, expected_commit=commit, trust=trust)
    assert caught.value.exit_code == EXIT_SIGNATURE
    return caught.value


def _edit_envelope(bundle: Path, edit: Any) -> None:
    path = bundle / DSSE_NAME
    envelope = json.loads(path.read_bytes())
    edit(envelope)
    path.write_text(json.dumps(envelope))


def test_pae_matches_the_dsse_test_vector() -> None:
    assert (
        pae("http://example.com/HelloWorld", b"hello world")
        == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )
    assert pae("t", b"") == b"DSSEv1 1 t 0 "
    assert pae("é", b"x") == "DSSEv1 2 é 1 x".encode()  # lengths count bytes, not characters


def test_keyid_is_sha256_of_the_public_key_der() -> None:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert keyid(key) == hashlib.sha256(der).hexdigest()


# One contract, every signer: sign exact bytes, refuse empty input, and write the file the verifier looks for.


def _signer(mode: str) -> Signer:
    if mode == "key":
        return KeySigner(ec.generate_private_key(ec.SECP256R1()))
    return (
        SigstoreSigner(identity_token="header.payload.sig") if mode == "sigstore" else NoneSigner()
    )


@pytest.mark.parametrize("mode", ["none", "key", "sigstore"])
def test_signer_contract(mode: str, fake_sigstore: Any) -> None:
    signer = _signer(mode)
    assert signer.mode == mode
    with pytest.raises(UsageError, match="empty manifest"):
        signer.sign(b"")
    envelope = signer.sign(b'{"_type": "x"}\n')
    assert (envelope is None) == (signer.envelope_name is None)
    assert signer.envelope_name in (None, DSSE_NAME, SIGSTORE_NAME)


def test_dsse_round_trip_returns_the_exact_signed_bytes() -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    body = "manifest bytes é\n".encode()
    envelope = KeySigner(private).sign(body)
    assert envelope is not None
    parsed = json.loads(envelope)
    assert parsed["payloadType"] == PAYLOAD_TYPE and parsed["signatures"][0]["keyid"] == keyid(
        private.public_key()
    )
    assert verify_dsse(envelope, private.public_key()) == body


def test_dsse_accepts_url_safe_unpadded_base64() -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    envelope = json.loads(KeySigner(private).sign(b"\xfb\xff" * 7) or b"")
    envelope["payload"] = (
        base64.urlsafe_b64encode(base64.b64decode(envelope["payload"])).decode().rstrip("=")
    )
    signature = envelope["signatures"][0]
    signature["sig"] = (
        base64.urlsafe_b64encode(base64.b64decode(signature["sig"])).decode().rstrip("=")
    )
    assert verify_dsse(json.dumps(envelope).encode(), private.public_key()) == b"\xfb\xff" * 7


def test_signed_bundle_verifies_signature_first(signed: tuple[Path, str, Path]) -> None:
    bundle, commit, public = signed
    result = verify_bundle(bundle, expected_commit=commit, trust=TrustPolicy(public_key=public))
    assert result.signature == "key"
    assert result.checks_passed[:2] == ("intake", "signature")


def test_bad_signature(signed: tuple[Path, str, Path]) -> None:
    bundle, commit, public = signed

    def flip(envelope: dict) -> None:
        sig = bytearray(base64.b64decode(envelope["signatures"][0]["sig"]))
        sig[-1] ^= 0x01
        envelope["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()

    _edit_envelope(bundle, flip)
    assert "does not verify with the given public key" in str(
        _rejects(bundle, commit, TrustPolicy(public_key=public))
    )


def test_wrong_key(signed: tuple[Path, str, Path], tmp_path: Path) -> None:
    bundle, commit, _ = signed
    _, other_public = generate_key(tmp_path / "other.pem")
    assert "made by another key" in str(
        _rejects(bundle, commit, TrustPolicy(public_key=other_public))
    )


def test_edited_manifest_of_a_signed_bundle(signed: tuple[Path, str, Path]) -> None:
    bundle, commit, public = signed
    rewrite_manifest(bundle, lambda m: m["predicate"]["summary"].update(passed=2, skipped=1))
    error = _rejects(bundle, commit, TrustPolicy(public_key=public))
    assert "manifest.json differs from the payload signed in manifest.dsse.json" in str(error)


def test_edited_payload_inside_the_envelope(signed: tuple[Path, str, Path]) -> None:
    bundle, commit, public = signed
    forged = (bundle / MANIFEST_NAME).read_bytes().replace(b'"PASSED"', b'"FAILED"')
    (bundle / MANIFEST_NAME).write_bytes(forged)
    _edit_envelope(bundle, lambda e: e.update(payload=base64.b64encode(forged).decode()))
    assert "does not verify" in str(_rejects(bundle, commit, TrustPolicy(public_key=public)))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda e: e.update(payloadType="text/plain"), "payloadType is 'text/plain'"),
        (lambda e: e.update(signatures=[]), "not a DSSE envelope"),
        (lambda e: e.update(payload="%%%"), "not valid base64"),
    ],
)
def test_malformed_envelope(signed: tuple[Path, str, Path], edit: Any, message: str) -> None:
    bundle, commit, public = signed
    _edit_envelope(bundle, edit)
    assert message in str(_rejects(bundle, commit, TrustPolicy(public_key=public)))


def test_envelope_that_is_not_json(signed: tuple[Path, str, Path]) -> None:
    bundle, commit, public = signed
    (bundle / DSSE_NAME).write_text("not json")
    assert "is not JSON" in str(_rejects(bundle, commit, TrustPolicy(public_key=public)))


def test_unsigned_bundle_when_a_signature_is_required(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    for trust in (TrustPolicy(require_signature=True), TrustPolicy(public_key=keys[1])):
        assert "bundle is not signed" in str(_rejects(bundle, commit, trust))


def test_deleting_the_signature_of_a_signed_bundle_is_caught_when_required(
    signed: tuple[Path, str, Path],
) -> None:
    bundle, commit, public = signed
    (bundle / DSSE_NAME).unlink()
    assert "bundle is not signed" in str(_rejects(bundle, commit, TrustPolicy(public_key=public)))


def test_signed_bundle_without_a_key_is_a_usage_error(signed: tuple[Path, str, Path]) -> None:
    bundle, commit, _ = signed
    with pytest.raises(UsageError, match="pass --public-key"):
        verify_bundle(bundle, expected_commit=commit)


def test_sign_bundle_signs_an_already_sealed_bundle(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    signer = make_signer("key", key=keys[0])
    assert sign_bundle(bundle, signer) == bundle / DSSE_NAME
    assert (
        verify_bundle(
            bundle, expected_commit=commit, trust=TrustPolicy(public_key=keys[1])
        ).signature
        == "key"
    )
    with pytest.raises(UsageError, match="already signed"):
        sign_bundle(bundle, signer)


def test_keygen_writes_a_private_key_only_its_owner_can_read(keys: tuple[Path, Path]) -> None:
    private, public = keys
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    with pytest.raises(UsageError, match="refusing to overwrite"):
        generate_key(private)
    with pytest.raises(UsageError, match="cannot write key"):
        generate_key(private.parent / "no-such-dir" / "key.pem")


def test_key_loading_errors_name_the_file(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    with pytest.raises(UsageError, match="garbage.pem is not an unencrypted PEM private key"):
        load_private_key(garbage)
    p384 = tmp_path / "p384.pem"
    p384.write_bytes(
        ec.generate_private_key(ec.SECP384R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(UsageError, match="not an ECDSA P-256 private key"):
        load_private_key(p384)
    with pytest.raises(UsageError, match="cannot read signing key"):
        load_private_key(tmp_path / "absent.pem")


def test_make_signer_explains_bad_choices() -> None:
    with pytest.raises(UsageError, match="needs --key"):
        make_signer("key")
    with pytest.raises(UsageError, match="unknown signing mode"):
        make_signer("gpg")


# sigstore: wiring tested against a stand-in package; the network is never touched.


@pytest.fixture
def fake_sigstore(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Install stand-in ``sigstore`` modules that record what our code asks of them."""
    record = types.SimpleNamespace(
        statement=None, token=None, policy=None, verify_returns=(PAYLOAD_TYPE, b"")
    )

    class Error(Exception):
        pass

    class Statement:
        def __init__(self, contents: bytes) -> None:
            record.statement = contents

    class Bundle:
        def __init__(self, raw: bytes = b"") -> None:
            self.raw = raw

        @classmethod
        def from_json(cls, raw: bytes) -> Bundle:
            if raw == b"corrupt":
                raise Error("invalid bundle")
            return cls(raw)

        def to_json(self) -> str:
            return '{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json"}'

    class FakeSigner:
        def __enter__(self) -> FakeSigner:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def sign_dsse(self, statement: Statement) -> Bundle:
            return Bundle()

    class SigningContext:
        @classmethod
        def from_trust_config(cls, trust: object) -> SigningContext:
            return cls()

        def signer(self, token: object) -> FakeSigner:
            record.token = token
            return FakeSigner()

    class Verifier:
        def __init__(self, *, trusted_root: object) -> None:
            pass

        def verify_dsse(self, bundle: Bundle, policy: object) -> tuple[str, bytes]:
            record.policy = policy
            return record.verify_returns

    def policy(name: str) -> type:
        return type(name, (), {"__init__": lambda self, *a, **kw: setattr(self, "args", (a, kw))})

    modules = {
        "sigstore": {},
        "sigstore.errors": {"Error": Error},
        "sigstore.dsse": {"Statement": Statement},
        "sigstore.models": {
            "Bundle": Bundle,
            "ClientTrustConfig": types.SimpleNamespace(
                production=lambda: "prod", staging=lambda: "staging"
            ),
            "TrustedRoot": types.SimpleNamespace(from_file=lambda path: path),
        },
        "sigstore.oidc": {
            "IdentityToken": lambda raw: ("token", raw),
            "detect_credential": lambda: None,
        },
        "sigstore.sign": {"SigningContext": SigningContext},
        "sigstore.verify": {"Verifier": Verifier},
        "sigstore.verify.policy": {
            name: policy(name) for name in ("AllOf", "Identity", "OIDCSourceRepositoryDigest")
        },
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    record.Error = Error
    return record


def test_sigstore_signer_signs_the_exact_manifest_bytes(fake_sigstore: Any) -> None:
    envelope = SigstoreSigner(identity_token="raw-oidc").sign(b"manifest")
    assert fake_sigstore.statement == b"manifest"
    assert fake_sigstore.token == ("token", "raw-oidc")
    assert envelope is not None and b"sigstore.bundle" in envelope


def test_sigstore_signer_without_a_token_is_a_usage_error(fake_sigstore: Any) -> None:
    with pytest.raises(UsageError, match="needs an OIDC token"):
        SigstoreSigner().sign(b"manifest")


def test_sigstore_verify_binds_identity_and_commit(fake_sigstore: Any, tmp_path: Path) -> None:
    fake_sigstore.verify_returns = (PAYLOAD_TYPE, b"signed bytes")
    payload = verify_sigstore(
        b"{}",
        trusted_root=tmp_path / "root.json",
        identity="wf@refs/heads/main",
        issuer="iss",
        expected_commit="a" * 40,
    )
    assert payload == b"signed bytes"
    identity, digest = fake_sigstore.policy.args[0][0]
    assert identity.args[1] == {"identity": "wf@refs/heads/main", "issuer": "iss"}
    assert digest.args[0] == ("a" * 40,)


def test_sigstore_verify_failures_are_signature_errors(fake_sigstore: Any, tmp_path: Path) -> None:
    options = {
        "trusted_root": tmp_path / "r.json",
        "identity": "i",
        "issuer": "s",
        "expected_commit": "a" * 40,
    }
    with pytest.raises(SignatureInvalid, match="does not verify"):
        verify_sigstore(b"corrupt", **options)  # type: ignore[arg-type]
    fake_sigstore.verify_returns = ("text/plain", b"x")
    with pytest.raises(SignatureInvalid, match="payloadType"):
        verify_sigstore(b"{}", **options)  # type: ignore[arg-type]


def test_sigstore_signed_bundle_goes_through_the_verifier(
    tmp_path: Path, fake_sigstore: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo, signer=SigstoreSigner(identity_token="t"))
    assert (bundle / SIGSTORE_NAME).is_file()
    with pytest.raises(UsageError, match="--trusted-root and --cert-identity"):
        verify_bundle(bundle, expected_commit=commit)
    fake_sigstore.verify_returns = (PAYLOAD_TYPE, (bundle / MANIFEST_NAME).read_bytes())
    trust = TrustPolicy(trusted_root=tmp_path / "root.json", cert_identity="wf@refs/heads/main")
    assert verify_bundle(bundle, expected_commit=commit, trust=trust).signature == "sigstore"
    fake_sigstore.verify_returns = (PAYLOAD_TYPE, b"other bytes")
    assert "differs from the payload signed in manifest.sigstore.json" in str(
        _rejects(bundle, commit, trust)
    )


def test_missing_sigstore_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in (
        "sigstore",
        "sigstore.dsse",
        "sigstore.errors",
        "sigstore.models",
        "sigstore.verify",
    ):
        monkeypatch.setitem(
            sys.modules, name, None
        )  # a None entry makes the import fail as if not installed
    with pytest.raises(UsageError, match=r"gemscout\[sigstore\]"):
        SigstoreSigner(identity_token="t").sign(b"x")
    with pytest.raises(UsageError, match=r"gemscout\[sigstore\]"):
        verify_sigstore(
            b"{}", trusted_root=tmp_path, identity="i", issuer="s", expected_commit="a" * 40
        )


def test_sigstore_signing_failure_is_one_qualification_error(
    fake_sigstore: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: object, statement: object) -> None:
        raise fake_sigstore.Error("fulcio said no")

    monkeypatch.setattr(
        sys.modules["sigstore.sign"].SigningContext, "signer", lambda self, t: _Raising(refuse)
    )
    with pytest.raises(QualificationError, match="sigstore signing failed: fulcio said no"):
        SigstoreSigner(identity_token="t").sign(b"x")


class _Raising:
    def __init__(self, sign: Any) -> None:
        self.sign_dsse = lambda statement: sign(self, statement)

    def __enter__(self) -> _Raising:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


# The real package, when installed: our manifest is a Statement it accepts, and its errors map to ours.


@pytest.mark.skipif(not HAVE_SIGSTORE, reason="the sigstore extra is not installed")
def test_real_sigstore_accepts_our_manifest_as_a_statement(tmp_path: Path) -> None:
    from sigstore.dsse import Statement

    repo, _ = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    Statement((bundle / MANIFEST_NAME).read_bytes())  # raises if sigstore would refuse to sign it


@pytest.mark.skipif(not HAVE_SIGSTORE, reason="the sigstore extra is not installed")
def test_real_sigstore_rejects_a_corrupt_bundle_offline(tmp_path: Path) -> None:
    import sigstore

    roots = sorted(Path(sigstore.__file__).parent.glob("_store/*/trusted_root.json"))
    if not roots:
        pytest.skip("this sigstore wheel embeds no trusted root")
    with pytest.raises(SignatureInvalid, match="manifest.sigstore.json does not verify"):
        verify_sigstore(
            b'{"not": "a bundle"}',
            trusted_root=roots[0],
            identity="i",
            issuer="s",
            expected_commit="a" * 40,
        )

"""Signed actions and commands (stream/signing.py): what verifies, what does not and why, key files
(Ed25519 pairs, HMAC old and new), rotation, purposes, the verify-only services' warning, and the
agent's side (a commands-topic message is carried out only when it verifies)."""

from __future__ import annotations

import os
import stat
import time

import orjson
import pytest

from faultlens import schema
from faultlens.cli import main
from faultlens.collectors.stacks import command_refusal
from faultlens.config import KeysConfig
from faultlens.errors import ConfigError
from faultlens.stream.signing import (
    Ed25519Key,
    Key,
    Keyring,
    Unverified,
    canonical,
    new_key,
    public_path,
    read_key,
    verifier_warning,
    write_key,
)
from tests.runner_standins import TEST_KEY, signing_keyring

T0 = 1_800_000_000.0


def _action(**kw) -> schema.Action:
    fields = dict(id="act-1", incident_id="inc-7", job="12345", ts=T0, type="evict_nodes", nodes=["n001"],
                  confidence=0.97, dry_run=False, reason="Xid 79")
    return schema.Action(**{**fields, **kw})


def _ring(keys: list[Key | Ed25519Key], now: float = T0, **kw) -> Keyring:
    return Keyring(keys, clock=lambda: now, **kw)


def _reason(ring: Keyring, event) -> str:
    with pytest.raises(Unverified) as info:
        ring.verify(event)
    return info.value.reason


def test_a_signed_action_verifies_and_every_change_to_it_does_not() -> None:
    ring = _ring([TEST_KEY])
    event = ring.sign(schema.cloudevent(_action(dry_run=True)))
    ring.verify(event)
    assert event["faultlenskeyid"] == "test-key" and len(event["faultlenssig"]) == 86
    assert event["faultlenssigalg"] == "ed25519"
    _ring([TEST_KEY.public_half()]).verify(event)  # the runner's side: the public half alone verifies
    flipped = orjson.loads(orjson.dumps(event))
    flipped["data"]["dry_run"] = False  # the forger's edit: make a dry-run action real
    assert _reason(ring, flipped) == "bad_signature"
    longer = dict(event, faultlensexpires="2100-01-01T00:00:00Z")  # the expiry is signed too
    assert _reason(ring, longer) == "bad_signature"
    ring.verify(orjson.loads(orjson.dumps(event, option=orjson.OPT_SORT_KEYS)))  # key order is not the signature's
    assert canonical(event) == canonical(dict(reversed(list(event.items()))))


def test_the_recorded_forged_action_is_refused_with_its_reason() -> None:
    # What the attack produced: a script writing CloudEvents with dry_run false, no signature.
    forged = schema.cloudevent(_action(id="act-forged-17", nodes=["n009"]))
    assert _reason(_ring([TEST_KEY]), forged) == "unsigned"
    other = Ed25519Key.from_seed("test-key", b"\x01" * 32)  # the right key id, the wrong private key
    assert _reason(_ring([TEST_KEY]), _ring([other]).sign(forged)) == "bad_signature"
    assert _reason(_ring([TEST_KEY]), _ring([Key("k-mine", b"\x02" * 32)]).sign(forged)) == "unknown_key"
    # Algorithm confusion: an HMAC "key" made of the public key bytes, under the real key id.
    confused = _ring([Key("test-key", TEST_KEY.public)]).sign(forged)
    assert _reason(_ring([TEST_KEY.public_half()]), confused) == "wrong_algorithm"
    assert _reason(_ring([]), forged) == "no_key_configured"
    assert _reason(_ring([TEST_KEY]), ["not", "an", "object"]) == "bad_envelope"


def test_expired_and_future_dated_events_are_refused_within_a_bounded_skew() -> None:
    signed = _ring([TEST_KEY], validity_s=900).sign(schema.cloudevent(_action()))
    _ring([TEST_KEY], now=T0 + 900 + 59).verify(signed)  # within max_skew_s (60) of the expiry
    assert _reason(_ring([TEST_KEY], now=T0 + 900 + 61), signed) == "expired"
    future = _ring([TEST_KEY]).sign(schema.cloudevent(_action(ts=T0 + 3600)))
    assert _reason(_ring([TEST_KEY]), future) == "future_dated"
    year_2100 = _ring([TEST_KEY]).sign(schema.cloudevent(_action(ts=4_102_444_800.0)))
    assert _reason(_ring([TEST_KEY]), year_2100) == "future_dated"
    _ring([TEST_KEY]).verify(_ring([TEST_KEY]).sign(schema.cloudevent(_action(ts=T0 + 30))))  # small skew is fine


def test_rotation_signs_with_the_active_key_and_verifies_with_every_listed_one(tmp_path) -> None:
    old, new = new_key("k-old"), new_key("k-new")
    files = tuple(str(write_key(k, tmp_path / f"{k.id}.toml")) for k in (old, new))
    before = Keyring.from_config(KeysConfig(files=files[:1]))
    during = Keyring.from_config(KeysConfig(files=files, active="k-new"))
    after = Keyring.from_config(KeysConfig(files=files[1:]))
    by_old = before.sign(schema.cloudevent(_action(ts=time.time())))
    by_new = during.sign(schema.cloudevent(_action(ts=time.time())))
    assert by_new["faultlenskeyid"] == "k-new"
    during.verify(by_old)  # in flight while diagnosis switched keys
    after.verify(by_new)
    with pytest.raises(Unverified, match="unknown_key"):
        after.verify(by_old)
    with pytest.raises(ConfigError, match="k-gone"):
        Keyring.from_config(KeysConfig(files=files, active="k-gone"))


def test_keys_new_writes_an_owner_only_file_and_bad_files_are_named(tmp_path, capsys) -> None:
    out = tmp_path / "keys" / "k1.toml"
    assert main(["keys", "new", "--out", str(out), "--id", "k1"]) == 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert read_key(out).id == "k1" and "FAULTLENS_KEYS_FILES" in capsys.readouterr().out
    assert main(["keys", "new", "--out", str(out)]) == 1  # never overwrites a key by accident
    assert "exists" in capsys.readouterr().err
    (tmp_path / "short.toml").write_text('id = "k2"\nsecret = "c2hvcnQ"\n')
    with pytest.raises(ConfigError, match="short.toml"):
        read_key(tmp_path / "short.toml")
    with pytest.raises(ConfigError, match="missing.toml"):
        Keyring.from_config(KeysConfig(files=(str(tmp_path / "missing.toml"),)))
    assert repr(read_key(out)) == "Ed25519Key(id='k1')"  # the secret is never printed
    assert "secret" not in public_path(out).read_text()


def test_a_signed_command_decodes_and_the_agent_refuses_an_unsigned_one() -> None:
    cmd = schema.Command("cmd-1", time.time(), "dump_stacks", "job-7", ["gpu-n1"])
    value = orjson.dumps(signing_keyring().sign(schema.cloudevent(cmd)))
    assert schema.decode("commands", value) == cmd  # the lake and older readers unwrap the envelope
    agent_ring = Keyring([TEST_KEY])
    assert command_refusal(agent_ring, value) is None
    # The recorded attack: a plain command written to the topic by anyone with write access.
    plain = schema.encode(cmd)
    assert command_refusal(agent_ring, plain).reason == "unsigned"
    assert command_refusal(agent_ring, b"\x00garbage").reason == "malformed_json"
    assert command_refusal(Keyring([]), value).reason == "no_key_configured"


def test_keys_new_makes_a_pair_the_public_half_verifies_and_cannot_sign(tmp_path, capsys) -> None:
    out, pub = tmp_path / "k1.toml", tmp_path / "runner" / "k1.pub.toml"
    assert main(["keys", "new", "--out", str(out), "--pub-out", str(pub), "--id", "k1"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and str(pub) in printed
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600 and stat.S_IMODE(os.stat(pub).st_mode) == 0o644
    assert 'type = "ed25519-private"' in out.read_text() and 'type = "ed25519-public"' in pub.read_text()
    diagnosis = Keyring.from_config(KeysConfig(files=(str(out),)))
    runner = Keyring.from_config(KeysConfig(files=(str(pub),)))
    event = diagnosis.sign(schema.cloudevent(_action(ts=time.time())))
    runner.verify(event)
    assert not runner.can_sign and runner.signing_key_ids() == []
    with pytest.raises(ConfigError, match="only public keys"):
        runner.sign(schema.cloudevent(_action()))
    with pytest.raises(ConfigError, match="public key"):
        Keyring.from_config(KeysConfig(files=(str(pub),), active="k1"))
    assert verifier_warning(runner, "runner") is None
    warning = verifier_warning(diagnosis, "agent")
    assert warning is not None and "holds a signing key (k1)" in warning and ".pub" in warning
    # Both files listed (diagnosis during a rotation): one key, and it signs.
    both = Keyring.from_config(KeysConfig(files=(str(pub), str(out))))
    assert list(both.keys) == ["k1"] and both.can_sign
    stranger = write_key(new_key("k1").public_half(), tmp_path / "other.pub")  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="different keys"):
        Keyring.from_config(KeysConfig(files=(str(out), str(stranger))))
    # A private file whose public line was edited is named, not trusted.
    edited = tmp_path / "edited.toml"
    edited.write_text(out.read_text().replace("public = \"", "public = \"AAAA"))
    with pytest.raises(ConfigError, match="edited.toml"):
        read_key(edited)


def test_hmac_keys_old_and_new_still_sign_and_verify(tmp_path, capsys) -> None:
    out = tmp_path / "shared.toml"
    assert main(["keys", "new", "--type", "hmac", "--out", str(out), "--id", "h1"]) == 0
    assert not public_path(out).exists() and 'type = "hmac-sha256"' in out.read_text()
    assert isinstance(read_key(out), Key) and "every holder can sign" in capsys.readouterr().out
    # A file written before key types existed: no type line, read as HMAC.
    old = tmp_path / "old.toml"
    old.write_text("# faultlens signing key; keep it secret (mode 0600)\nid = \"k-old\"\n"
                   "secret = \"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\"\n")
    old_key = read_key(old)
    assert old_key == Key("k-old", bytes(range(32)))
    ring = _ring([old_key])
    event = ring.sign(schema.cloudevent(_action()))
    assert event["faultlenssigalg"] == "hmac-sha256" and len(event["faultlenssig"]) == 43
    ring.verify(event)
    in_flight = {k: v for k, v in event.items() if k not in ("faultlenssigalg", "faultlenssig")}
    in_flight["faultlenssig"] = old_key.mac(canonical(in_flight))  # signed before faultlenssigalg existed
    ring.verify(in_flight)
    assert _reason(ring, dict(event, faultlenssigalg="ed25519")) == "wrong_algorithm"
    assert "holds a signing key (k-old): HMAC" in (verifier_warning(ring, "agent") or "")
    (tmp_path / "typo.toml").write_text('type = "rsa"\nid = "k3"\n')
    with pytest.raises(ConfigError, match="unknown key type .rsa.*typo.toml"):
        read_key(tmp_path / "typo.toml")


def test_a_key_restricted_to_commands_cannot_sign_an_action(tmp_path) -> None:
    cmd_key = new_key("k-cmd", purposes=["commands"])
    act_key = new_key("k-act", purposes=["actions"])
    files = [write_key(cmd_key, tmp_path / "cmd.toml"), write_key(act_key, tmp_path / "act.toml")]
    assert 'purposes = ["commands"]' in files[0].read_text()
    diagnosis = Keyring.from_config(KeysConfig(files=tuple(map(str, files)), active="k-cmd"))
    verifier = Keyring([read_key(f).public_half() for f in files])  # type: ignore[union-attr]
    cmd = schema.Command("cmd-1", time.time(), "dump_stacks", "job-7", ["gpu-n1"])
    action_event = diagnosis.sign(schema.cloudevent(_action(ts=time.time())))
    assert action_event["faultlenskeyid"] == "k-act"  # the active key may not sign actions: the other does
    assert diagnosis.sign(schema.cloudevent(cmd))["faultlenskeyid"] == "k-cmd"
    verifier.verify(action_event)
    # The attack: whoever holds the commands-only private key drops the restriction from their copy
    # and signs an eviction; the verifier's own (public) file says what the key may sign.
    unrestricted = Ed25519Key.from_seed("k-cmd", cmd_key.private or b"")  # type: ignore[union-attr]
    forged = Keyring([unrestricted]).sign(schema.cloudevent(_action(id="act-forged", ts=time.time())))
    assert _reason(verifier, forged) == "wrong_purpose"
    with pytest.raises(ConfigError, match="may sign actions"):
        _ring([cmd_key]).sign(schema.cloudevent(_action()))
    with pytest.raises(ConfigError, match="purposes"):
        new_key("k-x", purposes=["incidents"])


def test_an_agent_given_a_private_key_says_so_at_start(tmp_path, caplog) -> None:
    from types import SimpleNamespace

    from faultlens.collectors.stacks import StacksSource
    from faultlens.config import Config

    private = write_key(TEST_KEY, tmp_path / "k.toml")
    public = write_key(TEST_KEY.public_half(), public_path(private))
    StacksSource(SimpleNamespace(config=Config(keys=KeysConfig(files=(str(public),)))), {})
    assert "holds a signing key" not in caplog.text
    source = StacksSource(SimpleNamespace(config=Config(keys=KeysConfig(files=(str(private),)))), {})
    assert "agent holds a signing key (test-key)" in caplog.text and ".pub" in caplog.text
    assert source.keyring.keys["test-key"].can_sign  # it still verifies: a warning, not a refusal


def test_diagnosis_given_only_the_public_file_refuses_to_start(tmp_path) -> None:
    from faultlens.config import Config
    from faultlens.diagnosis.online import DiagnosisService

    public = write_key(TEST_KEY.public_half(), tmp_path / "k.toml.pub")
    with pytest.raises(ConfigError, match="only public keys.*not FILE.pub"):
        DiagnosisService(Config(keys=KeysConfig(files=(str(public),))))

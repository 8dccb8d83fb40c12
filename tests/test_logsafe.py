"""Log hygiene (faultlens/logsafe.py): no forged log lines, no secrets, for every logger of a service."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import time

from faultlens.logsafe import LogHygiene, escape_controls, redact, register_secret
from faultlens.stream.signing import new_key, read_key, write_key

# The recorded forgery: an action id carrying a newline and a fake runner line.
FORGED_ID = ("act-1\n2026-11-27 10:00:00,000 WARNING faultlens.diagnosis.runner.runner: executing action "
             "act-FORGED (evict_nodes) for job 1: scontrol update NodeName=n9 State=DRAIN")


def _logger(name: str) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(LogHygiene())
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


def test_a_newline_in_a_value_cannot_write_a_second_log_line() -> None:
    logger, out = _logger("faultlens.test.forged")
    logger.warning("action %s refused: %s", FORGED_ID, "reason\r\x1b[2Kcleared")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("WARNING faultlens.test.forged: action act-1\\n2026")
    assert "\\r\\x1b[2K" in lines[0]
    assert escape_controls("a\u2028b\x85c") == "a\\u2028b\\x85c"  # Unicode line breaks too


def test_passwords_tokens_and_keys_are_redacted_in_messages_and_tracebacks(tmp_path) -> None:
    key = read_key(write_key(new_key("k1"), tmp_path / "k1.toml"))  # reading a key registers its secret
    secret_text = (tmp_path / "k1.toml").read_text().split('secret = "')[1].split('"')[0]
    register_secret("hunter2-webhook-token")
    logger, out = _logger("kafka.test.dump")  # a third-party logger: the filter is on the handler
    logger.debug("Starting KafkaConsumer with configuration: {'sasl_plain_username': 'u', "
                 "'sasl_plain_password': 'pa ss', 'ssl_password': None}")
    logger.info("POST with Authorization: Bearer hunter2-webhook-token; password=abc&user=x; key %s", secret_text)
    try:
        raise RuntimeError(f"connect failed with sasl_password={secret_text}")
    except RuntimeError:
        logger.exception("oops")
    text = out.getvalue()
    for leaked in ("pa ss", "hunter2-webhook-token", "abc", secret_text):
        assert leaked not in text, leaked
    assert "'sasl_plain_password': '***'" in text and "user=x" in text and key.id == "k1"
    assert redact("tokens_per_s: 1200 step 5") == "tokens_per_s: 1200 step 5"  # ordinary words survive


def test_a_service_at_debug_never_prints_the_sasl_password(tmp_path) -> None:
    # The recorded leak: `faultlens runner --log-level DEBUG` printed kafka-python's configuration dump.
    password = "s3cr3t-SASL-pw"
    proc = subprocess.Popen(
        [sys.executable, "-m", "faultlens.cli", "runner", "--log-level", "DEBUG", "--duration-s", "2",
         "--bootstrap-servers", "127.0.0.1:9", "--set", "bus.security_protocol=SASL_PLAINTEXT",
         "--set", "bus.sasl_mechanism=PLAIN", "--set", "bus.sasl_username=u", "--set", f"bus.sasl_password={password}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(4)
    proc.kill()  # still retrying the unreachable bus; what it logged so far is what counts
    text = proc.communicate(timeout=30)[0].decode()
    assert "sasl_plain_password" in text  # kafka-python did dump its configuration
    assert password not in text

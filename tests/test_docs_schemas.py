"""Every example in docs/schemas.md decodes with the schema module."""

from __future__ import annotations

import re

import orjson

from faultlens import schema
from tests.conftest import REPO


def test_every_kind_has_a_decodable_example() -> None:
    text = (REPO / "docs" / "schemas.md").read_text()
    examples = dict(re.findall(r"^### (\S+)\n\n```json\n(.*?)\n```", text, flags=re.S | re.M))
    assert set(examples) == set(schema.RECORDS), "docs/schemas.md must show every record kind"
    for kind, body in examples.items():
        record = schema.decode(kind, body.encode())
        assert orjson.loads(body)["v"] == schema.SCHEMA_VERSION
        assert type(record).KIND == kind


def test_the_readme_configuration_example_loads(tmp_path) -> None:
    from faultlens.config import load_config

    text = (REPO / "README.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    path = tmp_path / "faultlens.toml"
    path.write_text(block)
    cfg = load_config(path, env={})
    assert cfg.bus.security_protocol == "SASL_SSL" and cfg.runner.adapter == "slurm"
    assert "..." not in str(cfg.describe())  # the password is masked

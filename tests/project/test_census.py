"""The census in the suite: a stratified slice of every transformers model type, each built tiny offline,
re-initialized, and judged by the model's own forward (tests/helpers/census.py), must keep the verdict that
tests/project/census_expected.json records. The whole census is `python scripts/census.py` (docs/census.md)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from helpers.census import census_one
from helpers.paths import ROOT

EXPECTED = json.loads((Path(__file__).parent / "census_expected.json").read_text())
SLICE = 60

sys.path.insert(0, str(ROOT / "scripts"))
from census import expected_verdict  # noqa: E402


def _slice(verdicts: dict[str, str], size: int) -> list[str]:
    """About ``size`` types, every verdict represented in proportion (at least two of each where it has
    two), picked by a hash of the name: the same slice on every machine, not a hand-kept list."""
    groups: dict[str, list[str]] = {}
    for name, verdict in verdicts.items():
        groups.setdefault(verdict.split(":")[0] if verdict.startswith("unbuildable") else verdict, []).append(name)
    picked = []
    for members in groups.values():
        members.sort(key=lambda n: hashlib.sha256(n.encode()).hexdigest())
        share = max(2, round(size * len(members) / len(verdicts)))
        picked += members[:share]
    return sorted(picked)


def test_no_type_is_silently_wrong_or_crashes():
    bad = {t: v for t, v in EXPECTED["verdicts"].items() if v.split(":")[0] in ("wrong", "crash")}
    assert not bad, f"the census records silently wrong or crashing types: {bad}"


def test_the_expectations_cover_every_installed_model_type():
    import transformers
    from transformers import CONFIG_MAPPING

    installed, recorded = set(CONFIG_MAPPING.keys()), set(EXPECTED["verdicts"])
    assert installed == recorded, (
        f"transformers {transformers.__version__} has types the census does not record ({sorted(installed - recorded)[:8]}) "
        f"or lacks recorded ones ({sorted(recorded - installed)[:8]}); census_expected.json is for "
        f"{EXPECTED['transformers']}: run `python scripts/census.py --update` and review the diff"
    )


@pytest.mark.parametrize("model_type", _slice(EXPECTED["verdicts"], SLICE))
def test_census_slice_keeps_its_verdict(model_type, tmp_path):
    verdict = census_one(model_type, work=tmp_path)
    assert expected_verdict(verdict.verdict) == EXPECTED["verdicts"][model_type], verdict.detail or verdict.verdict
    if verdict.kind in ("unbuildable", "unjudged"):  # why, in the census's fixed vocabulary
        assert verdict.reason is not None, verdict.verdict


@pytest.mark.parametrize(
    "model_type, row, broken",
    [
        ("convbert", "HEAD_RATIOS", {}),  # heads divided by a ratio
        ("maskformer", "SUBCONFIG_WORDS", {}),  # a backbone's and a decoder's heads from their own configs
        ("seamless_m4t", "SUBCONFIG_WORDS", {}),
    ],
)
def test_breaking_a_family_row_changes_the_verdict(model_type, row, broken, monkeypatch, tmp_path):
    """The census can fail: with one row of surgeon's family data emptied, a type it settles is no longer right."""
    from surgeon.detect import config
    from surgeon.vocab import config_keys

    assert EXPECTED["verdicts"][model_type] in ("right", "unjudged")
    monkeypatch.setattr(config_keys, row, broken)
    if row == "SUBCONFIG_WORDS":
        from surgeon.detect import subconfigs

        monkeypatch.setattr(subconfigs, row, broken)
        monkeypatch.setattr(subconfigs, "subconfig_key", lambda scope, word: None)
        monkeypatch.setattr(subconfigs, "prefixed_scope", lambda scope, word: None)
    else:
        monkeypatch.setattr(config, row, broken)
    verdict = census_one(model_type, work=tmp_path)
    assert verdict.kind in ("wrong", "refused"), verdict.verdict

"""Session fixtures shared by all tests."""

from __future__ import annotations

import pytest

from hf_assets import HFAssets


@pytest.fixture(autouse=True)
def _no_profiles_folder_left_behind(monkeypatch):
    """``--profiles DIR`` (cli.py) and benchmarks/fresh_profile.use set ``$REALLOC_PROFILES`` for the whole process,
    so a test that runs them in-process would price every later test's plans on its profiles (a search test failed
    only after test_fresh_profile). Each test starts without it, and whatever it sets is undone after it."""
    monkeypatch.setenv("REALLOC_PROFILES", "")
    monkeypatch.delenv("REALLOC_PROFILES")


@pytest.fixture(scope="session")
def hf_assets(tmp_path_factory) -> HFAssets:
    """The tiny tokenizer and HF checkpoints of tests/hf_assets.py, each built on first use."""
    return HFAssets(tmp_path_factory.mktemp("hf_assets"))


@pytest.fixture(scope="session")
def tiny_tok(hf_assets):
    """realloc's Tokenizer over the tiny tokenizer."""
    from realloc.data.tokenizer import Tokenizer

    return Tokenizer.load(hf_assets.tokenizer)


@pytest.fixture(scope="session")
def tiny_ref(hf_assets):
    """transformers' AutoTokenizer over the same directory: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_assets.tokenizer), local_files_only=True)

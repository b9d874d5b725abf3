"""The tokenizer cache: a GGUF file's tokenizer, converted by transformers once, loads from its saved folder."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from dflash2.loading.tokenizer import _from_pretrained, bundled_model_path, gguf_tokenizer_cache_path, load_tokenizer

pytestmark = pytest.mark.slow  # each conversion of the bundled vocabulary: ~10 s

TEXTS = ["Hello world", "  tabs\tand\nnewlines, ünïcödé, 日本語, 🙂", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def _same(cached, converted) -> None:
    for text in TEXTS:
        assert cached.encode(text) == converted.encode(text), text
        assert cached.decode(cached.encode(text)) == converted.decode(converted.encode(text))
    assert cached.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        converted.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (cached.bos_token_id, cached.eos_token_id, cached.pad_token_id, len(cached), cached.all_special_ids) == \
        (converted.bos_token_id, converted.eos_token_id, converted.pad_token_id, len(converted),
         converted.all_special_ids)


def test_the_first_load_saves_the_tokenizer_and_the_next_loads_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH2_CACHE_DIR", str(tmp_path))
    path = bundled_model_path()
    folder = Path(gguf_tokenizer_cache_path(os.path.realpath(path)))
    assert folder.parent.parent == tmp_path and not folder.exists()
    converted = load_tokenizer(path)
    assert (folder / "tokenizer.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left behind
    cached = _from_pretrained(str(folder))
    _same(cached, converted)
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    _same(load_tokenizer(path), converted)  # from the cache: not written again
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp


def test_a_damaged_cache_entry_is_converted_again_and_replaced(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("DFLASH2_CACHE_DIR", str(tmp_path))
    path = bundled_model_path()
    folder = Path(gguf_tokenizer_cache_path(os.path.realpath(path)))
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text('{"not": "a tokenizer"')
    with caplog.at_level(logging.WARNING, logger="dflash2.loading.tokenizer"):
        tokenizer = load_tokenizer(path)
    assert "did not load" in caplog.text and "converting" in caplog.text
    assert tokenizer.encode("Hello world") == _from_pretrained(str(folder)).encode("Hello world")


def test_an_unwritable_cache_only_costs_the_conversion(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("DFLASH2_CACHE_DIR", str(blocker))
    tokenizer = load_tokenizer(bundled_model_path())
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
    assert blocker.read_text() == "a file where the cache folder would be"


def test_two_processes_converting_at_once_both_load_and_leave_one_whole_entry(tmp_path: Path) -> None:
    """As a server and its engine process do on their first start: both convert, one rename wins."""
    import subprocess
    import sys

    script = ("from dflash2.loading.tokenizer import bundled_model_path, load_tokenizer; "
              "print(load_tokenizer(bundled_model_path()).encode('Hello world'))")
    env = {**os.environ, "DFLASH2_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    printed = [run.communicate(timeout=300)[0].strip() for run in runs]
    assert [run.returncode for run in runs] == [0, 0] and printed[0] == printed[1] != ""
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert not entry.name.startswith(".staging-")
    assert str(_from_pretrained(str(entry)).encode("Hello world")) == printed[0]

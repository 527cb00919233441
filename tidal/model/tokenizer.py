"""load_tokenizer: a transformers tokenizer for a GGUF file or HF directory, with chat_template set.

Building a tokenizer from GGUF metadata takes seconds (every vocab string and merge is parsed
field by field), so the converted tokenizer is cached on disk, keyed by the GGUF file's path,
size and mtime: $TIDAL_CACHE_DIR (default ~/.cache/tidal)/tokenizers/<key>/. Set
TIDAL_TOKENIZER_CACHE=0 to turn the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Optional

from tidal.model.loader import resolve_model_path

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str, tokenizer_path: Optional[str] = None) -> Any:
    """tokenizer_path, if given, is a tokenizer directory (or GGUF file) used instead of model_path."""
    from transformers import AutoTokenizer

    kind, resolved = resolve_model_path(tokenizer_path or model_path)
    if kind == "hf":
        return AutoTokenizer.from_pretrained(resolved)
    cache = _cache_dir(resolved)
    if cache is not None and os.path.exists(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception as e:  # a damaged cache entry: rebuild it
            logger.warning("ignoring tokenizer cache %s: %s", cache, e)
    tok = _tokenizer_from_gguf(resolved)
    if cache is not None:
        _save_to_cache(tok, cache)
    return tok


def _tokenizer_from_gguf(path: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    if not getattr(tok, "chat_template", None):
        from tidal.model.gguf_loader import read_gguf_chat_template

        template = read_gguf_chat_template(path)
        if template:
            tok.chat_template = template
    return tok


def _cache_dir(gguf_path: str) -> Optional[str]:
    if os.environ.get("TIDAL_TOKENIZER_CACHE", "1") == "0":
        return None
    st = os.stat(gguf_path)
    key = hashlib.sha1(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    root = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")
    return os.path.join(root, "tokenizers", key)


def _save_to_cache(tok: Any, cache: str) -> None:
    """Writes into a temporary sibling, then renames, so readers never see a half-written entry."""
    try:
        parent = os.path.dirname(cache)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # read-only home etc.: caching is only an optimisation
        logger.warning("could not cache the tokenizer in %s: %s", cache, e)


def eos_token_ids(tokenizer: Any, model_path: Optional[str] = None) -> list[int]:
    """The tokenizer's eos plus, for an HF directory, generation_config.json's eos ids (in that order)."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    if model_path and os.path.isdir(model_path):
        gen_path = os.path.join(model_path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            for e in eos if isinstance(eos, list) else ([eos] if eos is not None else []):
                if int(e) not in ids:
                    ids.append(int(e))
    return ids

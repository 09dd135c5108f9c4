"""The run's tokenizer: ``model.tokenizer`` names a Hugging Face tokenizer (hub name or local folder), or ``None``.

``None`` gives the built-in **byte tokenizer**: token id = UTF-8 byte value (0-255) plus a few special tokens, wrapped
as a real ``PreTrainedTokenizerFast`` with a ChatML chat template. It needs no download, fits the tiny demo model's
vocabulary (``model.vocab_size`` >= 259), and goes through exactly the same code paths (offsets, chat template,
encode/decode) as a production tokenizer such as Qwen3's, so nothing downstream special-cases it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from spade_mega.errors import SpadeError

log = logging.getLogger("spade_mega.tokenizer")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, the format Qwen3 uses; a generation prompt opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TokenizerError(SpadeError):
    """The configured tokenizer cannot be loaded."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_tokenizer() -> Any:
    """A fresh built-in byte tokenizer (``PreTrainedTokenizerFast``): ids 0-255 are bytes, then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


@lru_cache(maxsize=4)
def load_tokenizer(name: str | None) -> Any:
    """The tokenizer for ``model.tokenizer``: the byte tokenizer for ``None``, else ``AutoTokenizer`` (offline-safe)."""
    if name is None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise TokenizerError(
            f"model.tokenizer: cannot load tokenizer {name!r} ({str(exc).splitlines()[0]}); give a local folder "
            "holding tokenizer.json / tokenizer_config.json, or null for the built-in byte tokenizer") from None


@lru_cache(maxsize=4)
def tokenizer_identity(name: str | None) -> dict[str, Any]:
    """What a checkpoint records of the tokenizer its token ids mean: ``model.tokenizer`` as configured (None: the
    byte tokenizer), the vocabulary size, and a SHA-256 of every token -> id pair and the special tokens. Two
    tokenizers with the same hash give every id the same meaning, wherever their files live."""
    tok = load_tokenizer(name)
    vocab = sorted(tok.get_vocab().items(), key=lambda item: (item[1], item[0]))
    specials = sorted((token, tok.convert_tokens_to_ids(token)) for token in tok.all_special_tokens)
    payload = json.dumps({"vocab": vocab, "special_tokens": specials}, ensure_ascii=False, separators=(",", ":"))
    return {"name": name, "vocab_size": len(tok), "sha256": hashlib.sha256(payload.encode("utf-8")).hexdigest()}


def same_tokenizer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two identities give token ids the same meaning (their names may differ: a moved folder)."""
    return a.get("vocab_size") == b.get("vocab_size") and a.get("sha256") == b.get("sha256")


def check_folder_tokenizer(folder: str | Path, configured: str | None) -> bool:
    """A Hugging Face model folder that carries a tokenizer was trained with it: starting from its weights (convert
    from-hf, a run's or an evaluation's inference.hf_weights) under another ``model.tokenizer`` would give every
    token id another meaning from the first step, with no error anywhere. True when the folder's tokenizer was
    compared. A folder without tokenizer files (weights only, the tokenizer kept elsewhere) cannot be checked: its
    weights are taken to use ``model.tokenizer``, with a warning naming it, and False is returned (convert from-hf
    records the pairing as assumed in its checkpoint's manifest). Every rank of a job checks (each raises a mismatch,
    before the ranks join); rank 0 alone warns, once for the job."""
    from spade_mega.monitor.metrics import current_rank

    folder = Path(folder).expanduser().absolute()
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        if current_rank() == 0:
            log.warning("%s has no tokenizer files (tokenizer.json / tokenizer_config.json): its weights are taken "
                        "to use model.tokenizer, %s, unchecked; if they were trained with another, set "
                        "model.tokenizer to it", folder, describe_tokenizer(tokenizer_identity(configured)))
        return False
    theirs, ours = tokenizer_identity(str(folder)), tokenizer_identity(configured)
    if not same_tokenizer(theirs, ours):
        raise TokenizerError(f"{folder} holds the tokenizer {describe_tokenizer(theirs)}; model.tokenizer is "
                             f"{describe_tokenizer(ours)}: their token ids mean different things. Set "
                             f"model.tokenizer={folder}")
    return True


def describe_tokenizer(identity: Mapping[str, Any]) -> str:
    name = identity.get("name")
    what = "the built-in byte tokenizer (model.tokenizer: null)" if name is None else repr(name)
    return f"{what}, {identity.get('vocab_size')} tokens, vocabulary sha256 {str(identity.get('sha256'))[:12]}"

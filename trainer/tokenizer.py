"""Text -> token ids: a byte-level tokenizer by default, any Hugging Face ``tokenizer.json`` on request.

Why two: the tiny CPU ladders need no vocabulary at all (256 byte ids cover every text and keep the
embedding small), while real runs use a trained BPE. Both expose the same small surface (``encode``,
``encode_batch``, ``decode``, ``vocab_size``, ``eos_id``, ``identity``) so the data pipeline never cares
which one it holds. ``identity`` is a content hash: token caches are keyed by it, so editing a
tokenizer.json can never silently reuse tokens produced by the old one.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence

import fsspec
import numpy as np

# Names under which tokenizer.json files commonly declare their end-of-document token.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[SEP]", "<|im_end|>")


class Tokenizer(ABC):
    """Common interface; see ``ByteTokenizer`` and ``HFTokenizer``."""

    vocab_size: int
    eos_id: int | None
    identity: str

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text."""

    @abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of a sequence of token ids."""

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise if token ids from this tokenizer can overflow a model's embedding table."""
        check_vocab(self.vocab_size, model_vocab_size)


def check_vocab(tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """Raise a one-sentence ValueError when the model's vocabulary cannot hold every token id."""
    if tokenizer_vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer has vocab_size={tokenizer_vocab_size} but model.vocab_size={model_vocab_size}; "
            f"set model.vocab_size to at least {tokenizer_vocab_size} or choose a smaller tokenizer."
        )


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids (vocab 256). Byte 0 (NUL, absent from real text) separates documents."""

    vocab_size = 256
    eos_id = 0
    identity = "byte-utf8-v1"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from a tokenizer.json (any fsspec URL)."""

    def __init__(self, json_text: str, *, source: str = "<string>"):
        import tokenizers  # imported lazily: the byte path needs nothing beyond numpy

        self._tok = tokenizers.Tokenizer.from_str(json_text)
        self.source = source
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.identity = "hf-" + hashlib.sha256(json_text.encode("utf-8")).hexdigest()[:32]
        self.eos_id = next(
            (i for i in (self._tok.token_to_id(name) for name in _EOS_CANDIDATES) if i is not None), None
        )

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(path: str | None) -> Tokenizer:
    """None -> the byte-level tokenizer; otherwise a tokenizer.json at a local path or fsspec URL."""
    if path is None:
        return ByteTokenizer()
    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"data.tokenizer={path!r} does not exist; point it at a Hugging Face tokenizer.json or use None for bytes."
        ) from e
    try:
        return HFTokenizer(text, source=path)
    except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
        raise ValueError(
            f"data.tokenizer={path!r} is not a valid Hugging Face tokenizer.json ({e}); "
            "save one with tokenizers.Tokenizer.save(path)."
        ) from e

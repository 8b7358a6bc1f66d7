"""An observation cut to the rollout's token budget before it is tokenized: an environment's 100 MB answer was
tokenized whole (and its bytes turned into a list of ints to reach the replica's other ranks) only for all but the
budget's first tokens to be dropped. ``cut_observation`` returns a prefix of the text whose tokens begin with the
very ``budget`` tokens of the whole text's, looking at no more than a bounded window of it.

Why the prefix gives the same tokens: the cut falls right before a space that follows a non-space character. The
tokenizers the project loads split text into pieces before their merges (the regex pre-tokenization of byte-level
BPE: GPT-2, Llama 3, Qwen; Mistral's tekken; SentencePiece's "▁" word starts, as Llama 2's and Mistral's
tokenizer.json write them; one piece per character for the demos' tokenizers), and no piece runs from a
non-space character into the space after it (SentencePiece vocabularies have no piece ``x▁``; every pre-tokenizer
regex ends a word, a number or a punctuation run at a space). So the pieces before the cut, and their tokens, are
the whole text's, and the cut is kept only when those are at least ``budget + MARGIN`` tokens.

Where it may differ: a text with no such space in the window searched (``chars`` to ``2 * chars`` characters in,
a run of that many characters without a space, where ``chars`` is at least 8 characters per token of the
budget): the cut then falls inside the run, ``MARGIN`` tokens past the budget, and only a tokenizer whose merges
reach further back than that from the end of a piece (none that we know of) would give other tokens.
"""

from __future__ import annotations

import re
from typing import Any

MARGIN = 64  # tokens past the budget that the cut keeps
CHARS_PER_TOKEN = 8  # the first window: most tokens are shorter; a longer text's window grows four-fold
_BOUNDARY = re.compile(r"(?<=\S) ")  # a space after a non-space character: no piece runs across it


def cut_observation(tok: Any, text: str, budget: int) -> str:
    """A prefix of ``text`` whose first ``budget`` tokens (``tok.encode(..., add_special_tokens=False)``) are the
    whole text's (``text`` itself when it is short); what is tokenized to find it is bounded by the budget, not by
    the text."""
    chars = CHARS_PER_TOKEN * (max(budget, 0) + MARGIN)
    while 2 * chars < len(text):
        m = _BOUNDARY.search(text, chars, 2 * chars)
        cut = text[:m.start() if m is not None else chars]
        if len(tok.encode(cut, add_special_tokens=False)) >= budget + MARGIN:
            return cut
        chars *= 4
    return text

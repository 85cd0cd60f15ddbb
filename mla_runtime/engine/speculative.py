"""Speculative decoding by prompt lookup: draft tokens copied from the sequence's own past.

A decode step of a small batch on a CPU streams every weight once whatever the number of tokens, so
checking ``k`` guessed tokens costs little more than computing one. For each decode the prompt-lookup
proposer (``engine/proposer.py``) asks ``propose`` for up to ``k`` drafts: the longest suffix of the sequence
(``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) that occurred earlier, and the tokens that
followed its latest earlier occurrence — the pattern of code edits, quotes and retrieval answers, which repeat
their context. The
step runs the last token and the drafts together and samples every position, position j as if drafts
``[:j]`` were already generated; drafts are kept while the sampler accepts them (``sampler.sample``:
greedy rows when the draft is the argmax, random rows with probability ``p(draft)``), and the first
refusal is replaced by the sampler's own token. Greedy output is exactly plain greedy decoding's; sampled
output has the same distribution. Each step yields 1 to ``k + 1`` tokens.
"""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``tokens``
    of ``max_n`` .. ``min_n`` tokens; ``[]`` when none occurs."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts 0 .. len - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # what followed the latest earlier occurrence
            return arr[start:start + k].tolist()
    return []

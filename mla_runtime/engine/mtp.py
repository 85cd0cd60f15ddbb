"""Speculative decoding with the checkpoint's own draft head: DeepSeek-V3's multi-token-prediction (MTP) layer.

The MTP layer at position ``i`` reads the main model's hidden state ``h_i`` (after the final norm) and the token
``t_{i+1}``, and predicts ``t_{i+2}`` (``models/deepseek.py``, ``MTPLayer``). It is an MLA layer of its own,
so its latent rows live in the paged latent cache as one more layer, at the same slots as the main model's
rows of the same positions. Its row at position ``i`` depends on tokens ``0 .. i + 1`` only.

Each step, after the main model ran and the sampler chose the step's tokens, the MTP proposer
(``engine/proposer.py``) sends the worker a ``DraftInput`` (``draft_input``) and the worker (``Worker.draft``):

1. runs the MTP layer over the rows the step computed — with the step's own batch and attention metadata, so
   the pass plans nothing — each fed the token after its position: a prefill chunk's next prompt tokens, or for
   a decode its accepted drafts and then the token just sampled. That writes the MTP latent rows of every kept
   position, so that the MTP cache always holds the rows of every computed position (the prompt's included);
   the rows of rejected drafts are scratch, like the main model's, and are overwritten once those positions are
   real;
2. for each sequence that just sampled, takes the MTP output at its last kept position ``p`` as the first
   draft ``d_1`` (greedy), then chains: the layer runs again at ``p + 1`` on ``(its own output, d_1)`` to give
   ``d_2``, and so on up to ``num_speculative_tokens`` drafts, reusing its weights (as vLLM and SGLang do).

The next step verifies the drafts exactly like prompt-lookup drafts (``engine/speculative.py``): greedy output
is plain decoding's, sampled output keeps its distribution (the drafts are greedy, a deterministic proposal).
Chained links write scratch rows past the sequence's end; the next step's MTP pass overwrites the ones that
become real positions, as the main model's rows of rejected drafts are. The scheduler reserves the blocks the
chain needs past the sequence's end when they are free (the proposer's ``trailing_slots``); a chain never costs
another sequence a block, it gets shorter instead.

Prefix hits reuse the MTP rows of cached blocks. The row of a block's last position depends on the token after
the block, which the sharing sequence may not have: such a row is slightly stale. That only changes which drafts
are proposed, never the output.
"""

from __future__ import annotations

from mla_runtime.engine.scheduler import StepPlan
from mla_runtime.engine.worker import DraftInput


def draft_input(plan: StepPlan, gained: dict[int, list[int]], max_drafts: int, block_size: int) -> DraftInput:
    """The MTP pass of a step that ran ``plan`` (before its bookkeeping), one entry per sequence in the plan's
    order; ``gained``: the tokens each sampled sequence gains (accepted drafts, then the sampled token), by
    seq_id."""
    token_ids: list[int] = []
    last_rows: list[int] = []
    next_positions: list[int] = []
    tables: list[list[int]] = []
    wants: list[int] = []
    row = 0
    for seq, n, drafts in zip(plan.seqs, plan.num_new_tokens, plan.extra_token_ids):
        c, k = seq.num_computed_tokens, len(drafts)
        new = gained.get(seq.seq_id)
        if new is None:  # a prefill chunk before the prompt's end: the following tokens are the prompt's
            m, following, want = n, seq.token_ids[c + 1:c + n + 1], 0
        else:
            m = n - k + len(new) - 1  # positions kept: the chunk without its drafts, plus the accepted ones
            following = (seq.token_ids + new)[c + 1:c + m + 1]
            room = len(seq.block_table) * block_size - (c + m)  # chain links need a slot each
            left = seq.params.max_tokens - len(seq.output_token_ids) - len(new)
            want = max(0, min(max_drafts, room + 1, left - 1))
        # the rows of rejected drafts run too (scratch latents, as the main model's): the step's rows stay whole
        token_ids += following + following[-1:] * (n - m)
        last_rows.append(row + m - 1)
        next_positions.append(c + m)
        tables.append(seq.block_table)
        wants.append(want)
        row += n
    return DraftInput(token_ids, last_rows, next_positions, tables, wants)

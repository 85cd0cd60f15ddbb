"""fp32 PyTorch references for every kernel: slow, looped per sequence, obviously correct.

Tests compare both fast paths (Triton, vectorised torch) against these; benchmarks time them.
Everything is computed in float32 from the dequantised cache; outputs stay float32.

    dequantised token j of a sequence:  [c_j ; k_r_j] = cache[block_table[j // bs], j % bs] * scales
    absorbed decode:   s_j = sm_scale (q[:d_c]·c_j + q[d_c:]·k_r_j),   out = Σ_j softmax(s)_j c_j,
                       lse = log Σ_j exp(s_j)
    prefill (causal, bottom-right aligned):   query i of a sequence with q_len queries and k_len keys
                       sees keys j <= k_len - q_len + i;   s_ij = sm_scale (q_n_i·k_n_j + q_r_i·k_r_j)

DeepSeek Sparse Attention (``sparse.py``), query row t reading block-table row req_indices[t]:

    indexer key j (fp8: one scale per group of 128 values):   k_j = index_cache[block_table[j // bs], j % bs] * scales
    indexer score:     score[t, j] = Σ_h w[t, h] relu(q[t, h]·k_j)      j < key_lens[t]
    top-k:             the topk positions j of highest score, descending; key_lens[t] <= topk: 0 .. key_lens[t] - 1,
                       then -1
    sparse decode:     absorbed decode over the selected positions j in indices[t] (j >= 0) only; none: out 0, lse -inf
"""

from __future__ import annotations

import torch

from .common import dequantize_rows, quantize_per_token
from .dtypes import is_quantized

INDEX_GROUP = 128  # values of an fp8 indexer key sharing one scale


def ref_store_latent(cache: torch.Tensor, scales: torch.Tensor | None, latent: torch.Tensor,
                     k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's [latent ; k_rope] into slot slot_mapping[t] (skip negative slots), one token at a time."""
    block_size, d_c = cache.shape[1], latent.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        if is_quantized(cache.dtype):
            assert scales is not None  # a quantised cache has scales
            qc, sc = quantize_per_token(latent[t : t + 1], cache.dtype)
            qr, sr = quantize_per_token(k_rope[t : t + 1], cache.dtype)
            cache[blk, off, :d_c] = qc[0]
            cache[blk, off, d_c:] = qr[0]
            scales[blk, off, 0] = sc[0]
            scales[blk, off, 1] = sr[0]
        else:
            cache[blk, off, :d_c] = latent[t].to(cache.dtype)
            cache[blk, off, d_c:] = k_rope[t].to(cache.dtype)


def ref_sequence_latent(cache: torch.Tensor, scales: torch.Tensor | None, block_row: torch.Tensor,
                        seq_len: int, d_c: int) -> torch.Tensor:
    """The first seq_len dequantised tokens of one block-table row: float32 [seq_len, d_c + d_r]."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blk, off = block_row[pos // block_size].long(), pos % block_size  # only the entries the sequence uses
    return dequantize_rows(cache[blk, off], None if scales is None else scales[blk, off], d_c)


def ref_gather_latent(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, d_c: int) -> torch.Tensor:
    """float32 [sum(seq_lens), d_c + d_r]: each sequence's dequantised latents, concatenated in batch order."""
    parts = [ref_sequence_latent(cache, scales, block_tables[b], int(n), d_c)
             for b, n in enumerate(seq_lens.tolist())]
    return torch.cat(parts) if parts else torch.zeros(0, cache.shape[2], device=cache.device)


def ref_mla_decode(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, d_c: int,
                   req_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of each query row over its sequence: (out float32 [N, H, d_c], lse float32 [N, H])."""
    n_rows, n_heads, _ = q.shape
    out = torch.zeros(n_rows, n_heads, d_c, dtype=torch.float32, device=q.device)
    lse = torch.full((n_rows, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for n in range(n_rows):
        req = n if req_indices is None else int(req_indices[n])
        kv = ref_sequence_latent(cache, scales, block_tables[req], int(seq_lens[n]), d_c)  # [L, d_c + d_r]
        if kv.shape[0] == 0:
            continue
        qn = q[n].float()  # [H, d_c + d_r]
        scores = sm_scale * (qn[:, :d_c] @ kv[:, :d_c].T + qn[:, d_c:] @ kv[:, d_c:].T)  # [H, L]
        out[n] = torch.softmax(scores, dim=-1) @ kv[:, :d_c]
        lse[n] = torch.logsumexp(scores, dim=-1)
    return out, lse


def ref_prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor,
                          k_rope: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen attention, one sequence at a time: (out float32 [T, H, d_v], lse float32 [T, H])."""
    n_tokens, n_heads, _ = q_nope.shape
    out = torch.zeros(n_tokens, n_heads, v.shape[-1], dtype=torch.float32, device=q_nope.device)
    lse = torch.full((n_tokens, n_heads), float("-inf"), dtype=torch.float32, device=q_nope.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        q_len, k_len = qe - qs, ke - ks
        if q_len == 0:
            continue
        qn, qr = q_nope[qs:qe].float(), q_rope[qs:qe].float()  # [q_len, H, d_n], [q_len, H, d_r]
        kn, kr, vv = k_nope[ks:ke].float(), k_rope[ks:ke].float(), v[ks:ke].float()
        scores = torch.einsum("qhd,khd->hqk", qn, kn) + torch.einsum("qhr,kr->hqk", qr, kr)
        scores = scores * sm_scale  # [H, q_len, k_len]
        visible = torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khv->qhv", torch.softmax(scores, dim=-1), vv)
        lse[qs:qe] = torch.logsumexp(scores, dim=-1).T
    return out, lse


def ref_store_index_keys(cache: torch.Tensor, scales: torch.Tensor | None, keys: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write token t's indexer key into slot slot_mapping[t] (skip negative slots), one token and group at a time;
    fp8 caches quantise each group of 128 values with its own absmax scale."""
    block_size, d_index = cache.shape[1], cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        if scales is None:
            cache[blk, off] = keys[t].to(cache.dtype)
            continue
        for g, start in enumerate(range(0, d_index, INDEX_GROUP)):
            stored, scale = quantize_per_token(keys[t : t + 1, start : start + INDEX_GROUP], cache.dtype)
            cache[blk, off, start : start + INDEX_GROUP] = stored[0]
            scales[blk, off, g] = scale[0]


def ref_index_keys(cache: torch.Tensor, scales: torch.Tensor | None, block_row: torch.Tensor,
                   seq_len: int) -> torch.Tensor:
    """The first seq_len dequantised indexer keys of one block-table row: float32 [seq_len, d_I]."""
    block_size, d_index = cache.shape[1], cache.shape[2]
    out = torch.zeros(seq_len, d_index, dtype=torch.float32, device=cache.device)
    for j in range(seq_len):
        blk, off = int(block_row[j // block_size]), j % block_size
        out[j] = cache[blk, off].float()
        if scales is not None:
            for g, start in enumerate(range(0, d_index, INDEX_GROUP)):
                out[j, start : start + INDEX_GROUP] *= scales[blk, off, g]
    return out


def ref_indexer_scores(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                       block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor) -> torch.Tensor:
    """score[t, j] = Σ_h w[t, h] relu(q[t, h]·k_j) for j < key_lens[t], -inf after: float32 [T, max(key_lens)]."""
    lens = key_lens.tolist()
    out = torch.full((q.shape[0], max(lens, default=0)), float("-inf"), dtype=torch.float32, device=q.device)
    for t, n in enumerate(lens):
        keys = ref_index_keys(cache, scales, block_tables[int(req_indices[t])], n)  # [n, d_I]
        logits = q[t].float() @ keys.T  # [n_I, n]
        out[t, :n] = (weights[t].float()[:, None] * torch.relu(logits)).sum(dim=0)
    return out


def ref_indexer_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                     block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor,
                     topk: int) -> torch.Tensor:
    """The topk positions of highest indexer score per row, descending, equal scores lowest position first: int32
    [T, topk]; a row seeing at most topk keys keeps 0 .. key_len - 1, then -1."""
    scores = ref_indexer_scores(q, weights, cache, scales, block_tables, req_indices, key_lens)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for t, n in enumerate(key_lens.tolist()):
        if n <= topk:
            out[t, :n] = torch.arange(n, dtype=torch.int32)
        else:
            row = scores[t, :n]  # ties: the lower position first
            best = sorted(range(n), key=lambda j: (-float(row[j]), j))[:topk]
            out[t] = torch.tensor(best, dtype=torch.int32)
    return out


def ref_sparse_mla_decode(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                          block_tables: torch.Tensor, req_indices: torch.Tensor, indices: torch.Tensor,
                          sm_scale: float, d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of each query row over its selected positions only (indices[t] >= 0):
    (out float32 [T, H, d_c], lse float32 [T, H]); a row without a selected position gets out 0, lse -inf."""
    n_rows, n_heads, _ = q.shape
    block_size = cache.shape[1]
    out = torch.zeros(n_rows, n_heads, d_c, dtype=torch.float32, device=q.device)
    lse = torch.full((n_rows, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for t in range(n_rows):
        pos = [j for j in indices[t].tolist() if j >= 0]
        if not pos:
            continue
        row = block_tables[int(req_indices[t])]
        blk = torch.tensor([int(row[j // block_size]) for j in pos], device=cache.device)
        off = torch.tensor([j % block_size for j in pos], device=cache.device)
        kv = dequantize_rows(cache[blk, off], None if scales is None else scales[blk, off], d_c)  # [K', d_c + d_r]
        qt = q[t].float()
        scores = sm_scale * (qt[:, :d_c] @ kv[:, :d_c].T + qt[:, d_c:] @ kv[:, d_c:].T)  # [H, K']
        out[t] = torch.softmax(scores, dim=-1) @ kv[:, :d_c]
        lse[t] = torch.logsumexp(scores, dim=-1)
    return out, lse

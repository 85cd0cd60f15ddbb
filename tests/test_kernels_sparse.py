"""DeepSeek Sparse Attention kernels (Triton through the interpreter, and torch) against the fp32 references, on
poisoned, shuffled paged caches: the indexer's key store, its scores and top-k selection, sparse MLA over the
selected tokens, and the CPU gather plan of a selection."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels import (  # noqa: E402
    index_key_rows,
    indexer_scores,
    indexer_topk,
    mla_decode,
    mla_decode_planned,
    sparse_mla_decode,
    sparse_plan,
    store_index_keys,
)
from mla_kernels import sparse as sparse_mod  # noqa: E402
from mla_kernels.reference import (  # noqa: E402
    ref_indexer_scores,
    ref_indexer_topk,
    ref_sparse_mla_decode,
    ref_store_index_keys,
)
from tests.kernel_utils import (  # noqa: E402
    BACKENDS,
    DEVICE,
    OUT_OF_RANGE_BLOCK,
    assert_close_dtype,
    assert_lse_close,
    cosine,
    make_paged_case,
)

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------------------------
# case builders


def _groups(d_index: int) -> int:
    return -(-d_index // 128)


def poisoned_index_cache(num_blocks: int, block_size: int, d_index: int,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An index cache (and fp8 scales) whose every value reads back as NaN until written."""
    cache = torch.full((num_blocks, block_size, d_index), float("nan"), device=DEVICE).to(dtype)
    scales = None
    if dtype == FP8:
        scales = torch.full((num_blocks, block_size, _groups(d_index)), float("nan"), device=DEVICE)
    return cache, scales


def shuffled_tables(seq_lens: list[int], block_size: int, gen: torch.Generator,
                    extra_blocks: int = 2) -> tuple[torch.Tensor, int]:
    """Block tables over a random permutation of the blocks; unused entries point far out of range."""
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(need) + 1), OUT_OF_RANGE_BLOCK, dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[used : used + k].int()
        used += k
    return tables.to(DEVICE), num_blocks


def seq_slots(tables: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    """Flat slot of every token of every sequence, batch order: [sum(seq_lens)] int64."""
    out = []
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device=DEVICE)
        out.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(out)


@dataclass
class IndexCase:
    cache: torch.Tensor
    scales: torch.Tensor | None
    block_tables: torch.Tensor
    keys: torch.Tensor  # [sum(seq_lens), d_I] fp32, as stored
    q: torch.Tensor  # [T, n_I, d_I]
    weights: torch.Tensor  # [T, n_I] fp32
    req_indices: torch.Tensor  # [T] int32
    key_lens: torch.Tensor  # [T] int32


def make_index_case(seq_lens: list[int], rows: list[tuple[int, int]], heads: int, d_index: int, dtype: torch.dtype,
                    block_size: int = 16, seed: int = 0, keys: torch.Tensor | None = None,
                    q: torch.Tensor | None = None) -> IndexCase:
    """``rows``: (block-table row, key_len) of each query row."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_tables(seq_lens, block_size, gen)
    cache, scales = poisoned_index_cache(num_blocks, block_size, d_index, dtype)
    if keys is None:
        keys = torch.randn(sum(seq_lens), d_index, generator=gen)
    store_index_keys(cache, scales, keys.to(DEVICE), seq_slots(tables, seq_lens, block_size), backend="torch")
    if q is None:
        q = torch.randn(len(rows), heads, d_index, generator=gen)
    weights = torch.rand(len(rows), heads, generator=gen) + 0.1
    req = torch.tensor([r for r, _ in rows], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32, device=DEVICE)
    return IndexCase(cache, scales, tables, keys.to(DEVICE), q.to(DEVICE), weights.to(DEVICE), req, lens)


# the indexer's paths: Triton (interpreted off CUDA), torch (on CPU: the compiled operator of mla_kernels.cpu_ops
# where it builds) and torch with that operator switched off ("aten")
INDEXER_PATHS = [*BACKENDS, "aten"]


@pytest.fixture
def indexer_path(request: pytest.FixtureRequest):
    """The backend argument of a path of INDEXER_PATHS, with the CPU operator switched as the path says."""
    path = request.param
    sparse_mod.use_cpu_operator(path != "aten")
    try:
        yield "torch" if path == "aten" else path
    finally:
        sparse_mod.use_cpu_operator(True)


def test_the_cpu_indexer_operator_builds_on_this_machine() -> None:
    """The compiled operator is what CPUs run; where it cannot build the test names why."""
    from mla_kernels import cpu_ops

    if cpu_ops._compiler() is None:
        pytest.skip("no C++ compiler on this machine: the indexer runs its torch path")
    assert cpu_ops.failure() is None
    assert "indexer_scores" in str(torch.ops.mla_kernels.indexer_scores.default._schema)


@pytest.mark.parametrize("variant", ["avx512_bf16", "avx512", "avx2", "generic"])
@pytest.mark.parametrize("dtype,heads,d_index", [(torch.bfloat16, 64, 128), (FP8, 7, 200), (torch.float16, 4, 32)],
                         ids=str)
def test_every_cpu_indexer_variant_matches_reference(variant: str, dtype: torch.dtype, heads: int,
                                                      d_index: int) -> None:
    """Each variant of the operator's inner loop that this CPU executes; the others are named as skipped."""
    from mla_kernels import cpu_ops

    if cpu_ops._compiler() is None:
        pytest.skip("no C++ compiler on this machine: the indexer runs its torch path")
    assert cpu_ops.failure() is None
    held = dict(v.split(":", 1) for v in torch.ops.mla_kernels.cpu_variants())
    if variant not in held:
        pytest.skip(f"the {variant} variant is not built for this architecture")
    if held[variant] != "runs":
        pytest.skip(f"this CPU cannot run the {variant} variant")
    case = make_index_case(SEQ_LENS, ROWS, heads, d_index, dtype, seed=heads)
    if dtype == torch.bfloat16:  # a bfloat16 model's queries are bfloat16 values: avx512_bf16's dot products take them
        case.q[::2] = case.q[::2].bfloat16().float()  # (and the odd rows, which are not, the float32 products)
    got = torch.ops.mla_kernels.indexer_scores(case.q, case.weights, case.cache, case.scales, case.block_tables,
                                               case.req_indices, case.key_lens, max(SEQ_LENS), variant)
    ref = _scores(case, reference=True)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-4, atol=1e-4)


def test_the_cpu_indexer_operator_names_bad_arguments() -> None:
    from mla_kernels import cpu_ops

    if cpu_ops._compiler() is None:
        pytest.skip("no C++ compiler on this machine: the indexer runs its torch path")
    assert cpu_ops.failure() is None
    case = make_index_case(SEQ_LENS, ROWS, 3, 32, torch.float32)
    op = torch.ops.mla_kernels.indexer_scores
    args = (case.q, case.weights, case.cache, None, case.block_tables, case.req_indices)
    with pytest.raises(RuntimeError, match="key_lens"):
        op(*args, case.key_lens, 10)  # a key_len beyond max_len
    bad = case.block_tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(case.q, case.weights, case.cache, None, bad, case.req_indices, case.key_lens, max(SEQ_LENS))
    with pytest.raises(RuntimeError, match="unknown variant"):
        op(*args, case.key_lens, max(SEQ_LENS), "sse9")
    meta = op(case.q.to("meta"), case.weights.to("meta"), case.cache.to("meta"), None,
              case.block_tables.to("meta"), case.req_indices.to("meta"), case.key_lens.to("meta"), 70)
    assert meta.shape == (len(ROWS), 70)  # the shape function: the operator traces


def _scores(case: IndexCase, backend: str | None = None, reference: bool = False) -> torch.Tensor:
    fn = ref_indexer_scores if reference else indexer_scores
    kwargs = {} if reference else {"backend": backend}
    return fn(case.q, case.weights, case.cache, case.scales, case.block_tables, case.req_indices, case.key_lens,
              **kwargs)


def _topk(case: IndexCase, topk: int, backend: str | None = None, reference: bool = False) -> torch.Tensor:
    if reference:
        return ref_indexer_topk(case.q, case.weights, case.cache, case.scales, case.block_tables, case.req_indices,
                                case.key_lens, topk)
    return indexer_topk(case.q, case.weights, case.cache, case.scales, case.block_tables, case.req_indices,
                        case.key_lens, topk, backend=backend)


# ------------------------------------------------------------------------------------------------------------------
# indexer key cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=str)
@pytest.mark.parametrize("d_index", [64, 200])
def test_store_index_keys_matches_reference(backend: str, dtype: torch.dtype, d_index: int) -> None:
    gen = torch.Generator().manual_seed(d_index)
    keys = torch.randn(6, d_index, generator=gen) * torch.tensor([1.0, 10.0, 1e-3, 0.0, 3.0, 1.0])[:, None]
    keys[4, 128:] = 0.0  # an all-zero second group (d_index 200): scale 1, values 0
    keys = keys.to(DEVICE)
    slots = torch.tensor([5, -1, 17, 0, 31, -7], dtype=torch.int64, device=DEVICE)
    cache, scales = poisoned_index_cache(3, 16, d_index, dtype)
    ref_cache, ref_scales = poisoned_index_cache(3, 16, d_index, dtype)
    store_index_keys(cache, scales, keys, slots, backend=backend)
    ref_store_index_keys(ref_cache, ref_scales, keys, slots)
    # exact (up to the sign of zero), poison included: the skipped tokens wrote nothing
    torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=0, atol=0, equal_nan=True)
    if dtype == FP8:
        assert scales is not None and ref_scales is not None
        torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0, equal_nan=True)
        if d_index == 200:
            assert float(scales.view(-1, 2)[31, 1]) == 1.0

    written = slots[slots >= 0]
    rows = index_key_rows(cache, scales, written)
    assert not torch.isnan(rows).any()
    expect = keys[slots >= 0]
    if dtype == FP8:  # e4m3 keeps 3 mantissa bits: within 1/16 of each value, relative to its group's amax
        assert (rows - expect).abs().max() <= 0.07 * expect.abs().max()
        assert cosine(rows, expect) > 0.99
    else:
        torch.testing.assert_close(rows, expect.to(dtype).float(), rtol=0, atol=0)
    assert (rows[2] == 0).all()  # the all-zero key
    assert (index_key_rows(cache, scales, torch.tensor([-1], device=DEVICE)) == 0).all()


# ------------------------------------------------------------------------------------------------------------------
# indexer scores and top-k

# (block-table row, key_len) per query row: a decode row per sequence, a prefill chunk of rows sharing one sequence
SEQ_LENS = [47, 16, 70]
ROWS = [(0, 47), (1, 16), (2, 68), (2, 70), (2, 1), (2, 69), (0, 17), (0, 15)]


@pytest.mark.parametrize("indexer_path", INDEXER_PATHS, indirect=True)
@pytest.mark.parametrize("dtype,heads,d_index", [(torch.float32, 3, 32), (torch.bfloat16, 5, 128), (FP8, 17, 200),
                                                 (FP8, 1, 128)], ids=str)
def test_indexer_scores_match_reference(indexer_path: str, dtype: torch.dtype, heads: int, d_index: int) -> None:
    backend = indexer_path
    case = make_index_case(SEQ_LENS, ROWS, heads, d_index, dtype, seed=heads)
    scores = _scores(case, backend)
    ref = _scores(case, reference=True)
    assert scores.shape == (len(ROWS), max(SEQ_LENS)) and scores.dtype == torch.float32
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores), finite), "-inf exactly past each row's key_len"
    assert not torch.isnan(scores).any()
    torch.testing.assert_close(scores[finite], ref[finite], rtol=1e-4, atol=1e-4)
    if dtype == FP8:  # against the unquantised keys: the quantisation error only
        exact = make_index_case(SEQ_LENS, ROWS, heads, d_index, torch.float32, seed=heads)
        assert cosine(scores[finite], _scores(exact, reference=True)[finite]) > 0.995


@pytest.mark.parametrize("indexer_path", INDEXER_PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_indexer_topk_selects_the_reference_set(indexer_path: str, dtype: torch.dtype) -> None:
    backend = indexer_path
    topk = 16
    case = make_index_case(SEQ_LENS, ROWS, 3, 32, dtype, seed=3)
    got = _topk(case, topk, backend)
    ref = _topk(case, topk, reference=True)
    assert got.shape == (len(ROWS), topk) and got.dtype == torch.int32
    ref_scores = _scores(case, reference=True)
    for t, (_, n) in enumerate(ROWS):
        row = got[t].tolist()
        if n <= topk:  # every key, then -1 padding
            assert sorted(row[:n]) == list(range(n)) and row[n:] == [-1] * (topk - n)
            continue
        assert min(row) >= 0 and max(row) < n and len(set(row)) == topk
        picked = ref_scores[t, got[t].long()]
        assert (picked[:-1] >= picked[1:] - 1e-5).all(), "descending score order"
        # the reference's set, exact ties (relu makes many scores exactly 0) taken lowest position first; only a
        # near-tie at the boundary, two different scores within rounding, may go either way
        kth = float(ref_scores[t, ref[t].long()].min())
        assert (picked >= kth - 1e-5).all()
        sure = {j for j in ref[t].tolist() if float(ref_scores[t, j]) > kth + 1e-5}
        assert sure <= set(row)
        near = ((ref_scores[t, :n] - kth).abs() <= 1e-5) & (ref_scores[t, :n] != kth)
        if not near.any():
            assert set(row) == set(ref[t].tolist())


@pytest.mark.parametrize("indexer_path", INDEXER_PATHS, indirect=True)
def test_indexer_topk_breaks_exact_ties_by_position_whatever_the_batch(indexer_path: str) -> None:
    """Keys that no head scores positively are all worth exactly 0; where the k-th place falls among them, each
    query takes the lowest positions, alone or beside rows of other lengths (a row's choice must not depend on the
    padding its batch gives it: it did, and changed the tokens of concurrent requests)."""
    backend = indexer_path
    d_index, heads = 32, 2
    gen = torch.Generator().manual_seed(11)
    lens = [40, 300, 7]
    keys = torch.randn(sum(lens), d_index, generator=gen)
    q = torch.randn(1, heads, d_index, generator=gen)
    scores = (torch.relu(q[0] @ keys[:40].T)).sum(0)  # [40] (weights are positive: score 0 iff every relu is 0)
    positive = int((scores > 0).sum())
    zeros = (scores == 0).nonzero().flatten().tolist()
    assert len(zeros) >= 4, "the case needs a tie of several exact zeros"
    topk = positive + 2  # the last two places go to two of the zeros
    expect = sorted(scores.topk(positive).indices.tolist() + zeros[:2])
    rows = [(0, 40), (1, 300), (1, 299), (2, 7)]
    both = make_index_case(lens, rows, heads, d_index, torch.float32, seed=11, keys=keys,
                           q=torch.cat([q, torch.randn(3, heads, d_index, generator=gen)]))
    both.weights[0] = 1.0
    alone = IndexCase(both.cache, None, both.block_tables, both.keys, both.q[:1], both.weights[:1],
                      both.req_indices[:1], both.key_lens[:1])
    got_alone, got_batched = _topk(alone, topk, backend)[0], _topk(both, topk, backend)[0]
    assert sorted(got_alone.tolist()) == expect
    assert got_batched.tolist() == got_alone.tolist()


@pytest.mark.parametrize("indexer_path", INDEXER_PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=str)
def test_indexer_topk_well_separated_selection_survives_quantisation(indexer_path: str, dtype: torch.dtype) -> None:
    backend = indexer_path
    """Keys k_j = s_j u with distinct s_j: every head's score is proportional to s_j, so the selection (and its
    order) is that of s_j in every cache dtype."""
    d_index, heads, topk = 128, 5, 8
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(d_index, generator=gen)
    lens = [40, 33]
    mags = [torch.randperm(n, generator=gen).float() * 0.1 + 1.0 for n in lens]
    keys = torch.cat(mags)[:, None] * u[None, :]
    rows = [(0, 40), (1, 33), (1, 20)]
    q = u[None, None, :] * (torch.rand(len(rows), heads, 1, generator=gen) + 0.5)  # q·k_j > 0 for every head
    q[:, 0] = -q[:, 0]  # a head whose relu is 0 everywhere
    case = make_index_case(lens, rows, heads, d_index, dtype, seed=7, keys=keys, q=q)
    got = _topk(case, topk, backend)
    for t, (b, n) in enumerate(rows):
        expect = torch.topk(mags[b][:n], topk).indices.int().tolist()
        assert got[t].tolist() == expect


@pytest.mark.parametrize("indexer_path", INDEXER_PATHS, indirect=True)
def test_indexer_topk_larger_than_every_sequence_skips_scoring(indexer_path: str) -> None:
    backend = indexer_path
    """No row sees more than topk keys: all of them, then -1, without reading a key (the cache is all NaN)."""
    gen = torch.Generator().manual_seed(0)
    tables, num_blocks = shuffled_tables([5, 20], 16, gen)
    cache, _ = poisoned_index_cache(num_blocks, 16, 32, torch.bfloat16)
    q, w = torch.randn(3, 2, 32, device=DEVICE), torch.rand(3, 2, device=DEVICE)
    req = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([5, 20, 19], dtype=torch.int32, device=DEVICE)
    got = indexer_topk(q, w, cache, None, tables, req, lens, 20, backend=backend)
    assert got[0].tolist() == list(range(5)) + [-1] * 15
    assert got[1].tolist() == list(range(20))
    assert got[2].tolist() == list(range(19)) + [-1]


@pytest.mark.parametrize("indexer_path", INDEXER_PATHS, indirect=True)
def test_indexer_chunking_gives_the_same_answer(indexer_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = indexer_path
    """Byte budgets small enough to split the rows into many groups and chunks change nothing."""
    case = make_index_case(SEQ_LENS, ROWS, 3, 32, torch.float32, seed=5)
    scores, top = _scores(case, backend), _topk(case, 10, backend)
    monkeypatch.setattr(sparse_mod, "_TORCH_KEY_BYTES", 1)
    monkeypatch.setattr(sparse_mod, "_TORCH_LOGIT_BYTES", 1)
    monkeypatch.setattr(sparse_mod, "_TRITON_SCORE_BYTES", 1)
    torch.testing.assert_close(_scores(case, backend), scores, rtol=1e-6, atol=1e-6)
    assert torch.equal(_topk(case, 10, backend), top)


# ------------------------------------------------------------------------------------------------------------------
# sparse MLA over the selected positions


@dataclass(frozen=True)
class SparseCase:
    seq_lens: tuple[int, ...]
    heads: int
    d_c: int = 32
    d_r: int = 16
    topk: int = 24
    cache_dtype: torch.dtype = torch.float32
    q_dtype: torch.dtype = torch.float32
    block_size: int = 16

    def __str__(self) -> str:
        dt = str(self.cache_dtype).removeprefix("torch.")
        return f"L{'-'.join(map(str, self.seq_lens))}-H{self.heads}-{self.d_c}x{self.d_r}-k{self.topk}-{dt}"


SPARSE_CASES = [
    SparseCase((40, 17), 1),
    SparseCase((70, 5, 33), 3, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16),
    SparseCase((50, 64), 7, cache_dtype=FP8, q_dtype=torch.bfloat16, topk=80),
    SparseCase((65, 20), 16, cache_dtype=torch.int8, topk=9),
    SparseCase((31, 90), 5, d_c=96, d_r=24, cache_dtype=torch.float16, q_dtype=torch.float16),
    SparseCase((100,), 16, d_c=512, d_r=64, topk=64, block_size=64),
]


def make_selection(seq_lens: tuple[int, ...], topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows (two per sequence, then one that selects nothing) with random positions in random order and
    -1 scattered anywhere: (req_indices [T] int32, indices [T, topk] int32)."""
    gen = torch.Generator().manual_seed(seed)
    req, rows = [], []
    for b, n in enumerate(seq_lens):
        for _ in range(2):
            pos = torch.randperm(n, generator=gen)[:topk]
            row = torch.full((topk,), -1, dtype=torch.int32)
            row[: len(pos)] = pos.int()
            row[torch.rand(topk, generator=gen) < 0.25] = -1
            row[0] = pos[0]  # at least one valid position
            req.append(b)
            rows.append(row[torch.randperm(topk, generator=gen)])
    req.append(0)
    rows.append(torch.full((topk,), -1, dtype=torch.int32))
    return torch.tensor(req, dtype=torch.int32, device=DEVICE), torch.stack(rows).to(DEVICE)


def _sparse_inputs(case: SparseCase, seed: int = 0):
    paged = make_paged_case(list(case.seq_lens), case.d_c, case.d_r, case.block_size, case.cache_dtype, seed=seed)
    req, indices = make_selection(case.seq_lens, case.topk, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(req), case.heads, case.d_c + case.d_r, generator=gen).to(case.q_dtype).to(DEVICE)
    return paged, req, indices, q, (case.d_c + case.d_r) ** -0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SPARSE_CASES, ids=str)
def test_sparse_mla_decode_matches_reference(case: SparseCase, backend: str) -> None:
    paged, req, indices, q, sm_scale = _sparse_inputs(case, seed=case.heads)
    out, lse = sparse_mla_decode(q, paged.cache, paged.scales, paged.block_tables, req, indices, sm_scale, case.d_c,
                                 backend=backend)
    ref_out, ref_lse = ref_sparse_mla_decode(q, paged.cache, paged.scales, paged.block_tables, req, indices, sm_scale,
                                             case.d_c)
    assert out.shape == (len(req), case.heads, case.d_c) and out.dtype == case.q_dtype
    assert lse.shape == (len(req), case.heads) and lse.dtype == torch.float32
    assert_close_dtype(out, ref_out, case.q_dtype)
    assert_lse_close(lse, ref_lse, case.q_dtype)
    assert (out[-1] == 0).all() and torch.isneginf(lse[-1]).all(), "no selected position: out 0, lse -inf"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_over_every_position_equals_dense(backend: str) -> None:
    """Selecting every visible position (topk above every key_len) is dense attention: indexer_topk, then
    sparse_mla_decode == mla_decode, for a prefill chunk's rows and a decode row."""
    seq_lens, d_c, d_r = [37, 20], 32, 16
    paged = make_paged_case(seq_lens, d_c, d_r, 16, torch.float32, seed=9)
    req = torch.tensor([0, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    key_lens = torch.tensor([35, 36, 37, 20], dtype=torch.int32, device=DEVICE)
    index_cache, _ = poisoned_index_cache(paged.cache.shape[0], 16, 32, torch.bfloat16)  # never read: no scoring
    gen = torch.Generator().manual_seed(1)
    selected = indexer_topk(torch.randn(4, 2, 32, generator=gen).to(DEVICE), torch.rand(4, 2).to(DEVICE), index_cache,
                            None, paged.block_tables, req, key_lens, 40, backend=backend)
    q = torch.randn(4, 4, d_c + d_r, generator=gen).to(DEVICE)
    out, lse = sparse_mla_decode(q, paged.cache, None, paged.block_tables, req, selected, 0.1, d_c, backend=backend)
    dense_out, dense_lse = mla_decode(q, paged.cache, None, paged.block_tables, key_lens, 0.1, d_c, req_indices=req,
                                      backend=backend)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, dense_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sparse_plan_attends_the_selection(dtype: torch.dtype) -> None:
    case = SparseCase((70, 5, 33), 3, cache_dtype=dtype, q_dtype=dtype, topk=40)
    paged, req, indices, q, sm_scale = _sparse_inputs(case, seed=4)
    req, indices, q = req[:-1], indices[:-1], q[:-1]  # a plan needs a valid index in every row
    plan = sparse_plan(indices, paged.block_tables, req, case.block_size)
    assert plan.max_len % 32 == 0 and plan.slots.shape == (len(req), plan.max_len)
    assert plan.slots.dtype == torch.int64 and plan.lens.dtype == torch.int64
    for t in range(len(req)):
        pos = [j for j in indices[t].tolist() if j >= 0]
        n = len(pos)
        table = paged.block_tables[int(req[t])].long()
        expect = [int(table[j // case.block_size]) * case.block_size + j % case.block_size for j in pos]
        assert int(plan.lens[t]) == n and plan.slots[t, :n].tolist() == expect
        assert (plan.slots[t, n:] == expect[-1]).all(), "padding repeats the last valid slot"
        assert (plan.mask[t, 0, :n] == 0).all() and torch.isneginf(plan.mask[t, 0, n:]).all()
    planned = mla_decode_planned(q, paged.cache, plan, sm_scale, case.d_c)
    out, _ = sparse_mla_decode(q, paged.cache, None, paged.block_tables, req, indices, sm_scale, case.d_c,
                               backend="torch")
    assert not torch.isnan(planned).any()
    assert_close_dtype(planned, out, dtype)
    with pytest.raises(ValueError, match="at least one valid index"):
        sparse_plan(torch.full_like(indices, -1), paged.block_tables, req, case.block_size)


# ------------------------------------------------------------------------------------------------------------------
# argument checks


def test_sparse_kernels_reject_bad_arguments() -> None:
    case = make_index_case([20], [(0, 20)], 2, 32, FP8)
    assert case.scales is not None
    with pytest.raises(ValueError, match="scales"):
        store_index_keys(case.cache, None, case.keys[:1], torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="scales"):
        store_index_keys(case.cache, case.scales[..., :0], case.keys[:1], torch.zeros(1, dtype=torch.int32,
                                                                                         device=DEVICE))
    with pytest.raises(ValueError, match="keys"):
        store_index_keys(case.cache, case.scales, case.keys[:1, :16], torch.zeros(1, dtype=torch.int32,
                                                                                     device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_index_keys(case.cache, case.scales, case.keys[:1], torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        store_index_keys(case.cache.view(torch.int8), None, case.keys[:1],
                         torch.zeros(1, dtype=torch.int32, device=DEVICE))
    args = (case.q, case.weights, case.cache, case.scales, case.block_tables, case.req_indices)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(*args, case.key_lens, 0)
    with pytest.raises(ValueError, match="at least one key"):
        indexer_topk(*args, case.key_lens * 0, 4)
    with pytest.raises(ValueError, match="block table"):
        indexer_topk(*args, case.key_lens * 100, 4)
    with pytest.raises(ValueError, match="weights"):
        indexer_topk(case.q, case.weights[:, :1], *args[2:], case.key_lens, 4)
    with pytest.raises(ValueError, match="q must be"):
        indexer_topk(case.q[..., :8], *args[1:], case.key_lens, 4)
    with pytest.raises(ValueError, match="backend"):
        indexer_topk(*args, case.key_lens, 4, backend="cuda")

    paged = make_paged_case([5], 32, 16)
    q = torch.randn(1, 2, 48, device=DEVICE)
    req = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    idx = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="q width"):
        sparse_mla_decode(q[..., :40], paged.cache, None, paged.block_tables, req, idx, 0.1, 32)
    with pytest.raises(ValueError, match="d_c"):
        sparse_mla_decode(q, paged.cache, None, paged.block_tables, req, idx, 0.1, 48)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, paged.cache, None, paged.block_tables, req, idx[0], 0.1, 32)
    with pytest.raises(ValueError, match="one entry per query row"):
        sparse_mla_decode(q, paged.cache, None, paged.block_tables, req, idx.expand(2, 4), 0.1, 32)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, paged.cache, None, paged.block_tables, req, idx.float(), 0.1, 32)

"""Constrained decoding (structured outputs) with llguidance: JSON schemas, regular expressions, choices and
grammars turned into a mask of the tokens each constrained row may sample next.

- ``GrammarCompiler`` (one per engine) builds the llguidance tokenizer on first use and compiles each
  constraint once: the compiled matcher is cached under the constraint's hash (``StructuredOutputs.key``),
  and every sequence gets a copy of it. Compilation runs where requests are prepared — a worker thread in the
  server, never its event loop — and a constraint llguidance refuses is ``InvalidParam`` naming its field.
- ``GrammarState`` (one per sequence) follows the sequence's output: each appended token is consumed, so the
  state is the output's, whatever happened to the sequence's cache (a preempted sequence is recomputed with
  the same output tokens, and its matcher has already consumed them). It also cuts speculative drafts to
  the prefix the grammar accepts, before they are verified.
- ``MaskBuilder`` (rank 0's runner) computes a step's masks on a worker thread while the model runs its
  forward pass (llguidance releases the GIL and spreads the rows over its own threads); the sampler applies
  them (``sampler.TokenMasks``). Row j of a speculative decode gets the mask after the first j drafts.

A grammar that has nothing left to generate (llguidance's "stopped": only EOS may follow) ends the sequence
with ``finish_reason="stop"`` at once, so a complete JSON value never waits for the model to choose EOS.
llguidance is an optional dependency (the ``structured`` extra); it is imported on the first constrained request.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from mla_runtime.engine.sampler import TokenMasks
from mla_runtime.engine.sequence import Sequence
from mla_runtime.errors import InvalidParam
from mla_runtime.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# compact JSON with a space after ',' and ':': a model cannot spin on free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise InvalidParam("structured_outputs", "structured outputs need llguidance: "
                                                 "pip install 'mla-runtime[structured]'") from None
    return llguidance


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (not yet checked: compiling it checks it)."""
    ll = _llguidance()
    m = ll.LLMatcher
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        try:
            return str(m.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))
        except ValueError as e:  # not a JSON object at all
            raise InvalidParam(spec.param, f"{spec.param}: invalid JSON schema: {e}") from None
    if spec.regex is not None:
        return str(m.grammar_from_regex(spec.regex))
    if spec.choice is not None:
        return str(ll.grammar_from("choice", spec.choice))  # type: ignore[arg-type]
    assert spec.grammar is not None
    try:
        return str(ll.grammar_from("grammar", spec.grammar))
    except ValueError as e:
        raise InvalidParam(spec.param, f"{spec.param}: invalid grammar: {e}") from None


class GrammarCompiler:
    """Constraints → llguidance matchers, compiled once per distinct constraint (thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise InvalidParam("structured_outputs", "structured outputs need the checkpoint's tokenizer")
                _llguidance()
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def compiled(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The cached matcher of ``spec`` in its initial state (compiled on a miss). Do not advance it: copy it."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        tok = self.ll_tokenizer()
        matcher: llguidance.LLMatcher = _llguidance().LLMatcher(tok, grammar_text(spec), log_level=0)  # GIL released
        if matcher.is_error():
            raise InvalidParam(spec.param, f"{spec.param}: the constraint cannot be compiled: "
                                           f"{matcher.get_error().strip()}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def new_state(self, spec: StructuredOutputs) -> GrammarState:
        return GrammarState(self.compiled(spec).deep_copy())


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)  # a refused token leaves the matcher in error: ``finished`` then holds

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow (the value is complete), or the matcher failed."""
        return bool(self.matcher.is_stopped())

    def valid_prefix(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts from here (the state does not move)."""
        return drafts[:self.matcher.validate_tokens(drafts)] if drafts else drafts


class MaskBuilder:
    """Computes the masks of a step's constrained rows on a worker thread (see the module docstring); keeps the
    time each step's masks took and the time the step waited for them after its forward pass."""

    def __init__(self, vocab_size: int, max_records: int = 100_000) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.mask_seconds: deque[tuple[float, int]] = deque(maxlen=max_records)  # (seconds, rows) per step
        self.wait_seconds: deque[float] = deque(maxlen=max_records)

    def start(self, seqs: list[Sequence], drafts: list[tuple[int, ...]]) -> Future[TokenMasks] | None:
        """Begin the masks of ``seqs`` (in the step's row order, k + 1 rows per sequence with k ``drafts``); None
        when no sequence is constrained."""
        if not any(s.grammar is not None for s in seqs):
            return None
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mla-masks")
            self._executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._pool.submit(self._compute, seqs, drafts)

    def _compute(self, seqs: list[Sequence], drafts: list[tuple[int, ...]]) -> TokenMasks:
        t0 = time.perf_counter()
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        rows: list[int] = []
        first = 0
        for seq, more in zip(seqs, drafts):
            k = len(more)
            if seq.grammar is not None:
                if k:
                    drafted.append((seq.grammar.matcher, len(rows), list(more)))
                else:
                    plain.append((seq.grammar.matcher, len(rows)))
                rows.extend(range(first, first + k + 1))
            first += k + 1
        words = (self.vocab_size + 31) // 32
        bits = torch.zeros(len(rows), words, dtype=torch.int32)  # [rows, words]: nothing allowed until written
        ex = self._executor
        assert ex is not None
        # llguidance.torch's wrappers of these two calls import torch.compile machinery (seconds): called directly
        if plain:
            ex.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, len(rows))
        if drafted:
            ex.unsafe_compute_mask_ptr_with_draft_token(drafted, bits.data_ptr(), words * 4, len(rows))
        self.mask_seconds.append((time.perf_counter() - t0, len(rows)))
        return TokenMasks(rows, bits)

    def finish(self, pending: Future[TokenMasks] | None) -> TokenMasks | None:
        """The masks begun by ``start``, waiting for them if the forward pass was faster."""
        if pending is None:
            return None
        t0 = time.perf_counter()
        masks = pending.result()
        self.wait_seconds.append(time.perf_counter() - t0)
        return masks

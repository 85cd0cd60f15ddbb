"""Where a request should go among engine replicas: its routing key, and the affinity policy that ranks replicas.

A request's **routing key** (``route_key``) is its session (the ``X-Session-Id`` header, else the OpenAI ``user``
field) and the chained hashes of its prompt's leading full blocks, computed as the engine's block pool computes
them (``block_hash`` over ``block_size`` token ids, each chained over the previous one). The prompt is tokenized
as the replica will tokenize it (the chat template for chat requests); without a tokenizer, blocks are
``4 × block_size`` bytes of the prompt's UTF-8 text.

The **policy** (``AffinityPolicy``) remembers, per replica, the block hashes of the prompts it recently sent there
(an LRU bounded by ``max_blocks`` per replica, about what its latent cache holds) and the replica of each recent
session. For a request it prefers, in order:

1. ``session``: the replica that served the request's session before;
2. ``affinity_hit``: the replica with the longest run of the prompt's leading block hashes (ties: the less loaded);
3. ``least_loaded``: with no preference, the replica with the fewest ongoing requests (ties: the one that holds
   fewer remembered blocks, so new prefixes spread evenly over the caches).

When the preferred replica has more than ``queue_threshold`` ongoing requests, the least-loaded replica is
taken instead (``load_fallback``). ``round_robin`` (the baseline of the benchmark) ignores keys. Each decision
names its reason; the router counts them. Pure Python: the Ray request router wraps it (``ray_replicas.py``).
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mla_runtime.engine.block_pool import block_hash

SESSION_HEADER = "x-session-id"
POLICIES = ("affinity", "round_robin")
REASONS = ("session", "affinity_hit", "load_fallback", "least_loaded", "round_robin")
MAX_KEY_BLOCKS = 256  # leading blocks hashed per request (bounds the ingress's tokenization work)
MAX_SESSIONS = 100_000
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


@dataclass(frozen=True)
class RouteKey:
    session: str | None = None
    block_hashes: tuple[int, ...] = ()


@dataclass
class Decision:
    """A ranking of replica ids (first: preferred) and why."""

    ranked: list[str]
    reason: str
    preferred: str | None = None


# -- the key ---------------------------------------------------------------------------------------
def chained_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_KEY_BLOCKS) -> tuple[int, ...]:
    """The chained hashes of the full blocks of ``token_ids`` (at most ``max_blocks``), as the block pool has them."""
    out: list[int] = []
    parent: int | None = None
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        out.append(parent)
    return tuple(out)


def prompt_units(path: str, body: Mapping[str, Any], tokenizer: Any, block_size: int) -> tuple[list[int], int] | None:
    """The leading token ids of a generation request's (first) prompt and the block size to cut them by, or None
    when the body has no usable prompt. Without a tokenizer, a text's UTF-8 bytes stand for its tokens, 4 per token."""
    text_limit = block_size * MAX_KEY_BLOCKS * 8  # characters: more than MAX_KEY_BLOCKS blocks of any tokenizer
    byte_block = 4 * block_size
    if path == "/v1/chat/completions":
        from mla_runtime.serving.protocol import ChatRequest
        from mla_runtime.tokenizer import apply_chat_template

        try:
            req = ChatRequest.model_validate(body)
            messages = req.plain_messages()
            if tokenizer is None:
                return list(json.dumps(messages).encode()[:text_limit]), byte_block
            return apply_chat_template(tokenizer, messages, None, req.chat_template_kwargs), block_size
        except Exception:  # noqa: BLE001 - an invalid body routes anywhere; its replica answers the error
            return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) for t in prompt[:block_size * MAX_KEY_BLOCKS]], block_size
    if not isinstance(prompt, str) or not prompt:
        return None
    if tokenizer is None:
        return list(prompt[:text_limit].encode("utf-8", "replace")), byte_block
    return list(tokenizer.encode(prompt[:text_limit])), block_size


def route_key(path: str, headers: Mapping[str, str], body: bytes, tokenizer: Any, block_size: int) -> RouteKey:
    """A request's routing key: its session and its prompt's leading block hashes (empty when there is none)."""
    session = headers.get(SESSION_HEADER) or None
    if path not in GENERATION_PATHS:
        return RouteKey(session)
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        return RouteKey(session)
    if session is None and isinstance(data.get("user"), str) and data["user"]:
        session = data["user"]
    units = prompt_units(path, data, tokenizer, block_size)
    return RouteKey(session, chained_hashes(*units) if units else ())


# -- the policy ------------------------------------------------------------------------------------
@dataclass
class AffinityPolicy:
    policy: str = "affinity"
    queue_threshold: int = 8
    max_blocks: int = 4096  # remembered block hashes per replica
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    blocks: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    _next: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.queue_threshold < 0:
            raise ValueError(f"affinity_queue_threshold must be >= 0, got {self.queue_threshold}")

    def matched_blocks(self, replica: str, key: RouteKey) -> int:
        held = self.blocks.get(replica)
        n = 0
        if held:
            for h in key.block_hashes:
                if h not in held:
                    break
                n += 1
        return n

    def least_loaded(self, replicas: Sequence[str], queue: Mapping[str, int]) -> str:
        return min(replicas, key=lambda r: (queue.get(r, 0), len(self.blocks.get(r, ())), self.rng.random()))

    def decide(self, replicas: Sequence[str], queue: Mapping[str, int], key: RouteKey) -> Decision:
        """Rank ``replicas`` (ids) for a request with ``key``; ``queue``: each one's ongoing requests."""
        if not replicas:
            return Decision([], "least_loaded")
        if self.policy == "round_robin":
            self._next += 1
            first = replicas[self._next % len(replicas)]
            return Decision([first, *[r for r in replicas if r != first]], "round_robin", first)
        preferred, reason = None, "least_loaded"
        if key.session is not None and self.sessions.get(key.session) in replicas:
            preferred, reason = self.sessions[key.session], "session"
        elif key.block_hashes:
            best = max(replicas, key=lambda r: (self.matched_blocks(r, key), -queue.get(r, 0)))
            if self.matched_blocks(best, key) > 0:
                preferred, reason = best, "affinity_hit"
        if preferred is not None and queue.get(preferred, 0) > self.queue_threshold:
            preferred, reason = None, "load_fallback"
        first = preferred if preferred is not None else self.least_loaded(replicas, queue)
        rest = sorted((r for r in replicas if r != first), key=lambda r: queue.get(r, 0))
        return Decision([first, *rest], reason, first)

    def record(self, replica: str, key: RouteKey, decision: Decision | None) -> str:
        """The request went to ``replica``: remember its blocks and session; count (and return) the reason."""
        reason = decision.reason if decision is not None else "least_loaded"
        if decision is not None and decision.preferred not in (None, replica):
            reason = "load_fallback"  # the preferred replica was full (at max_ongoing_requests)
        self.counts[reason] = self.counts.get(reason, 0) + 1
        held = self.blocks.setdefault(replica, OrderedDict())
        for h in key.block_hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)
        if key.session is not None:
            self.sessions[key.session] = replica
            self.sessions.move_to_end(key.session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return reason

    def forget(self, live: Sequence[str]) -> None:
        """Drop what was remembered about replicas that are gone (their caches went with them)."""
        for replica in [r for r in self.blocks if r not in live]:
            del self.blocks[replica]
        for session in [s for s, r in self.sessions.items() if r not in live]:
            del self.sessions[session]

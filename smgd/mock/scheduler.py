"""A sans-IO mock engine scheduler: continuous batching with one token per running request per step.

It plays what matters of a real scheduler for smgd: a waiting queue and a running batch capped
at ``max_batch``; one new token per running request per :meth:`MockScheduler.step`; max tokens,
EOS and stop token ids; aborts of running requests (finish ``abort`` in the next step) and of
queued ones (``aborted_queued``, which SGLang answers with an ``AbortReq`` echo).

Output tokens echo the prompt cyclically (skipping ``skip_ids``, e.g. special tokens), so a
test can compute every stream's exact expected output and the demo streams readable text.
With a :class:`~smgd.mock.script.Script`, a prompt it has a reply for gets that reply's tokens
then the first EOS id instead (cyclically too, so ``ignore_eos`` writes the reply again).
A request with ``logprobs`` set gets :func:`mock_logprob` entries for its tokens, equally
predictable; one with ``prompt_logprobs`` set gets them for prompt tokens 1, 2, ... with its
first output. Before ``min_tokens`` tokens, EOS and stop ids are skipped (a real engine masks
them), so the echo goes on. With ``priority_scheduling``, waiting requests are admitted lowest
``priority`` first (vLLM's order; arrival order among equals). A request with a LoRA adapter
writes the same tokens rotated by :func:`lora_rotation` of the adapter's name, so each adapter
observably changes the output. An embedding request finishes in its first step with
:func:`mock_embedding`, a vector that depends only on its token ids.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smgd.wire.common import TokenLogprob, TopLogprob
from smgd.wire.sglang.encode import HEALTH_CHECK_PREFIX

if TYPE_CHECKING:
    from collections.abc import Iterable

    from smgd.mock.script import Script


# The mock's prefix cache, as a real engine's: prompts in blocks of PREFIX_BLOCK tokens, each
# block keyed by a hash chained over the blocks before it (vLLM's prefix caching keys its KV
# blocks the same way), the least recently used dropped past PREFIX_CACHE_BLOCKS. 16 tokens is
# SGLang's and vLLM's usual page/block size on GPUs. 16,384 blocks is 262,144 tokens of "KV":
# a real GPU's order, and ~2 MB of the mock's memory. It kept every prefix as a tuple of its
# tokens, unbounded: 2,000 distinct 2,048-token prompts held 2.1 GB and cost 5.8 ms each.
PREFIX_BLOCK = 16
PREFIX_CACHE_BLOCKS = 16_384

# The mock's embedding size: the hidden size of the packaged tiny model, so `dimensions`
# checked against its config.json matches what the mock returns.
MOCK_EMBED_SIZE = 64


class MockFinish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"  # EOS or stop token id
    ABORT = "abort"
    EMBEDDED = "embedded"  # an embedding request's vector is ready


@dataclass(slots=True)
class MockRequest:
    rid: str
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stream: bool = True
    logprobs: int | None = None  # None: none; k: sampled token plus top-k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's plus top-k
    min_tokens: int = 0
    priority: int = 0
    lora: str | None = None  # the LoRA adapter's name: its output is rotated (lora_rotation)
    embed: bool = False  # an embedding request: one step, a vector, no tokens
    dimensions: int | None = None  # an embedding's Matryoshka truncation
    # Filled by the scheduler:
    source: list[int] = field(default_factory=list)
    cursor: int = 0  # the next position in source
    generated: int = 0
    unsent: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    aborted: bool = False


def lora_rotation(name: str, length: int) -> int:
    """How far an adapter rotates the mock's output (1..length-1; 0 for one token): a fixed
    function of its name, so each adapter writes its own, reproducible, text."""
    if length < 2:
        return 0
    return 1 + zlib.crc32(name.encode()) % (length - 1)


@dataclass(slots=True)
class StepOutput:
    rid: str
    new_ids: list[int]
    finish: MockFinish | None
    matched: int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per new id, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., first output only
    prompt_first: int = 0  # the first prompt token (the one without a logprob)
    embedding: list[float] | None = None  # an embedding request's vector


def mock_embedding(prompt_ids: list[int], dimensions: int | None = None) -> list[float]:
    """The mock's embedding of ``prompt_ids``: :data:`MOCK_EMBED_SIZE` values from a hash of the
    ids, the first ``dimensions`` of them kept, L2-normalized (as the engines' poolers do), each
    a float32 value (so both wires carry it exactly)."""
    seed = hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)).digest()
    raw: list[float] = []
    counter = 0
    while len(raw) < MOCK_EMBED_SIZE:
        block = hashlib.blake2b(seed + counter.to_bytes(4, "little")).digest()
        raw.extend(b / 127.5 - 1.0 for b in block)
        counter += 1
    kept = raw[: dimensions or MOCK_EMBED_SIZE]
    norm = math.sqrt(sum(x * x for x in kept)) or 1.0
    return [struct.unpack("<f", struct.pack("<f", x / norm))[0] for x in kept]


def mock_prompt_logprob(token_id: int, position: int, k: int) -> TokenLogprob:
    """The fake logprob of prompt token ``position`` (1-based: the first has none): as
    :func:`mock_logprob`, one step lower, and the token's rank is 1."""
    entry = mock_logprob(token_id, position, k)
    top = [TopLogprob(t.token_id, t.logprob - 1) for t in entry.top] if entry.top else None
    return TokenLogprob(token_id=token_id, logprob=entry.logprob - 1, top=top, rank=1)


def mock_logprob(token_id: int, position: int, k: int) -> TokenLogprob:
    """The fake logprob of output token ``position`` (0-based) and its top-``k`` alternatives.

    The sampled token is the most likely one (first of the top-k); alternative j is
    ``token_id ^ j``, which stays inside the token's aligned block of 32 ids (in the vocab of
    any model whose vocab size is a multiple of 32). Multiples of 1/4 survive JSON exactly.
    """
    value = -0.25 * (1 + position % 4)
    top = [TopLogprob(token_id ^ j, value - j) for j in range(k)] if k else None
    return TokenLogprob(token_id=token_id, logprob=value, top=top)


class MockScheduler:
    def __init__(
        self,
        *,
        max_batch: int,
        eos_ids: Iterable[int] = (),
        skip_ids: Iterable[int] = (),
        # Non-stream requests still report every 50 tokens, as SGLang does
        # (SGLANG_FORCE_STREAM_INTERVAL), so partial frames get exercised.
        nonstream_interval: int = 50,
        script: Script | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        self.max_batch = max_batch
        eos_ids = list(eos_ids)
        self.eos_ids = frozenset(eos_ids)
        # What a scripted reply ends with: the model's (first) EOS, as a model stops.
        self._reply_end = eos_ids[:1]
        self.script = script
        self.skip_ids = frozenset(skip_ids) | self.eos_ids
        self.nonstream_interval = nonstream_interval
        self.priority_scheduling = priority_scheduling
        self.waiting: deque[MockRequest] = deque()
        self.running: dict[str, MockRequest] = {}
        self.aborted_queued: list[str] = []
        self.steps = 0
        self.tokens = 0
        # The mock engine's "lose" fault: requests added meanwhile are dropped unanswered, all
        # but health checks (an engine alive and answering, that lost a request).
        self.lose_requests = False
        self._prefix_blocks: OrderedDict[int, None] = OrderedDict()  # chained block hashes, LRU

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.aborted_queued

    def add(self, req: MockRequest) -> None:
        if self.lose_requests and not req.rid.startswith(HEALTH_CHECK_PREFIX):
            return
        reply = self.script.pick(req.prompt_ids) if self.script is not None else None
        # (An empty reply of a model without EOS would be no tokens at all: it echoes.)
        if reply is not None and (reply or self._reply_end):
            req.source = reply + self._reply_end
        else:
            source = [t for t in req.prompt_ids if t not in self.skip_ids]
            req.source = source or [t for t in req.prompt_ids if t not in self.eos_ids] or [4]
        if req.lora is not None:
            shift = lora_rotation(req.lora, len(req.source))
            req.source = req.source[shift:] + req.source[:shift]
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Abort by exact rid; an empty rid aborts everything (SGLang's prefix rule). Whether
        a request was found: the abort of one that finished already finds none."""
        found = False
        for req in list(self.waiting):
            if req.rid.startswith(rid):
                self.waiting.remove(req)
                self.aborted_queued.append(req.rid)
                found = True
        for req in self.running.values():
            if req.rid.startswith(rid):
                req.aborted = True
                found = True
        return found

    def _cached(self, prompt: list[int]) -> int:
        """How many of ``prompt``'s first tokens the prefix cache held (whole blocks); the
        prompt's blocks are cached from now on (:data:`PREFIX_CACHE_BLOCKS`)."""
        blocks = self._prefix_blocks
        best = 0
        chain = 0
        for end in range(PREFIX_BLOCK, len(prompt) + 1, PREFIX_BLOCK):
            chain = hash((chain, *prompt[end - PREFIX_BLOCK : end]))
            if chain in blocks:
                blocks.move_to_end(chain)
                best = end
            else:
                blocks[chain] = None
        while len(blocks) > PREFIX_CACHE_BLOCKS:
            blocks.popitem(last=False)
        return best

    def step(self) -> list[StepOutput]:
        """Admit waiting requests, produce one token per running request."""
        while self.waiting and len(self.running) < self.max_batch:
            if self.priority_scheduling:
                req = min(self.waiting, key=lambda r: r.priority)  # the first of the lowest
                self.waiting.remove(req)
            else:
                req = self.waiting.popleft()
            self.running[req.rid] = req
        outputs: list[StepOutput] = []
        finished: list[str] = []
        for req in self.running.values():
            finish: MockFinish | None = None
            matched: int | None = None
            if req.embed:
                outputs.append(self._embedded(req))
                finished.append(req.rid)
                continue
            if req.aborted:
                finish = MockFinish.ABORT
            else:
                token = self._next_token(req)
                if req.logprobs is not None:
                    entry = mock_logprob(token, req.generated, req.logprobs)
                    req.unsent_logprobs.append(entry)
                req.generated += 1
                req.unsent.append(token)
                self.tokens += 1
                if token in req.stop_token_ids or (token in self.eos_ids and not req.ignore_eos):
                    finish, matched = MockFinish.STOP, token
                elif req.generated >= req.max_tokens:
                    finish = MockFinish.LENGTH
            if req.stream or finish is not None or len(req.unsent) >= self.nonstream_interval:
                cached = self._cached(req.prompt_ids) if req.generated <= 1 else 0
                outputs.append(
                    StepOutput(
                        rid=req.rid,
                        new_ids=req.unsent,
                        finish=finish,
                        matched=matched,
                        prompt_tokens=len(req.prompt_ids),
                        completion_tokens=req.generated,
                        cached_tokens=cached,
                        logprobs=req.unsent_logprobs if req.logprobs is not None else None,
                        prompt_logprobs=self._prompt_logprobs(req),
                        prompt_first=req.prompt_ids[0] if req.prompt_ids else 0,
                    )
                )
                req.unsent = []
                req.unsent_logprobs = []
            if finish is not None:
                finished.append(req.rid)
        for rid in finished:
            del self.running[rid]
        self.steps += 1
        return outputs

    def _embedded(self, req: MockRequest) -> StepOutput:
        aborted = req.aborted
        return StepOutput(
            rid=req.rid,
            new_ids=[],
            finish=MockFinish.ABORT if aborted else MockFinish.EMBEDDED,
            matched=None,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=0,
            cached_tokens=self._cached(req.prompt_ids),
            embedding=None if aborted else mock_embedding(req.prompt_ids, req.dimensions),
        )

    def _next_token(self, req: MockRequest) -> int:
        """The next echoed token; before ``min_tokens``, EOS and stop ids are passed over (a
        source of nothing else still yields its token after one lap)."""
        source = req.source
        for _ in range(len(source)):
            token = source[req.cursor % len(source)]
            req.cursor += 1
            stops = token in req.stop_token_ids or (token in self.eos_ids and not req.ignore_eos)
            if not stops or req.generated >= req.min_tokens:
                return token
        return token

    @staticmethod
    def _prompt_logprobs(req: MockRequest) -> list[TokenLogprob] | None:
        """Prompt logprobs go out once, with the request's first output."""
        k = req.prompt_logprobs
        if k is None or req.generated > len(req.unsent):
            return None
        ids = req.prompt_ids
        return [mock_prompt_logprob(ids[p], p, k) for p in range(1, len(ids))]

    def take_aborted_queued(self) -> list[str]:
        rids, self.aborted_queued = self.aborted_queued, []
        return rids

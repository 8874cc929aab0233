"""NGRAM proposer: drafts continuations of the context's tail from one n-gram cache
shared by every request (prompts and generated tokens feed it).

* a request's prompt is fed on its first proposal, not at prefill: on a busy server,
  where the policy lets nobody speculate and only a probe proposes now and then, the
  requests that never propose cost the cache nothing (what they would have fed is read
  from the request whenever it does propose);
* each proposal: tokens the request gained since the last feed are fed, then the
  tail (``--speculative-ngram-max-match-window-size`` tokens) is matched;
  BFS or PROB trees (``--speculative-ngram-match-type``) of <= N nodes;
* after verification: the emitted tokens are fed right away, so other requests
  see them in the same step order;
* where the cache has no match, the corpus of the target's own answers
  (``--speculative-ngram-corpus``, ``ngram_corpus.py``) drafts instead, while at most
  CORPUS_MAX_RUNNING requests run. Its drafts are accepted less than the cache's: against
  NGRAM without it (2-core AVX-512 Zen4, `spec_ab`) it gave 1.05x at 2 requests, 0.99x at 4
  (the policy's probes of its trees cost about what they found) and nothing at 16.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from specserve.core import Request
from specserve.speculative.base import Proposer, ProposerContext
from specserve.speculative.ngram_corpus import read_corpus_documents
from specserve.speculative.ngram_native import make_ngram_cache, make_ngram_corpus
from specserve.speculative.state import spec_state, tail_ids
from specserve.speculative.tree import DraftTree

COST_EMA_WEIGHT = 0.1
CORPUS_MAX_RUNNING = 2
logger = logging.getLogger(__name__)


class NgramProposer(Proposer):
    is_cheap = True
    catches_up_lazily = True          # _unfed reads the tokens it has not seen from the request

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        self.cache = make_ngram_cache(ctx.server_args)       # native where the CPU kernels load
        self.corpus = _load_corpus(ctx)
        self.seconds_per_request = 0.0

    def propose(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree]:
        t0 = time.perf_counter()
        trees, most_fed = [], 0
        corpus = self.corpus if len(engine.scheduler.running) <= CORPUS_MAX_RUNNING else None
        for item, cap in zip(items, max_nodes):
            req, state = item.req, _state(item.req)
            num_new, context = self._unfed(req, state)
            most_fed = max(most_fed, num_new)
            tree, state.suffix_keys = self.cache.feed_and_match(context, num_new, cap, state.suffix_keys)
            if corpus is not None and len(tree.draft_tokens) == 1:
                tree = corpus.match(context, cap)
            state.num_fed = max(state.num_fed, req.seq_len)
            trees.append(tree)
        # timed where each request fed at most the one token of its last step: a prompt (a
        # request's first proposal) or tokens caught up after plain steps are one-off costs
        if most_fed <= 1:
            per_request = (time.perf_counter() - t0) / max(len(items), 1)
            self.seconds_per_request += COST_EMA_WEIGHT * (per_request - self.seconds_per_request)
        return trees

    def on_verified(self, engine, items: list, emitted: list[list[int]]) -> None:
        for item, tokens in zip(items, emitted):
            req = item.req
            self._feed(req)
            state = _state(req)
            context = tail_ids(req, self.cache.max_depth) + tokens
            state.suffix_keys = self.cache.insert_incremental(context, len(tokens), state.suffix_keys)
            state.num_fed = req.seq_len + len(tokens)

    def draft_cost(self, batch_size: int, max_nodes: int) -> float:
        return batch_size * self.seconds_per_request

    def _feed(self, req: Request) -> None:
        """Feed the tokens of ``req`` not fed yet (the whole prompt the first time)."""
        state = _state(req)
        num_new, context = self._unfed(req, state)
        if num_new:
            state.suffix_keys = self.cache.insert_incremental(context, num_new, state.suffix_keys)
            state.num_fed = req.seq_len

    def _unfed(self, req: Request, state: "_NgramState") -> tuple[int, list[int]]:
        """How many of ``req``'s tokens the cache has not been fed (0 if none), and the tail
        a feed of them reads (those tokens and the max_depth - 1 or more before them)."""
        num_new = max(req.seq_len - state.num_fed, 0)
        return num_new, tail_ids(req, num_new + self.cache.max_depth)


def start_corpus_load(args) -> Future | None:
    """``--speculative-ngram-corpus`` read and indexed on a thread of its own (None for none), started
    before the target loads; ``_load_corpus`` takes the result. Built after the model instead, the
    shipped corpus (0.27 s to read, 0.65 s to index) added its whole time to the server's startup
    (2-core AVX-512 Zen4). Its C index runs without the GIL."""
    if _corpus_path(args) is None:
        return None
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ngram-corpus")
    try:
        return executor.submit(_read_and_index, args)
    finally:
        executor.shutdown(wait=False)


def _corpus_path(args) -> str | None:
    path = args.speculative_ngram_corpus
    return None if path is None or path.lower() == "none" else path


def _read_and_index(args):
    documents, _ = read_corpus_documents(_corpus_path(args))
    return make_ngram_corpus(documents, args)


def _load_corpus(ctx: ProposerContext):
    """The corpus of ``--speculative-ngram-corpus`` (None for none), its ids checked against the
    target's vocabulary; ``ctx.pending_ngram_corpus``'s if ``start_corpus_load`` began it."""
    path = _corpus_path(ctx.server_args)
    if path is None:
        return None
    pending = ctx.pending_ngram_corpus
    corpus = pending.result() if pending is not None else _read_and_index(ctx.server_args)
    vocab_size = ctx.target_config.vocab_size
    if corpus.num_tokens and int(corpus.tokens.max()) >= vocab_size:
        raise ValueError(f"--speculative-ngram-corpus {path}: token ids beyond the target's vocabulary "
                         f"({vocab_size}); the corpus was made for another model")
    logger.info("NGRAM corpus %s: %d answers, %d tokens", path, corpus.num_documents, corpus.num_tokens)
    return corpus


class _NgramState:
    __slots__ = ("num_fed", "suffix_keys")

    def __init__(self) -> None:
        self.num_fed = 0      # tokens of req.all_ids already fed to the cache
        self.suffix_keys: list[int] | None = None   # keys of the windows ending at the last fed token


def _state(req: Request) -> _NgramState:
    state = spec_state(req)
    if state.ngram is None:
        state.ngram = _NgramState()
    return state.ngram


"""Speculative-decoding shape: validation and auto-choice of S / K / N (SGLang semantics).

* S = ``--speculative-num-steps``: draft forward passes per step (tree depth).
* K = ``--speculative-eagle-topk``: children kept per expanded node (tree width).
* N = ``--speculative-num-draft-tokens``: nodes verified per request per step,
  root included (= KV slots the scheduler allocates per request per decode step).

Rules (errors are ``ConfigError`` naming the flags):

* all three unset: auto-chosen per algorithm (``auto_choose``); only some set: the
  others are filled from the auto choice, as SGLang does (an auto-filled N is then
  fitted to the tree S and K can build). NGRAM uses only N (its tree shape comes
  from ``--speculative-ngram-*``; unset, N = ``--speculative-ngram-max-match-window-size``,
  as in SGLang); S and K are ignored with a warning.
* K == 1 forces N = S + 1 (a chain), as SGLang does (warning if a given N differed).
* the policy (``--speculative-policy``, else ``$SPECSERVE_SPEC_POLICY``, else auto): auto
  speculates where the startup cost curve says it pays, always on every step.
* N >= 2, and N - 1 <= K + (S - 1) * K * K: the dynamic tree's candidate pool
  (step 0 offers K nodes, every later step K * K expansions) must hold N - 1 nodes.
* thresholds in [0, 1]; an acc threshold of 0 is clamped to 1e-9 (accept all).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.config import ConfigError

if TYPE_CHECKING:
    from specserve.config import ModelConfig, ServerArgs

logger = logging.getLogger(__name__)

SHAPE_FLAGS = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
EAGLE_FAMILY = ("EAGLE", "EAGLE3")
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM")
MIN_THRESHOLD_ACC = 1e-9
IMPLEMENTED = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
POLICY_ENV = "SPECSERVE_SPEC_POLICY"      # the flag's older spelling, still honoured
POLICIES = ("auto", "always")


@dataclass(frozen=True)
class SpecParams:
    algorithm: str            # canonical: EAGLE (NEXTN folded in), EAGLE3, STANDALONE, NGRAM
    num_steps: int            # S
    topk: int                 # K
    num_draft_tokens: int     # N, root included
    threshold_single: float = 1.0
    threshold_acc: float = 1.0
    policy: str = "auto"      # auto: speculate where it pays; always: every step
    assist_nodes: int = 0     # --speculative-ngram-assist: NGRAM's trees first, of up to this many nodes

    @property
    def is_chain(self) -> bool:
        return self.topk == 1 and self.algorithm != "NGRAM"

    @property
    def tree_cap(self) -> int:
        """Most nodes a request's tree may have in a step (its KV slots): N, or an assisting NGRAM tree's."""
        return max(self.num_draft_tokens, self.assist_nodes)


def auto_choose(algorithm: str, architecture: str) -> tuple[int, int, int]:
    """(S, K, N) when none is given, as SGLang's auto choice."""
    if algorithm == "NGRAM":
        return 0, 0, 12
    if algorithm in EAGLE_FAMILY and architecture in LLAMA_FAMILY:
        return 5, 4, 8
    return 3, 1, 4


def resolve_spec_params(args: "ServerArgs", model_config: "ModelConfig | None" = None) -> SpecParams | None:
    """Validated speculative shape from ``args``; None when speculation is off."""
    algorithm = _canonical_algorithm(args)
    if algorithm is None:
        return None
    single, acc = _thresholds(args)
    policy = resolve_policy(args)
    arch = model_config.architecture if model_config is not None else ""
    if algorithm == "NGRAM":
        n = _ngram_num_draft_tokens(args)
        return SpecParams(algorithm, 0, 0, n, single, acc, policy)
    steps, topk, n = _shape(args, algorithm, arch)
    _check_standalone(args, algorithm)
    params = SpecParams(algorithm, steps, topk, n, single, acc, policy, args.speculative_ngram_assist)
    if algorithm not in IMPLEMENTED:
        raise ConfigError(f"--speculative-algorithm {args.speculative_algorithm}: not implemented yet "
                          f"(available: {', '.join(IMPLEMENTED)})")
    return params


def resolve_policy(args: "ServerArgs") -> str:
    """``--speculative-policy``; when left at auto, ``$SPECSERVE_SPEC_POLICY`` may say always."""
    policy = (getattr(args, "speculative_policy", None) or "auto").lower()
    env = os.environ.get(POLICY_ENV, "").strip().lower()
    if policy == "auto" and env:
        if env not in POLICIES:
            raise ConfigError(f"${POLICY_ENV} must be one of {', '.join(POLICIES)}; got {env!r}")
        policy = env
    if policy not in POLICIES:
        raise ConfigError(f"--speculative-policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


def _canonical_algorithm(args: "ServerArgs") -> str | None:
    algo = args.speculative_algorithm
    if algo is None:
        given = [f for f, v in zip(SHAPE_FLAGS, _shape_values(args)) if v is not None]
        if given or args.speculative_draft_model_path:
            flags = given + (["--speculative-draft-model-path"] if args.speculative_draft_model_path else [])
            raise ConfigError(f"{', '.join(flags)} set without --speculative-algorithm")
        return None
    algo = algo.upper()
    return "EAGLE" if algo == "NEXTN" else algo


def _shape_values(args: "ServerArgs") -> tuple[int | None, int | None, int | None]:
    return args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens


def _thresholds(args: "ServerArgs") -> tuple[float, float]:
    single, acc = args.speculative_accept_threshold_single, args.speculative_accept_threshold_acc
    for flag, value in (("--speculative-accept-threshold-single", single),
                        ("--speculative-accept-threshold-acc", acc)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{flag} must be in [0, 1]; got {value}")
    return single, max(acc, MIN_THRESHOLD_ACC)


def _ngram_num_draft_tokens(args: "ServerArgs") -> int:
    steps, topk, n = _shape_values(args)
    if steps is not None or topk is not None:
        logger.warning("NGRAM ignores --speculative-num-steps / --speculative-eagle-topk; its tree "
                       "shape comes from --speculative-ngram-* and --speculative-num-draft-tokens")
    n = args.speculative_ngram_max_match_window_size if n is None else n
    if n < 2:
        raise ConfigError(f"--speculative-num-draft-tokens must be >= 2 (root + one draft); got {n}")
    if args.speculative_ngram_match_type.upper() not in ("BFS", "PROB"):
        raise ConfigError("--speculative-ngram-match-type must be BFS or PROB; "
                          f"got {args.speculative_ngram_match_type!r}")
    _check_ngram_windows(args)
    return n


def _check_ngram_windows(args: "ServerArgs") -> None:
    lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ConfigError("need 1 <= --speculative-ngram-min-match-window-size <= "
                          f"--speculative-ngram-max-match-window-size; got {lo}, {hi}")
    lo, hi = args.speculative_ngram_min_bfs_breadth, args.speculative_ngram_max_bfs_breadth
    if not 1 <= lo <= hi:
        raise ConfigError("need 1 <= --speculative-ngram-min-bfs-breadth <= "
                          f"--speculative-ngram-max-bfs-breadth; got {lo}, {hi}")
    for flag, value in (("--speculative-ngram-branch-length", args.speculative_ngram_branch_length),
                        ("--speculative-ngram-capacity", args.speculative_ngram_capacity)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1; got {value}")


def _shape(args: "ServerArgs", algorithm: str, arch: str) -> tuple[int, int, int]:
    values = _shape_values(args)
    auto = auto_choose(algorithm, arch)
    if all(v is None for v in values):
        return auto
    steps, topk, n = (auto[i] if v is None else v for i, v in enumerate(values))
    filled = [f"{flag}={v}" for flag, v, given in zip(SHAPE_FLAGS, (steps, topk, n), values) if given is None]
    if filled:
        logger.info("speculative shape: %s filled from the auto choice %s", ", ".join(filled), auto)
    if values[2] is None:          # an auto N fits the tree the given S and K can build
        n = steps + 1 if topk == 1 else min(n, topk + (steps - 1) * topk * topk + 1)
    return _check_shape(steps, topk, n)


def _check_shape(steps: int, topk: int, n: int) -> tuple[int, int, int]:
    if steps < 1:
        raise ConfigError(f"--speculative-num-steps must be >= 1; got {steps}")
    if topk < 1:
        raise ConfigError(f"--speculative-eagle-topk must be >= 1; got {topk}")
    if n < 2:
        raise ConfigError(f"--speculative-num-draft-tokens must be >= 2 (root + one draft); got {n}")
    if topk == 1:
        if n != steps + 1:
            logger.warning("--speculative-eagle-topk 1: --speculative-num-draft-tokens set to "
                           "--speculative-num-steps + 1 = %d (was %d)", steps + 1, n)
        return steps, 1, steps + 1
    pool = topk + (steps - 1) * topk * topk
    if n - 1 > pool:
        raise ConfigError(f"--speculative-num-draft-tokens {n} is too large for --speculative-num-steps "
                          f"{steps} and --speculative-eagle-topk {topk}: the draft tree offers at most "
                          f"{pool} candidates (K + (S-1)*K*K), so N must be <= {pool + 1}")
    return steps, topk, n


def _check_standalone(args: "ServerArgs", algorithm: str) -> None:
    if algorithm == "STANDALONE" and not args.speculative_draft_model_path:
        raise ConfigError("--speculative-algorithm STANDALONE requires --speculative-draft-model-path")

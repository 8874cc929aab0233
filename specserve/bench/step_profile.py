"""Where a plain decode step's time goes (``specserve bench plain --profile``).

One request decodes ``max_new_tokens`` tokens after its prefill; the time of each decode step is
split into the native decoder layers' ops (clocked in C, ``kernels/layer.profile``), the final
norm, the LM head, the rest of the model forward (embedding, metadata, Python) and the rest of
the engine step (scheduling, sampling, bookkeeping). Milliseconds per decode step, wall clock.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable


def profile_decode(core, id_lists: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """ms per decode step by part, over the decode steps of ``id_lists`` run as one batch (their
    prefill step excluded; with one prompt, one request's decode steps)."""
    from specserve.bench import serving
    from specserve.kernels import layer as native_layer

    model = core.runner.model
    seconds: dict[str, float] = {}
    for ids in id_lists:
        core.add_request(None, ids, serving.sampling_params(max_new_tokens, True))
    while core.scheduler.waiting:                            # the prefills (and first tokens)
        core.step()
    native_layer.profile(True)
    num_steps = 0
    with timed(core, "step", seconds), timed(core.runner, "forward", seconds), \
            timed(model, "compute_logits", seconds), timed(model.model.norm, "forward", seconds, "final norm"):
        while core.has_unfinished():
            core.step()
            num_steps += 1
    layer_ops = native_layer.profile(False)
    return {"batch": len(id_lists), **_breakdown(seconds, layer_ops, max(num_steps, 1))}


def _breakdown(seconds: dict[str, float], layer_ops: dict[str, float], num_steps: int) -> dict[str, Any]:
    quantize = layer_ops.pop("input quantization", 0.0)
    layers = sum(layer_ops.values())
    forward = seconds.get("forward", 0.0)
    parts = {f"layer: {name}": s for name, s in layer_ops.items()}
    norm = seconds.get("final norm")          # None: it ran inside the native call (model_stack)
    if norm is not None:
        parts["final norm"] = norm
    parts["lm_head"] = seconds.get("compute_logits", 0.0)
    rest = "embedding, metadata, Python" if norm is not None else "embedding and final norm natively, metadata, Python"
    parts[f"rest of forward ({rest})"] = forward - layers - (norm or 0.0) - parts["lm_head"]
    parts["rest of step (schedule, sample, bookkeeping)"] = seconds.get("step", 0.0) - forward
    ms = {name: 1000 * s / num_steps for name, s in parts.items()}
    return {"num_decode_steps": num_steps, "ms_per_step": ms, "step_ms": 1000 * seconds.get("step", 0.0) / num_steps,
            "of_which_input_quantization_ms": 1000 * quantize / num_steps}


@contextlib.contextmanager
def timed(obj, name: str, seconds: dict[str, float], key: str | None = None):
    """Accumulate the wall time of ``obj.name(...)`` calls into ``seconds[key or name]``."""
    original: Callable = getattr(obj, name)
    key = key or name

    def clocked(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start

    setattr(obj, name, clocked)
    try:
        yield
    finally:
        delattr(obj, name) if name in vars(obj) else None


def print_breakdown(dtype: str, profile: dict[str, Any]) -> None:
    from specserve.bench import report

    total = profile["step_ms"]
    rows = [[name, ms, 100 * ms / total if total else float("nan")] for name, ms in profile["ms_per_step"].items()]
    rows.append(["(input quantization, inside the linears)", profile["of_which_input_quantization_ms"], float("nan")])
    rows.append(["decode step", total, 100.0])
    report.print_table(["part", "ms / step", "%"], rows,
                       title=f"{dtype}: one decode step by part, mean of {profile['num_decode_steps']} steps"
                             f" at batch {profile['batch']}")

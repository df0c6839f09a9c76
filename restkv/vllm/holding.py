"""The blocks one request holds in vLLM's KV pool, step by step, with the plugin and without
(``restkv.vllm.capacity`` reads them; no vLLM import).

A request of prompt P and output O, in blocks of b tokens: its prompt computed ``chunk`` tokens a step,
then a token a step; its last step writes entry P + O - 2 (the O-th token is sampled, never written).

- The evicted group (a plain model's only one; a hybrid model's full attention, ``evicted_steps``):
  without the plugin ``ceil(e / b)`` blocks for its e entries. With it (the scheduler's own rule,
  ``settings.eviction``) its whole prompt up to the end-of-prefill eviction, in that step also, under
  prefix caching, the ``ceil(B / b)`` fresh blocks its B kept entries go to; then ``ceil(B / b)``
  blocks, a token more each step, cut back at each ``decode_interval`` check.
- A sliding-window group of window W (``window_steps``, the same with the plugin and without, vLLM's
  ``SlidingWindowManager``): before a step that computes tokens c .. c + n - 1 vLLM frees the blocks
  wholly below ``c - W + 1`` (``get_num_skipped_tokens``), then allocates up to ``ceil((c + n) / b)``:
  ``ceil((c + n) / b) - floor(max(0, c - W + 1) / b)`` blocks held.
- Admission (``scheduler_reserve_full_isl``, vLLM's default): a request waits until its whole prompt's
  blocks are free, a sliding group's at most ``ceil(min(W - 1 + T, L) / b) + 1`` (``T``
  ``max_num_batched_tokens``, one step in flight: the plugin runs without asynchronous scheduling; L
  ``max_model_len``), vLLM's admission cap (``SlidingWindowSpec.max_admission_blocks_per_request``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings


@dataclass(frozen=True)
class Holding:
    """Blocks one request holds: at its largest in its prompt's steps (``prompt``), once its prompt is
    done (``after``), at its largest from its next step to P + O - 1 entries (``largest``), and free
    for vLLM to admit it (``admitted``)."""

    prompt: int
    after: int
    largest: int
    admitted: int = 0


@dataclass(frozen=True)
class Steps:
    """Blocks of one KV cache group at each of a request's steps: its prompt's chunks, once its prompt
    is done, each decoding step's."""

    prompt: list
    after: int
    decode: list


def _blocks(entries: int, block_size: int) -> int:
    return -(-entries // block_size)


def evicted_steps(cfg, prompt_len: int, output_len: int, block_size: int, caching: bool, chunk: int) -> Steps:
    """The evicted group's ``Steps`` (``cfg`` None: plain vLLM), from ``settings.eviction`` at its
    check points: the prompt's last step, then every ``decode_interval`` tokens."""
    P, end, b = prompt_len, prompt_len + output_len - 1, block_size
    prompt = [_blocks(min(c + chunk, P), b) for c in range(0, P, chunk)]
    e = cfg and settings.eviction(cfg, P - 1, 1, P, 0, caching, b, False)
    prompt[-1] = _blocks(e.slots if e else P, b)
    offset = e.evicted if e else 0
    after, evicted, decode = _blocks(P - offset, b), bool(e), []
    interval = (cfg and cfg.get("decode_interval")) or 0
    for c in range(P, end):
        e = None
        if interval and (c + 1 - P) % interval == 0:
            e = settings.eviction(cfg, c, 1, P, offset, caching, b, evicted)
        decode.append(_blocks(e.slots if e else c + 1 - offset, b))
        offset += e.evicted if e else 0
        evicted = evicted or bool(e)
    return Steps(prompt, after, decode)


def window_steps(window: int, prompt_len: int, output_len: int, block_size: int, chunk: int) -> Steps:
    """A sliding-window group's ``Steps``: ``ceil((c + n) / b) - floor(max(0, c - W + 1) / b)`` in the
    step computing tokens c .. c + n - 1."""
    P, b = prompt_len, block_size

    def held(c: int, n: int) -> int:
        return _blocks(c + n, b) - max(0, c - window + 1) // b

    prompt = [held(c, min(chunk, P - c)) for c in range(0, P, chunk)]
    decode = [held(c, 1) for c in range(P, P + output_len - 1)]
    return Steps(prompt, held(P, 0), decode)


def admission_cap(window: int, block_size: int, max_model_len: int, max_num_batched_tokens: int) -> int:
    """vLLM's most blocks a sliding-window group reserves for a request (admission, start-up check)."""
    return _blocks(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1


def holding(cfg, prompt_len: int, output_len: int, block_size: int, caching: bool,
            model=None, chunk: int | None = None, max_model_len: int | None = None) -> Holding:
    """A request's ``Holding`` (``cfg`` None: plain vLLM) over every KV cache group of ``model``
    (``model_sizes.Model``; None: one group, the evicted one), its prompt ``chunk`` tokens a step (None:
    at once)."""
    chunk = chunk or prompt_len
    full, sliding = model.groups() if model is not None else (1, 0)
    evicted = evicted_steps(cfg, prompt_len, output_len, block_size, caching, chunk)
    slides = window_steps(model.window if sliding else 0, prompt_len, output_len, block_size, chunk)
    slides = slides if sliding else Steps([0] * len(evicted.prompt), 0, [0] * len(evicted.decode))

    def total(a: int, s: int) -> int:
        return full * a + sliding * s

    prompt = max(map(total, evicted.prompt, slides.prompt))
    decode = list(map(total, evicted.decode, slides.decode))
    whole = _blocks(prompt_len, block_size)
    cap = admission_cap(model.window, block_size, max_model_len or prompt_len, chunk) if sliding else whole
    admitted = total(whole, min(whole, cap))
    return Holding(prompt, total(evicted.after, slides.after), max(decode, default=prompt), admitted)


def at_once(h: Holding, blocks: int, max_num_seqs: int) -> int:
    """Requests running together, each at its largest: one at its prompt's peak (and admitted), the
    others at their largest after it."""
    first = max(h.prompt, h.largest, h.admitted)
    return 0 if blocks < first else min(max_num_seqs, 1 + (blocks - first) // h.largest)


def briefly(h: Holding, blocks: int, max_num_seqs: int) -> int:
    """At most the requests vLLM runs for moments: admitted while the others hold ``after`` each,
    the newest preempted as they grow."""
    first = max(h.prompt, h.after, h.admitted)
    return 0 if blocks < first else min(max_num_seqs, 1 + (blocks - first) // h.after)

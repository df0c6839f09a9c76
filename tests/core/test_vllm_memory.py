"""``restkv.vllm.memory``'s estimate of the plugin's memory against what the worker allocates on CPU:
every tensor created during an eviction, op by op (``helpers.PeakBytes``), and the tensors the worker holds
after a paged engine in plain torch (``tests/vllm_sim.py``) has served requests."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PeakBytes, prompt, small, tiny_model
from test_vllm_worker import VLLM_METHODS
from vllm_sim import PagedEngine

from restkv.config import CompressionConfig
from restkv.vllm import memory, paged, settings
from restkv.vllm.heads import Space
from restkv.vllm.worker import Worker

FACTOR = 2.0  # the estimate is at most this multiple of the measured peak
# AdaKV's split with CriticalKV's L1 stage: the widest head's kept set and the W_O projections' block are
# counted as if held at once (they are not), which puts the estimate up to 2.15x over (DefensiveKV's score;
# Layer-DefensiveKV's the same, its widest head sharing every layer's budget)
LOOSER = {"critical_adakv": 2.25, "defensivekv": 2.25, "layer_defensivekv": 2.25}
EXTRA = [  # configs whose selection reads W_O otherwise
    {"method": "criticalkv", "value_norm": "l2"},
    {"method": "snapkv", "refine_rounds": 1},
]


def _knobs(case) -> dict:
    return small(case) if isinstance(case, str) else dict(case)


@pytest.mark.parametrize(
    "geometry",
    [(8, 2, 128, torch.bfloat16, 4096), (9, 3, 64, torch.float32, 2048)],
    ids=["8-2-d128-bf16-L4096", "9-3-d64-fp32-L2048"],
)
@pytest.mark.parametrize("case", VLLM_METHODS + EXTRA, ids=lambda c: c if isinstance(c, str) else json.dumps(c))
def test_eviction_peak_within_the_estimate(case, geometry):
    """One request holding L entries evicts in one layer of a paged cache (its prompt in one step):
    the peak of what ``Worker.layer`` allocates is at most ``memory.eviction_bytes`` (plus, for H2O,
    the layer's summed scores it counts per token) and, but for set-level refinement, at least
    1 / FACTOR of it. The W_O factor is computed when the layers are indexed exactly when
    ``memory.reads_factor`` says so, and the step reads the o_proj weight exactly when
    ``memory.reads_weight`` does."""
    hq, hkv, d, dtype, L = geometry
    hidden, block_size, budget = 4 * d, 16, 256
    cfg = CompressionConfig.from_kwargs(**{**_knobs(case), "max_capacity_prompt": budget, "window_size": 32})
    settings.check(cfg)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(hidden, hq * d, generator=g).to(dtype)
    reads = []

    def o_proj():
        reads.append(1)
        return weight.clone()  # a read makes the weight anew, as vLLM's reader does

    worker = Worker(cfg, slots=2, caching=False, block_size=block_size)
    blocks = -(-L // block_size)
    others = {f"model.layers.{i}.attn": None for i in (1, 2, 3)}  # the first of 4 layers (LaCache's ladder)
    worker.index_layers({"model.layers.0.attn": o_proj, **others}, heads=hq)
    assert bool(worker.factors) == memory.reads_factor(cfg) == bool(reads)
    reads.clear()
    cache = torch.randn(blocks, hkv, block_size, 2 * d, generator=g).to(dtype)
    layer = paged.Paged(cache, cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2), block_size)
    settings.bind_model(cfg, 4, hq, hkv)
    if settings.per_head(cfg):  # the layer's pages the whole pool (the others evict nothing here)
        worker.space, worker.whole = Space({"model.layers.0.attn": 0}, hkv), layer
    worker.blocks["r"] = list(range(blocks))
    worker.begin(["r"], [0], [L], [L], "cpu")
    query = torch.randn(L, hq, d, generator=g).to(dtype)
    with PeakBytes() as t:
        worker.layer("model.layers.0.attn", query, layer, d**-0.5, None)
        if settings.deferred(cfg):  # its selection once every layer has run (here the one)
            worker._finish(worker.step[0])
    ring = worker.ring.buffers["model.layers.0.attn"].nbytes  # allocated on the layer's first step
    peak = t.peak - ring
    assert bool(reads) == memory.reads_weight(cfg)
    model = memory.Model(1, hq, hkv, d, hidden, torch.empty(0, dtype=dtype).element_size())
    estimate = sum(memory.eviction_bytes(cfg, model, L).values())
    if settings.summed(cfg) or settings.deferred(cfg):
        estimate += (memory.per_token(cfg, model) - 16) * L  # the layer's float32 sums or scores
    assert peak <= estimate, f"measured {peak / 2**20:.2f} MiB over the estimate {estimate / 2**20:.2f} MiB"
    if not cfg.get("refine_rounds"):  # refinement's own scratch is counted as a coarse bound
        assert estimate <= LOOSER.get(str(case), FACTOR) * peak, f"estimate {estimate / 2**20:.2f} MiB, measured {peak / 2**20:.2f} MiB"


@pytest.mark.parametrize("method", ["snapkv", "restkv", "h2o"])
def test_held_tensors_are_the_estimates(method):
    """After a paged engine (4 slots) has served two prompts in chunks, evicting while decoding,
    the worker holds its query ring (as counted), the W_O factors (as counted, and only where the
    config reads them) and nothing else: no o_proj weight, no summed scores, no kept positions (a check
    records them only through ``Worker.observer``)."""
    knobs = {**small(method), "max_capacity_prompt": 40, "window_size": 8, "decode_interval": 10}
    eng = PagedEngine(tiny_model(attn_implementation="restkv_paged_sim"), knobs, chunk=13)
    for seed in (1, 2):
        eng.generate(prompt(80, seed=seed)[0].tolist(), 25)
    c = eng.model.config
    model = memory.Model(
        c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, 4
    )
    terms = memory.fixed_bytes(eng.cfg, model, max_num_seqs=4, max_model_len=80 + 25)
    w = eng.worker
    assert sum(b.nbytes for b in w.ring.buffers.values()) == terms["query ring"]
    assert sum(f.nbytes for f in w.factors.values()) == terms["W_O factors"]
    assert not any(h.sums for h in w.requests.values())
    assert w.observer is not None and eng.recorded  # the simulation's own record, not the worker's


def test_reserved_fits_the_pool_and_the_plugin():
    """Of ``available`` bytes, the pool left after ``reserved`` plus the plugin's fixed bytes and its
    bytes per pooled token fit, with less than one pool token to spare."""
    model = memory.model_of("llama-3.1-8b")
    for knobs in ({"method": "snapkv"}, {"method": "h2o"}):
        cfg = CompressionConfig.from_kwargs(**knobs)
        for available in (40 * 2**30, 100 * 2**30):
            pool = available - memory.reserved(cfg, model, 256, 32768, available)
            tokens = pool / (model.layers * model.kv_bytes(1))
            fixed = sum(memory.fixed_bytes(cfg, model, 256, 32768).values())
            used = pool + fixed + tokens * memory.per_token(cfg, model)
            assert available - model.layers * model.kv_bytes(1) < used <= available + 1


def test_config_folder_equals_built_in(tmp_path, capsys):
    """A folder's config.json reads as the built-in sizes; the command prints every term."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "hidden_size": 4096, "torch_dtype": "bfloat16",
            }
        )
    )
    assert memory.model_of(str(tmp_path)) == memory.model_of("llama-3.1-8b")
    assert memory.model_of("llama-3.1-8b").per_rank(4).kv_heads == 2
    memory.main(["--model", str(tmp_path), "--max-model-len", "32768", "--knobs", '{"method": "restkv"}'])
    out = capsys.readouterr().out
    for term in ("query ring", "W_O factors", "one eviction", "read back", "per token held"):
        assert term in out
    with pytest.raises(ValueError, match="--model"):
        memory.model_of(str(tmp_path / "absent"))


@pytest.mark.parametrize("method", ["snapkv", "adakv", "pyramidkv"])
def test_a_check_under_a_decoding_ratio_within_the_estimate(method):
    """decode_compression_ratio=0.5: a check after 4,096 tokens (a 64-token prompt kept whole) keeps 2,048
    entries per head, 8x max_capacity_prompt; what its eviction allocates in one layer is within
    ``memory.eviction_bytes`` at those 4,096 entries, which counts the largest budget of any check up to
    them (``settings.most_budget``), and at least half of it."""
    hq, hkv, d, L, block_size = 8, 2, 64, 4096, 16
    knobs = {**small(method), "max_capacity_prompt": 256, "window_size": 32, "decode_interval": 8,
             "decode_compression_ratio": 0.5}
    cfg = CompressionConfig.from_kwargs(**knobs)
    settings.check(cfg)
    g = torch.Generator().manual_seed(0)
    worker = Worker(cfg, slots=2, caching=False, block_size=block_size)
    worker.index_layers({f"model.layers.{i}.attn": None for i in range(4)}, heads=hq)
    blocks = L // block_size
    cache = torch.randn(blocks, hkv, block_size, 2 * d, generator=g)
    layer = paged.Paged(cache, cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2), block_size)
    settings.bind_model(cfg, 4, hq, hkv)
    if settings.per_head(cfg):
        worker.space, worker.whole = Space({"model.layers.0.attn": 0}, hkv), layer
    worker.blocks["r"] = list(range(blocks))
    worker.begin(["r"], [L - 1], [1], [64], "cpu")
    assert worker.step[0].eviction.budget == L // 2
    with PeakBytes() as t:
        worker.layer("model.layers.0.attn", torch.randn(1, hq, d, generator=g), layer, d**-0.5, None)
    peak = t.peak - worker.ring.buffers["model.layers.0.attn"].nbytes
    estimate = sum(memory.eviction_bytes(cfg, memory.Model(1, hq, hkv, d, 4 * d, 4), L).values())
    assert peak <= estimate <= FACTOR * peak, f"measured {peak / 2**20:.2f} MiB, estimate {estimate / 2**20:.2f} MiB"


STEP_TERMS = ("step's staged indices", "flattened attention", "flattened page tables")


@pytest.mark.parametrize("knobs", [{"method": "adakv"}, {"method": "pyramidkv"}], ids=["adakv", "pyramidkv"])
def test_a_per_head_steps_allocations_within_the_estimate(knobs, monkeypatch):
    """Decoding steps of a request whose heads hold their own pages (one token, no eviction): everything
    the worker allocates in the step, from ``begin`` to ``end`` (the arrays it stages, held as a device
    holds them: one buffer per copy; the page axes; the flattened queries, keys, values and output), peaks
    at most at the estimate's per-step terms for that step's sizes (``STEP_TERMS``, ``max_model_len`` the
    request's length), and at least at a quarter of them."""
    from restkv.vllm import head_steps, heads, layer_eviction, worker

    def staged(arrays, device, dtype=torch.int64):  # one allocation per copy, as on a device
        out = heads.stage.__wrapped__(arrays, device, dtype)
        return list(torch.split(torch.cat(out).clone(), [len(a) for a in arrays]))

    staged.__wrapped__ = heads.stage
    monkeypatch.setattr(heads, "stage", staged)
    for module in (worker, head_steps, layer_eviction):  # the worker's rooms that stage arrays
        monkeypatch.setattr(module, "stage", staged)
    knobs = {**small(knobs["method"]), **knobs, "max_capacity_prompt": 40, "window_size": 8}
    # blocks of 2: page tables as wide as the step's other terms
    eng = PagedEngine(tiny_model(attn_implementation="restkv_paged_sim"), knobs, block_size=2, num_blocks=512)
    eng.worker.attends = {n: (lambda q, batch, cache, keys, values: torch.zeros_like(q)) for n in eng.names}  # the backend's output
    peaks, mode = [], PeakBytes()
    for name in ("begin", "layer", "end"):
        orig = getattr(eng.worker, name)

        def measured(*args, _orig=orig, _name=name):
            if _name == "begin":
                mode.held = mode.peak = 0
            with mode:
                out = _orig(*args)
            if _name == "end" and flat[0]:
                peaks.append(mode.peak)
            return out

        setattr(eng.worker, name, measured)
    flat = [False]
    begin = eng.worker.begin

    def noting(*args):  # whether the step's request decodes on its heads' pages without evicting
        begin(*args)
        flat[0] = eng.worker.flat_tokens is not None and not eng.worker.evicts

    eng.worker.begin = noting
    ids, new = prompt(80)[0].tolist(), 20
    eng.generate(ids, new)
    assert len(peaks) >= 10
    c = eng.model.config
    model = memory.Model(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, 4)
    terms = memory.fixed_bytes(eng.cfg, model, 1, len(ids) + new, 1, eng.bs)
    estimate = sum(terms[t] for t in STEP_TERMS)
    assert max(peaks) <= estimate, f"measured {max(peaks)} B over the estimate {estimate} B"
    assert estimate <= 4 * max(peaks), f"estimate {estimate} B, measured {max(peaks)} B"


FP8_METHODS = ["snapkv", "h2o", "restkv", "keydiff", "lagkv", "cam"]


@pytest.mark.parametrize("method", FP8_METHODS)
def test_an_fp8_pools_eviction_peak_within_the_estimate(method):
    """An FP8 cache (1 byte an element, read back dequantized to float32, kept rows moved as stored) of a
    bfloat16 model: the peak of one eviction is at most ``eviction_bytes`` of a model with
    ``cache_bytes=1`` and at least 1 / FACTOR of it."""
    hq, hkv, d, L, block_size = 8, 2, 128, 4096, 16
    cfg = CompressionConfig.from_kwargs(**{**small(method), "max_capacity_prompt": 256, "window_size": 32})
    g = torch.Generator().manual_seed(0)
    worker = Worker(cfg, slots=2, caching=False, block_size=block_size)
    worker.index_layers({"model.layers.0.attn": None})
    blocks = -(-L // block_size)
    cache = torch.randn(blocks, hkv, block_size, 2 * d, generator=g).to(torch.float8_e4m3fn)
    scales = (torch.tensor(0.5), torch.tensor(0.25))
    layer = paged.Paged(cache, cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2), block_size,
                        scales=scales)
    settings.bind_model(cfg, 1, hq, hkv)
    worker.blocks["r"] = list(range(blocks))
    worker.begin(["r"], [0], [L], [L], "cpu")
    query = torch.randn(L, hq, d, generator=g).to(torch.bfloat16)
    with PeakBytes() as t:
        worker.layer("model.layers.0.attn", query, layer, d**-0.5, None)
    peak = t.peak - worker.ring.buffers["model.layers.0.attn"].nbytes
    model = memory.Model(1, hq, hkv, d, 4 * d, 2, cache_bytes=1)
    estimate = sum(memory.eviction_bytes(cfg, model, L).values())
    if settings.summed(cfg):
        estimate += (memory.per_token(cfg, model) - 16) * L
    assert peak <= estimate, f"measured {peak / 2**20:.2f} MiB over the estimate {estimate / 2**20:.2f} MiB"
    assert estimate <= FACTOR * peak, f"estimate {estimate / 2**20:.2f} MiB, measured {peak / 2**20:.2f} MiB"


def test_an_fp8_pools_terms_by_hand():
    """Llama 3.1 8B under an FP8 cache: the pool's token is 32 layers x K+V of 8 heads x 128 at 1 byte; the
    read-back K+V in float32 (4 B), with its FP8 copy and a float32 temporary of K or V while dequantized;
    the rows written at 1 byte, the kept set in float32; no float32 copy of a KV head's keys."""
    base, fp8 = memory.model_of("llama-3.1-8b"), memory.model_of("llama-3.1-8b", kv_cache_dtype="fp8")
    cfg = CompressionConfig.from_kwargs(method="snapkv", max_capacity_prompt=1024)
    L, kv = 8192, 2 * 8 * 128  # elements of one token's K+V in one layer
    assert memory.fraction(cfg, fp8) == 16 / (32 * kv * 1) == 2 * memory.fraction(cfg, base)
    terms, plain = memory.eviction_bytes(cfg, fp8, L), memory.eviction_bytes(cfg, base, L)
    assert terms["read back (1 x K+V)"] == L * kv * (4 + 1 + 2) and plain["read back (1 x K+V)"] == L * kv * 2
    assert terms["observed queries' attention"] == 32 * 32 * L * 4  # Hq r L float32, nothing more
    assert plain["observed queries' attention"] == 32 * 32 * L * 4 + 32 * 32 * L * 4 // 8 + L * 128 * 4
    assert terms["kept entries and their rows"] == 1024 * kv * (4 + 1) + 32 * 8 * 1024


def test_a_hybrid_models_plugin_terms_count_its_evicted_layers():
    """Gemma 3 270M (18 layers, 3 of full attention, Hq 4, Hkv 1, d 256, float32), H2O with per-head
    budgets and ReST-KV's W_O: the query ring, the flattened page tables, the pages moved and the
    per-token sums and the W_O factors are the 3 evicted layers' (the worker indexes no sliding-window
    layer); a pool token is 3 layers' K+V (one block's layers)."""
    m = memory.Model(18, 4, 1, 256, 640, 4, sliding=15, window=512)
    cfg = CompressionConfig.from_kwargs(method="restkv", use_wo=True, head_budget="adakv", max_capacity_prompt=256)
    S, L, T, r, b = 8, 4096, 512, settings.query_rows(cfg), 16
    terms = memory.fixed_bytes(cfg, m, S, L, T, b)
    assert terms["query ring"] == 3 * S * r * 4 * 256 * 4
    assert terms["W_O factors"] == 3 * 4 * 256 * 256 * 4
    assert terms["flattened page tables"] == 3 * 1 * (S * 4 * (L // b + 1) + T * 32)
    most = settings.most_kept(cfg, settings.most_budget(cfg, L), L)
    assert terms["pages moved"] == 3 * 2 * (most + b) * 256 * 4
    h2o = CompressionConfig.from_kwargs(method="h2o", max_capacity_prompt=256)
    assert memory.per_token(h2o, m) == 3 * 4 * 4 + 16
    assert memory.fraction(h2o, m) == (3 * 4 * 4 + 16) / (3 * 2 * 256 * 4)


def test_the_command_takes_kv_cache_dtype(capsys):
    memory.main(["--model", "llama-3.1-8b", "--max-model-len", "8192", "--kv-cache-dtype", "fp8"])
    assert "cache_bytes=1" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        memory.main(["--model", "llama-3.1-8b", "--max-model-len", "8192", "--kv-cache-dtype", "fp4"])
    assert "--kv-cache-dtype" in str(e.value.code) and "\n" not in str(e.value.code)

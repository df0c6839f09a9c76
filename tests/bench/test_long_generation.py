"""scripts/study/long_generation.py on tiny models: chunked teacher forcing equals decoding one token at a
time under eviction, the continuation is the full cache's greedy one, and a run resumes and extends."""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, tiny_model, tiny_tokenizer

import restkv
from restkv.compat import cache_argument

spec = importlib.util.spec_from_file_location("study_long_generation", ROOT / "scripts" / "study" / "long_generation.py")
long_generation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(long_generation)

TRI = f"triattention:tokenizer={tiny_tokenizer()},triattention_length=256"
SPECS = ["snapkv", "rkv:window_size=4", "restkv_w8=restkv:window_size=8", TRI]


def step_by_step(model, prompt, cont, knobs):
    """[T] KL(full || config) and top-1 agreement after each token of ``cont``, decoding one token at a time
    on a model configured with ``knobs`` (the full cache: the plain model)."""
    out = []
    for config in (None, knobs):
        restkv.detach(model)
        if config is not None:
            restkv.configure(model, **config)
        arg = cache_argument(model)
        step = model(prompt[None], use_cache=True)
        cache = step.cache if getattr(step, "cache", None) is not None else step.past_key_values
        rows = []
        for t in cont.tolist():
            step = model(torch.tensor([[t]]), use_cache=True, **{arg: cache})
            rows.append(step.logits[0, -1].double().log_softmax(-1))
        out.append(torch.stack(rows))
    restkv.detach(model)
    full, mine = out
    return (full.exp() * (full - mine)).sum(-1), mine.argmax(-1) == full.argmax(-1)


@pytest.mark.parametrize("chunk", [4, 8])
def test_chunked_teacher_forcing_equals_decoding_one_token_at_a_time(chunk):
    model = tiny_model("llama", "sdpa", seed=2)
    prompt = torch.randint(3, 97, (12,), generator=torch.Generator().manual_seed(0))
    cont = long_generation.continuation(model, prompt, 64)
    configs = long_generation.grid(SPECS, [40], [8])
    got = long_generation.evaluate(model, prompt, cont, configs, chunk, bin_size=1)
    for label, knobs in configs:
        kl, top1 = step_by_step(model, prompt, cont, knobs)
        assert kl[40:].max() > 1e-4, f"{label}: nothing evicted"
        torch.testing.assert_close(torch.tensor(got[label]["kl"], dtype=torch.float64), kl, rtol=1e-3, atol=1e-5)
        assert got[label]["top1"] == top1.double().tolist()


def test_the_continuation_is_the_full_caches_greedy_one():
    model = tiny_model("llama", "sdpa", seed=2)
    model.generation_config.eos_token_id = 5
    prompt = torch.randint(3, 97, (10,), generator=torch.Generator().manual_seed(1))
    cont = long_generation.continuation(model, prompt, 30)
    with torch.no_grad():
        logits = model(torch.cat([prompt, cont])[None]).logits[0, 9:-1]
    logits[:, 5] = float("-inf")
    assert torch.equal(logits.argmax(-1), cont) and 5 not in cont.tolist()


def test_a_sampled_continuation_draws_from_the_top_p_set_and_is_seeded():
    model = tiny_model("llama", "sdpa", seed=2)
    model.generation_config.eos_token_id = 5
    prompt = torch.randint(3, 97, (10,), generator=torch.Generator().manual_seed(1))
    cont = long_generation.continuation(model, prompt, 40, temperature=0.6, top_p=0.2, seed=3)
    assert torch.equal(cont, long_generation.continuation(model, prompt, 40, temperature=0.6, top_p=0.2, seed=3))
    assert not torch.equal(cont, long_generation.continuation(model, prompt, 40, temperature=0.6, top_p=0.2, seed=4))
    with torch.no_grad():
        logits = model(torch.cat([prompt, cont])[None]).logits[0, 9:-1].double()
    logits[:, 5] = float("-inf")
    probs = (logits / 0.6).softmax(-1)
    for p, token in zip(probs, cont.tolist()):  # the tokens more probable than it hold less than top_p
        assert p[p > p[token]].sum() < 0.2
    assert 5 not in cont.tolist()


def test_labels_name_the_config_and_a_bad_one_is_refused():
    labels = [label for label, _ in long_generation.grid(["snapkv", "x=rkv:mix_lambda=0.5"], [64, 128], [32])]
    assert labels == ["snapkv|64|32", "snapkv|128|32", "x|64|32", "x|128|32"]
    with pytest.raises(ValueError, match=r"^rkv:mix_lambda=2.0\|64\|32: mix_lambda must be in"):
        long_generation.grid(["rkv:mix_lambda=2.0"], [64], [32])


def test_a_run_resumes_and_extends(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    model = tiny_model("llama", "sdpa", seed=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer())
    output = str(tmp_path / "run.json")
    args = SimpleNamespace(model_path="tiny", set="choice", samples=1, prompt=16, tokens=48, temperature=0.0, top_p=1.0, chunk=8, bin=16,
                           cost=False, cost_tokens=10, output=output)
    first = long_generation.run(model, tokenizer, args, long_generation.grid(["snapkv"], [40], [8]))
    assert len(first["continuations"]) == 1 and len(first["results"]["snapkv|40|8"]) == 1
    assert len(first["results"]["snapkv|40|8"][0]["kl"]) == 3  # 48 positions in bins of 16
    calls = []
    monkeypatch.setattr(long_generation, "continuation",
                        lambda *a, f=long_generation.continuation, **k: calls.append(1) or f(*a, **k))
    args.samples = 2
    more = long_generation.run(model, tokenizer, args, long_generation.grid(["snapkv", "tova"], [40], [8]))
    assert len(calls) == 1  # the first sample's continuation is read back
    assert more["results"]["snapkv|40|8"][0] == first["results"]["snapkv|40|8"][0]
    assert [len(more["results"][k]) for k in ("snapkv|40|8", "tova|40|8")] == [2, 2]
    args.cost = True
    cost = long_generation.run(model, tokenizer, args, long_generation.grid(["tova"], [40], [8]))
    assert set(cost["cost"]) == {"fullkv", "tova|40|8"} and min(cost["cost"].values()) > 0
    assert cost["args"]["cost"] is False and cost["cost_args"]["cost"] is True
    args.prompt = 20
    with pytest.raises(ValueError, match="--output .* holds a run with other"):
        long_generation.run(model, tokenizer, args, [])


def test_the_tables_by_hand(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("study_long_generation_table",
                                                  ROOT / "scripts" / "study" / "long_generation_table.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    sample = lambda kl, top1: {"kl": kl, "top1": top1, "seconds": 1.0}  # noqa: E731
    results = {"restkv|128|128": [sample([0.1, 0.3], [1.0, 0.5]), sample([0.2, 0.2], [1.0, 1.0])],
               "snapkv|128|128": [sample([0.3, 0.5], [0.5, 0.5]), sample([0.2, 0.4], [1.0, 0.0])],
               "snapkv|128|32": [sample([0.1, 0.1], [1.0, 1.0]), sample([0.1, 0.1], [1.0, 1.0]),
                                 sample([9.0, 9.0], [0.0, 0.0])]}  # a third sample: left out of the paired comparison
    record = {"args": {"model_path": "m", "prompt": 4, "tokens": 4, "bin": 2, "temperature": 0.6, "top_p": 0.95},
              "results": results, "cost": {"fullkv": 0.010, "snapkv|128|32": 0.012}, "cost_args": {"cost_tokens": 8}}
    (tmp_path / "run.json").write_text(__import__("json").dumps(record))
    tables.main([str(tmp_path / "run.json"), "--position_budget", "128", "--group", "1"])
    out = capsys.readouterr().out
    # restkv: per-sample means 0.2, 0.2; snapkv 0.4, 0.3 -> mean 0.35, s.e. 0.05; paired +0.2, +0.1 -> 0.15 ± 0.05
    assert "| restkv | 0.2000 ± 0.0000 | 0.875 ± 0.125 |  |" in out
    assert "| snapkv | 0.3500 ± 0.0500 | 0.500 ± 0.000 | **+0.1500 ± 0.0500** |" in out
    assert "| snapkv | 0.1000 ± 0.0000 | 0.3500 ± 0.0500 | **-0.2500 ± 0.0500** |" in out  # interval 32 vs 128
    assert "| snapkv | 0.2500 | 0.4500 |" in out and "tokens 1-2 | tokens 3-4" in out
    assert "| snapkv | 128 | 32 | 12.0 | 1.20 |" in out and "| fullkv |  |  | 10.0 | 1.00 |" in out


def _tables():
    spec = importlib.util.spec_from_file_location("study_long_generation_table",
                                                  ROOT / "scripts" / "study" / "long_generation_table.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    return tables


def test_the_arm_says_its_plan_first_refuses_in_one_line_and_ends_saying_where(tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    output = tmp_path / "run.json"
    argv = ["--methods", "snapkv", "--budgets", "40", "--intervals", "8", "--samples", "1", "--prompt", "16",
            "--tokens", "32", "--bin", "16", "--output", str(output)]
    loaded = []
    monkeypatch.setattr(long_generation, "load_model", lambda path: loaded.append(path) or (
        tiny_model("llama", "sdpa", seed=2), AutoTokenizer.from_pretrained(tiny_tokenizer())))
    long_generation.main(argv)
    captured = capsys.readouterr()
    assert captured.err.startswith("long generation: 1 samples (choice set) of 16 prompt tokens, 32 generated "
                                   f"tokens each, 1 configs (1 methods x 1 budgets x 1 intervals) -> {output}")
    assert captured.out.splitlines()[-2:] == [
        f"results: {output}", f"tabulate them with: python scripts/study/long_generation_table.py {output}"]
    for bad, what in ((["--prompt", "20"], "--output .* holds a run with other"),
                      (["--methods", "rkv:mix_lambda=2.0"], r"rkv:mix_lambda=2.0\|40\|8: mix_lambda"),
                      (["--tokens", "0"], "--tokens 0: must be >= 1")):
        with pytest.raises(SystemExit) as exit_:
            long_generation.main(argv + bad)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and re.search(what, err[-1]) and "Traceback" not in "".join(err), err
    assert loaded == ["smollm2-135m"]  # refused before the model loads

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(long_generation, "run", interrupted)
    with pytest.raises(SystemExit) as exit_:
        long_generation.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 130 and err[-1] == (
        f"interrupted: the finished samples are in {output}; rerun the same command to resume")
    # the tables of this small run at their defaults: its only interval and budget
    _tables().main([str(output)])
    out = capsys.readouterr().out
    assert "1 prompts of 16 tokens" in out and "| snapkv |" in out and "KL, B=40" in out
    with pytest.raises(SystemExit) as exit_:
        _tables().main([str(output), "--interval", "128"])
    assert exit_.value.code == 2 and "--interval 128: the run has 8" in capsys.readouterr().err

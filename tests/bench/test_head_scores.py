"""HeadKV's head scores computed for a model: the authors' rule, the model's own attention, the cache."""

import json

import pytest
import torch

import restkv
from restkv.bench import models
from restkv.integration import headkv as head_scores
from restkv.strategies.budgets import load_head_importance
from restkv.data.needles import Haystack, make_case


def authors_rule(attention, span, answer_tokens):
    """The authors' ``retrieval_calculate``, loop by loop: per step and head, the top-k (k = needle length)
    attended entries, 10 * weight / (k * answer tokens) summed for those inside the needle."""
    heads, steps, _ = attention.shape
    k = span[1] - span[0]
    out = [0.0] * heads
    for t in range(steps):
        for h in range(heads):
            values, idx = attention[h, t].topk(k)
            for v, i in zip(values.tolist(), idx.tolist()):
                if span[0] <= i < span[1]:
                    out[h] += 10 * v / (k * answer_tokens)
    return torch.tensor(out)


def test_scores_follow_the_authors_rule():
    g = torch.Generator().manual_seed(0)
    attention = torch.randn(6, 4, 50, generator=g).mul(3).softmax(-1)
    attention[2, :, 20:25] += 1.0  # a head that looks at the needle
    for span in ((20, 25), (0, 3), (45, 50)):
        got = head_scores.answer_scores(attention, span, 5)
        torch.testing.assert_close(got, authors_rule(attention, span, 5), rtol=1e-5, atol=1e-6)
    assert int(head_scores.answer_scores(attention, (20, 25), 5).argmax()) == 2


def test_the_cache_file_sits_beside_a_converted_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("RESTKV_CACHE", str(tmp_path))
    model = type("M", (), {})()
    model.config = type("C", (), {"get_text_config": lambda self: self, "num_hidden_layers": 3,
                                  "num_attention_heads": 6})()
    (tmp_path / "smollm2-135m").mkdir()
    model.config._name_or_path = str(tmp_path / "smollm2-135m")
    assert head_scores.table_path(model) == tmp_path / "smollm2-135m" / "head_importance-r2.json"
    model.config._name_or_path = "owner/some-model"
    path = head_scores.table_path(model)
    assert path.parent == tmp_path / "head_importance" and path.name.startswith("some-model-")


@pytest.mark.slow
def test_answer_steps_are_the_models_greedy_tokens_and_its_attention(smollm2):
    model, tokenizer = smollm2
    case = make_case(tokenizer, Haystack(tokenizer, models.essays_dir()), head_scores.NEEDLES_R2[0], 300, 50)
    ids = case.ids + tokenizer(head_scores.PREFIX["passkey"], add_special_tokens=False).input_ids
    with torch.inference_mode():
        tokens, attention, limit = head_scores.answer_attention(model, tokenizer, ids, case.answer)
        prompt = torch.tensor([ids])
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(tokens),
                                do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        model.set_attn_implementation("eager")
        try:  # one forward over prompt and answer: its rows at the answer steps
            full = model(torch.tensor([ids + tokens[:-1]]), output_attentions=True).attentions
        finally:
            model.set_attn_implementation("sdpa")
    assert tokens == greedy and limit == 6 and tokenizer.decode(tokens).strip().startswith(case.answer)
    m = len(tokens)
    for layer in (0, 14, 29):
        torch.testing.assert_close(attention[layer], full[layer][0, :, -m:].float(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_headkv_without_a_file_computes_the_table_once_and_caches_it(smollm2, tmp_path, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(head_scores, "LENGTHS", (384,))
    monkeypatch.setattr(head_scores, "DEPTHS", (25.0, 75.0))
    path = tmp_path / "heads.json"
    monkeypatch.setattr(head_scores, "table_path", lambda m: path)
    restkv.configure(model, method="headkv", max_capacity_prompt=64, window_size=8)
    table = json.loads(path.read_text())
    assert len(table) == 30 * 9 and {len(v) for v in table.values()} - {0}
    again = head_scores.score_heads(model, tokenizer)
    assert again == table  # deterministic
    monkeypatch.setattr(head_scores, "score_heads", lambda *a, **k: pytest.fail("computed again"))
    restkv.configure(model, method="headkv", max_capacity_prompt=64, window_size=8)  # read from the cache
    ids = make_case(tokenizer, Haystack(tokenizer, models.essays_dir()), head_scores.NEEDLES_R2[0], 300, 50).ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == len(ids) + 2
    kept = restkv.kept_positions(model)
    sizes = torch.stack([(k >= 0).sum(-1)[0] for k in kept])  # [layers, kv heads]: per-head budgets from the table
    importance = load_head_importance(str(path), 30, 9, 3)
    assert int(sizes.sum()) <= 30 * 3 * 64 and sizes.unique().numel() > 1  # heads clamp at the prompt's length
    assert int(sizes.flatten().argmax()) == int(importance.flatten().argmax())  # the most important keeps the most
    restkv.detach(model)

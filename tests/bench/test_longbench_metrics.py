"""LongBench metrics and tables against hand-computed values."""

import pytest

from restkv.bench.longbench import metrics as m
from restkv.bench.longbench.evaluate import bucket, score_dataset, score_dataset_e
from restkv.bench.longbench.tasks import (DATASETS, ENGLISH, FIRST_LINE, LONGBENCH_E, MAX_NEW_TOKENS, METRICS,
                                          NO_CHAT, PROMPTS)


def test_qa_f1_english_normalization():
    # "cat sat" vs "cat sat on mat": p = 2/2, r = 2/4 -> 2/3
    assert m.qa_f1("The cat sat.", "a cat sat on mat") == pytest.approx(2 / 3)
    assert m.qa_f1("An Apple!", "apple") == 1.0
    assert m.qa_f1("dog", "cat") == 0.0


def test_qa_f1_zh_uses_jieba_words():
    # jieba: 我 / 爱 / 北京 / 天安门 vs 北京 -> p = 1/4, r = 1 -> 0.4
    assert m.qa_f1_zh("我爱北京天安门", "北京") == pytest.approx(0.4)
    # punctuation becomes an empty token and is dropped
    assert m.qa_f1_zh("北京。", "北京") == 1.0
    assert m.qa_f1_zh("上海", "北京") == 0.0


def test_rouge_l_f():
    # LCS(x y z w, x z w v) = 3 -> p = r = 3/4
    assert m.rouge("x y z w", "x z w v") == pytest.approx(0.75, abs=1e-6)
    # LCS = 3 of 3 and 6 words -> p = 1, r = 1/2 -> 2/3
    assert m.rouge("a b c", "a b c d e f") == pytest.approx(2 / 3, abs=1e-6)
    assert m.rouge("", "a b") == 0.0


def test_rouge_long_texts_are_scored():
    words = [f"w{i % 50}" for i in range(1500)]
    assert m.rouge(" ".join(words), " ".join(words)) == pytest.approx(1.0, abs=1e-6)


def test_rouge_zh_on_jieba_words():
    # 我 爱 北京 天安门 vs 我 爱 北京: LCS 3, p = 3/4, r = 1 -> 6/7
    assert m.rouge_zh("我爱北京天安门", "我爱北京") == pytest.approx(6 / 7, abs=1e-6)


def test_classification():
    classes = ["Individual", "Distance", "City"]
    assert m.classification("City", "City", classes) == 1.0
    assert m.classification("Distance or City", "City", classes) == 0.5
    assert m.classification("no idea", "City", classes) == 0.0
    # a class that is a proper substring of the label is dropped
    assert m.classification("Other location", "Other location", ["Other", "Other location"]) == 1.0
    # official walk: after dropping "a", "ab" is never examined
    assert m.classification("abc", "abc", ["a", "ab", "abc"]) == 0.5


def test_count_and_retrieval():
    assert m.count("There are 5 unique, not 7", "5") == 0.5
    assert m.count("none", "5") == 0.0
    assert m.retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert m.retrieval("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert m.retrieval_zh("段落3", "段落3") == 1.0
    assert m.retrieval_zh("段落3和段落4", "段落4") == 0.5


def test_code_sim_first_non_comment_line():
    # "x = 1" vs "x = 2": 4 matching of 10 chars -> 0.8
    assert m.code_sim("# comment\nx = 1\n", "x = 2") == 0.8
    assert m.code_sim("```python\nreturn a + b", "return a + b") == 1.0
    assert m.code_sim("// only comments", "x") == 0.0


def test_first_line_rule_and_max_over_references():
    classes = ["Individual", "Distance", "City"]
    # without the first-line rule both classes are found -> 0.5
    assert m.score_record("trec", "\nCity\nDistance", ["City"], classes) == 1.0
    assert m.score_record("qasper", "\nCity\nDistance", ["City"]) == pytest.approx(2 / 3)
    assert m.score_record("hotpotqa", "cat sat", ["dog", "cat sat", "cat"]) == 1.0
    assert m.score_record("triviaqa", "Paris\nLondon", ["London"]) == 0.0


def test_dataset_score_is_percent_and_buckets():
    recs = [{"pred": "cat", "answers": ["cat"], "length": 100},
            {"pred": "dog", "answers": ["cat"], "length": 5000},
            {"pred": "cat", "answers": ["cat"], "length": 9000}]
    assert score_dataset("hotpotqa", recs) == 66.67
    assert score_dataset_e("hotpotqa", recs) == {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}
    assert score_dataset_e("hotpotqa", recs[:1]) == {"0-4k": 100.0, "4-8k": None, "8k+": None}
    assert [bucket(n) for n in (3999, 4000, 7999, 8000)] == ["0-4k", "4-8k", "4-8k", "8k+"]


def test_tables_cover_every_dataset():
    assert len(DATASETS) == 21 and len(ENGLISH) == 16 and len(LONGBENCH_E) == 13
    for table in (PROMPTS, MAX_NEW_TOKENS, METRICS):
        assert set(table) == set(DATASETS)
    assert set(LONGBENCH_E) <= set(ENGLISH)
    assert FIRST_LINE == {"trec", "triviaqa", "samsum", "lsht"}
    assert NO_CHAT == FIRST_LINE | {"lcc", "repobench-p"}
    assert all(callable(getattr(m, name)) for name in METRICS.values())


def test_official_templates_and_lengths():
    assert MAX_NEW_TOKENS["gov_report"] == 512 and MAX_NEW_TOKENS["qasper"] == 128
    assert MAX_NEW_TOKENS["samsum"] == 128 and MAX_NEW_TOKENS["passage_retrieval_zh"] == 32
    assert PROMPTS["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert PROMPTS["trec"] == ("Please determine the type of the question below. "
                               "Here are some examples of questions.\n\n{context}\n{input}")
    assert PROMPTS["narrativeqa"].count("asconcisely") == 2
    assert "\n\n Answer the question based on the above article" in PROMPTS["qasper"]
    assert PROMPTS["passage_count"].endswith("The final answer is: ")
    assert PROMPTS["vcsum"] == "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："
    for name, template in PROMPTS.items():
        assert "{context}" in template, name

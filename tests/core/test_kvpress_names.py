"""The table of kvpress's presses (docs/usage.md): every press of kvpress 0.5.5 named there, with its file,
and every restkv method and knob it names registered."""

from __future__ import annotations

import re

from helpers import ROOT

from restkv.config import all_knobs
from restkv.methods import METHODS

KVPRESS_VERSION = "0.5.5"
# the classes named *Press in kvpress 0.5.5's kvpress/presses/*.py
PRESSES = (
    "AdaKVPress BasePress BlockPress CAMPress CURPress CapPress ChunkKVPress ChunkPress "
    "CompactorPress ComposedPress CompressionRatioDecodingPress CriticalAdaKVPress "
    "CriticalKVPress DMSPress DecodingPress DuoAttentionPress EntropyGatedChunkKVPress "
    "ExpectedAttentionPress ExpectedAttentionStatsPress FastKVzipPress FinchPress "
    "KVComposePress KVgradPress KVzapPress KVzipPress KeyDiffPress KeyRerotationPress "
    "KnormPress LUKVPress LagKVPress LeverageScorePress MergingPress NonCausalAttnPress "
    "ObservedAttentionPress PerLayerCompressionPress PrefillDecodingPress PyramidKVPress "
    "QFilterPress RandomPress RestoreKVPress ScorerPress SimLayerKVPress SnapKVPress "
    "StreamingLLMPress TOVAPress ThinKPress"
).split()
# the files of kvpress 0.5.5's kvpress/presses/ (but __init__.py)
FILES = (
    "adakv base block cam cap chunk chunkkv compactor composed compression_ratio_decoding "
    "criticalkv cur decoding dms duo_attention entropy_gated_chunkkv expected_attention "
    "expected_attention_with_stats fastkvzip finch key_rerotation keydiff knorm kvcompose "
    "kvgrad kvzap kvzip lagkv leverage lukv merging non_causal_attention observed_attention "
    "per_layer_compression prefill_decoding pyramidkv qfilter random restorekv scorer "
    "simlayerkv snapkv streaming_llm think tova"
).split()


def table() -> dict:
    """docs/usage.md's table under "## kvpress's presses": first cell -> second cell."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    section = text.split("\n## kvpress's presses\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        line.split(" | ")
        for line in section.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    return {cells[0][2:]: cells[1].rstrip(" |") for cells in rows[1:]}


def test_every_kvpress_press_and_file_is_in_the_usage_page():
    rows = table()
    named = {m for first in rows for m in re.findall(r"`(\w+Press)`", first)}
    files = {m for first in rows for m in re.findall(r"`(\w+?)(?:_press)?\.py`", first)}
    assert len(PRESSES) == 46 and len(FILES) == 45
    assert sorted(set(PRESSES) - named) == [], (
        f"kvpress {KVPRESS_VERSION} presses missing from docs/usage.md"
    )
    assert sorted(set(FILES) - files) == [], f"kvpress {KVPRESS_VERSION} files missing from docs/usage.md"


def test_every_restkv_method_and_knob_named_exists():
    knobs = set(all_knobs())
    for first, restkv in table().items():
        for method in re.findall(r'method="(\w+)"', restkv):
            assert method in METHODS, f"{first}: no method {method!r}"
        for knob in re.findall(r"`(\w+)(?:=|`)", restkv):
            assert knob in knobs or knob in ("method", "configure", "compressing"), (
                f"{first}: no knob {knob!r}"
            )

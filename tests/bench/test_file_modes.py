"""Files a run writes get the modes of ordinary new files: the umask decides (022: 0644 files, 0755 folders)."""

import os
import stat

import pytest

from helpers import tiny_model
from restkv.bench import meta, models, shard
from restkv.bench.results import atomic_write


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_run_meta_and_merged_results_respect_the_umask(tmp_path, umask):
    path = meta.write_metadata(str(tmp_path / "run"), {"x": 1})
    assert mode(path) == 0o666 & ~umask
    atomic_write(str(tmp_path / "results.jsonl"), "{}\n")
    assert mode(tmp_path / "results.jsonl") == 0o666 & ~umask
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert shard.atomic_write is atomic_write  # the merged parts of a sharded run are written the same way


def test_a_converted_checkpoint_respects_the_umask(tmp_path, umask):
    model = tiny_model()
    out = models.atomic_dir(tmp_path / "m", model.save_pretrained)  # save_pretrained writes safetensors 0600
    assert mode(out) == 0o777 & ~umask
    files = sorted(os.listdir(out))
    assert "model.safetensors" in files
    assert {name: mode(out / name) for name in files} == {name: 0o666 & ~umask for name in files}

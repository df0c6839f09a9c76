"""Predict RULER tasks with any methods and budgets.

Reads folders of ``<task>/validation.jsonl`` (made by ``python -m
restkv.bench.ruler.generate`` or by RULER's own scripts) and appends predictions
to ``<save_dir>/<model>/<max_seq_length>/<task>/<label>.jsonl``; records already
there are skipped. Each batch is prefilled once for every method x budget
(``--no_sweep``: once per config). Under ``accelerate launch`` the samples
(numbered over all tasks) are sharded over the processes and the main process
merges their parts (see :mod:`restkv.bench.shard`).

Folders from RULER's own ``prepare.py`` (``.../synthetic/4096/data``) lack
``max_seq_length``: pass ``--context_length 4096``; when they were made with a
model template already in ``input``, add ``--chat_template off``.

Example
-------
python run_ruler.py --data_dir data/ruler/smollm2-135m/4096 --method restkv snapkv fullkv \\
    --max_capacity_prompts 128 256 512 --save_dir results/ruler
"""

from restkv.bench.cli import Runner, add_common_args
from restkv.bench.ruler.run import add_ruler_args, prepare, run

RUNNER = Runner(__doc__.split("\n")[0], (add_common_args, add_ruler_args), prepare, run)
build_parser, parse_args, main = RUNNER.build_parser, RUNNER.parse_args, RUNNER.main

if __name__ == "__main__":
    main()

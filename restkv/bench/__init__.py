"""The benchmark runners' machinery.

:mod:`.cli` (shared flags), :mod:`.grid` (the method x budget configs), :mod:`.models` (the model
registry and loading), :mod:`.prompts`, :mod:`.generation` (batched greedy decoding), :mod:`.loop`
(the prediction loop), :mod:`.datasets` (runs over datasets of records), :mod:`.results` and
:mod:`.shard` (resumable, sharded results files), :mod:`.meta` (run metadata); one package per
benchmark: :mod:`.longbench`, :mod:`.infinitebench`, :mod:`.ruler`, :mod:`.needle`.
"""

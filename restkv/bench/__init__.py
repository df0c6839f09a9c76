"""The benchmark runners' machinery.

:mod:`.cli` (shared flags), :mod:`.grid` (the method x budget configs), :mod:`.models` (the model
registry and loading), :mod:`.prompts`, :mod:`.generation` (batched greedy decoding), :mod:`.loop`
(the prediction loop), :mod:`.datasets` (runs over datasets of records), :mod:`.results` and
:mod:`.shard` (resumable, sharded results files), :mod:`.meta` (run metadata), :mod:`.hubdata` (data sets
read with ``datasets`` from a folder or the hub), :mod:`.evaluation` (the evaluators' skeleton); one package
per benchmark: :mod:`.longbench`, :mod:`.longbench_v2`, :mod:`.infinitebench`, :mod:`.ruler`,
:mod:`.needle`, :mod:`.reasoning` (MATH500, AIME, GSM8K), :mod:`.scbench`.
"""

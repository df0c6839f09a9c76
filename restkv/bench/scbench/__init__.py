"""SCBench's shared-context tasks: a context compressed once, several questions after it (its
"same context, different query" mode), data, metrics, evaluation and the prediction run."""

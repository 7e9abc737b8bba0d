"""Speed and memory benchmarks of the fused 512 + 1024 build (issue 6): `python -m benchmarks`.

Run from the repository root (see README.md here). Modules:

* cli: the options and the modes they select; __main__ runs it (run.py is an alias).
* corpus: the generated photo-like Parquet corpora, cached in the workdir.
* The three pipelines: naive_worker (plain Pillow, standalone, runs in its own venv),
  floor (cheapest decode + encode) and fused (the project's shard builder).
* naive_venv: creates and probes the Pillow 13 virtual environment of the naive pipeline.
* workers: one long-lived process per pipeline, driven over a JSON-line protocol.
* The modes: compare (the three pipelines, shard by shard), webp_methods, memory, profiling.
* report: the comparison's ratios and targets, machine and corpus facts, the printed tables.
"""

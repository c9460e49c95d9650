"""Commands behind the docs' speed figures, tables and examples; run each from
the repo root as a module (``python -m benchmarks.NAME [RUNS]``) so it imports
the tests' helpers."""

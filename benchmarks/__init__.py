"""Commands behind the README's speed figures; run each from the repo root as a
module (``python -m benchmarks.NAME [RUNS]``) so it imports the tests' helpers."""

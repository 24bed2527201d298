"""Benchmarks. serve: closed-loop serving benchmark against an OpenAI-compatible server; plot: Pareto charts."""
